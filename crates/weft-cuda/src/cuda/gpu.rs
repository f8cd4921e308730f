//! One CUDA device and its primary context.

use super::{drv, probe};
use crate::{CudaCopy, CudaError, DeviceBuffer, HostFlag, Kernels, Stream, WatchWord};
use cudarc::driver::{result, sys};
use parking_lot::Mutex;
use std::fmt;
use std::sync::Arc;
use weft_transport::Device;

/// One CUDA device (its primary context). Cheap to clone; everything
/// allocated from it keeps the context alive.
#[derive(Clone)]
pub struct Gpu {
    pub(crate) inner: Arc<GpuInner>,
}

pub(crate) struct GpuInner {
    pub(crate) ordinal: u32,
    pub(crate) label: String,
    pub(crate) dev: sys::CUdevice,
    pub(crate) ctx: sys::CUcontext,
    name: String,
    cc: (i32, i32),
    /// A non-blocking stream for the synchronous helpers of
    /// [`DeviceBuffer`] (so they never wait behind a spinning kernel).
    pub(crate) util_stream: Mutex<sys::CUstream>,
}

// SAFETY: `CUcontext`/`CUstream` are driver handles; the CUDA driver API is
// thread-safe and a context may be made current on any thread (every call
// below binds it first). The utility stream is only used under its mutex.
unsafe impl Send for GpuInner {}
// SAFETY: see `Send`; no interior state is mutated without the mutex.
unsafe impl Sync for GpuInner {}

impl Drop for GpuInner {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            let stream = *self.util_stream.get_mut();
            // SAFETY: the stream was created in this context and nothing else
            // uses it now (we are the last owner).
            if let Err(e) = unsafe { result::stream::destroy(stream) } {
                tracing::warn!(device = %self.label, ?e, "cuStreamDestroy failed");
            }
        }
        // SAFETY: `dev` came from cuDeviceGet and we retained its primary
        // context exactly once in `Gpu::open`.
        if let Err(e) = unsafe { result::primary_ctx::release(self.dev) } {
            tracing::warn!(device = %self.label, ?e, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

impl GpuInner {
    /// Makes this context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `ctx` is a retained primary context, valid until drop.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(drv(&self.label, "cuCtxSetCurrent"))
    }

    /// Waits for all work of this context (used before freeing memory that
    /// kernels or copies may still touch).
    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        result::ctx::synchronize().map_err(drv(&self.label, "cuCtxSynchronize"))
    }
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("device", &self.inner.label)
            .field("name", &self.inner.name)
            .field("compute_capability", &self.inner.cc)
            .finish()
    }
}

impl Gpu {
    /// Opens device `ordinal`. Probes the driver first ([`crate::probe`]), so
    /// on a machine without CUDA this returns an error rather than panicking.
    pub fn open(ordinal: u32) -> Result<Gpu, CudaError> {
        let info = probe()?;
        if ordinal >= info.device_count {
            return Err(CudaError::NoDevice {
                ordinal,
                count: info.device_count,
            });
        }
        let label = format!("cuda:{ordinal}");
        result::init().map_err(drv(&label, "cuInit"))?;
        let ord = i32::try_from(ordinal).map_err(|_| CudaError::NoDevice {
            ordinal,
            count: info.device_count,
        })?;
        let dev = result::device::get(ord).map_err(drv(&label, "cuDeviceGet"))?;
        // SAFETY: `dev` was returned by cuDeviceGet.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(drv(&label, "cuDevicePrimaryCtxRetain"))?;
        let attr = |a| {
            // SAFETY: `dev` is a valid device handle.
            unsafe { result::device::get_attribute(dev, a) }
                .map_err(drv(&label, "cuDeviceGetAttribute"))
        };
        let checks = (|| {
            // SAFETY: `ctx` was just retained.
            unsafe { result::ctx::set_current(ctx) }.map_err(drv(&label, "cuCtxSetCurrent"))?;
            let major =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let can_map = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)?;
            let uva = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)?;
            if can_map == 0 || uva == 0 {
                return Err(CudaError::InvalidArgument {
                    device: label.clone(),
                    what: format!(
                        "device cannot map host memory (can_map={can_map}) or lacks unified addressing (uva={uva})"
                    ),
                });
            }
            let name = result::device::get_name(dev).map_err(drv(&label, "cuDeviceGetName"))?;
            let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(drv(&label, "cuStreamCreate"))?;
            Ok((name, (major, minor), stream))
        })();
        let (name, cc, stream) = match checks {
            Ok(v) => v,
            Err(e) => {
                // SAFETY: balance the retain above.
                let _ = unsafe { result::primary_ctx::release(dev) };
                return Err(e);
            }
        };
        tracing::info!(device = %label, %name, ?cc, "opened CUDA device");
        Ok(Gpu {
            inner: Arc::new(GpuInner {
                ordinal,
                label,
                dev,
                ctx,
                name,
                cc,
                util_stream: Mutex::new(stream),
            }),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    /// The weft device this GPU is (`Device::Cuda(ordinal)`).
    pub fn device(&self) -> Device {
        Device::Cuda(self.inner.ordinal)
    }

    /// The device's marketing name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.cc
    }

    /// Makes this device's context current on the calling thread (needed
    /// only before calling the driver directly through raw handles).
    pub fn bind_to_thread(&self) -> Result<(), CudaError> {
        self.inner.bind()
    }

    /// Waits until all work submitted to this device has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.inner.synchronize()
    }

    /// Allocates `len` bytes of device memory, zero-filled.
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer, CudaError> {
        DeviceBuffer::new(self, len)
    }

    /// A copy engine for the loopback fabric (see [`CudaCopy`]).
    pub fn copy_engine(&self) -> Result<CudaCopy, CudaError> {
        CudaCopy::new(self)
    }

    /// A new host-mapped watcher word, initially 0.
    pub fn watch_word(&self) -> Result<WatchWord, CudaError> {
        WatchWord::new(self)
    }

    /// A new host-mapped flag, initially 0.
    pub fn host_flag(&self) -> Result<HostFlag, CudaError> {
        HostFlag::new(self)
    }

    /// A new non-blocking stream.
    pub fn stream(&self) -> Result<Stream, CudaError> {
        Stream::new(self)
    }

    /// Compiles weft's kernels for this device with NVRTC.
    pub fn kernels(&self) -> Result<Kernels, CudaError> {
        Kernels::compile(self)
    }
}
