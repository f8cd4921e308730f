//! Host-mapped pinned words: watcher words the GPU writes and flags the host
//! raises.

use super::drv;
use crate::{CudaError, DeviceBuffer, Gpu};
use cudarc::driver::sys;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One cache line of pinned host memory, mapped into the device's address
/// space (`cuMemHostAlloc(DEVICEMAP | PORTABLE)`), zeroed.
pub(crate) struct HostMapped {
    gpu: Gpu,
    host: NonNull<AtomicU64>,
    dev: u64,
}

// SAFETY: the memory is pinned, lives until drop, and is only accessed as an
// `AtomicU64` on the host; the device pointer is a plain address.
unsafe impl Send for HostMapped {}
// SAFETY: see `Send`; all host accesses are atomic.
unsafe impl Sync for HostMapped {}

/// Bytes per mapped word: a word alone on its 128-byte line, so host polling
/// and GPU writes never share a line with anything else.
const LINE: usize = 128;

impl HostMapped {
    fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let label = &gpu.inner.label;
        gpu.inner.bind()?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: `p` is a valid out-pointer; the context is current.
        unsafe { sys::cuMemHostAlloc(&mut p, LINE, flags) }
            .result()
            .map_err(drv(label, "cuMemHostAlloc"))?;
        let host = NonNull::new(p.cast::<AtomicU64>()).ok_or_else(|| CudaError::Driver {
            device: label.clone(),
            op: "cuMemHostAlloc",
            code: 0,
            name: "returned a null pointer".into(),
        })?;
        // SAFETY: `p` points to LINE >= 8 writable bytes of pinned memory,
        // page-aligned (so aligned for u64); nothing else references it yet.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, LINE) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a DEVICEMAP allocation of this context; `dev` is a
        // valid out-pointer; flags must be 0.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) }
            .result()
            .map_err(drv(label, "cuMemHostGetDevicePointer"));
        if let Err(e) = rc {
            // SAFETY: `p` came from cuMemHostAlloc and is freed once.
            let _ = unsafe { sys::cuMemFreeHost(p) };
            return Err(e);
        }
        Ok(HostMapped {
            gpu: gpu.clone(),
            host,
            dev,
        })
    }

    fn atomic(&self) -> &AtomicU64 {
        // SAFETY: `host` points to a live, aligned u64 we own until drop; it is
        // only ever accessed atomically on the host.
        unsafe { self.host.as_ref() }
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.inner.synchronize() {
            tracing::warn!(device = %self.gpu.inner.label, %e, "synchronize before cuMemFreeHost failed");
        }
        // SAFETY: the pointer came from cuMemHostAlloc and is freed once, after
        // the device finished all work that could touch it.
        let rc = unsafe { sys::cuMemFreeHost(self.host.as_ptr().cast()) };
        if let Err(e) = rc.result() {
            tracing::warn!(device = %self.gpu.inner.label, ?e, "cuMemFreeHost failed");
        }
    }
}

/// A UVM watcher word the GPU bumps and the host watches.
///
/// Host side: [`WatchWord::host_ptr`] is what the engine's watcher polls
/// (`weft_engine`'s `watch_word`). Device side: [`WatchWord::device_ptr`] is
/// writable from any kernel and from inside CUDA graphs;
/// [`crate::Kernels::scalar_inc`] bumps it.
///
/// The GPU is the only writer. `scalar_inc` keeps a device-memory shadow of
/// the value so it never reads across PCIe: the word's value is the sum of
/// all `scalar_inc` deltas so far. Bumps of one word must not race (issue
/// them on one stream, or order them with events).
///
/// Dropping it waits for all work of its device first; a watcher polling the
/// host pointer must be stopped before the word is dropped.
#[derive(Clone)]
pub struct WatchWord {
    pub(crate) inner: Arc<WatchInner>,
}

pub(crate) struct WatchInner {
    pub(crate) mem: HostMapped,
    pub(crate) shadow: DeviceBuffer,
}

impl fmt::Debug for WatchWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WatchWord")
            .field("device", &self.inner.mem.gpu.inner.label)
            .field("host", &self.inner.mem.host)
            .field("dev", &format_args!("{:#x}", self.inner.mem.dev))
            .field("value", &self.value())
            .finish()
    }
}

impl WatchWord {
    pub(crate) fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let mem = HostMapped::new(gpu)?;
        let shadow = DeviceBuffer::new(gpu, 8)?;
        Ok(WatchWord {
            inner: Arc::new(WatchInner { mem, shadow }),
        })
    }

    /// The host address of the word, for the engine's watcher. Valid while
    /// any clone of this `WatchWord` lives.
    pub fn host_ptr(&self) -> NonNull<AtomicU64> {
        self.inner.mem.host
    }

    /// The device address of the word (for kernels).
    pub fn device_ptr(&self) -> u64 {
        self.inner.mem.dev
    }

    /// The device address of the device-memory shadow `scalar_inc` keeps.
    pub fn shadow_device_ptr(&self) -> u64 {
        self.inner.shadow.device_ptr()
    }

    /// The current value (acquire load on the host).
    pub fn value(&self) -> u64 {
        self.inner.mem.atomic().load(Ordering::Acquire)
    }

    /// The GPU the word is mapped into.
    pub fn gpu(&self) -> &Gpu {
        &self.inner.mem.gpu
    }
}

/// A flag the host raises and kernels wait on (the MoE proxy's signal to a
/// waiting kernel).
///
/// The host stores with release semantics ([`HostFlag::raise`]), so every
/// host write before the raise is visible to a kernel that observed the new
/// value with an acquire load (`weft_wait_flag` in [`crate::KERNELS_CU`]
/// spins with `ld.acquire.sys`). Kernels wait for `flag >= target`, so raise
/// monotonically increasing values (a sequence number per round).
#[derive(Clone)]
pub struct HostFlag {
    pub(crate) inner: Arc<HostMapped>,
}

impl fmt::Debug for HostFlag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostFlag")
            .field("device", &self.inner.gpu.inner.label)
            .field("dev", &format_args!("{:#x}", self.inner.dev))
            .field("value", &self.value())
            .finish()
    }
}

impl HostFlag {
    pub(crate) fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        Ok(HostFlag {
            inner: Arc::new(HostMapped::new(gpu)?),
        })
    }

    /// Raises the flag to `value` (release store).
    pub fn raise(&self, value: u64) {
        self.inner.atomic().store(value, Ordering::Release);
    }

    /// The current value.
    pub fn value(&self) -> u64 {
        self.inner.atomic().load(Ordering::Acquire)
    }

    /// The host address of the flag word.
    pub fn host_ptr(&self) -> NonNull<AtomicU64> {
        self.inner.host
    }

    /// The device address of the flag word (for kernels).
    pub fn device_ptr(&self) -> u64 {
        self.inner.dev
    }

    pub(crate) fn inner_gpu(&self) -> Gpu {
        self.inner.gpu.clone()
    }
}
