//! Reading a DLPack capsule (`__dlpack__()` of numpy, torch, cupy, jax)
//! under the stable ABI: the C structs of `dlpack.h` (v0.8 legacy
//! `DLManagedTensor` and v1.x `DLManagedTensorVersioned`), the capsule
//! rename that takes ownership, and the deleter call at deregistration.

#![allow(unsafe_code)]

use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_void, CStr};

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[repr(C)]
struct DlVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

const FLAG_READ_ONLY: u64 = 1;
/// `kDLOpaqueHandle`: items are pointers.
const KDL_OPAQUE_HANDLE: u8 = 3;
const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
const KDL_CUDA_MANAGED: i32 = 13;

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const USED_LEGACY: &CStr = c"used_dltensor";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";

/// An owned DLPack tensor: its deleter runs when this is dropped (with the
/// GIL held, by the registration's keep-alive).
pub(crate) struct DlOwned {
    legacy: *mut DlManagedTensor,
    versioned: *mut DlManagedTensorVersioned,
}

// SAFETY: the pointers are only dereferenced by `Drop` (once), which the
// keep-alive runs with the GIL held; producers' deleters are thread-safe
// under the GIL (they free their own allocation).
unsafe impl Send for DlOwned {}
// SAFETY: shared access does nothing with the pointers.
unsafe impl Sync for DlOwned {}

impl Drop for DlOwned {
    fn drop(&mut self) {
        // SAFETY: we took ownership by renaming the capsule to `used_*`, so
        // the deleter is ours to call exactly once; the struct is still
        // live (only the deleter frees it).
        unsafe {
            if let Some(m) = self.legacy.as_mut() {
                if let Some(d) = m.deleter {
                    d(m);
                }
            } else if let Some(m) = self.versioned.as_mut() {
                if let Some(d) = m.deleter {
                    d(m);
                }
            }
        }
    }
}

/// Why a DLPack tensor cannot be registered.
pub(crate) enum DlError {
    /// Not C-contiguous: its shape, and its strides in bytes.
    NotContiguous {
        /// Elements per dimension.
        shape: Vec<i64>,
        /// Bytes between consecutive elements, per dimension.
        strides: Vec<i64>,
    },
    /// Its items are opaque handles (pointers), not plain bytes.
    Pointers,
    /// Anything else, said in a sentence.
    Other(String),
}

impl From<&str> for DlError {
    fn from(s: &str) -> Self {
        DlError::Other(s.into())
    }
}

impl From<String> for DlError {
    fn from(s: String) -> Self {
        DlError::Other(s)
    }
}

/// A tensor read out of a capsule.
pub(crate) struct DlView {
    pub(crate) ptr: *mut u8,
    pub(crate) nbytes: usize,
    pub(crate) device: weft::Device,
    pub(crate) read_only: bool,
    pub(crate) owned: DlOwned,
}

/// Whether `obj` is a DLPack capsule not yet consumed.
pub(crate) fn is_capsule(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: type check and name-validity checks on a live object.
    unsafe {
        ffi::PyCapsule_CheckExact(obj.as_ptr()) == 1
            && (ffi::PyCapsule_IsValid(obj.as_ptr(), LEGACY.as_ptr()) == 1
                || ffi::PyCapsule_IsValid(obj.as_ptr(), VERSIONED.as_ptr()) == 1)
    }
}

/// Consumes a DLPack capsule: checks the tensor is compact (C-contiguous)
/// and holds no pointers, computes its byte extent, and renames the capsule
/// so that we own it. On error the capsule is left untouched (its producer
/// still frees it).
pub(crate) fn consume(capsule: &Bound<'_, PyAny>) -> Result<DlView, DlError> {
    let p = capsule.as_ptr();
    // SAFETY: `p` is a live capsule (checked by the caller with
    // `is_capsule`); `PyCapsule_GetPointer` returns the pointer stored under
    // that exact name, or NULL with an exception set (cleared below).
    unsafe {
        if ffi::PyCapsule_IsValid(p, VERSIONED.as_ptr()) == 1 {
            let m =
                ffi::PyCapsule_GetPointer(p, VERSIONED.as_ptr()).cast::<DlManagedTensorVersioned>();
            let m_ref = m.as_ref().ok_or("DLPack capsule holds NULL")?;
            if m_ref.version.major != 1 {
                return Err(DlError::Other(format!(
                    "unsupported DLPack version {}.{}",
                    m_ref.version.major, m_ref.version.minor
                )));
            }
            let (ptr, nbytes, device) = extent(&m_ref.dl_tensor)?;
            let read_only = m_ref.flags & FLAG_READ_ONLY != 0;
            rename(p, USED_VERSIONED)?;
            Ok(DlView {
                ptr,
                nbytes,
                device,
                read_only,
                owned: DlOwned {
                    legacy: std::ptr::null_mut(),
                    versioned: m,
                },
            })
        } else {
            let m = ffi::PyCapsule_GetPointer(p, LEGACY.as_ptr()).cast::<DlManagedTensor>();
            let m_ref = m.as_ref().ok_or("DLPack capsule holds NULL")?;
            let (ptr, nbytes, device) = extent(&m_ref.dl_tensor)?;
            rename(p, USED_LEGACY)?;
            Ok(DlView {
                ptr,
                nbytes,
                device,
                read_only: false,
                owned: DlOwned {
                    legacy: m,
                    versioned: std::ptr::null_mut(),
                },
            })
        }
    }
}

/// # Safety
/// `p` is a live capsule.
unsafe fn rename(p: *mut ffi::PyObject, name: &'static CStr) -> Result<(), String> {
    // SAFETY: forwarded; `name` is 'static as the capsule requires.
    if unsafe { ffi::PyCapsule_SetName(p, name.as_ptr()) } == 0 {
        Ok(())
    } else {
        // SAFETY: an exception is set; clear it, the caller reports.
        unsafe { ffi::PyErr_Clear() };
        Err("cannot take ownership of the DLPack capsule".into())
    }
}

/// Start, byte length and device of a compact tensor.
fn extent(t: &DlTensor) -> Result<(*mut u8, usize, weft::Device), DlError> {
    let device = match t.device.device_type {
        KDL_CPU | KDL_CUDA_HOST => weft::Device::Host,
        KDL_CUDA | KDL_CUDA_MANAGED => weft::Device::Cuda(
            u32::try_from(t.device.device_id).map_err(|_| "negative CUDA device id")?,
        ),
        other => {
            return Err(DlError::Other(format!(
                "DLPack device type {other} is not supported (only CPU and CUDA)"
            )))
        }
    };
    if t.dtype.code == KDL_OPAQUE_HANDLE {
        return Err(DlError::Pointers);
    }
    let bits = u64::from(t.dtype.bits) * u64::from(t.dtype.lanes);
    if bits == 0 || bits % 8 != 0 {
        return Err(DlError::Other(format!(
            "DLPack dtype (code {}, {} bits x {} lanes) is not a whole number of bytes",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        )));
    }
    let ndim = usize::try_from(t.ndim).map_err(|_| "negative ndim")?;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else if t.shape.is_null() {
        return Err("DLPack tensor without shape".into());
    } else {
        // SAFETY: DLPack: `shape` has `ndim` entries, live with the tensor.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let mut elems: u64 = 1;
    for &d in shape {
        let d = u64::try_from(d).map_err(|_| "negative dimension")?;
        elems = elems.checked_mul(d).ok_or("tensor size overflows")?;
    }
    if !t.strides.is_null() && ndim > 0 && elems > 1 {
        // SAFETY: as `shape`.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut want: i64 = 1;
        for i in (0..ndim).rev() {
            if shape[i] != 1 && strides[i] != want {
                let item = i64::try_from(bits / 8).unwrap_or(i64::MAX);
                return Err(DlError::NotContiguous {
                    shape: shape.to_vec(),
                    strides: strides.iter().map(|s| s.saturating_mul(item)).collect(),
                });
            }
            want = want.saturating_mul(shape[i]);
        }
    }
    let nbytes = elems.checked_mul(bits / 8).ok_or("tensor size overflows")?;
    let nbytes = usize::try_from(nbytes).map_err(|_| "tensor too large")?;
    let off = usize::try_from(t.byte_offset).map_err(|_| "byte offset too large")?;
    let ptr = t.data.cast::<u8>().wrapping_add(off);
    Ok((ptr, nbytes, device))
}
