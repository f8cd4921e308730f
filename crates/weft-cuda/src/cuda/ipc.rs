//! Device memory shared between processes: export a range of this
//! process's allocation as a [`SharedMemory`], import a peer's.
//!
//! Two kinds of allocation can be shared:
//! - `cuMemAlloc`-style memory (what torch's caching allocator hands out):
//!   a legacy IPC handle of the whole allocation (`cuIpcGetMemHandle` of its
//!   base), and the range's offset in it;
//! - virtual-memory allocations (`cuMemCreate` with POSIX file-descriptor
//!   handles, as torch's expandable segments and
//!   [`Gpu::alloc_shareable`] make): the exporter keeps a descriptor open
//!   ([`Exported`] owns it) and the importer takes a copy with
//!   `pidfd_getfd` (same user, and ptrace access to the exporter: a
//!   `kernel.yama.ptrace_scope` of 0, or root).
//!
//! An import maps the whole allocation once; [`ImportCache`] keeps one
//! mapping per peer and allocation, and unmaps a peer's when it is told the
//! peer is gone.

use super::drv;
use crate::{CudaError, DeviceBuffer, Gpu, ShareKind, SharedMemory};
use cudarc::driver::sys;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use weft_transport::MemRegion;

/// A range of this process's device memory made openable by other
/// processes. Keep it while peers may still import the range: for a
/// virtual-memory allocation it holds the descriptor they copy (mappings
/// already made stay valid after it is dropped).
#[derive(Debug)]
pub struct Exported {
    shared: SharedMemory,
    _fd: Option<OwnedFd>,
}

impl Exported {
    /// What a peer needs to import the range ([`SharedMemory::to_bytes`]
    /// carries it).
    pub fn shared(&self) -> &SharedMemory {
        &self.shared
    }
}

/// One peer allocation mapped into this process; unmapped when dropped.
struct Mapping {
    gpu: Gpu,
    base: sys::CUdeviceptr,
    size: u64,
    vmm: Option<sys::CUmemGenericAllocationHandle>,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let g = &self.gpu.inner;
        if let Err(e) = g.synchronize() {
            tracing::warn!(device = %g.label, %e, "synchronize before unmapping a peer's memory failed");
        }
        // SAFETY: `base..base+size` is a mapping this value made (legacy:
        // opened with cuIpcOpenMemHandle; VMM: reserved, mapped and the
        // handle imported), undone once, here, with the context current
        // (bound by `synchronize`) and idle.
        unsafe {
            let rc = match self.vmm {
                None => sys::cuIpcCloseMemHandle(self.base),
                Some(h) => {
                    let a = sys::cuMemUnmap(self.base, self.size as usize);
                    let b = sys::cuMemAddressFree(self.base, self.size as usize);
                    let c = sys::cuMemRelease(h);
                    [a, b, c]
                        .into_iter()
                        .find(|r| *r != sys::CUresult::CUDA_SUCCESS)
                        .unwrap_or(sys::CUresult::CUDA_SUCCESS)
                }
            };
            if rc != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(device = %g.label, ?rc, "unmapping a peer's memory failed");
            }
        }
    }
}

/// A peer's device memory range mapped into this process: usable as the
/// destination or source of copies and kernels on this GPU.
#[derive(Clone)]
pub struct Imported {
    mapping: Arc<Mapping>,
    offset: u64,
    len: u64,
}

impl std::fmt::Debug for Imported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Imported")
            .field("device", &self.mapping.gpu.inner.label)
            .field("ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("len", &self.len)
            .finish()
    }
}

impl Imported {
    /// Device address of the range's first byte in this process.
    pub fn device_ptr(&self) -> u64 {
        self.mapping.base + self.offset
    }

    /// Length of the range in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false` (empty ranges are refused).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The range as a [`MemRegion`] on this GPU.
    ///
    /// # Safety
    /// Keep this value (or a clone) alive until every registration of the
    /// region is gone, and only while the exporting peer keeps the memory
    /// allocated (the promise of [`MemRegion::new`]).
    pub unsafe fn region(&self) -> MemRegion {
        let p = self.device_ptr() as usize as *mut u8;
        let ptr = std::ptr::NonNull::new(p).unwrap_or(std::ptr::NonNull::dangling());
        // SAFETY: the range is mapped while `self` lives; the caller keeps
        // it (above).
        unsafe { MemRegion::new(ptr, self.len as usize, self.mapping.gpu.device()) }
    }
}

impl Gpu {
    /// This GPU's UUID (`cuDeviceGetUuid`).
    pub fn uuid(&self) -> Result<[u8; 16], CudaError> {
        let g = &self.inner;
        let mut u = sys::CUuuid_st { bytes: [0; 16] };
        // SAFETY: `u` is a valid out-parameter; `dev` a valid device.
        unsafe { sys::cuDeviceGetUuid_v2(&mut u, g.dev) }
            .result()
            .map_err(drv(&g.label, "cuDeviceGetUuid"))?;
        Ok(u.bytes.map(|b| b as u8))
    }

    /// Makes `[ptr, ptr+len)` of this GPU's memory openable by other
    /// processes. `ptr` may point anywhere inside an allocation
    /// (`cuMemAlloc`, or `cuMemCreate` with POSIX-fd handles); memory that
    /// cannot be shared (host memory, a VMM allocation without POSIX-fd
    /// handles, a range past the allocation) is a
    /// [`CudaError::NotShareable`].
    pub fn export(&self, ptr: u64, len: u64) -> Result<Exported, CudaError> {
        let g = &self.inner;
        let refuse = |what: String| CudaError::NotShareable {
            device: g.label.clone(),
            what,
        };
        if len == 0 {
            return Err(refuse("an empty range".into()));
        }
        g.bind()?;
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: valid out-parameters; an address outside any allocation
        // is reported as an error, not dereferenced.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(|e| {
                refuse(format!(
                    "{ptr:#x} is not device memory of this process ({e:?})"
                ))
            })?;
        let offset = ptr - base;
        if offset.checked_add(len).is_none_or(|end| end > size as u64) {
            return Err(refuse(format!(
                "[{ptr:#x}, +{len}) runs past its allocation [{base:#x}, +{size})"
            )));
        }
        let device_uuid = self.uuid()?;
        let mut handle = 0;
        // SAFETY: `handle` is a valid out-parameter; `ptr` is device memory
        // (checked above). Fails for memory that is not a VMM mapping.
        let vmm = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, ptr as usize as *mut _) };
        if vmm == sys::CUresult::CUDA_SUCCESS {
            let mut fd: i32 = -1;
            // SAFETY: `fd` receives an int for the POSIX-fd handle type.
            let rc = unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut i32).cast(),
                    handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            };
            // SAFETY: releases the reference cuMemRetainAllocationHandle took.
            let _ = unsafe { sys::cuMemRelease(handle) };
            rc.result().map_err(|e| {
                refuse(format!(
                    "a virtual-memory allocation without POSIX file-descriptor handles ({e:?})"
                ))
            })?;
            // SAFETY: the driver handed us a new descriptor we now own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            return Ok(Exported {
                shared: SharedMemory {
                    kind: ShareKind::PosixFd {
                        pid: std::process::id() as i32,
                        fd: fd.as_raw_fd(),
                        size: size as u64,
                    },
                    offset,
                    len,
                    device_uuid,
                },
                _fd: Some(fd),
            });
        }
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `h` is a valid out-parameter; `base` is the start of a
        // live allocation of this context.
        unsafe { sys::cuIpcGetMemHandle(&mut h, base) }
            .result()
            .map_err(|e| refuse(format!("cuIpcGetMemHandle: {e:?}")))?;
        Ok(Exported {
            shared: SharedMemory {
                kind: ShareKind::Legacy {
                    handle: h.reserved.map(|b| b as u8),
                },
                offset,
                len,
                device_uuid,
            },
            _fd: None,
        })
    }

    /// Maps a peer's exported range into this process (uncached: each call
    /// maps the allocation anew; [`ImportCache`] maps it once). A legacy
    /// handle cannot be opened twice at once in one process, nor in the
    /// process that exported it.
    pub fn import(&self, shared: &SharedMemory) -> Result<Imported, CudaError> {
        let mapping = Arc::new(self.map(shared)?);
        Imported::within(mapping, shared)
    }

    fn map(&self, shared: &SharedMemory) -> Result<Mapping, CudaError> {
        let g = &self.inner;
        let fail = |what: String| CudaError::ImportFailed {
            device: g.label.clone(),
            what,
        };
        g.bind()?;
        match shared.kind {
            ShareKind::Legacy { handle } => {
                let h = sys::CUipcMemHandle_st {
                    reserved: handle.map(|b| b as _),
                };
                let mut base = 0;
                // SAFETY: `base` is a valid out-parameter; the driver checks
                // the handle (a forged one is an error).
                unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut base,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                }
                .result()
                .map_err(|e| fail(format!("cuIpcOpenMemHandle: {e:?}")))?;
                let (mut b, mut size) = (0, 0usize);
                // SAFETY: valid out-parameters; `base` was just mapped.
                let rc = unsafe { sys::cuMemGetAddressRange_v2(&mut b, &mut size, base) };
                let m = Mapping {
                    gpu: self.clone(),
                    base,
                    size: size as u64,
                    vmm: None,
                };
                rc.result()
                    .map_err(|e| fail(format!("cuMemGetAddressRange: {e:?}")))?;
                Ok(m)
            }
            ShareKind::PosixFd { pid, fd, size } => {
                let local = take_fd(pid, fd).map_err(|e| {
                    fail(format!(
                        "pidfd_getfd of descriptor {fd} of process {pid}: {e} (needs the same \
                         user and ptrace access to it)"
                    ))
                })?;
                let mut h = 0;
                // SAFETY: `h` is a valid out-parameter; the descriptor is
                // passed by value as the driver expects for POSIX fds.
                unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut h,
                        local.as_raw_fd() as usize as *mut _,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                }
                .result()
                .map_err(|e| fail(format!("cuMemImportFromShareableHandle: {e:?}")))?;
                drop(local);
                let size_us = usize::try_from(size).map_err(|_| fail("size".into()))?;
                let mut base = 0;
                // SAFETY: reserves address space of the allocation's size.
                let rc = unsafe { sys::cuMemAddressReserve(&mut base, size_us, 0, 0, 0) };
                if let Err(e) = rc.result() {
                    // SAFETY: releases the handle imported above.
                    let _ = unsafe { sys::cuMemRelease(h) };
                    return Err(fail(format!("cuMemAddressReserve: {e:?}")));
                }
                // From here the mapping's drop undoes whatever was done.
                let m = Mapping {
                    gpu: self.clone(),
                    base,
                    size,
                    vmm: Some(h),
                };
                // SAFETY: maps the whole imported allocation at the reserved
                // range, then grants this device read-write access to it.
                unsafe {
                    sys::cuMemMap(base, size_us, 0, h, 0)
                        .result()
                        .map_err(|e| fail(format!("cuMemMap: {e:?}")))?;
                    let access = access_desc(g.ordinal);
                    sys::cuMemSetAccess(base, size_us, &access, 1)
                        .result()
                        .map_err(|e| fail(format!("cuMemSetAccess: {e:?}")))?;
                }
                Ok(m)
            }
        }
    }

    /// `len` bytes of device memory made with `cuMemCreate` and POSIX
    /// file-descriptor handles (rounded up to the allocation granularity),
    /// zero-filled: memory [`Gpu::export`] shares as a virtual-memory
    /// allocation.
    pub fn alloc_shareable(&self, len: usize) -> Result<DeviceBuffer, CudaError> {
        DeviceBuffer::new_shareable(self, len)
    }
}

/// Read-write access for device `ordinal`.
pub(crate) fn access_desc(ordinal: u32) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// Device `ordinal` as a memory location.
pub(crate) fn location(ordinal: u32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    }
}

/// A copy of descriptor `fd` of process `pid` (`pidfd_open` +
/// `pidfd_getfd`).
fn take_fd(pid: i32, fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscalls with integer arguments; results checked.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: as above.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
}

impl Imported {
    /// The range `shared` names inside `mapping`, checked against its size
    /// (a peer's description is untrusted).
    fn within(mapping: Arc<Mapping>, shared: &SharedMemory) -> Result<Imported, CudaError> {
        let inside = shared
            .offset
            .checked_add(shared.len)
            .is_some_and(|end| end <= mapping.size);
        if !inside {
            return Err(CudaError::ImportFailed {
                device: mapping.gpu.inner.label.clone(),
                what: format!(
                    "range [{}, +{}) outside the peer's allocation of {} bytes",
                    shared.offset, shared.len, mapping.size
                ),
            });
        }
        Ok(Imported {
            mapping,
            offset: shared.offset,
            len: shared.len,
        })
    }
}

/// A mapping's key: the peer, the allocation, its GPU.
type MapKey = (u64, ShareKind, [u8; 16]);

/// Peers' allocations mapped once each, by peer (any `u64` the caller uses
/// to name peers) and allocation; [`ImportCache::forget_peer`] unmaps a
/// peer's (when it is removed or dies). Ranges handed out keep their
/// mapping alive until they are dropped too.
pub struct ImportCache {
    gpu: Gpu,
    maps: Mutex<BTreeMap<MapKey, Arc<Mapping>>>,
}

impl std::fmt::Debug for ImportCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportCache")
            .field("device", &self.gpu.inner.label)
            .field("mappings", &self.mappings())
            .finish()
    }
}

impl ImportCache {
    /// An empty cache importing onto `gpu`.
    pub fn new(gpu: &Gpu) -> ImportCache {
        ImportCache {
            gpu: gpu.clone(),
            maps: Mutex::new(BTreeMap::new()),
        }
    }

    /// `shared`, exported by `peer`, mapped into this process (the
    /// allocation is mapped on first use and reused after).
    pub fn import(&self, peer: u64, shared: &SharedMemory) -> Result<Imported, CudaError> {
        let key = (peer, shared.kind, shared.device_uuid);
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        let mapping = match maps.get(&key) {
            Some(m) => m.clone(),
            None => {
                let m = Arc::new(self.gpu.map(shared)?);
                maps.insert(key, m.clone());
                m
            }
        };
        drop(maps);
        Imported::within(mapping, shared)
    }

    /// Drops every mapping of `peer` (unmapped once no range handed out
    /// still uses it); returns how many there were.
    pub fn forget_peer(&self, peer: u64) -> usize {
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        let before = maps.len();
        maps.retain(|k, _| k.0 != peer);
        before - maps.len()
    }

    /// Mappings held.
    pub fn mappings(&self) -> usize {
        self.maps.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}
