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
//! The same runtime copies messages between device memory and the message
//! layer's host buffers ([`CudaFence::copy`]): a SEND from device memory is
//! staged into a host buffer first, a message for a RECV buffer in device
//! memory is copied up from its bounce buffer.
//!
//! The CUDA runtime is the one libfabric loaded (`libcudart.so`, found with
//! `RTLD_NOLOAD`): weft itself does not link CUDA.

use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

type StreamSync = unsafe extern "C" fn(stream: *mut c_void) -> c_int;
type SetDevice = unsafe extern "C" fn(device: c_int) -> c_int;
type StreamCreate = unsafe extern "C" fn(stream: *mut *mut c_void, flags: c_uint) -> c_int;
type MemcpyAsync = unsafe extern "C" fn(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: *mut c_void,
) -> c_int;

/// `cudaStreamNonBlocking`: a stream that does not wait for the legacy
/// default stream (where kernels may spin on the very message).
const STREAM_NON_BLOCKING: c_uint = 0x1;
/// `cudaMemcpyDefault`: direction from the pointers (unified addressing).
const MEMCPY_DEFAULT: c_int = 4;

/// `cudaStreamLegacy`: the legacy default stream, whatever the default
/// stream mode of the code that issued the copies.
const STREAM_LEGACY: usize = 0x1;

/// The CUDA runtime entry points the fence needs.
pub(crate) struct CudaFence {
    stream_sync: StreamSync,
    set_device: SetDevice,
    stream_create: StreamCreate,
    memcpy_async: MemcpyAsync,
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
                        stream_create: *lib
                            .get::<StreamCreate>(b"cudaStreamCreateWithFlags\0")
                            .ok()?,
                        memcpy_async: *lib.get::<MemcpyAsync>(b"cudaMemcpyAsync\0").ok()?,
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

    /// Copies `len` bytes from `src` to `dst`, either of which may be memory
    /// of `device`, on this thread's own non-blocking stream for `device`,
    /// and waits until the copy has completed. Returns the CUDA error code
    /// on failure.
    ///
    /// # Safety
    /// `dst` must be valid for writes and `src` for reads of `len` bytes
    /// (host memory, or `device`'s memory at unified addresses), and
    /// nothing else may write `dst` until this returns.
    pub(crate) unsafe fn copy(
        &self,
        device: u32,
        dst: *mut u8,
        src: *const u8,
        len: usize,
    ) -> Result<(), i32> {
        thread_local! {
            /// This thread's copy stream per device (never destroyed: one
            /// per thread and device).
            static STREAMS: RefCell<Vec<(u32, usize)>> = const { RefCell::new(Vec::new()) };
        }
        if len == 0 {
            return Ok(());
        }
        self.bind(device)?;
        let stream = match STREAMS.with_borrow(|v| v.iter().find(|s| s.0 == device).map(|s| s.1)) {
            Some(s) => s as *mut c_void,
            None => {
                let mut s: *mut c_void = std::ptr::null_mut();
                // SAFETY: the runtime writes one stream handle into `s`.
                let rc = unsafe { (self.stream_create)(&mut s, STREAM_NON_BLOCKING) };
                if rc != 0 {
                    return Err(rc);
                }
                STREAMS.with_borrow_mut(|v| v.push((device, s as usize)));
                s
            }
        };
        // SAFETY: the caller vouches for both ranges; the stream belongs to
        // this thread and `device`, whose context is current (bound above).
        let rc =
            unsafe { (self.memcpy_async)(dst.cast(), src.cast(), len, MEMCPY_DEFAULT, stream) };
        if rc != 0 {
            return Err(rc);
        }
        // SAFETY: a plain runtime call with a live stream handle.
        let rc = unsafe { (self.stream_sync)(stream) };
        if rc != 0 {
            return Err(rc);
        }
        Ok(())
    }
}
