//! A heap buffer that engines register. It is only accessed through raw
//! pointers (NICs write into it), never through long-lived references.

use std::ptr::NonNull;
use weft_transport::{Device, MemRegion};

/// Page-aligned zeroed heap memory, freed on drop. Whoever registers it
/// must shut the engine down (or deregister) before dropping it.
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: std::alloc::Layout,
}

// SAFETY: a plain heap allocation accessed through raw pointers only.
unsafe impl Send for HostBuf {}
// SAFETY: see Send.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// `len` zero bytes (page-aligned). Panics if the allocation fails.
    pub fn new(len: usize) -> Self {
        let layout = match std::alloc::Layout::from_size_align(len.max(1), 4096) {
            Ok(l) => l,
            Err(e) => panic!("bad buffer size {len}: {e}"),
        };
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len, layout }
    }

    /// `len` bytes, byte `i` being `f(i)`.
    pub fn from_fn(len: usize, f: impl Fn(usize) -> u8) -> Self {
        let b = Self::new(len);
        let v: Vec<u8> = (0..len).map(f).collect();
        b.write(0, &v);
        b
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer as a host memory region.
    pub fn region(&self) -> MemRegion {
        // SAFETY: the memory lives until `self` is dropped; every user shuts
        // its engines down (or deregisters) before dropping the buffer.
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

    /// Copies `data` to `off`; `false` (nothing written) when out of bounds.
    pub fn write(&self, off: usize, data: &[u8]) -> bool {
        match off.checked_add(data.len()) {
            Some(end) if end <= self.len => {}
            _ => return false,
        }
        // SAFETY: in bounds; `data` is a separate Rust slice.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.as_ptr().add(off), data.len()) };
        true
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
