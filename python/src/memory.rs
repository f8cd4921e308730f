//! Registered memory: resolving a Python object to a memory region,
//! keeping the object (and its buffer export) alive, and the `Registration`
//! handle.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::buffer_ffi::BufferGuard;
use crate::dlpack::{self, DlError, DlOwned};
use crate::engine::PyTransferEngine;
use crate::errors;
use crate::items::{self, Remedy};
use crate::types::PyMrDesc;

/// What keeps registered memory valid: the Python object and its buffer
/// export or DLPack tensor. Held by the engine's table until `unreg` (or
/// shutdown) and by every in-flight transfer that uses it, so the memory
/// outlives both.
pub(crate) struct RegKeep {
    obj: Option<Py<PyAny>>,
    buf: Option<BufferGuard>,
    dl: Option<DlOwned>,
}

impl RegKeep {
    /// Keeps a Python object alive (no memory export).
    pub(crate) fn object(obj: Py<PyAny>) -> Arc<RegKeep> {
        Arc::new(RegKeep {
            obj: Some(obj),
            buf: None,
            dl: None,
        })
    }
}

impl Drop for RegKeep {
    fn drop(&mut self) {
        // The last holder may be a transfer completing on an engine thread:
        // take the GIL to release the export and the reference. During
        // interpreter finalization there is none to take; all are then
        // leaked with the process.
        let (obj, buf, dl) = (self.obj.take(), self.buf.take(), self.dl.take());
        let _ = Python::try_attach(move |py| {
            if let Some(mut b) = buf {
                b.release(py);
            }
            drop(dl);
            drop(obj);
        });
    }
}

/// A resolved Python object.
pub(crate) struct Resolved {
    pub(crate) region: weft::MemRegion,
    pub(crate) writable: bool,
    pub(crate) keep: Arc<RegKeep>,
}

/// Parses `"cpu"`, `"cuda"`, `"cuda:N"` (or anything whose `str()` is one,
/// such as a `torch.device`).
pub(crate) fn parse_device(py: Python<'_>, d: &Bound<'_, PyAny>) -> PyResult<weft::Device> {
    let s = d.str()?.to_string();
    match s.as_str() {
        "cpu" => Ok(weft::Device::Host),
        "cuda" => Ok(weft::Device::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<u32>().ok())
            .map(weft::Device::Cuda)
            .ok_or_else(|| {
                errors::invalid(
                    py,
                    format!("device must be \"cpu\", \"cuda\" or \"cuda:N\", got {s:?}"),
                )
            }),
    }
}

/// The Python name of a device.
pub(crate) fn device_name(d: weft::Device) -> String {
    match d {
        weft::Device::Host => "cpu".into(),
        weft::Device::Cuda(i) => format!("cuda:{i}"),
    }
}

/// Raw memory found in a Python object, before the checks common to all
/// kinds.
struct Found {
    ptr: *mut u8,
    len: usize,
    device: weft::Device,
    read_only: bool,
    keep: RegKeep,
}

/// Resolves what `reg_mr` accepts, in this order: a raw `(ptr, nbytes,
/// device)` tuple (the caller vouches for the memory; `keepalive` is held);
/// a DLPack capsule; a torch-like tensor (`data_ptr()`, `device`,
/// `is_contiguous()`, `numel()`, `element_size()`: torch is never imported);
/// a buffer-protocol object (numpy array, `bytearray`, `memoryview`,
/// `mmap`, ...); any other object with `__dlpack__` (cupy, jax). Memory
/// whose items are not plain bytes (Python objects, pointers: see
/// `items`) and non-contiguous memory are refused, naming the object.
/// `device` (if given) must match where the memory is; `writable=True`
/// refuses read-only memory.
pub(crate) fn resolve(
    obj: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
    writable: Option<bool>,
    keepalive: Option<&Bound<'_, PyAny>>,
) -> PyResult<Resolved> {
    let py = obj.py();
    let found = find(obj, keepalive)?;
    let what = items::describe(obj);
    if let Some(d) = device {
        let want = parse_device(py, d)?;
        if want != found.device {
            return Err(errors::invalid(
                py,
                format!(
                    "device={} but the {what} lives on {}",
                    device_name(want),
                    device_name(found.device)
                ),
            ));
        }
    }
    if writable == Some(true) && found.read_only {
        return Err(errors::new_err(
            py,
            "ReadOnlyBufferError",
            "read_only",
            format!("writable=True but the {what} is read-only"),
        ));
    }
    if found.len == 0 {
        return Err(errors::invalid(
            py,
            format!("cannot register an empty {what}"),
        ));
    }
    let Some(ptr) = NonNull::new(found.ptr) else {
        return Err(errors::invalid(
            py,
            format!("cannot register the {what}: its memory is at address 0"),
        ));
    };
    // SAFETY: `ptr..ptr+len` is the object's contiguous memory on
    // `device` (buffer export, DLPack tensor, tensor storage, or the raw
    // caller's promise); the keep-alive (object, export, DLPack ownership)
    // is held by the engine until deregistration and by every transfer using
    // it, so the memory is neither freed nor moved while registered. Its
    // items hold no pointers (checked by `find`, except for a raw region,
    // which the caller vouches for). Remote writes into it are the caller's
    // intent (RDMA semantics, documented).
    #[allow(unsafe_code)]
    let region = unsafe { weft::MemRegion::new(ptr, found.len, found.device) };
    Ok(Resolved {
        region,
        writable: !found.read_only && writable != Some(false),
        keep: Arc::new(found.keep),
    })
}

fn find(obj: &Bound<'_, PyAny>, keepalive: Option<&Bound<'_, PyAny>>) -> PyResult<Found> {
    let py = obj.py();
    // Both the object and `keepalive` (if any) are held.
    let keep_obj = Some(match keepalive {
        Some(k) => PyTuple::new(py, [obj, k])?.into_any().unbind(),
        None => obj.clone().unbind(),
    });
    // 1. (ptr, nbytes, device)
    if let Ok(t) = obj.cast::<PyTuple>() {
        let (ptr, len, dev): (usize, usize, Bound<'_, PyAny>) = t.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(
                "a raw region is a tuple (ptr: int, nbytes: int, device: str)",
            )
        })?;
        return Ok(Found {
            ptr: ptr as *mut u8,
            len,
            device: parse_device(py, &dev)?,
            read_only: false,
            keep: RegKeep {
                obj: keep_obj,
                buf: None,
                dl: None,
            },
        });
    }
    // 2. a DLPack capsule
    if dlpack::is_capsule(obj) {
        return from_capsule(obj, "DLPack capsule", keep_obj);
    }
    // What the object says of its items (numpy's dtype, the array
    // interfaces), before any memory is looked at.
    items::check_declared(obj)?;
    let what = items::describe(obj);
    // 3. a torch-like tensor (torch tensors do not export the buffer protocol)
    if obj.hasattr("data_ptr")? && obj.hasattr("element_size")? && obj.hasattr("device")? {
        return from_tensor(obj, &what, keep_obj);
    }
    // 4. the buffer protocol
    let buffer_err = match BufferGuard::acquire(obj) {
        Ok(buf) => {
            if let Some(why) = items::format_refusal(&buf.format()) {
                return Err(items::refuse_format(py, &what, &why));
            }
            return Ok(Found {
                ptr: buf.ptr(),
                len: buf.len(),
                device: weft::Device::Host,
                read_only: buf.readonly(),
                keep: RegKeep {
                    obj: keep_obj,
                    buf: Some(buf),
                    dl: None,
                },
            });
        }
        // Not an exporter at all.
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => {
            if !obj.hasattr("__dlpack__")? {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "cannot register {what}: {e} (reg_mr takes a buffer-protocol object, a torch \
                     tensor, a DLPack capsule or object, or a (ptr, nbytes, device) tuple)"
                )));
            }
            None
        }
        // Anything but a refusal (an interrupt, out of memory) is no
        // reason to try another way.
        Err(e)
            if !e.is_instance_of::<pyo3::exceptions::PyBufferError>(py)
                && !e.is_instance_of::<pyo3::exceptions::PyValueError>(py) =>
        {
            return Err(e)
        }
        // An exporter that refused a C-contiguous export: if it offers a
        // strided one, that is why (said of the object, never of a fallback
        // it did not ask for).
        Err(e) => {
            if let Ok(view) = BufferGuard::acquire_strided(obj) {
                if let Some(why) = items::format_refusal(&view.format()) {
                    return Err(items::refuse_format(py, &what, &why));
                }
                let (shape, strides) = (widen(&view.shape()), widen(&view.strides()));
                let layout = Some((&shape[..], &strides[..]));
                return Err(items::not_contiguous(py, &what, layout, Remedy::Copy));
            }
            if !obj.hasattr("__dlpack__")? {
                return Err(errors::invalid(
                    py,
                    format!("cannot register the {what}: {e}"),
                ));
            }
            Some(e)
        }
    };
    // 5. any other `__dlpack__` producer (or an exporter whose buffer
    // export failed but whose DLPack export may not)
    let failed = |why: String| {
        let also = buffer_err
            .as_ref()
            .map(|e| format!(" (and its buffer export: {e})"))
            .unwrap_or_default();
        errors::refused(
            py,
            "dlpack",
            format!("cannot register the {what}: {why}{also}"),
        )
    };
    let kw = PyDict::new(py);
    kw.set_item("max_version", (1, 0))?;
    let cap = match obj.call_method("__dlpack__", (), Some(&kw)) {
        Ok(c) => Ok(c),
        // A producer older than DLPack 1.0 takes no `max_version`.
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => {
            obj.call_method0("__dlpack__")
        }
        Err(e) => Err(e),
    }
    .map_err(|e| failed(format!("its __dlpack__() failed: {e}")))?;
    if !dlpack::is_capsule(&cap) {
        return Err(failed(
            "its __dlpack__() did not return a DLPack capsule".into(),
        ));
    }
    from_capsule(&cap, &what, keep_obj)
}

/// Byte counts of a buffer export as `i64` (as DLPack's).
fn widen(v: &[isize]) -> Vec<i64> {
    v.iter().map(|&x| x as i64).collect()
}

/// Reads a DLPack capsule; errors name `what` (the user's object).
fn from_capsule(
    cap: &Bound<'_, PyAny>,
    what: &str,
    keep_obj: Option<Py<PyAny>>,
) -> PyResult<Found> {
    let py = cap.py();
    let v = dlpack::consume(cap).map_err(|e| match e {
        DlError::NotContiguous { shape, strides } => {
            items::not_contiguous(py, what, Some((&shape, &strides)), Remedy::Copy)
        }
        DlError::Pointers => {
            items::refuse_format(py, what, "its DLPack dtype is an opaque handle (pointers)")
        }
        DlError::Other(why) => errors::invalid(py, format!("cannot register the {what}: {why}")),
    })?;
    Ok(Found {
        ptr: v.ptr,
        len: v.nbytes,
        device: v.device,
        read_only: v.read_only,
        // The capsule itself is kept too: a legacy producer's deleter may
        // expect its capsule to outlive the tensor.
        keep: RegKeep {
            obj: keep_obj,
            buf: None,
            dl: Some(v.owned),
        },
    })
}

fn from_tensor(t: &Bound<'_, PyAny>, what: &str, keep_obj: Option<Py<PyAny>>) -> PyResult<Found> {
    let py = t.py();
    if !t.call_method0("is_contiguous")?.is_truthy()? {
        return Err(items::not_contiguous(py, what, None, Remedy::Tensor));
    }
    let ptr: usize = t.call_method0("data_ptr")?.extract()?;
    let numel: usize = t.call_method0("numel")?.extract()?;
    let esize: usize = t.call_method0("element_size")?.extract()?;
    let dev = t.getattr("device")?;
    let device = match dev.getattr("type")?.extract::<String>()?.as_str() {
        "cpu" => weft::Device::Host,
        "cuda" => {
            let idx: Option<u32> = dev.getattr("index")?.extract()?;
            weft::Device::Cuda(idx.unwrap_or(0))
        }
        other => {
            return Err(errors::invalid(
                py,
                format!(
                    "tensors on device type {other:?} cannot be registered (only cpu and cuda)"
                ),
            ))
        }
    };
    let len = numel
        .checked_mul(esize)
        .ok_or_else(|| errors::invalid(py, "tensor size overflows"))?;
    Ok(Found {
        ptr: ptr as *mut u8,
        len,
        device,
        read_only: false,
        keep: RegKeep {
            obj: keep_obj,
            buf: None,
            dl: None,
        },
    })
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
                "stale_mr",
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
                "read_only",
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
        device_name(self.handle.device())
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
        // Absent after shutdown, which released every registration.
        let Some((reg, table_keep)) = engine.take_registration(&self.handle) else {
            return Ok(());
        };
        let r = py.detach(|| reg.release());
        drop((table_keep, keep));
        r.map_err(|e| errors::engine_err(py, &e))
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
