//! Memory: devices, regions to register, and the keys registration returns.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ptr::NonNull;

/// Where a memory region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// Ordinary host memory.
    Host,
    /// Memory of the CUDA device with this ordinal.
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Who may access a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Only local operations (SEND sources, RECV buffers, WRITE sources).
    LocalOnly,
    /// Local operations plus remote WRITEs from peers holding the rkey.
    RemoteWrite,
}

/// A span of memory the caller promises stays valid while registered.
///
/// This is the single place where raw pointers enter weft: creating a
/// `MemRegion` is `unsafe`, and everything downstream (registration, remote
/// writes landing in it) relies on that promise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemRegion {
    ptr: NonNull<u8>,
    len: usize,
    device: Device,
}

// SAFETY: `MemRegion` is only an address range plus a promise made by the
// creator of the region (see `MemRegion::new`); it does not own or alias any
// Rust object, so moving or sharing the description across threads is sound.
// Actual accesses to the memory are done by backends under their own rules.
#[allow(unsafe_code)]
unsafe impl Send for MemRegion {}
// SAFETY: see the `Send` impl above; `MemRegion` has no interior state.
#[allow(unsafe_code)]
unsafe impl Sync for MemRegion {}

impl MemRegion {
    /// Describes `len` bytes at `ptr` on `device`.
    ///
    /// # Safety
    ///
    /// For as long as any domain has this region registered:
    /// - `ptr..ptr+len` must be valid for reads and writes on `device` (host
    ///   memory for [`Device::Host`], device memory for [`Device::Cuda`]);
    /// - the memory must not be freed or unmapped;
    /// - the caller accepts that peers and the NIC write into it concurrently
    ///   with the program (as with any RDMA registration), so it must not be
    ///   covered by a live Rust `&`/`&mut` reference that assumes exclusive
    ///   or immutable access while remote writes may land.
    #[allow(unsafe_code)]
    pub unsafe fn new(ptr: NonNull<u8>, len: usize, device: Device) -> Self {
        Self { ptr, len, device }
    }

    /// Start address.
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Start address as an integer (what descriptors carry).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether `[addr, addr+len)` lies inside this region (no overflow).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        span_within(self.addr(), self.len as u64, addr, len)
    }
}

/// Whether `[addr, addr+len)` lies within `[base, base+base_len)`, without
/// overflowing.
pub(crate) fn span_within(base: u64, base_len: u64, addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let Some(base_end) = base.checked_add(base_len) else {
        return false;
    };
    addr >= base && end <= base_end
}

/// A domain-local key identifying a registration (an lkey / fid_mr handle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MrKey(pub u64);

/// The key a peer presents to WRITE into a registration on one NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Rkey(pub u64);

impl fmt::Display for Rkey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// What [`crate::Domain::register`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalMr {
    /// Local key, used in [`LocalSlice`]s.
    pub key: MrKey,
    /// Remote key; meaningful only for [`Access::RemoteWrite`].
    pub rkey: Rkey,
    /// Start address of the registered memory.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device the memory lives on.
    pub device: Device,
}

impl LocalMr {
    /// A slice of this registration, `len` bytes at byte `offset`. Returns
    /// `None` if it does not fit (checked without overflow).
    pub fn slice(&self, offset: u64, len: u64) -> Option<LocalSlice> {
        let addr = self.addr.checked_add(offset)?;
        span_within(self.addr, self.len, addr, len).then_some(LocalSlice {
            mr: self.key,
            addr,
            len,
        })
    }
}

/// Local memory an operation reads from or writes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSlice {
    /// Registration the memory belongs to.
    pub mr: MrKey,
    /// Absolute start address (inside the registration).
    pub addr: u64,
    /// Length in bytes (up to `u64`; never truncated to 32 bits).
    pub len: u64,
}

/// Copies bytes between memories of any [`Device`]s (host↔host, host↔GPU,
/// GPU↔GPU). Backends that move bytes in software (the loopback fabric) use
/// it for regions that are not host memory; `weft-cuda` provides one backed by
/// the CUDA copy engine.
pub trait DeviceCopy: Send + Sync {
    /// Copies `len` bytes from `src` on `src_dev` to `dst` on `dst_dev` and
    /// returns when the bytes are visible at `dst`.
    ///
    /// Callers guarantee both spans lie inside registered [`MemRegion`]s of
    /// the stated devices.
    fn copy(
        &self,
        dst: u64,
        dst_dev: Device,
        src: u64,
        src_dev: Device,
        len: u64,
    ) -> Result<(), crate::TransportError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_within_rejects_overflow_and_outside() {
        assert!(span_within(100, 10, 100, 10));
        assert!(span_within(100, 10, 105, 0));
        assert!(span_within(100, 10, 110, 0));
        assert!(!span_within(100, 10, 111, 0));
        assert!(!span_within(100, 10, 99, 1));
        assert!(!span_within(100, 10, 105, 6));
        assert!(!span_within(100, 10, u64::MAX, 2));
        assert!(!span_within(u64::MAX - 1, 10, u64::MAX - 1, 1));
    }

    #[test]
    fn local_mr_slice_bounds() {
        let mr = LocalMr {
            key: MrKey(1),
            rkey: Rkey(2),
            addr: 4096,
            len: 100,
            device: Device::Host,
        };
        assert_eq!(mr.slice(0, 100).unwrap().addr, 4096);
        assert_eq!(mr.slice(99, 1).unwrap().len, 1);
        assert!(mr.slice(99, 2).is_none());
        assert!(mr.slice(u64::MAX, 1).is_none());
    }
}
