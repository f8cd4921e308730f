//! Harnesses over the nvlink backend: every host in this process
//! ([`NvInProcess`]) or each in a child process ([`NvXproc`], through
//! `weft_conformance::xproc`).

use std::sync::Arc;
use std::time::Duration;
use weft_conformance::xproc::XprocBackend;
use weft_conformance::{HarnessError, HostId, InProcessBackend};
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_nvlink::{NvlinkConfig, NvlinkProvider};
use weft_transport::{Domain, NetAddr, Provider};

/// Lanes (NICs) per host.
pub const LANES: usize = 4;
/// NICs per engine of the engine scenarios.
pub const ENGINE_NICS: usize = 2;

/// The provider every test uses: [`LANES`] lanes and a short
/// receiver-not-ready timeout (the conformance case waits for it).
pub fn provider() -> NvlinkProvider {
    NvlinkProvider::new(
        NvlinkConfig::default()
            .with_lanes(LANES)
            .with_rnr_timeout(Duration::from_millis(200)),
    )
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
    provider: NvlinkProvider,
}

impl NvInProcess {
    /// The conformance harness.
    pub fn harness(seed: u64) -> weft_conformance::InProcess<NvInProcess> {
        weft_conformance::InProcess::new(NvInProcess {
            seed,
            provider: provider(),
        })
    }
}

impl InProcessBackend for NvInProcess {
    fn name(&self) -> String {
        "nvlink/in-process".into()
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

/// nvlink hosts in child processes (profile: `nvlink`).
pub struct NvXproc;

/// The conformance harness with every host in its own child process.
pub type CrossProcess = weft_conformance::xproc::CrossProcess<NvXproc>;
/// The engine-suite harness with every peer engine in its own child process.
pub type XprocEngines = weft_conformance::xproc::XprocEngines<NvXproc>;

impl XprocBackend for NvXproc {
    fn from_profile(profile: &str) -> Result<Self, HarnessError> {
        match profile {
            "nvlink" => Ok(NvXproc),
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
        let p = provider();
        (0..nics)
            .map(|i| p.open(i).map_err(|e| format!("open lane {i}: {e}")))
            .collect()
    }
    fn engine(&self) -> Result<TransferEngine, String> {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
        let p: Arc<dyn Provider> = Arc::new(provider());
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
