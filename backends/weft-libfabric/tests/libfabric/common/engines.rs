//! Engines over libfabric for the engine scenario suite: every engine has
//! one group of 2 NICs (two endpoints of `lo` for `tcp`, two `shm`
//! endpoints). Used by `engine_tcp.rs`, `engine_shm.rs` and, through
//! [`super::LfXproc`], `engine_xproc.rs`.

use std::sync::Arc;
use std::time::Duration;
use weft_conformance::engine::EngineBackend;
use weft_conformance::HarnessError;
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::Provider;

/// NICs per engine.
pub const NICS: usize = 2;

/// A provider for `name` (`"tcp"` on `lo`, or `"shm"`) with [`NICS`]
/// endpoints, with `tweak` applied to its configuration.
pub fn lf_provider(
    name: &str,
    tweak: impl FnOnce(LibfabricConfig) -> LibfabricConfig,
) -> Result<Arc<dyn Provider>, HarnessError> {
    let domain = match name {
        "tcp" => "lo",
        other => other,
    };
    let cfg = tweak(
        LibfabricConfig::new(name)
            .with_domains(vec![domain; NICS])
            .with_connect_timeout(Duration::from_secs(3)),
    );
    match LibfabricProvider::with_config(cfg) {
        Ok(p) => Ok(Arc::new(p)),
        Err(e) => Err(HarnessError::Unsupported(format!(
            "libfabric provider {name} unavailable: {e}"
        ))),
    }
}

/// An engine with one group of [`NICS`] NICs of `p`.
pub fn lf_engine(p: Arc<dyn Provider>) -> Result<TransferEngine, String> {
    let cfg = {
        let mut c = EngineConfig::default();
        c.idle_sleep = Some(Duration::from_micros(500));
        c
    };
    let e = TransferEngine::builder()
        .group(DomainGroupSpec::new(p, (0..NICS).collect::<Vec<_>>()))
        .config(cfg)
        .build()
        .map_err(|e| format!("engine over libfabric builds: {e}"))?;
    let n = e.nic_count(0).map_err(|e| format!("group 0: {e}"))?;
    if n != NICS {
        return Err(format!("{NICS} NICs per engine, got {n}"));
    }
    Ok(e)
}

/// Every engine in this process (threaded engines).
pub struct LfEngines {
    pub name: String,
    pub seed: u64,
}

impl EngineBackend for LfEngines {
    fn name(&self) -> String {
        format!("libfabric:{}/in-process/{NICS}-nic", self.name)
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn engine(&mut self, _host: usize) -> Result<TransferEngine, HarnessError> {
        lf_engine(lf_provider(&self.name, |c| c)?).map_err(HarnessError::Failed)
    }

    /// Unsupported: a host in this process cannot die on its own. Closing
    /// its endpoints (shutting its engine down) instead is a graceful close,
    /// not a death, and libfabric 1.17 sometimes crashes (SIGSEGV in the
    /// provider's progress, tcp and shm) when an endpoint in the process
    /// closes with writes to it in flight. `engine_xproc` kills peer
    /// processes.
    fn kill_host(&mut self, host: usize, _engine: &TransferEngine) -> Result<(), HarnessError> {
        Err(HarnessError::Unsupported(format!(
            "host {host} shares this process (engine_xproc kills peer processes)"
        )))
    }
}
