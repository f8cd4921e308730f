//! The buffer protocol under the stable ABI.
//!
//! `pyo3::buffer` is only available under the limited API from Python 3.11,
//! but this extension targets `abi3-py39`. `Py_buffer`, `PyObject_GetBuffer`
//! and `PyBuffer_Release` have been unchanged since CPython 3.3 and are
//! exported by every CPython 3.x (they entered the limited API in 3.11
//! because they were already frozen), so we declare them ourselves: an
//! accepted, documented deviation from the strict 3.9 limited API.

#![allow(unsafe_code)]

use pyo3::ffi::PyObject;
use pyo3::prelude::*;
use std::ffi::{c_char, c_int, c_void, CStr};

/// CPython's `Py_buffer` (Include/pybuffer.h, unchanged since 3.3).
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut PyObject,
    len: isize,
    itemsize: isize,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut isize,
    strides: *mut isize,
    suboffsets: *mut isize,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

/// An acquired buffer export: pins the exporter's memory (a `bytearray`
/// cannot be resized, an `mmap` not closed) until it is released.
pub(crate) struct BufferGuard {
    view: Box<RawBuffer>,
    released: bool,
}

// SAFETY: the view is only read (ptr, len) from any thread; it is released
// exactly once, with the GIL held (`release`, or `Drop` attaching first).
unsafe impl Send for BufferGuard {}
// SAFETY: as above; shared access only reads plain fields.
unsafe impl Sync for BufferGuard {}

impl BufferGuard {
    /// Acquires a C-contiguous export of `obj` with its item format,
    /// writable if the exporter allows it, else read-only. Exporters refuse
    /// a writable request on read-only memory in their own way (numpy with
    /// `ValueError`, `bytes` with `BufferError`), so any refusal but
    /// `TypeError` (not an exporter at all) is retried read-only; if that
    /// fails too, its error is returned.
    pub(crate) fn acquire(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        let flags = PYBUF_C_CONTIGUOUS | PYBUF_FORMAT;
        let view = match Self::get(obj, flags | PYBUF_WRITABLE) {
            Ok(v) => v,
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => return Err(e),
            Err(_) => Self::get(obj, flags)?,
        };
        Ok(BufferGuard {
            view,
            released: false,
        })
    }

    /// Acquires a read-only, possibly strided export of `obj`: what an
    /// exporter that refused [`acquire`](Self::acquire) still offers, to
    /// tell the user why (its shape and strides).
    pub(crate) fn acquire_strided(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(BufferGuard {
            view: Self::get(obj, PYBUF_STRIDES | PYBUF_FORMAT)?,
            released: false,
        })
    }

    fn get(obj: &Bound<'_, PyAny>, flags: c_int) -> PyResult<Box<RawBuffer>> {
        let mut view = Box::new(RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object (the GIL is held: `obj` is a
        // `Bound`), `view` points to a zeroed `Py_buffer` that outlives the
        // call.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc == 0 {
            Ok(view)
        } else {
            Err(PyErr::fetch(obj.py()))
        }
    }

    /// Start of the exported memory.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.view.buf.cast()
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        usize::try_from(self.view.len).unwrap_or(0)
    }

    /// The exported bytes (valid until `release`).
    pub(crate) fn as_slice(&self) -> &[u8] {
        if self.released || self.view.buf.is_null() {
            return &[];
        }
        // SAFETY: an acquired, unreleased export: `buf..buf+len` is the
        // exporter's contiguous memory, pinned until release; the borrow of
        // `self` ends before `release(&mut self)` can run.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }

    /// The struct-module format of one item (`"B"` when the exporter gave
    /// none, as the buffer protocol specifies).
    pub(crate) fn format(&self) -> String {
        if self.released || self.view.format.is_null() {
            return "B".into();
        }
        // SAFETY: a non-NULL `format` of an unreleased export is a
        // NUL-terminated string owned by the exporter until release; the
        // borrow ends before this returns.
        unsafe { CStr::from_ptr(self.view.format) }
            .to_string_lossy()
            .into_owned()
    }

    /// The export's shape (empty for a scalar or a released export).
    pub(crate) fn shape(&self) -> Vec<isize> {
        self.dims(self.view.shape)
    }

    /// The export's strides in bytes (empty when the exporter gave none:
    /// C-contiguous).
    pub(crate) fn strides(&self) -> Vec<isize> {
        self.dims(self.view.strides)
    }

    fn dims(&self, p: *const isize) -> Vec<isize> {
        let n = usize::try_from(self.view.ndim).unwrap_or(0);
        if self.released || p.is_null() || n == 0 {
            return Vec::new();
        }
        // SAFETY: `shape`/`strides` of an unreleased export, when non-NULL,
        // have `ndim` entries owned by the exporter until release.
        unsafe { std::slice::from_raw_parts(p, n) }.to_vec()
    }

    /// Whether the export is read-only.
    pub(crate) fn readonly(&self) -> bool {
        self.view.readonly != 0
    }

    /// Releases the export (idempotent). Needs the GIL.
    pub(crate) fn release(&mut self, _py: Python<'_>) {
        if !self.released {
            self.released = true;
            // SAFETY: acquired by `PyObject_GetBuffer`, not yet released, and
            // the GIL is held (`_py`).
            unsafe { PyBuffer_Release(&mut *self.view) };
        }
    }
}

impl Drop for BufferGuard {
    fn drop(&mut self) {
        if !self.released {
            // During interpreter finalization there is no GIL to take: the
            // export is then leaked with the process.
            let _ = Python::try_attach(|py| self.release(py));
        }
    }
}
