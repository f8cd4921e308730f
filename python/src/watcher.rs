//! Python callbacks run by weft's own threads: receive-pool callbacks
//! (callback thread) and UVM watchers (watcher thread), plus the
//! `UvmWatcher` handle.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::errors;
use crate::memory::{self, RegKeep};
use crate::transfer::{self, BindingStats};

fn check_callable(f: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    if f.is_callable() {
        Ok(())
    } else {
        Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be callable"
        )))
    }
}

/// The receive callback for `submit_recvs`: `on_message(bytes)` and
/// `on_error(exc)` under the GIL on the callback thread.
#[allow(clippy::type_complexity)]
pub(crate) fn recv_callback(
    on_message: &Bound<'_, PyAny>,
    on_error: Option<&Bound<'_, PyAny>>,
    peers: Option<Vec<weft::GroupAddress>>,
    stats: &Arc<BindingStats>,
) -> PyResult<
    impl FnMut(Result<(&[u8], Option<&weft::MessageSender>), weft::EngineError>) + Send + 'static,
> {
    check_callable(on_message, "on_message")?;
    if let Some(f) = on_error {
        check_callable(f, "on_error")?;
    }
    let on_message = on_message.clone().unbind();
    let on_error = on_error.map(|f| f.clone().unbind());
    let stats = Arc::clone(stats);
    Ok(
        move |r: Result<(&[u8], Option<&weft::MessageSender>), weft::EngineError>| {
            let _ = transfer::engine_attach(|py| {
                transfer::as_callback(|| match r {
                    Ok((msg, from)) => {
                        let cb = on_message.bind(py);
                        let data = PyBytes::new(py, msg);
                        let called = match &peers {
                            None => cb.call1((data,)),
                            Some(peers) => {
                                let i = from.and_then(|f| peers.iter().position(|p| f.is(p)));
                                cb.call1((data, i))
                            }
                        };
                        if let Err(e) = called {
                            transfer::report(py, &stats, e, cb);
                        }
                    }
                    Err(err) => {
                        let exc = errors::engine_err(py, &err);
                        match &on_error {
                            Some(f) => {
                                let f = f.bind(py);
                                if let Err(e) = f.call1((exc.into_value(py),)) {
                                    transfer::report(py, &stats, e, f);
                                }
                            }
                            None => exc.write_unraisable(py, Some(on_message.bind(py))),
                        }
                    }
                })
            });
        },
    )
}

/// A watched word (`TransferEngine.alloc_uvm_watcher`). `addr` is the
/// word's address: in pinned (page-locked, mapped) host memory it is also
/// the address a GPU kernel writes under unified addressing, which
/// `__cuda_array_interface__` exposes (`torch.as_tensor(w, device="cuda")`).
/// `close()` (or dropping it) stops watching.
#[pyclass(name = "UvmWatcher", module = "weft._weft", frozen)]
pub struct PyUvmWatcher {
    inner: Mutex<Option<weft::UvmWatcher>>,
    addr: usize,
    /// The watched memory when the caller provided it.
    keep: Mutex<Option<Arc<RegKeep>>>,
}

impl PyUvmWatcher {
    fn word(&self, py: Python<'_>) -> PyResult<NonNull<AtomicU64>> {
        self.inner
            .lock()
            .as_ref()
            .map(|w| w.ptr())
            .ok_or_else(|| errors::refused(py, "watcher_closed", "the watcher is closed"))
    }

    fn close_inner(&self, py: Python<'_>) {
        let w = self.inner.lock().take();
        // Dropping waits for a running scan, whose callback may be waiting
        // for the GIL: release it meanwhile.
        py.detach(move || drop(w));
        let keep = self.keep.lock().take();
        drop(keep);
    }
}

/// Builds a watcher over an engine-owned word, or over `word`'s memory.
pub(crate) fn alloc(
    py: Python<'_>,
    engine: &weft::TransferEngine,
    stats: &Arc<BindingStats>,
    callback: &Bound<'_, PyAny>,
    word: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyUvmWatcher> {
    check_callable(callback, "callback")?;
    let cb_obj = callback.clone().unbind();
    let stats = Arc::clone(stats);
    let cb = move |old: u64, new: u64| {
        let _ = transfer::engine_attach(|py| {
            let cb = cb_obj.bind(py);
            if let Err(e) = cb.call1((old, new)) {
                transfer::report(py, &stats, e, cb);
            }
        });
    };
    let Some(word) = word else {
        let w = engine.alloc_uvm_watcher(cb);
        let addr = w.ptr().as_ptr() as usize;
        return Ok(PyUvmWatcher {
            inner: Mutex::new(Some(w)),
            addr,
            keep: Mutex::new(None),
        });
    };
    let r = memory::resolve(word, None, Some(true), None)?;
    let (ptr, len, dev) = (r.region.addr(), r.region.len(), r.region.device());
    if dev != weft::Device::Host {
        return Err(errors::invalid(
            py,
            format!(
                "the watched word must be host memory (pinned, for a GPU to write it), not {}",
                memory::device_name(dev)
            ),
        ));
    }
    if len < 8 || ptr % 8 != 0 {
        return Err(errors::invalid(
            py,
            format!("the watched word needs 8 bytes at an 8-byte aligned address (got {len} bytes at {ptr:#x})"),
        ));
    }
    let nn = NonNull::new(ptr as usize as *mut AtomicU64)
        .ok_or_else(|| errors::invalid(py, "null word address"))?;
    // SAFETY: `nn` is 8-byte aligned host memory of at least 8 bytes kept
    // alive by `r.keep` (the object and its export), which the watcher
    // handle holds until after the engine's watcher is dropped
    // (`close_inner` drops the watcher first). The word is written by the
    // watcher's user atomically (`store`) or by a device.
    #[allow(unsafe_code)]
    let w = unsafe { engine.watch_word(nn, cb) };
    Ok(PyUvmWatcher {
        inner: Mutex::new(Some(w)),
        addr: ptr as usize,
        keep: Mutex::new(Some(r.keep)),
    })
}

impl Drop for PyUvmWatcher {
    fn drop(&mut self) {
        let w = self.inner.get_mut().take();
        let keep = self.keep.get_mut().take();
        let _ = Python::try_attach(move |py| {
            py.detach(move || drop(w));
            drop(keep);
        });
    }
}

#[pymethods]
impl PyUvmWatcher {
    /// The word's address (host; also the device address of pinned memory
    /// under unified addressing).
    #[getter]
    fn addr(&self) -> usize {
        self.addr
    }

    /// The word's current value.
    #[getter]
    fn value(&self, py: Python<'_>) -> PyResult<u64> {
        // SAFETY: the word is live while the watcher is open (checked by
        // `word()`, under the handle's lifetime).
        #[allow(unsafe_code)]
        let v = unsafe { self.word(py)?.as_ref() }.load(Ordering::Acquire);
        Ok(v)
    }

    /// Stores `value` into the word from the host (atomically).
    fn store(&self, py: Python<'_>, value: u64) -> PyResult<()> {
        // SAFETY: as in `value`.
        #[allow(unsafe_code)]
        unsafe { self.word(py)?.as_ref() }.store(value, Ordering::Release);
        Ok(())
    }

    /// Stops watching (idempotent); the callback is not called afterwards.
    fn close(&self, py: Python<'_>) {
        self.close_inner(py);
    }

    /// The CUDA array interface (v3) of the word as one `int64` (torch's
    /// CUDA kernels cover int64, not uint64), so
    /// `torch.as_tensor(w, device="cuda")` is a CUDA tensor aliasing it.
    /// Valid when the word is in pinned host memory (a `word=` tensor made
    /// with `pin_memory=True`).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.word(py)?;
        let d = PyDict::new(py);
        d.set_item("shape", (1,))?;
        d.set_item("typestr", "<i8")?;
        d.set_item("data", (self.addr, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        Ok(d)
    }

    /// The numpy array interface of the word (one `uint64`): a host view.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = self.__cuda_array_interface__(py)?;
        d.set_item("typestr", "<u8")?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "UvmWatcher(addr={:#x}, open={})",
            self.addr,
            self.inner.lock().is_some()
        )
    }
}
