//! A heap buffer the engine tests register with their engines. It is only
//! accessed through raw pointers (NICs write into it), never through
//! long-lived references. Shared by `engine_tcp.rs` and `engine_xproc.rs`.

use std::ptr::NonNull;
use weft_transport::{Device, MemRegion};

pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain heap allocation accessed through raw pointers only.
unsafe impl Send for HostBuf {}
// SAFETY: see Send.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// `len` zero bytes.
    pub fn new(len: usize) -> Self {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let ptr = NonNull::new(Box::into_raw(b).cast::<u8>()).expect("non-null");
        Self { ptr, len }
    }

    /// `len` bytes, byte `i` being `f(i)`.
    pub fn from_fn(len: usize, f: impl Fn(usize) -> u8) -> Self {
        let b = Self::new(len);
        let v: Vec<u8> = (0..len).map(f).collect();
        // SAFETY: in bounds, nothing else touches the fresh buffer.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), b.ptr.as_ptr(), len) };
        b
    }

    pub fn region(&self) -> MemRegion {
        // SAFETY: every test shuts its engines down before its buffers are
        // dropped, so the memory outlives its registrations.
        unsafe { MemRegion::new(self.ptr, self.len, Device::Host) }
    }

    /// A copy of `[off, off + len)`, or `None` when out of bounds.
    pub fn read(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        if off.checked_add(len)? > self.len {
            return None;
        }
        let mut v = vec![0u8; len];
        // SAFETY: in bounds; read only after the engine said the bytes are final.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len) };
        Some(v)
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: allocated by `Box<[u8]>` of this length in `new`.
        drop(unsafe { Box::from_raw(slice) });
    }
}
