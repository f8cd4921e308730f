//! The real libibverbs behind the seam, loaded at run time (`libibverbs.so.1`
//! via `libloading`), so the crate builds without rdma-core installed.
//!
//! All FFI of the crate lives here, split by what each part owns: the ABI
//! mirrors and constants (`abi`: hand-written `#[repr(C)]` copies of the
//! parts of rdma-core's `<infiniband/verbs.h>` used, checked against the
//! installed header by `tests/layout.rs`), the return-code checks (this
//! file), loading the library and listing devices (`loader`), and one
//! opened device with its objects (`device`).
//! `ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv` and `ibv_poll_cq`
//! are `static inline` in verbs.h and dispatch through `context->ops`; this
//! module does the same through `IbvContext::ops`. Every call's return
//! value goes through `check` / `check_ptr`.

#![allow(unsafe_code)]

use crate::ops::*;
use abi::*;
use libloading::Library;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};
use weft_transport::TransportError;

/// The library file loaded.
pub const LIBIBVERBS: &str = "libibverbs.so.1";

/// Turns a verbs `int` return into a result: 0 is success, a positive value
/// is an errno (rdma-core's convention for most calls), a negative one
/// means "see errno".
pub(crate) fn check(op: &'static str, rc: c_int, detail: &str) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::new(op, rc, detail)),
        _ => Err(VerbsError::new(op, last_errno(), detail)),
    }
}

/// A pointer-returning call: NULL means failure with errno.
pub(crate) fn check_ptr<T>(
    op: &'static str,
    p: *mut T,
    detail: &str,
) -> Result<*mut T, VerbsError> {
    if p.is_null() {
        Err(VerbsError::new(op, last_errno(), detail))
    } else {
        Ok(p)
    }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(5)
        .max(1)
}

#[doc(hidden)]
pub mod abi;
mod device;
mod loader;

pub use device::IbvDevice;
pub use loader::IbvLib;
use loader::{sysfs_gid_type, Api};

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn check_maps_return_codes() {
        assert!(check("x", 0, "").is_ok());
        assert_eq!(check("x", 12, "").unwrap_err().code, 12);
        assert!(check("x", -1, "").unwrap_err().code > 0);
        assert!(check_ptr::<u8>("x", std::ptr::null_mut(), "").is_err());
    }
}
