//! Provider selection: `providers()`, `provider()` and `Backend`.

use pyo3::prelude::*;
use std::sync::Arc;

use crate::errors;

/// One line of `weft.providers()`: a backend spec and whether it can be
/// used on this host.
#[pyclass(name = "ProviderStatus", module = "weft._weft", frozen, get_all)]
pub struct PyProviderStatus {
    /// The spec, e.g. `"libfabric:tcp"`.
    spec: String,
    /// Whether the backend is usable here.
    available: bool,
    /// Why it is not usable (`None` when it is).
    reason: Option<String>,
    /// NIC names of one host (empty when unavailable).
    nics: Vec<String>,
}

#[pymethods]
impl PyProviderStatus {
    fn __repr__(&self) -> String {
        match &self.reason {
            None => format!(
                "ProviderStatus({:?}, available, nics={:?})",
                self.spec, self.nics
            ),
            Some(r) => format!("ProviderStatus({:?}, unavailable: {r})", self.spec),
        }
    }
}

/// Every known backend and whether it works on this host (and why not).
#[pyfunction]
pub fn providers(py: Python<'_>) -> Vec<PyProviderStatus> {
    py.detach(weft::providers)
        .into_iter()
        .map(|s| {
            let (available, reason, nics) = match &s.availability {
                weft::Availability::Available { nics } => (true, None, nics.clone()),
                other => (false, Some(other.to_string()), Vec::new()),
            };
            PyProviderStatus {
                spec: s.spec,
                available,
                reason,
                nics,
            }
        })
        .collect()
}

/// The libfabric knobs of `provider()` and `TransferEngine(spec, ...)`:
/// failure timeouts in seconds (`None`: the backend's defaults) and
/// whether GPU memory is registered with the provider.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Knobs {
    /// A peer with work in flight that completes none of it for this long
    /// fails as unreachable.
    pub(crate) write: Option<f64>,
    /// Posts to a peer wait this long for its connection.
    pub(crate) connect: Option<f64>,
    /// Register GPU memory with the provider (FI_HMEM; needs a libfabric
    /// built with CUDA).
    pub(crate) hmem: bool,
    /// With `hmem`: shm moves GPU memory with CUDA IPC.
    pub(crate) hmem_ipc: bool,
    /// `nvlink`: the GPU whose memory peers may map (CUDA IPC).
    pub(crate) gpu: Option<u32>,
}

impl Knobs {
    fn duration(
        py: Python<'_>,
        what: &str,
        s: Option<f64>,
    ) -> PyResult<Option<std::time::Duration>> {
        s.map(|s| {
            std::time::Duration::try_from_secs_f64(s).map_err(|_| {
                errors::invalid(
                    py,
                    format!("{what} must be a non-negative number of seconds, got {s}"),
                )
            })
        })
        .transpose()
    }
}

/// The provider options of `provider()` and `TransferEngine(spec, ...)`.
pub(crate) fn open(
    py: Python<'_>,
    spec: &str,
    nics: usize,
    profile: &str,
    seed: u64,
    domain: Option<&str>,
    knobs: Knobs,
) -> PyResult<weft::Backend> {
    let profile = match profile {
        "adversarial" => weft::LoopbackProfile::Adversarial,
        "ideal" => weft::LoopbackProfile::Ideal,
        other => {
            return Err(errors::invalid(
                py,
                format!("profile must be \"adversarial\" or \"ideal\", got {other:?}"),
            ))
        }
    };
    if nics == 0 {
        return Err(errors::invalid(py, "nics must be at least 1"));
    }
    let spec: weft::ProviderSpec = spec.parse().map_err(|e| errors::provider_err(py, &e))?;
    let mut cfg = weft::ProviderConfig::default()
        .with_nics(nics)
        .with_loopback(weft::LoopbackOptions::new(profile, seed));
    match domain {
        None => {}
        // Both processes on this machine: libfabric tcp over `lo`, shm.
        Some("same-machine") => {
            let prov = spec.to_string();
            let prov = prov.strip_prefix("libfabric:").unwrap_or(&prov).to_string();
            cfg = cfg.with_libfabric(weft::LibfabricOptions::same_machine(&prov));
        }
        Some(d) => cfg = cfg.with_libfabric(weft::LibfabricOptions::default().with_domain(d)),
    }
    if let Some(t) = Knobs::duration(py, "write_timeout", knobs.write)? {
        cfg.libfabric = cfg.libfabric.with_write_timeout(t);
    }
    if let Some(t) = Knobs::duration(py, "connect_timeout", knobs.connect)? {
        cfg.libfabric.connect_timeout = Some(t);
    }
    cfg.libfabric.hmem = knobs.hmem;
    cfg.libfabric.hmem_ipc = knobs.hmem_ipc;
    if let (weft::ProviderSpec::Nvlink, Some(i)) = (&spec, knobs.gpu) {
        let pm = py
            .detach(|| weft_cuda::Gpu::open(i).and_then(|g| g.peer_memory()))
            .map_err(|e| errors::invalid(py, format!("nvlink with GPU memory of cuda:{i}: {e}")))?;
        cfg = cfg.with_nvlink(weft::NvlinkOptions::default().with_peer_memory(Arc::new(pm)));
    }
    py.detach(|| weft::provider_with(&spec, &cfg))
        .map_err(|e| errors::provider_err(py, &e))
}

/// An opened backend: a source of hosts. Engines built from one `Backend`
/// share its fabric (on `loopback`, two engines of one backend can talk).
#[pyclass(name = "Backend", module = "weft._weft", frozen)]
pub struct PyBackend {
    pub(crate) inner: Arc<weft::Backend>,
}

#[pymethods]
impl PyBackend {
    /// The spec it was opened with.
    #[getter]
    fn spec(&self) -> String {
        self.inner.spec().to_string()
    }

    /// NICs per host (per engine).
    #[getter]
    fn nics(&self) -> usize {
        self.inner.nics()
    }

    fn __repr__(&self) -> String {
        format!("Backend({:?}, nics={})", self.spec(), self.nics())
    }
}

/// Opens the backend named by `spec` (`"loopback"`, `"libfabric:tcp"`, ...)
/// with `nics` NICs per host; `profile` and `seed` configure the simulated
/// fabric (`"adversarial"` or `"ideal"`); `domain` picks the libfabric
/// domain (`"same-machine"`: `lo` for tcp, the shm domain for shm);
/// `write_timeout` and `connect_timeout` (seconds) bound how long work to a
/// hung or unreachable libfabric peer waits before failing; `hmem=True`
/// registers GPU memory with the libfabric provider (a libfabric built with
/// CUDA; docs/gpu.md), and `hmem_ipc=True` lets shm move it with CUDA IPC;
/// `gpu=i` gives `"nvlink"` GPU `i`'s memory through CUDA IPC.
#[pyfunction]
#[pyo3(signature = (spec, *, nics=1, profile="adversarial", seed=0, domain=None, write_timeout=None, connect_timeout=None, hmem=false, hmem_ipc=false, gpu=None))]
// One parameter per Python argument (keywords included).
#[allow(clippy::too_many_arguments)]
pub fn provider(
    py: Python<'_>,
    spec: &str,
    nics: usize,
    profile: &str,
    seed: u64,
    domain: Option<&str>,
    write_timeout: Option<f64>,
    connect_timeout: Option<f64>,
    hmem: bool,
    hmem_ipc: bool,
    gpu: Option<u32>,
) -> PyResult<PyBackend> {
    let t = Knobs {
        write: write_timeout,
        connect: connect_timeout,
        hmem,
        hmem_ipc,
        gpu,
    };
    Ok(PyBackend {
        inner: Arc::new(open(py, spec, nics, profile, seed, domain, t)?),
    })
}
