//! Backend selection: `--backend loopback|loopback-null|libfabric:<prov>|verbs`.
//!
//! Every benchmark needs two independent "hosts" per measurement (the weft
//! sender and receiver engines) plus two more for the raw baseline (domains
//! driven directly), so the engine and the baseline never share a NIC.
//! A [`Testbed`] hands out [`Provider`]s for such hosts.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_loopback::{Fabric, FabricConfig};
use weft_transport::{Domain, Provider};
use weft_verbs::{VerbsConfig, VerbsProvider};

/// Which backend a benchmark runs on.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum BackendKind {
    /// The simulated fabric, ideal profile (400 Gbit/s, 2 µs model, bytes
    /// really copied), realtime-driven.
    Loopback,
    /// The simulated fabric in null mode: WRs are validated and completed at
    /// the next poll, nothing is copied. Isolates engine cost.
    LoopbackNull,
    /// libfabric with this provider (`tcp`, `shm`, `efa`, ...).
    Libfabric(String),
    /// libibverbs (ConnectX / any RC NIC).
    Verbs,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendKind::Loopback => f.write_str("loopback"),
            BackendKind::LoopbackNull => f.write_str("loopback-null"),
            BackendKind::Libfabric(p) => write!(f, "libfabric:{p}"),
            BackendKind::Verbs => f.write_str("verbs"),
        }
    }
}

impl FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "loopback" => Ok(BackendKind::Loopback),
            "loopback-null" | "null" => Ok(BackendKind::LoopbackNull),
            "verbs" => Ok(BackendKind::Verbs),
            other => match other.strip_prefix("libfabric:") {
                Some(p) if !p.is_empty() => Ok(BackendKind::Libfabric(p.to_string())),
                _ => Err(format!(
                    "unknown backend {other:?} (expected loopback, loopback-null, \
                     libfabric:tcp, libfabric:shm, libfabric:efa or verbs)"
                )),
            },
        }
    }
}

impl BackendKind {
    /// Whether this is one of the simulated fabrics.
    pub fn is_loopback(&self) -> bool {
        matches!(self, BackendKind::Loopback | BackendKind::LoopbackNull)
    }
}

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
    kind: BackendKind,
    nics: usize,
    fabric: Option<Fabric>,
    max_inflight: usize,
}

impl fmt::Debug for Testbed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Testbed")
            .field("kind", &self.kind)
            .field("nics", &self.nics)
            .finish()
    }
}

impl Testbed {
    /// A testbed for `kind` with `nics` NICs per host, or why the backend
    /// is unavailable on this machine.
    pub fn new(kind: &BackendKind, nics: usize) -> Result<Self, String> {
        let fabric = match kind {
            BackendKind::Loopback => Some(Fabric::new_realtime(FabricConfig::ideal(1))),
            BackendKind::LoopbackNull => Some(Fabric::new_realtime(FabricConfig::null())),
            _ => None,
        };
        let tb = Testbed {
            kind: kind.clone(),
            nics,
            fabric,
            max_inflight: max_inflight(),
        };
        // Probe once so an unavailable backend is reported up front.
        let p = tb.host()?;
        let have = p.nics().map_err(|e| e.to_string())?.len();
        if have < nics {
            return Err(format!(
                "{kind} offers {have} NIC(s) on this host, {nics} requested"
            ));
        }
        Ok(tb)
    }

    /// The backend.
    pub fn kind(&self) -> &BackendKind {
        &self.kind
    }

    /// NICs per host.
    pub fn nics(&self) -> usize {
        self.nics
    }

    /// A fresh host (for loopback a new simulated host with `nics` NICs; for
    /// real backends a new provider instance, whose domains are new
    /// endpoints on the same NICs).
    pub fn host(&self) -> Result<Arc<dyn Provider>, String> {
        self.host_with(self.nics)
    }

    /// A fresh host with `nics` NICs.
    pub fn host_with(&self, nics: usize) -> Result<Arc<dyn Provider>, String> {
        match &self.kind {
            BackendKind::Loopback | BackendKind::LoopbackNull => {
                let f = self
                    .fabric
                    .as_ref()
                    .ok_or_else(|| "loopback fabric missing".to_string())?;
                let h = f.add_host(nics);
                Ok(Arc::new(f.provider(h)))
            }
            BackendKind::Libfabric(prov) => {
                let mut cfg = LibfabricConfig::new(prov.clone())
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_max_inflight(self.max_inflight);
                let domain = match prov.as_str() {
                    "tcp" => Some("lo"),
                    "shm" => Some("shm"),
                    _ => None,
                };
                if let Some(d) = domain {
                    cfg = cfg.with_domains(vec![d; nics]);
                }
                let p = LibfabricProvider::with_config(cfg).map_err(|e| e.to_string())?;
                Ok(Arc::new(p))
            }
            BackendKind::Verbs => Ok(Arc::new(VerbsProvider::new(VerbsConfig::default()))),
        }
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
        matches!(self.kind, BackendKind::Libfabric(_))
    }

    /// Opens all NICs of a fresh host as raw domains (for baselines).
    pub fn raw_host(&self) -> Result<Vec<Box<dyn Domain>>, String> {
        let p = self.host()?;
        (0..self.nics)
            .map(|i| p.open(i).map_err(|e| format!("opening NIC {i}: {e}")))
            .collect()
    }

    /// Whether peers must be polled for the initiator to make progress
    /// (software libfabric providers progress only inside `fi_cq_read`).
    pub fn target_needs_polling(&self) -> bool {
        !matches!(self.kind, BackendKind::LoopbackNull)
    }
}
