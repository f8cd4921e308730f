//! A host buffer that NICs write into (the stand-in for GPU memory).

use std::ptr::NonNull;
use weft_transport::{Device, MemRegion};

/// A zeroed heap buffer that is only ever accessed through raw pointers, so
/// remote WRITEs may land in it while it is shared. Reads are only
/// meaningful once a completion (imm count, on_done) said the bytes are
/// final; the apps only read after such a signal.
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain heap allocation, accessed only through raw-pointer copies.
unsafe impl Send for HostBuf {}
// SAFETY: see Send; no references into the memory are ever handed out.
unsafe impl Sync for HostBuf {}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuf({} bytes)", self.len)
    }
}

impl HostBuf {
    /// Allocates `len` zeroed bytes (at least 1).
    pub fn new(len: usize) -> Self {
        let len = len.max(1);
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let raw = Box::into_raw(b).cast::<u8>();
        // SAFETY: Box::into_raw never returns null.
        let ptr = unsafe { NonNull::new_unchecked(raw) };
        Self { ptr, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (buffers hold at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The region to register. The caller must keep `self` alive until the
    /// registration is released (every app here unregisters or shuts its
    /// engine down before dropping its buffers).
    pub fn region(&self) -> MemRegion {
        // SAFETY: the allocation is valid for `len` bytes for the lifetime
        // of `self`; it is only accessed through raw pointers.
        unsafe { MemRegion::new(self.ptr, self.len, Device::Host) }
    }

    /// Copies `len` bytes at `off` out, or `None` if out of bounds.
    pub fn read(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        let end = off.checked_add(len)?;
        if end > self.len {
            return None;
        }
        let mut v = vec![0u8; len];
        // SAFETY: `off..end` is in bounds (checked above); raw copy, no
        // reference into the shared memory is created.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len) };
        Some(v)
    }

    /// Copies `data` in at `off`; returns false if out of bounds.
    pub fn write(&self, off: usize, data: &[u8]) -> bool {
        let Some(end) = off.checked_add(data.len()) else {
            return false;
        };
        if end > self.len {
            return false;
        }
        // SAFETY: in bounds (checked above); raw copy.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.as_ptr().add(off), data.len()) };
        true
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: allocated in `new` from a boxed slice of exactly this length.
        drop(unsafe { Box::from_raw(slice) });
    }
}

/// Deterministic content of byte `i` of stream `tag` (test/demo patterns).
pub fn pattern(tag: u64, i: u64) -> u8 {
    let x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ tag.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x >> 29) as u8
}
