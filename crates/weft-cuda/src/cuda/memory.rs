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
    /// A virtual-memory allocation (`new_shareable`): its handle and mapped
    /// size; `None` for `cuMemAlloc` memory.
    vmm: Option<(sys::CUmemGenericAllocationHandle, usize)>,
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
                vmm: None,
            }),
        };
        buf.fill(0)?;
        Ok(buf)
    }

    /// `len` bytes (rounded up to the granularity) of `cuMemCreate` memory
    /// with POSIX file-descriptor handles, mapped read-write for this
    /// device, zero-filled.
    pub(crate) fn new_shareable(gpu: &Gpu, len: usize) -> Result<Self, CudaError> {
        let g = &gpu.inner;
        let label = &g.label;
        if len == 0 {
            return Err(CudaError::InvalidArgument {
                device: label.clone(),
                what: "cannot allocate a zero-length device buffer".into(),
            });
        }
        g.bind()?;
        // SAFETY: zero is a valid bit pattern for this plain C struct.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = super::ipc::location(g.ordinal);
        let mut gran = 0usize;
        // SAFETY: valid out-parameter and property struct.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(drv(label, "cuMemGetAllocationGranularity"))?;
        let size = len.div_ceil(gran.max(1)) * gran.max(1);
        let mut h = 0;
        // SAFETY: valid out-parameter and property struct; `size` is a
        // multiple of the granularity.
        unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) }
            .result()
            .map_err(drv(label, "cuMemCreate"))?;
        let mut ptr = 0;
        // SAFETY: reserves `size` bytes of address space.
        if let Err(e) = unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) }.result() {
            // SAFETY: the handle created above, released once.
            let _ = unsafe { sys::cuMemRelease(h) };
            return Err(drv(label, "cuMemAddressReserve")(e));
        }
        // From here `BufInner`'s drop undoes what was done.
        let buf = DeviceBuffer {
            inner: Arc::new(BufInner {
                gpu: gpu.clone(),
                ptr,
                len,
                vmm: Some((h, size)),
            }),
        };
        let access = super::ipc::access_desc(g.ordinal);
        // SAFETY: maps the new allocation over the reserved range and grants
        // this device read-write access.
        unsafe {
            sys::cuMemMap(ptr, size, 0, h, 0)
                .result()
                .map_err(drv(label, "cuMemMap"))?;
            sys::cuMemSetAccess(ptr, size, &access, 1)
                .result()
                .map_err(drv(label, "cuMemSetAccess"))?;
        }
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
        if let Some((h, size)) = self.vmm {
            // SAFETY: the range, reservation and handle of `new_shareable`,
            // undone once (an unmapped range reports an error, harmlessly).
            unsafe {
                let _ = sys::cuMemUnmap(self.ptr, size);
                let _ = sys::cuMemAddressFree(self.ptr, size);
                if let Err(e) = sys::cuMemRelease(h).result() {
                    tracing::warn!(device = %self.gpu.inner.label, ?e, "cuMemRelease failed");
                }
            }
            return;
        }
        // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once;
        // the context is current (bound by `synchronize`) and idle.
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!(device = %self.gpu.inner.label, ?e, "cuMemFree failed");
        }
    }
}
