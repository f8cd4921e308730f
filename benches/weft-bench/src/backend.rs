//! Backend selection: `--backend loopback|loopback-null|libfabric:<prov>|verbs[:<device>]`,
//! through the `weft` provider registry.
//!
//! Every benchmark needs two independent "hosts" per measurement (the weft
//! sender and receiver engines) plus two more for the raw baseline (domains
//! driven directly), so the engine and the baseline never share a NIC.
//! A [`Testbed`] hands out [`Provider`]s for such hosts.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use weft::{
    Backend, Domain, LibfabricOptions, LoopbackOptions, LoopbackProfile, Provider, ProviderConfig,
    ProviderSpec,
};

/// Which backend a benchmark runs on: a `weft` provider spec
/// (`loopback`, `loopback-null`, `libfabric:<prov>`, `verbs[:<device>]`, or
/// a backend registered with `weft::register`). `loopback` is the ideal
/// profile (400 Gbit/s, 2 µs model, bytes really copied, seed 1),
/// realtime-driven; `loopback-null` validates WRs and completes them at the
/// next poll without copying, to isolate engine cost.
pub type BackendKind = ProviderSpec;

/// Outstanding WRs per libfabric domain used by the bench (engine and raw
/// baseline alike): the backend's default of 1024, overridable with
/// `WEFT_BENCH_MAX_INFLIGHT`. (shm used to need 8: its EAGAIN backlog was
/// re-issued whole on every poll; the backend now stops at the first
/// EAGAIN per peer, see docs/backends.md.)
pub fn max_inflight() -> usize {
    if let Some(n) = std::env::var("WEFT_BENCH_MAX_INFLIGHT")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n;
    }
    1024
}

/// A source of hosts on one backend, each with `nics` NICs.
pub struct Testbed {
    backend: Backend,
    max_inflight: usize,
}

impl fmt::Debug for Testbed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Testbed")
            .field("kind", self.kind())
            .field("nics", &self.nics())
            .finish()
    }
}

/// The options the bench opens `kind` with: the ideal loopback profile
/// (seed 1); libfabric on this machine's domains
/// ([`LibfabricOptions::same_machine`]: tcp on `lo`, shm on `shm`, each
/// opened `nics` times per host), a 5 s connect timeout and
/// [`max_inflight`].
fn provider_config(kind: &BackendKind, nics: usize, max_inflight: usize) -> ProviderConfig {
    let lf = match kind {
        BackendKind::Libfabric(prov) => LibfabricOptions::same_machine(prov),
        _ => LibfabricOptions::default(),
    };
    ProviderConfig::default()
        .with_nics(nics)
        .with_loopback(LoopbackOptions::new(LoopbackProfile::Ideal, 1))
        .with_libfabric(
            lf.with_connect_timeout(Duration::from_secs(5))
                .with_max_inflight(max_inflight),
        )
}

impl Testbed {
    /// A testbed for `kind` with `nics` NICs per host, or why the backend
    /// is unavailable on this machine.
    pub fn new(kind: &BackendKind, nics: usize) -> Result<Self, String> {
        let max_inflight = max_inflight();
        let backend = weft::provider_with(kind, &provider_config(kind, nics, max_inflight))
            .map_err(|e| e.to_string())?;
        // Probe once so an unavailable backend is reported up front.
        backend.probe().map_err(|e| e.to_string())?;
        Ok(Testbed {
            backend,
            max_inflight,
        })
    }

    /// The backend.
    pub fn kind(&self) -> &BackendKind {
        self.backend.spec()
    }

    /// NICs per host.
    pub fn nics(&self) -> usize {
        self.backend.nics()
    }

    /// A fresh host (for loopback a new simulated host with `nics` NICs; for
    /// real backends a new provider instance, whose domains are new
    /// endpoints on the same NICs).
    pub fn host(&self) -> Result<Arc<dyn Provider>, String> {
        self.backend.host().map_err(|e| e.to_string())
    }

    /// A fresh host with `nics` NICs.
    pub fn host_with(&self, nics: usize) -> Result<Arc<dyn Provider>, String> {
        self.backend.host_with(nics).map_err(|e| e.to_string())
    }

    /// The per-domain bound on outstanding WRs the bench configures for
    /// libfabric hosts (see [`max_inflight`]).
    pub fn max_inflight(&self) -> usize {
        self.max_inflight
    }

    /// Whether domains that only receive (scatter peers, raw targets) must
    /// be polled for WRITEs to them to complete: libfabric's software
    /// providers (tcp, shm) and EFA's emulated protocols progress only
    /// inside `fi_cq_read`, on both sides.
    pub fn peers_need_progress(&self) -> bool {
        matches!(self.kind(), BackendKind::Libfabric(_) | BackendKind::Nvlink)
    }

    /// Opens all NICs of a fresh host as raw domains (for baselines).
    pub fn raw_host(&self) -> Result<Vec<Box<dyn Domain>>, String> {
        let p = self.host()?;
        (0..self.nics())
            .map(|i| p.open(i).map_err(|e| format!("opening NIC {i}: {e}")))
            .collect()
    }

    /// Whether peers must be polled for the initiator to make progress
    /// (software libfabric providers progress only inside `fi_cq_read`).
    pub fn target_needs_polling(&self) -> bool {
        !matches!(self.kind(), BackendKind::LoopbackNull)
    }
}
