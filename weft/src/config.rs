//! [`ProviderConfig`]: options a backend is opened with.

use std::time::Duration;

/// Options for opening a backend. Each backend reads its own section and
/// ignores the others, so one config serves any spec.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ProviderConfig {
    /// NICs per host: [`crate::Backend::host`] gives providers with this
    /// many NICs (loopback: a simulated host with this many; libfabric:
    /// with [`LibfabricOptions::domain`] set, that domain opened this many
    /// times). Default 1.
    pub nics: usize,
    /// The simulated fabric (`loopback`; `loopback-null` ignores it: null
    /// mode has no profile).
    pub loopback: LoopbackOptions,
    /// libfabric (`libfabric:<provider>`).
    pub libfabric: LibfabricOptions,
    /// The same-host backend (`nvlink`).
    pub nvlink: NvlinkOptions,
}

impl Default for ProviderConfig {
    fn default() -> Self {
        ProviderConfig {
            nics: 1,
            loopback: LoopbackOptions::default(),
            libfabric: LibfabricOptions::default(),
            nvlink: NvlinkOptions::default(),
        }
    }
}

impl ProviderConfig {
    /// Sets [`ProviderConfig::nics`].
    pub fn with_nics(mut self, nics: usize) -> Self {
        self.nics = nics;
        self
    }

    /// Sets [`ProviderConfig::loopback`].
    pub fn with_loopback(mut self, loopback: LoopbackOptions) -> Self {
        self.loopback = loopback;
        self
    }

    /// Sets [`ProviderConfig::libfabric`].
    pub fn with_libfabric(mut self, libfabric: LibfabricOptions) -> Self {
        self.libfabric = libfabric;
        self
    }

    /// Sets [`ProviderConfig::nvlink`].
    pub fn with_nvlink(mut self, nvlink: NvlinkOptions) -> Self {
        self.nvlink = nvlink;
        self
    }
}

/// Options of the same-host backend (`nvlink`). [`ProviderConfig::nics`]
/// is its number of lanes.
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct NvlinkOptions {
    /// Memory peers may map, e.g. `weft_cuda::Gpu::peer_memory` (GPU
    /// memory registered and written one-sidedly through CUDA IPC);
    /// without it only host memory can be registered.
    pub peer_memory: Option<std::sync::Arc<dyn weft_transport::PeerMemory>>,
    /// How long a SEND waits for a receive buffer; `None`: the backend's
    /// default (1 s).
    pub rnr_timeout: Option<Duration>,
    /// The host identity in the addresses (`None`: the kernel's boot id);
    /// see `weft_nvlink::NvlinkConfig::host`.
    pub host: Option<[u8; 16]>,
}

impl NvlinkOptions {
    /// Sets [`NvlinkOptions::peer_memory`].
    pub fn with_peer_memory(mut self, pm: std::sync::Arc<dyn weft_transport::PeerMemory>) -> Self {
        self.peer_memory = Some(pm);
        self
    }

    /// Sets [`NvlinkOptions::host`].
    pub fn with_host(mut self, host: [u8; 16]) -> Self {
        self.host = Some(host);
        self
    }

    /// Sets [`NvlinkOptions::rnr_timeout`].
    pub fn with_rnr_timeout(mut self, t: Duration) -> Self {
        self.rnr_timeout = Some(t);
        self
    }
}

impl std::fmt::Debug for NvlinkOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvlinkOptions")
            .field(
                "peer_memory",
                &self.peer_memory.as_ref().map(|p| p.name().to_string()),
            )
            .field("rnr_timeout", &self.rnr_timeout)
            .field("host", &self.host)
            .finish()
    }
}

/// Equal when both name the same peer memory object (or none) and the
/// same timeout.
impl PartialEq for NvlinkOptions {
    fn eq(&self, other: &Self) -> bool {
        let pm = match (&self.peer_memory, &other.peer_memory) {
            (None, None) => true,
            (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
            _ => false,
        };
        pm && self.rnr_timeout == other.rnr_timeout && self.host == other.host
    }
}

/// How the simulated fabric behaves (the `loopback` spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LoopbackProfile {
    /// The worst NIC we know: chunked, reordered, jittered, lossy writes
    /// (`FabricConfig::adversarial`).
    #[default]
    Adversarial,
    /// No jitter, no loss, one chunk per WRITE; latency and bandwidth still
    /// modelled (`FabricConfig::ideal`).
    Ideal,
}

/// Options of the simulated fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct LoopbackOptions {
    /// Behaviour profile (ignored by `loopback-null`).
    pub profile: LoopbackProfile,
    /// Seed of the fabric's RNG: same seed and same calls, same trace.
    pub seed: u64,
    /// Largest WRITE one WR may carry (bytes); `None`: the profile's.
    pub max_write_len: Option<u64>,
}

impl LoopbackOptions {
    /// `profile` with `seed`.
    pub fn new(profile: LoopbackProfile, seed: u64) -> Self {
        LoopbackOptions {
            profile,
            seed,
            max_write_len: None,
        }
    }

    /// Sets [`LoopbackOptions::max_write_len`].
    pub fn with_max_write_len(mut self, len: u64) -> Self {
        self.max_write_len = Some(len);
        self
    }
}

/// Options of the libfabric backend. `None` fields keep the backend's
/// defaults.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct LibfabricOptions {
    /// The libfabric domain (for `tcp`: a network interface such as `eth0`
    /// or `lo`; for `shm`: `shm`) each NIC of a host opens, repeated
    /// [`ProviderConfig::nics`] times. `None`: every domain the provider
    /// reports.
    pub domain: Option<String>,
    /// Bound on outstanding WRs per domain.
    pub max_inflight: Option<usize>,
    /// How long posts to a peer may wait for its connection.
    pub connect_timeout: Option<Duration>,
    /// How long a peer with work in flight may go without completing any
    /// of it before its work fails as unreachable (a hung peer, or one gone
    /// without closing its connection). `None`: the backend's default (30 s).
    pub write_timeout: Option<Duration>,
    /// Register GPU memory with the provider (FI_HMEM). Needs a libfabric
    /// built with CUDA support (docs/gpu.md); with one without, registering
    /// GPU memory is a typed `Unsupported`.
    pub hmem: bool,
    /// With `hmem`: let shm move GPU memory with CUDA IPC (fast; the
    /// initiator's completion then comes before the copy from its buffer
    /// ends: see `weft_libfabric::LibfabricConfig::hmem_ipc`).
    pub hmem_ipc: bool,
}

impl LibfabricOptions {
    /// Options for hosts that all live on this machine (benchmarks, demos,
    /// tests): `tcp` on the loopback interface `lo`, `shm` on its `shm`
    /// domain, any other provider on every domain it reports.
    pub fn same_machine(provider: &str) -> Self {
        let domain = match provider {
            "tcp" => Some("lo".to_string()),
            "shm" => Some("shm".to_string()),
            _ => None,
        };
        LibfabricOptions {
            domain,
            ..LibfabricOptions::default()
        }
    }

    /// Sets [`LibfabricOptions::domain`].
    pub fn with_domain(mut self, domain: impl Into<String>) -> Self {
        self.domain = Some(domain.into());
        self
    }

    /// Sets [`LibfabricOptions::write_timeout`].
    pub fn with_write_timeout(mut self, t: Duration) -> Self {
        self.write_timeout = Some(t);
        self
    }

    /// Sets [`LibfabricOptions::hmem`].
    pub fn with_hmem(mut self, on: bool) -> Self {
        self.hmem = on;
        self
    }

    /// Sets [`LibfabricOptions::hmem_ipc`].
    pub fn with_hmem_ipc(mut self, on: bool) -> Self {
        self.hmem_ipc = on;
        self
    }

    /// Sets [`LibfabricOptions::max_inflight`].
    pub fn with_max_inflight(mut self, n: usize) -> Self {
        self.max_inflight = Some(n);
        self
    }

    /// Sets [`LibfabricOptions::connect_timeout`].
    pub fn with_connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = Some(t);
        self
    }
}
