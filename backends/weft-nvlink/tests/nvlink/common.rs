//! Harnesses over the nvlink backend: every host in this process
//! ([`NvInProcess`]) or each in a child process ([`NvXproc`], through
//! `weft_conformance::xproc`).

use std::sync::Arc;
use std::time::Duration;
use weft_conformance::xproc::XprocBackend;
use weft_conformance::{HarnessError, HostId, InProcessBackend};
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_nvlink::{NvlinkConfig, NvlinkProvider};
use weft_testkit::peer_memory::HostPeerMemory;
use weft_transport::{Domain, NetAddr, Provider};

/// Lanes (NICs) per host.
pub const LANES: usize = 4;
/// NICs per engine of the engine scenarios.
pub const ENGINE_NICS: usize = 2;

/// The provider every test uses: [`LANES`] lanes and a short
/// receiver-not-ready timeout (the conformance case waits for it); with
/// `one_sided`, a host-memory [`HostPeerMemory`] exports every remotely
/// writable registration (peers in this process then copy into it
/// directly; peers in other processes cannot map it and stage).
pub fn provider_with(one_sided: bool) -> NvlinkProvider {
    let c = NvlinkConfig::default()
        .with_lanes(LANES)
        .with_rnr_timeout(Duration::from_millis(200));
    NvlinkProvider::new(if one_sided {
        c.with_peer_memory(Arc::new(HostPeerMemory::new()))
    } else {
        c
    })
}

/// [`provider_with`]`(false)`.
pub fn provider() -> NvlinkProvider {
    provider_with(false)
}

/// An address of this backend on this host that nobody listens on: a
/// domain opened and closed again.
fn unreachable_addr() -> Result<NetAddr, HarnessError> {
    let d = provider()
        .open(0)
        .map_err(|e| HarnessError::Failed(format!("open: {e}")))?;
    let a = d.local_addr().clone();
    drop(d);
    Ok(a)
}

/// Every host in this process.
pub struct NvInProcess {
    seed: u64,
    one_sided: bool,
    provider: NvlinkProvider,
}

impl NvInProcess {
    /// The conformance harness (`one_sided`: see [`provider_with`]).
    pub fn harness(seed: u64, one_sided: bool) -> weft_conformance::InProcess<NvInProcess> {
        weft_conformance::InProcess::new(NvInProcess {
            seed,
            one_sided,
            provider: provider_with(one_sided),
        })
    }
}

impl InProcessBackend for NvInProcess {
    fn name(&self) -> String {
        format!(
            "nvlink{}/in-process",
            if self.one_sided { "+one-sided" } else { "" }
        )
    }
    fn seed(&self) -> u64 {
        self.seed
    }
    fn add_host(
        &mut self,
        _host: HostId,
        nics: usize,
    ) -> Result<Vec<Box<dyn Domain>>, HarnessError> {
        if nics > LANES {
            return Err(HarnessError::Unsupported(format!(
                "{nics} NICs per host (max {LANES})"
            )));
        }
        (0..nics)
            .map(|i| {
                self.provider
                    .open(i)
                    .map_err(|e| HarnessError::Failed(format!("open lane {i}: {e}")))
            })
            .collect()
    }
    fn progress(&mut self) {
        std::thread::yield_now();
    }
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        unreachable_addr()
    }
}

/// nvlink hosts in child processes (profile: `nvlink`, or
/// `nvlink;one-sided` for [`provider_with`]`(true)`).
pub struct NvXproc {
    one_sided: bool,
}

/// The conformance harness with every host in its own child process.
pub type CrossProcess = weft_conformance::xproc::CrossProcess<NvXproc>;
/// The engine-suite harness with every peer engine in its own child process.
pub type XprocEngines = weft_conformance::xproc::XprocEngines<NvXproc>;

impl XprocBackend for NvXproc {
    fn from_profile(profile: &str) -> Result<Self, HarnessError> {
        match profile {
            "nvlink" => Ok(NvXproc { one_sided: false }),
            "nvlink;one-sided" => Ok(NvXproc { one_sided: true }),
            other => Err(HarnessError::Failed(format!("unknown profile {other:?}"))),
        }
    }
    fn name(&self) -> String {
        "nvlink".into()
    }
    fn max_nics(&self) -> usize {
        LANES
    }
    fn open_domains(&self, nics: usize) -> Result<Vec<Box<dyn Domain>>, String> {
        let p = provider_with(self.one_sided);
        (0..nics)
            .map(|i| p.open(i).map_err(|e| format!("open lane {i}: {e}")))
            .collect()
    }
    fn engine(&self) -> Result<TransferEngine, String> {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
        let p: Arc<dyn Provider> = Arc::new(provider_with(self.one_sided));
        let mut cfg = EngineConfig::default();
        cfg.idle_sleep = Some(Duration::from_micros(500));
        TransferEngine::builder()
            .group(DomainGroupSpec::new(
                p,
                (0..ENGINE_NICS).collect::<Vec<_>>(),
            ))
            .config(cfg)
            .build()
            .map_err(|e| format!("engine over nvlink builds: {e}"))
    }
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        unreachable_addr()
    }
}
