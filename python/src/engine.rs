//! `TransferEngine`: building an engine from a provider, registering memory,
//! submits and immediate rounds.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::collections::HashMap;
use std::sync::Arc;

use crate::errors;
use crate::memory::{self, PyRegistration, RegKeep};
use crate::provider::{self, PyBackend};
use crate::transfer::{self, PyTransfer};
use crate::types::{PyImmCounts, PyMrDesc};

/// A weft transfer engine over one backend: register memory, write into
/// peers' memory, count immediates. Shut it down with `shutdown()` or by
/// using it as a context manager.
#[pyclass(name = "TransferEngine", module = "weft._weft", frozen)]
pub struct PyTransferEngine {
    pub(crate) engine: weft::TransferEngine,
    backend: Arc<weft::Backend>,
    /// The keep-alives of live registrations: memory stays valid until
    /// `unreg` or shutdown even if the `Registration` handle is dropped.
    regs: Mutex<HashMap<weft::MrHandle, Arc<RegKeep>>>,
}

impl PyTransferEngine {
    /// Drops a registration's keep-alive from the table.
    pub(crate) fn forget(&self, h: &weft::MrHandle) {
        let keep = self.regs.lock().remove(h);
        drop(keep);
    }

    fn shutdown_inner(&self, py: Python<'_>) {
        // Shutdown joins the callback thread, which may need the GIL to
        // drop a registration: never hold it here.
        py.detach(|| self.engine.shutdown());
        let regs = std::mem::take(&mut *self.regs.lock());
        drop(regs);
    }
}

/// Refuses a host without enough NICs as `ProviderUnavailableError` (as
/// `weft::Backend::probe` does, without opening another host), before the
/// engine build would fail with a less telling setup error.
fn check_nics(py: Python<'_>, backend: &weft::Backend, host: &dyn weft::Provider) -> PyResult<()> {
    let spec = backend.spec();
    let nics = py
        .detach(|| host.nics())
        .map_err(|e| errors::provider_err(py, &weft::ProviderError::transport(spec, e)))?;
    let err = if nics.is_empty() {
        weft::ProviderError::transport(
            spec,
            weft::TransportError::NoDevice {
                what: spec.to_string(),
            },
        )
    } else if nics.len() < backend.nics() {
        weft::ProviderError::TooFewNics {
            spec: spec.to_string(),
            have: nics.len(),
            want: backend.nics(),
        }
    } else {
        return Ok(());
    };
    Err(errors::provider_err(py, &err))
}

impl Drop for PyTransferEngine {
    fn drop(&mut self) {
        let _ = Python::try_attach(|py| py.detach(|| self.engine.shutdown()));
    }
}

#[pymethods]
impl PyTransferEngine {
    /// Builds an engine over `provider` (default `"loopback"`): a spec string (a fresh backend
    /// with `nics`, `profile`, `seed`) or a `Backend` (engines of one
    /// backend share its fabric). One domain group over all of the
    /// backend's NICs.
    #[new]
    #[pyo3(signature = (provider=None, *, nics=1, profile="adversarial", seed=0))]
    fn new(
        py: Python<'_>,
        provider: Option<&Bound<'_, PyAny>>,
        nics: usize,
        profile: &str,
        seed: u64,
    ) -> PyResult<Self> {
        let backend = match provider {
            None => Arc::new(provider::open(py, "loopback", nics, profile, seed)?),
            Some(p) => {
                if let Ok(b) = p.cast::<PyBackend>() {
                    Arc::clone(&b.get().inner)
                } else if let Ok(spec) = p.extract::<String>() {
                    Arc::new(provider::open(py, &spec, nics, profile, seed)?)
                } else {
                    return Err(pyo3::exceptions::PyTypeError::new_err(
                        "provider must be a spec string or a weft.Backend",
                    ));
                }
            }
        };
        let host = py
            .detach(|| backend.host())
            .map_err(|e| errors::provider_err(py, &e))?;
        check_nics(py, &backend, &*host)?;
        let nic_idx: Vec<usize> = (0..backend.nics()).collect();
        let engine = py
            .detach(|| {
                weft::TransferEngine::builder()
                    .group(weft::DomainGroupSpec::new(host, nic_idx))
                    .build()
            })
            .map_err(|e| errors::engine_err(py, &e))?;
        Ok(PyTransferEngine {
            engine,
            backend,
            regs: Mutex::new(HashMap::new()),
        })
    }

    /// The provider spec of the engine's backend.
    #[getter]
    fn provider(&self) -> String {
        self.backend.spec().to_string()
    }

    /// Registers host memory given as a buffer-protocol object (numpy
    /// array, `bytearray`, `memoryview`, `mmap`, ...). The object and its
    /// buffer export are kept until `unreg()` (or shutdown), so the memory
    /// can neither be freed nor resized meanwhile. `writable=True` refuses
    /// read-only memory; `writable=False` registers writable memory as a
    /// source only (no `desc`).
    #[pyo3(signature = (obj, *, writable=None))]
    fn reg_mr(
        slf: &Bound<'_, Self>,
        obj: &Bound<'_, PyAny>,
        writable: Option<bool>,
    ) -> PyResult<PyRegistration> {
        let py = slf.py();
        let this = slf.get();
        let r = memory::resolve(obj, writable)?;
        let region = r.region;
        let (h, desc) = py
            .detach(|| this.engine.reg_mr(region))
            .map_err(|e| errors::engine_err(py, &e))?;
        this.regs.lock().insert(h, Arc::clone(&r.keep));
        Ok(PyRegistration::new(
            slf.clone().unbind(),
            h,
            desc,
            r.writable,
            obj.clone().unbind(),
            r.keep,
        ))
    }

    /// Writes `nbytes` bytes from `src` (at `src_offset`) into the peer
    /// memory `dst` (at `dst_offset`), sharded over the NICs; with `imm`,
    /// every piece carries that immediate value (see `imm_counts`).
    /// Argument errors raise here; the returned `Transfer` reports the rest.
    #[pyo3(signature = (nbytes, src, dst, *, src_offset=0, dst_offset=0, imm=None))]
    // One parameter per Python argument (keywords included).
    #[allow(clippy::too_many_arguments)]
    fn submit_single_write(
        &self,
        py: Python<'_>,
        nbytes: u64,
        src: &Bound<'_, PyRegistration>,
        dst: &Bound<'_, PyMrDesc>,
        src_offset: u64,
        dst_offset: u64,
        imm: Option<u32>,
    ) -> PyResult<PyTransfer> {
        let src = src.get();
        let keep = src.live_keep(py)?;
        let (state, on_done) = transfer::on_done(vec![keep]);
        let id = self
            .engine
            .submit_single_write(
                nbytes,
                imm,
                (&src.handle, src_offset),
                (&dst.get().inner, dst_offset),
                on_done,
            )
            .map_err(|e| errors::engine_err(py, &e))?;
        Ok(PyTransfer::new(Some(id.0), state))
    }

    /// Allocates an immediate value (free it with `free_imm`).
    fn alloc_imm(&self, py: Python<'_>) -> PyResult<u32> {
        self.engine
            .alloc_imm()
            .map_err(|e| errors::engine_err(py, &e))
    }

    /// Returns an immediate value to the allocator; an armed, unfired round
    /// on it fails.
    fn free_imm(&self, imm: u32) {
        self.engine.free_imm(imm);
    }

    /// Arms a round: the returned `Transfer` finishes once `count`
    /// immediates `imm` have arrived (counting earlier arrivals). Re-arm
    /// after it finished for the next round.
    fn expect_imm_count(&self, py: Python<'_>, imm: u32, count: u64) -> PyResult<PyTransfer> {
        let (state, on_done) = transfer::on_done(Vec::new());
        py.detach(|| self.engine.expect_imm_count_with(imm, count, on_done))
            .map_err(|e| errors::engine_err(py, &e))?;
        Ok(PyTransfer::new(None, state))
    }

    /// How many immediates a submit from domain group `group` delivers.
    #[pyo3(signature = (group=0))]
    fn imm_counts(&self, py: Python<'_>, group: usize) -> PyResult<PyImmCounts> {
        self.engine
            .imm_counts(group)
            .map(|inner| PyImmCounts { inner })
            .map_err(|e| errors::engine_err(py, &e))
    }

    /// Stops the engine (idempotent): new submits raise `ShutDownError`,
    /// pending work fails, and the registered objects are released.
    fn shutdown(&self, py: Python<'_>) {
        self.shutdown_inner(py);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> bool {
        self.shutdown_inner(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferEngine({:?}, nics={})",
            self.backend.spec().to_string(),
            self.backend.nics()
        )
    }
}
