//! Registered memory: resolving a Python object to a memory region,
//! keeping the object (and its buffer export) alive, and the `Registration`
//! handle.

use parking_lot::Mutex;
use pyo3::prelude::*;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::buffer_ffi::BufferGuard;
use crate::engine::PyTransferEngine;
use crate::errors;
use crate::types::PyMrDesc;

/// What keeps registered memory valid: the Python object and its buffer
/// export. Held by the engine's table until `unreg` (or shutdown) and by
/// every in-flight transfer that uses it, so the memory outlives both.
pub(crate) struct RegKeep {
    obj: Option<Py<PyAny>>,
    buf: Option<BufferGuard>,
}

impl Drop for RegKeep {
    fn drop(&mut self) {
        // The last holder may be a transfer completing on an engine thread:
        // take the GIL to release the export and the reference. During
        // interpreter finalization there is none to take; both are then
        // leaked with the process.
        let (obj, buf) = (self.obj.take(), self.buf.take());
        let _ = Python::try_attach(move |py| {
            if let Some(mut b) = buf {
                b.release(py);
            }
            drop(obj);
        });
    }
}

/// A resolved host buffer-protocol object.
pub(crate) struct Resolved {
    pub(crate) region: weft::MemRegion,
    pub(crate) writable: bool,
    pub(crate) keep: Arc<RegKeep>,
}

/// Resolves a buffer-protocol object (numpy array, `bytearray`,
/// `memoryview`, `mmap`, `array.array`, ...) to a host region. The export
/// stays acquired until the keep-alive is dropped.
pub(crate) fn resolve(obj: &Bound<'_, PyAny>, writable: Option<bool>) -> PyResult<Resolved> {
    let py = obj.py();
    let buf = BufferGuard::acquire(obj).map_err(|e| {
        let msg = format!("cannot register {}: {e}", type_name(obj));
        if e.is_instance_of::<pyo3::exceptions::PyBufferError>(py)
            || e.is_instance_of::<pyo3::exceptions::PyValueError>(py)
        {
            errors::invalid(py, msg)
        } else if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) {
            pyo3::exceptions::PyTypeError::new_err(msg)
        } else {
            e
        }
    })?;
    let is_writable = !buf.readonly();
    if writable == Some(true) && !is_writable {
        return Err(errors::new_err(
            py,
            "ReadOnlyBufferError",
            None,
            format!("writable=True but the {} is read-only", type_name(obj)),
        ));
    }
    let len = buf.len();
    let Some(ptr) = NonNull::new(buf.ptr()).filter(|_| len > 0) else {
        return Err(errors::invalid(py, "cannot register an empty buffer"));
    };
    // SAFETY: `ptr..ptr+len` is the exporter's contiguous host memory; the
    // export (`buf`) stays acquired, and the object referenced, inside the
    // `RegKeep` until deregistration and the end of every transfer using
    // it, so the memory is neither freed nor moved while registered. Remote
    // writes into it are the caller's intent (RDMA semantics, documented).
    #[allow(unsafe_code)]
    let region = unsafe { weft::MemRegion::new(ptr, len, weft::Device::Host) };
    Ok(Resolved {
        region,
        writable: is_writable && writable != Some(false),
        keep: Arc::new(RegKeep {
            obj: Some(obj.clone().unbind()),
            buf: Some(buf),
        }),
    })
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// Memory registered with an engine (`TransferEngine.reg_mr`). Use it as a
/// transfer source; give `desc` to peers so they can write into it.
/// Deregister with `unreg()` or by using it as a context manager; dropping
/// the handle alone does not deregister (the engine keeps the memory
/// registered, and the object alive, until `unreg` or shutdown).
#[pyclass(name = "Registration", module = "weft._weft", frozen)]
pub struct PyRegistration {
    pub(crate) engine: Py<PyTransferEngine>,
    pub(crate) handle: weft::MrHandle,
    desc: weft::MrDesc,
    writable: bool,
    obj: Py<PyAny>,
    /// `None` once deregistered.
    pub(crate) keep: Mutex<Option<Arc<RegKeep>>>,
}

impl PyRegistration {
    pub(crate) fn new(
        engine: Py<PyTransferEngine>,
        handle: weft::MrHandle,
        desc: weft::MrDesc,
        writable: bool,
        obj: Py<PyAny>,
        keep: Arc<RegKeep>,
    ) -> Self {
        PyRegistration {
            engine,
            handle,
            desc,
            writable,
            obj,
            keep: Mutex::new(Some(keep)),
        }
    }

    /// The keep-alive for a transfer using this registration, or
    /// `StaleRegistrationError` after `unreg`.
    pub(crate) fn live_keep(&self, py: Python<'_>) -> PyResult<Arc<RegKeep>> {
        self.keep.lock().clone().ok_or_else(|| {
            errors::new_err(
                py,
                "StaleRegistrationError",
                None,
                "the registration was released (unreg)".into(),
            )
        })
    }
}

#[pymethods]
impl PyRegistration {
    /// The descriptor peers need to write into this memory. Raises
    /// `ReadOnlyBufferError` for read-only memory (it can only be a source).
    #[getter]
    fn desc(&self, py: Python<'_>) -> PyResult<PyMrDesc> {
        if !self.writable {
            return Err(errors::new_err(
                py,
                "ReadOnlyBufferError",
                None,
                "read-only memory cannot be a write target: no descriptor".into(),
            ));
        }
        self.live_keep(py)?;
        Ok(PyMrDesc {
            inner: self.desc.clone(),
        })
    }

    /// Start address of the registered memory.
    #[getter]
    fn addr(&self) -> u64 {
        self.handle.addr()
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.handle.len()
    }

    /// Where the memory lives (`"cpu"`).
    #[getter]
    fn device(&self) -> String {
        match self.handle.device() {
            weft::Device::Host => "cpu".into(),
            weft::Device::Cuda(i) => format!("cuda:{i}"),
        }
    }

    /// Whether peers may write into it (it has a `desc`).
    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    /// The registered Python object.
    #[getter]
    fn obj(&self, py: Python<'_>) -> Py<PyAny> {
        self.obj.clone_ref(py)
    }

    /// Whether it is still registered.
    #[getter]
    fn registered(&self) -> bool {
        self.keep.lock().is_some()
    }

    /// Deregisters the memory (idempotent). Transfers still using it fail
    /// with a local-access error; the object is released once they end.
    fn unreg(&self, py: Python<'_>) -> PyResult<()> {
        let Some(keep) = self.keep.lock().take() else {
            return Ok(());
        };
        let engine = self.engine.get();
        engine.forget(&self.handle);
        let h = self.handle;
        let r = py.detach(|| engine.engine.unreg_mr(h));
        drop(keep);
        match r {
            Ok(()) | Err(weft::EngineError::ShutDown) => Ok(()),
            Err(e) => Err(errors::engine_err(py, &e)),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.unreg(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "Registration(addr={:#x}, nbytes={}, device={:?}, writable={}, registered={})",
            self.handle.addr(),
            self.handle.len(),
            self.device(),
            self.writable,
            self.registered()
        )
    }
}
