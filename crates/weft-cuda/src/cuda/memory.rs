//! Device memory buffers.

use super::drv;
use crate::{CudaError, Gpu};
use cudarc::driver::{result, sys};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use weft_transport::{Device, MemRegion};

/// `len` bytes of device memory (`cuMemAlloc`), zero-filled at allocation.
///
/// Register it with a backend through [`DeviceBuffer::region`]. Dropping it
/// first waits for all work of its device (so no kernel or copy still
/// touches it), then frees it.
pub struct DeviceBuffer {
    pub(crate) inner: Arc<BufInner>,
}

pub(crate) struct BufInner {
    gpu: Gpu,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.inner.gpu.inner.label)
            .field("ptr", &format_args!("{:#x}", self.inner.ptr))
            .field("len", &self.inner.len)
            .finish()
    }
}

impl DeviceBuffer {
    pub(crate) fn new(gpu: &Gpu, len: usize) -> Result<Self, CudaError> {
        let label = &gpu.inner.label;
        if len == 0 {
            return Err(CudaError::InvalidArgument {
                device: label.clone(),
                what: "cannot allocate a zero-length device buffer".into(),
            });
        }
        gpu.inner.bind()?;
        // SAFETY: the context is current; the size is non-zero.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(drv(label, "cuMemAlloc"))?;
        let buf = DeviceBuffer {
            inner: Arc::new(BufInner {
                gpu: gpu.clone(),
                ptr,
                len,
            }),
        };
        buf.fill(0)?;
        Ok(buf)
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.inner.gpu.device()
    }

    /// The GPU that owns the memory.
    pub fn gpu(&self) -> &Gpu {
        &self.inner.gpu
    }

    /// Device address of the first byte (a UVA address).
    pub fn device_ptr(&self) -> u64 {
        self.inner.ptr
    }

    /// Length in bytes (never 0).
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Always `false` (zero-length buffers are refused at allocation).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The buffer as a [`MemRegion`] on [`Device::Cuda`], for
    /// `Domain::register` / the engine's `reg_mr`.
    ///
    /// # Safety
    ///
    /// The caller must keep this buffer alive until every registration of
    /// the returned region has been deregistered (the promise
    /// [`MemRegion::new`] asks for).
    pub unsafe fn region(&self) -> MemRegion {
        let ptr = NonNull::new(self.inner.ptr as usize as *mut u8).unwrap_or(NonNull::dangling());
        // SAFETY: `ptr..ptr+len` is a live device allocation on this GPU; the
        // caller promises (above) to keep it alive while registered.
        unsafe { MemRegion::new(ptr, self.inner.len, self.device()) }
    }

    fn check(&self, offset: usize, len: usize) -> Result<u64, CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.len => Ok(self.inner.ptr + offset as u64),
            _ => Err(CudaError::InvalidArgument {
                device: self.inner.gpu.inner.label.clone(),
                what: format!(
                    "range {offset}+{len} outside device buffer of {} bytes",
                    self.inner.len
                ),
            }),
        }
    }

    /// Sets every byte to `byte` (synchronous).
    pub fn fill(&self, byte: u8) -> Result<(), CudaError> {
        let g = &self.inner.gpu.inner;
        g.bind()?;
        let stream = g.util_stream.lock();
        // SAFETY: the whole range is our live allocation; the stream belongs
        // to this context and is used only under its lock.
        unsafe {
            sys::cuMemsetD8Async(self.inner.ptr, byte, self.inner.len, *stream)
                .result()
                .map_err(drv(&g.label, "cuMemsetD8Async"))?;
            result::stream::synchronize(*stream).map_err(drv(&g.label, "cuStreamSynchronize"))
        }
    }

    /// Copies `data` into the buffer at `offset` (synchronous H2D).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        let dst = self.check(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let g = &self.inner.gpu.inner;
        g.bind()?;
        let stream = g.util_stream.lock();
        // SAFETY: `dst..dst+len` is inside our allocation (checked), `data`
        // stays borrowed until the stream is synchronised below.
        unsafe {
            result::memcpy_htod_async(dst, data, *stream)
                .map_err(drv(&g.label, "cuMemcpyHtoDAsync"))?;
            result::stream::synchronize(*stream).map_err(drv(&g.label, "cuStreamSynchronize"))
        }
    }

    /// Copies `out.len()` bytes from the buffer at `offset` into `out`
    /// (synchronous D2H).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        let src = self.check(offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let g = &self.inner.gpu.inner;
        g.bind()?;
        let stream = g.util_stream.lock();
        // SAFETY: `src..src+len` is inside our allocation (checked); `out` is
        // exclusively borrowed until the stream is synchronised below.
        unsafe {
            result::memcpy_dtoh_async(out, src, *stream)
                .map_err(drv(&g.label, "cuMemcpyDtoHAsync"))?;
            result::stream::synchronize(*stream).map_err(drv(&g.label, "cuStreamSynchronize"))
        }
    }

    /// Reads the whole buffer into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>, CudaError> {
        let mut v = vec![0u8; self.inner.len];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

impl Drop for BufInner {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.inner.synchronize() {
            tracing::warn!(device = %self.gpu.inner.label, %e, "synchronize before cuMemFree failed");
        }
        // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once;
        // the context is current (bound by `synchronize`) and idle.
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!(device = %self.gpu.inner.label, ?e, "cuMemFree failed");
        }
    }
}
