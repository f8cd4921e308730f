//! The UD handshake slots: heap memory the NIC reads and writes.

use std::ptr::NonNull;

/// Heap memory the NIC reads and writes (UD handshake slots), accessed only
/// through raw pointers.
pub(super) struct DmaBuf {
    ptr: NonNull<u8>,
    pub(super) len: usize,
}

impl DmaBuf {
    pub(super) fn new(len: usize) -> Self {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let raw = Box::into_raw(b) as *mut u8;
        Self {
            ptr: NonNull::new(raw).unwrap_or(NonNull::dangling()),
            len,
        }
    }
    pub(super) fn addr(&self, off: usize) -> u64 {
        self.ptr.as_ptr() as u64 + off as u64
    }
    pub(super) fn write(&mut self, off: usize, data: &[u8]) {
        if off.checked_add(data.len()).is_some_and(|e| e <= self.len) {
            // SAFETY: in bounds of our own allocation; the slot is not posted
            // to the NIC while we fill it.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(off), data.len())
            }
        }
    }
    pub(super) fn read(&self, off: usize, len: usize) -> Vec<u8> {
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Vec::new();
        }
        let mut v = vec![0u8; len];
        // SAFETY: in bounds; the NIC finished writing the slot (its receive
        // completion was polled) and it is not reposted until after this.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len) };
        v
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: allocated by `Box<[u8]>` of exactly this length in `new`;
        // the domain destroys every QP using it before dropping it.
        drop(unsafe { Box::from_raw(slice) });
    }
}

// SAFETY: DmaBuf owns its allocation exclusively; the pointer is never shared
// outside the domain that owns it.
unsafe impl Send for DmaBuf {}
