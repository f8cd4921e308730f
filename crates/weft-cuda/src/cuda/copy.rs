//! A [`DeviceCopy`] backed by the CUDA copy engine.

use super::drv;
use crate::{CudaError, Gpu};
use cudarc::driver::{result, sys};
use parking_lot::Mutex;
use weft_transport::{Device, DeviceCopy, TransportError};

/// Copies bytes host↔GPU and GPU↔GPU (same device) with
/// `cuMemcpy{HtoD,DtoH,DtoD}Async` on a non-blocking stream it owns, then
/// waits for the stream, so each [`DeviceCopy::copy`] returns with the bytes
/// visible at the destination. Host↔host copies are plain `memcpy`.
///
/// Copies from several threads are serialised on the one stream. Only the
/// GPU this was made for is accepted; other `Device::Cuda` ordinals get
/// [`TransportError::Unsupported`].
pub struct CudaCopy {
    gpu: Gpu,
    stream: Mutex<sys::CUstream>,
}

// SAFETY: the stream handle is only used under the mutex, with the owning
// context bound first; the driver API is thread-safe.
unsafe impl Send for CudaCopy {}
// SAFETY: see `Send`.
unsafe impl Sync for CudaCopy {}

impl std::fmt::Debug for CudaCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopy")
            .field("device", &self.gpu.inner.label)
            .finish()
    }
}

impl CudaCopy {
    /// A copy engine for `gpu` with its own stream.
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        gpu.inner.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(drv(&gpu.inner.label, "cuStreamCreate"))?;
        Ok(CudaCopy {
            gpu: gpu.clone(),
            stream: Mutex::new(stream),
        })
    }

    /// The GPU this engine copies for.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn unsupported(&self, what: String) -> TransportError {
        TransportError::Unsupported {
            nic: self.gpu.inner.label.clone(),
            what,
        }
    }
}

impl DeviceCopy for CudaCopy {
    fn copy(
        &self,
        dst: u64,
        dst_dev: Device,
        src: u64,
        src_dev: Device,
        len: u64,
    ) -> Result<(), TransportError> {
        if len == 0 {
            return Ok(());
        }
        let n = usize::try_from(len)
            .map_err(|_| self.unsupported(format!("copy of {len} bytes exceeds usize")))?;
        let me = self.gpu.ordinal();
        for d in [dst_dev, src_dev] {
            if let Device::Cuda(i) = d {
                if i != me {
                    return Err(self.unsupported(format!(
                        "copy between {src_dev} and {dst_dev}: this CudaCopy serves cuda:{me} only"
                    )));
                }
            }
        }
        if dst_dev == Device::Host && src_dev == Device::Host {
            // SAFETY: the DeviceCopy contract: both spans lie inside host
            // memory registered as MemRegions (valid for reads/writes);
            // `ptr::copy` allows overlap.
            unsafe {
                std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, n);
            }
            return Ok(());
        }
        let g = &self.gpu.inner;
        g.bind()?;
        let stream = self.stream.lock();
        let label = &g.label;
        // SAFETY: per the DeviceCopy contract both spans lie inside live
        // registered regions of the stated devices; host pointers are used
        // as `n`-byte buffers; the stream belongs to this (current) context
        // and we synchronise before returning, so no buffer is used after.
        unsafe {
            let rc = match (dst_dev, src_dev) {
                (Device::Cuda(_), Device::Host) => {
                    sys::cuMemcpyHtoDAsync_v2(dst, src as usize as *const _, n, *stream)
                        .result()
                        .map_err(drv(label, "cuMemcpyHtoDAsync"))
                }
                (Device::Host, Device::Cuda(_)) => {
                    sys::cuMemcpyDtoHAsync_v2(dst as usize as *mut _, src, n, *stream)
                        .result()
                        .map_err(drv(label, "cuMemcpyDtoHAsync"))
                }
                _ => result::memcpy_dtod_async(dst, src, n, *stream)
                    .map_err(drv(label, "cuMemcpyDtoDAsync")),
            };
            rc?;
            result::stream::synchronize(*stream).map_err(drv(label, "cuStreamSynchronize"))?;
        }
        Ok(())
    }
}

impl Drop for CudaCopy {
    fn drop(&mut self) {
        if self.gpu.inner.bind().is_ok() {
            // SAFETY: the stream belongs to this context; every copy
            // synchronised it before returning, so it is idle.
            if let Err(e) = unsafe { result::stream::destroy(*self.stream.get_mut()) } {
                tracing::warn!(device = %self.gpu.inner.label, ?e, "cuStreamDestroy failed");
            }
        }
    }
}
