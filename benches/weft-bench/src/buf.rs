//! Heap buffers that NICs (real or simulated) read and write behind Rust's
//! back: only ever accessed through raw pointers.

use std::ptr::NonNull;
use weft_transport::{Device, MemRegion};

/// A zeroed heap allocation handed to NICs. Pages are mapped lazily by the
/// allocator, so a large buffer that a null backend never touches costs
/// nothing.
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain heap allocation that is only accessed through raw pointers
// (by backends); no Rust reference to its bytes is ever created.
unsafe impl Send for HostBuf {}
// SAFETY: see `Send`; the type has no interior state of its own.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// Allocates `len` zeroed bytes (at least 1).
    pub fn new(len: usize) -> Self {
        let len = len.max(1);
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let raw = Box::into_raw(b).cast::<u8>();
        // `Box::into_raw` never returns null.
        let ptr = NonNull::new(raw).unwrap_or(NonNull::dangling());
        Self { ptr, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: at least 1 byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region to register.
    ///
    /// Callers must deregister (drop the domains / shut the engines down)
    /// before dropping the buffer; every benchmark in this crate keeps its
    /// buffers alive until its engines and domains are gone.
    pub fn region(&self) -> MemRegion {
        // SAFETY: the allocation lives until `self` is dropped, and this
        // crate drops buffers only after every domain/engine that registered
        // them; nothing creates references to the bytes.
        unsafe { MemRegion::new(self.ptr, self.len, Device::Host) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: `ptr`/`len` came from `Box::<[u8]>::into_raw` in `new` and
        // are freed exactly once, here.
        drop(unsafe { Box::from_raw(slice) });
    }
}
