//! Waiting for the CUDA copies a software provider issued on the target.
//!
//! libfabric's shm (and tcp) move GPU memory with `cudaMemcpy` on the
//! target's legacy default stream and report the operation, immediate
//! included, as soon as the call returns; a device-to-device copy (and a
//! host-to-device one from pageable memory) returns before the bytes have
//! landed. weft's contract is that a WRITE's bytes are visible when its
//! immediate is reported, so a domain holding remotely writable CUDA
//! registrations synchronises that stream before it reports immediates.
//!
//! The CUDA runtime is the one libfabric loaded (`libcudart.so`, found with
//! `RTLD_NOLOAD`): weft itself does not link CUDA.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

type StreamSync = unsafe extern "C" fn(stream: *mut c_void) -> c_int;
type SetDevice = unsafe extern "C" fn(device: c_int) -> c_int;

/// `cudaStreamLegacy`: the legacy default stream, whatever the default
/// stream mode of the code that issued the copies.
const STREAM_LEGACY: usize = 0x1;

/// The CUDA runtime entry points the fence needs.
pub(crate) struct CudaFence {
    stream_sync: StreamSync,
    set_device: SetDevice,
}

impl CudaFence {
    /// The fence, if a CUDA runtime is loaded in this process (libfabric
    /// loads one when it initialises its CUDA support).
    pub(crate) fn get() -> Option<&'static CudaFence> {
        static FENCE: OnceLock<Option<CudaFence>> = OnceLock::new();
        FENCE
            .get_or_init(|| {
                let flags = libc::RTLD_NOW | libc::RTLD_NOLOAD;
                let lib = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
                    .into_iter()
                    .find_map(|n| {
                        // SAFETY: RTLD_NOLOAD only looks up a library
                        // already loaded (its initialisers have run); no
                        // new code runs.
                        unsafe { libloading::os::unix::Library::open(Some(n), flags) }.ok()
                    })?;
                // SAFETY: the symbols have these C signatures in every CUDA
                // runtime (cuda_runtime_api.h); the library is never
                // unloaded (leaked below), so the pointers stay valid.
                let fence = unsafe {
                    CudaFence {
                        stream_sync: *lib.get::<StreamSync>(b"cudaStreamSynchronize\0").ok()?,
                        set_device: *lib.get::<SetDevice>(b"cudaSetDevice\0").ok()?,
                    }
                };
                std::mem::forget(lib);
                Some(fence)
            })
            .as_ref()
    }

    /// Makes `device`'s primary context current on the calling thread
    /// (`cudaSetDevice`), once per thread and device. libfabric's CUDA
    /// support calls the driver on the thread that posts and progresses
    /// (`cuMemGetAddressRange` before it hands a peer a CUDA IPC handle);
    /// without a current context that call fails and shm falls back to
    /// copying through host memory, where every copy ends in a
    /// `cudaDeviceSynchronize`, which never returns while a kernel waits on
    /// the device for the very bytes being copied.
    pub(crate) fn bind(&self, device: u32) -> Result<(), i32> {
        thread_local! {
            static BOUND: Cell<Option<u32>> = const { Cell::new(None) };
        }
        if BOUND.get() == Some(device) {
            return Ok(());
        }
        let dev = c_int::try_from(device).map_err(|_| -1)?;
        // SAFETY: a plain runtime call with an integer; it only changes the
        // calling thread's current context.
        let rc = unsafe { (self.set_device)(dev) };
        if rc != 0 {
            BOUND.set(None);
            return Err(rc);
        }
        BOUND.set(Some(device));
        Ok(())
    }

    /// Waits until every copy issued on `device`'s legacy default stream
    /// has completed. Returns the CUDA error code on failure.
    pub(crate) fn wait(&self, device: u32) -> Result<(), i32> {
        self.bind(device)?;
        // SAFETY: a plain runtime call with the legacy stream handle; it
        // only blocks the calling thread.
        let rc = unsafe { (self.stream_sync)(STREAM_LEGACY as *mut c_void) };
        if rc != 0 {
            return Err(rc);
        }
        Ok(())
    }
}
