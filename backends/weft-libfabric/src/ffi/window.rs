//! Backend-owned and registered memory the message layer reads and writes.

use super::*;

// ---------------------------------------------------------------------------
// Backend-owned and registered memory the message layer reads and writes
// ---------------------------------------------------------------------------

/// Whether `off..off + len` lies within `0..total`.
fn fits(off: usize, len: usize, total: usize) -> bool {
    off.checked_add(len).is_some_and(|end| end <= total)
}

/// A zeroed, page-aligned heap buffer owned by one domain and registered
/// with it: SEND headers and the bounce buffers incoming messages land in.
/// The provider (or the NIC) writes into parts of it while they are posted;
/// this side only copies in and out of parts that are not, and never forms
/// references to its bytes.
pub(crate) struct CtlBuf {
    ptr: ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: plain heap memory owned by this value; access goes through
// `&self`/`&mut self` methods of the one domain that owns it.
unsafe impl Send for CtlBuf {}

impl CtlBuf {
    /// A zeroed buffer of `len` bytes (at least one), or `None` when the
    /// allocation fails.
    pub(crate) fn new(len: usize) -> Option<CtlBuf> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(CtlBuf {
            ptr: ptr::NonNull::new(p)?,
            layout,
        })
    }

    /// Start address (for registration and iovs).
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }

    /// Copies `src` to `off`; false (nothing written) when out of range.
    pub(crate) fn write(&mut self, off: usize, src: &[u8]) -> bool {
        if !fits(off, src.len(), self.len()) {
            return false;
        }
        // SAFETY: `off..off + src.len()` lies inside the allocation (checked
        // above); the caller writes only parts no posted operation uses.
        unsafe {
            ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len());
        }
        true
    }

    /// A copy of `len` bytes at `off`; `None` when out of range.
    pub(crate) fn read(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        if !fits(off, len, self.len()) {
            return None;
        }
        let mut v = vec![0u8; len];
        // SAFETY: `off..off + len` lies inside the allocation (checked
        // above) and `v` holds `len` bytes; the caller reads only parts that
        // no posted operation writes (a completed receive).
        unsafe {
            ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len);
        }
        Some(v)
    }
}

impl Drop for CtlBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Host memory of one live registration: where the message layer copies a
/// received message into the user's receive buffer. Held only while the
/// region is registered with the domain (dropped on deregistration).
pub(crate) struct HostWindow {
    ptr: ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: a window onto memory the registrant promised (MemRegion::new) to
// keep valid for reads and writes while registered, from any thread.
unsafe impl Send for HostWindow {}

impl HostWindow {
    /// The window of host region `region`; `None` for device memory (which
    /// plain copies cannot reach).
    pub(crate) fn of(region: &weft_transport::MemRegion) -> Option<HostWindow> {
        match region.device() {
            weft_transport::Device::Host => Some(HostWindow {
                ptr: region.ptr(),
                len: region.len(),
            }),
            weft_transport::Device::Cuda(_) => None,
        }
    }

    /// Copies `src` to `off` within the region; false (nothing written) when
    /// out of range.
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> bool {
        if !fits(off, src.len(), self.len) {
            return false;
        }
        // SAFETY: the range lies inside the registered region (checked
        // above), which `MemRegion::new`'s contract keeps valid for writes
        // while it is registered; this window exists only while it is. The
        // contract also lets the NIC and peers write it concurrently, so no
        // reference to it is formed.
        unsafe {
            ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len());
        }
        true
    }
}
