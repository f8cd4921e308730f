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

/// The memory of one live registration, as the message layer reaches it:
/// where a received message is copied into the user's receive buffer, and
/// where a SEND from device memory is staged from. Host memory is copied
/// directly; CUDA memory through the CUDA runtime libfabric loaded
/// ([`CudaFence::copy`]). Held only while the region is registered with
/// the domain (dropped on deregistration).
pub(crate) struct MrWindow {
    ptr: ptr::NonNull<u8>,
    len: usize,
    /// The CUDA device of device memory; `None` for host memory.
    cuda: Option<u32>,
}

// SAFETY: a window onto memory the registrant promised (MemRegion::new) to
// keep valid for reads and writes while registered, from any thread.
unsafe impl Send for MrWindow {}

impl MrWindow {
    /// The window of `region`; `None` for device memory when no CUDA
    /// runtime is loaded (nothing could copy it).
    pub(crate) fn of(region: &weft_transport::MemRegion) -> Option<MrWindow> {
        let cuda = match region.device() {
            weft_transport::Device::Host => None,
            weft_transport::Device::Cuda(d) => {
                CudaFence::get()?;
                Some(d)
            }
        };
        Some(MrWindow {
            ptr: region.ptr(),
            len: region.len(),
            cuda,
        })
    }

    /// Copies `src` to `off` within the region; false (nothing written,
    /// or a failed CUDA copy, logged) when out of range.
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> bool {
        if !fits(off, src.len(), self.len) {
            return false;
        }
        // Address arithmetic only (device memory is no Rust allocation).
        let dst = self.ptr.as_ptr().wrapping_add(off);
        match self.cuda {
            None => {
                // SAFETY: the range lies inside the registered region
                // (checked above), which `MemRegion::new`'s contract keeps
                // valid for writes while it is registered; this window
                // exists only while it is. The contract also lets the NIC
                // and peers write it concurrently, so no reference to it is
                // formed; `src` is a separate slice.
                unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
                true
            }
            // `dst..+len` is device memory of `d` inside the registration
            // (checked above), `src` a host slice of that length.
            Some(d) => cuda_copy(d, dst, src.as_ptr(), src.len()),
        }
    }
}

impl CtlBuf {
    /// Copies `len` bytes at `src_off` of registration `src` to `off`;
    /// false (nothing copied, or a failed CUDA copy, logged) when either
    /// range is out of bounds.
    pub(crate) fn fill_from(
        &mut self,
        off: usize,
        src: &MrWindow,
        src_off: usize,
        len: usize,
    ) -> bool {
        if !fits(off, len, self.len()) || !fits(src_off, len, src.len) {
            return false;
        }
        // Address arithmetic only (the source may be device memory).
        let dst = self.ptr.as_ptr().wrapping_add(off);
        let s = src.ptr.as_ptr().wrapping_add(src_off);
        match src.cuda {
            None => {
                // SAFETY: both ranges lie inside their allocations (checked
                // above): this buffer, owned here and not in use by a posted
                // operation at `off` (the caller's staging slot), and the
                // registered region, valid for reads while registered
                // (`MemRegion::new`); the two are distinct.
                unsafe { ptr::copy_nonoverlapping(s, dst, len) };
                true
            }
            // As above, the source being device memory of `d`.
            Some(d) => cuda_copy(d, dst, s, len),
        }
    }
}

/// [`CudaFence::copy`] for ranges the callers checked; false (logged) when
/// it fails.
fn cuda_copy(device: u32, dst: *mut u8, src: *const u8, len: usize) -> bool {
    let Some(fence) = CudaFence::get() else {
        return false;
    };
    // SAFETY: the callers checked both ranges against live allocations
    // (a registered region and a host buffer they own).
    match unsafe { fence.copy(device, dst, src, len) } {
        Ok(()) => true,
        Err(code) => {
            tracing::warn!(device, code, len, "CUDA copy of a message failed");
            false
        }
    }
}
