//! Building blocks for kernels outside this crate (the MoE kernels of
//! apps/weft-moe): a generic NVRTC [`Module`], a multi-byte host-mapped
//! [`MappedBuffer`] and timing [`Event`]s.

use super::{drv, probe_nvrtc};
use crate::{CudaError, DeviceBuffer, Gpu, Stream};
use cudarc::driver::{result, sys};
use std::ffi::{c_void, CString};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

/// An NVRTC-compiled module of your own CUDA C++ source (prepend
/// [`crate::KERNELS_CU`] to use weft's device functions), loaded on one GPU.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

struct ModuleInner {
    gpu: Gpu,
    what: String,
    module: sys::CUmodule,
    funcs: Vec<(String, sys::CUfunction)>,
}

// SAFETY: module/function handles are driver objects usable from any thread
// with the context bound (every launch binds it); never mutated.
unsafe impl Send for ModuleInner {}
// SAFETY: see `Send`.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        if self.gpu.inner.synchronize().is_ok() {
            // SAFETY: we own the module; the device is idle. Graphs that use
            // its functions hold a clone of `self` (note_use in `launch`).
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Module")
            .field("device", &self.inner.gpu.inner.label)
            .field("what", &self.inner.what)
            .field("functions", &self.inner.funcs.len())
            .finish()
    }
}

/// A kernel of a [`Module`] (an index into its function table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Function(usize);

impl Module {
    /// Compiles `src` with NVRTC for `gpu` (its own compute capability, no
    /// fast-math: `--fmad=false` is *not* set, so write `__fmaf_rn` where
    /// bit-exact results matter) and looks up the `extern "C"` kernels
    /// `names`. `what` names the source in errors.
    pub fn compile(gpu: &Gpu, what: &str, src: &str, names: &[&str]) -> Result<Module, CudaError> {
        probe_nvrtc()?;
        let label = &gpu.inner.label;
        let (major, minor) = gpu.compute_capability();
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            ..Default::default()
        };
        let cerr = |log: String| CudaError::Compile {
            device: label.clone(),
            what: what.to_string(),
            log,
        };
        let ptx =
            cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| cerr(format!("{e:?}")))?;
        let ptx = CString::new(ptx.to_src()).map_err(|e| cerr(format!("PTX contains NUL: {e}")))?;
        gpu.inner.bind()?;
        // SAFETY: `ptx` is a NUL-terminated PTX image; the context is current.
        let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }
            .map_err(drv(label, "cuModuleLoadData"))?;
        let mut funcs = Vec::with_capacity(names.len());
        for name in names {
            let c = CString::new(*name).unwrap_or_default();
            // SAFETY: `module` is loaded; `c` is a NUL-terminated name.
            match unsafe { result::module::get_function(module, c) } {
                Ok(f) => funcs.push((name.to_string(), f)),
                Err(e) => {
                    // SAFETY: unload the module we just loaded; nothing uses it.
                    let _ = unsafe { result::module::unload(module) };
                    return Err(drv(label, "cuModuleGetFunction")(e));
                }
            }
        }
        tracing::debug!(device = %label, what, arch, "module compiled");
        Ok(Module {
            inner: Arc::new(ModuleInner {
                gpu: gpu.clone(),
                what: what.to_string(),
                module,
                funcs,
            }),
        })
    }

    /// The kernel `name` (one of the names given to [`Module::compile`]).
    pub fn function(&self, name: &str) -> Result<Function, CudaError> {
        self.inner
            .funcs
            .iter()
            .position(|(n, _)| n == name)
            .map(Function)
            .ok_or_else(|| CudaError::InvalidArgument {
                device: self.inner.gpu.inner.label.clone(),
                what: format!("{}: no kernel named {name}", self.inner.what),
            })
    }

    /// The GPU the module is loaded on.
    pub fn gpu(&self) -> &Gpu {
        &self.inner.gpu
    }

    /// Enqueues kernel `f` on `stream` with a `grid` × `block` shape and
    /// `shared` bytes of dynamic shared memory. Capturable; a graph keeps
    /// the module alive.
    ///
    /// # Safety
    /// `params` must point to values matching the kernel's signature, and
    /// all memory the kernel touches must stay alive until it completes (or,
    /// captured, as long as the graph is launched; see
    /// [`Stream::keep_alive`]).
    pub unsafe fn launch(
        &self,
        f: Function,
        stream: &Stream,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        let label = &self.inner.gpu.inner.label;
        if !Arc::ptr_eq(&stream.gpu().inner, &self.inner.gpu.inner) {
            return Err(CudaError::InvalidArgument {
                device: label.clone(),
                what: format!("stream belongs to {}", stream.gpu().inner.label),
            });
        }
        let (_, func) = self
            .inner
            .funcs
            .get(f.0)
            .ok_or_else(|| CudaError::InvalidArgument {
                device: label.clone(),
                what: format!("{}: function index {} out of range", self.inner.what, f.0),
            })?;
        self.inner.gpu.inner.bind()?;
        // SAFETY: forwarded from the caller; `func` belongs to our loaded
        // module, in the now-current context.
        unsafe { result::launch_kernel(*func, grid, block, shared, stream.raw(), params) }
            .map_err(drv(label, "cuLaunchKernel"))?;
        stream.note_use(self.inner.clone());
        Ok(())
    }
}

impl Stream {
    /// Records that work enqueued now references `buf`: if the stream is
    /// capturing, the resulting graph keeps `buf` alive.
    pub fn keep_alive(&self, buf: &DeviceBuffer) {
        self.note_use(buf.inner.clone());
    }

    /// Like [`Stream::keep_alive`] for a [`MappedBuffer`].
    pub fn keep_alive_mapped(&self, buf: &MappedBuffer) {
        self.note_use(buf.inner.clone());
    }

    /// Enqueues a device-to-device copy of `len` bytes (capturable).
    pub fn copy_d2d(
        &self,
        dst: &DeviceBuffer,
        dst_off: usize,
        src: &DeviceBuffer,
        src_off: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        let label = &self.gpu().inner.label;
        let ok = |b: &DeviceBuffer, off: usize| off.checked_add(len).is_some_and(|e| e <= b.len());
        if !ok(dst, dst_off) || !ok(src, src_off) {
            return Err(CudaError::InvalidArgument {
                device: label.clone(),
                what: format!("copy of {len} bytes at {src_off} -> {dst_off} outside the buffers"),
            });
        }
        if len == 0 {
            return Ok(());
        }
        self.gpu().inner.bind()?;
        // SAFETY: both ranges lie inside live device allocations (checked);
        // they are kept alive by note_use while capturing, and freeing device
        // memory synchronises the device first.
        unsafe {
            result::memcpy_dtod_async(
                dst.device_ptr() + dst_off as u64,
                src.device_ptr() + src_off as u64,
                len,
                self.raw(),
            )
        }
        .map_err(drv(label, "cuMemcpyDtoDAsync"))?;
        self.note_use(dst.inner.clone());
        self.note_use(src.inner.clone());
        Ok(())
    }
}

/// `len` bytes of pinned host memory mapped into the GPU's address space
/// (`cuMemHostAlloc(DEVICEMAP | PORTABLE)`), zeroed: kernels write it
/// through [`MappedBuffer::device_ptr`], the host reads it in place.
#[derive(Clone)]
pub struct MappedBuffer {
    pub(crate) inner: Arc<MappedInner>,
}

pub(crate) struct MappedInner {
    gpu: Gpu,
    host: NonNull<u8>,
    dev: u64,
    len: usize,
}

// SAFETY: pinned memory that lives until drop; the host pointer is only used
// through the bounds-checked methods below.
unsafe impl Send for MappedInner {}
// SAFETY: see `Send`.
unsafe impl Sync for MappedInner {}

impl Drop for MappedInner {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.inner.synchronize() {
            tracing::warn!(device = %self.gpu.inner.label, %e, "synchronize before cuMemFreeHost failed");
        }
        // SAFETY: allocated by cuMemHostAlloc, freed once, device idle.
        let rc = unsafe { sys::cuMemFreeHost(self.host.as_ptr().cast()) };
        if let Err(e) = rc.result() {
            tracing::warn!(device = %self.gpu.inner.label, ?e, "cuMemFreeHost failed");
        }
    }
}

impl fmt::Debug for MappedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedBuffer")
            .field("device", &self.inner.gpu.inner.label)
            .field("len", &self.inner.len)
            .finish()
    }
}

impl MappedBuffer {
    /// Allocates `len` bytes (at least one page is reserved).
    pub fn new(gpu: &Gpu, len: usize) -> Result<MappedBuffer, CudaError> {
        let label = &gpu.inner.label;
        let alloc = len.max(4096);
        gpu.inner.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: `p` is a valid out-pointer; the context is current.
        unsafe { sys::cuMemHostAlloc(&mut p, alloc, flags) }
            .result()
            .map_err(drv(label, "cuMemHostAlloc"))?;
        let host = NonNull::new(p.cast::<u8>()).ok_or_else(|| CudaError::Driver {
            device: label.clone(),
            op: "cuMemHostAlloc",
            code: 0,
            name: "returned a null pointer".into(),
        })?;
        // SAFETY: `alloc` writable pinned bytes we own.
        unsafe { std::ptr::write_bytes(host.as_ptr(), 0, alloc) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a DEVICEMAP allocation of this context.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) }
            .result()
            .map_err(drv(label, "cuMemHostGetDevicePointer"));
        if let Err(e) = rc {
            // SAFETY: freed once, never used by the device.
            let _ = unsafe { sys::cuMemFreeHost(p) };
            return Err(e);
        }
        Ok(MappedBuffer {
            inner: Arc::new(MappedInner {
                gpu: gpu.clone(),
                host,
                dev,
                len,
            }),
        })
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The device address (for kernel parameters).
    pub fn device_ptr(&self) -> u64 {
        self.inner.dev
    }

    /// The host address. Valid while any clone lives.
    pub fn host_ptr(&self) -> NonNull<u8> {
        self.inner.host
    }

    fn check(&self, off: usize, len: usize) -> Result<(), CudaError> {
        match off.checked_add(len) {
            Some(end) if end <= self.inner.len => Ok(()),
            _ => Err(CudaError::InvalidArgument {
                device: self.inner.gpu.inner.label.clone(),
                what: format!(
                    "range {off}+{len} outside mapped buffer of {} bytes",
                    self.inner.len
                ),
            }),
        }
    }

    /// Copies bytes out. Bytes the GPU wrote are seen once the host has
    /// observed (with acquire) a flag the GPU stored with release after them.
    pub fn read(&self, off: usize, out: &mut [u8]) -> Result<(), CudaError> {
        self.check(off, out.len())?;
        // SAFETY: in bounds (checked); the source is pinned memory we own and
        // `out` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.inner.host.as_ptr().add(off),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Copies bytes in. A kernel sees them once it has observed (acquire) a
    /// flag the host raised (release) after this call.
    pub fn write(&self, off: usize, data: &[u8]) -> Result<(), CudaError> {
        self.check(off, data.len())?;
        // SAFETY: in bounds (checked); distinct memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.inner.host.as_ptr().add(off),
                data.len(),
            )
        };
        Ok(())
    }

    /// The buffer as a host [`weft_transport::MemRegion`] (the engine
    /// registers mapped memory as host memory).
    ///
    /// # Safety
    /// Keep the buffer alive until every registration is deregistered.
    pub unsafe fn region(&self) -> weft_transport::MemRegion {
        // SAFETY: `host..host+len` is live pinned host memory; the caller
        // keeps it alive while registered.
        unsafe {
            weft_transport::MemRegion::new(
                self.inner.host,
                self.inner.len,
                weft_transport::Device::Host,
            )
        }
    }
}

/// A CUDA event with timing, for `cuEventElapsedTime` measurements.
pub struct Event {
    gpu: Gpu,
    raw: sys::CUevent,
}

// SAFETY: an event handle is a driver object usable from any thread with the
// context bound (every method binds it).
unsafe impl Send for Event {}
// SAFETY: see `Send`.
unsafe impl Sync for Event {}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.gpu.inner.label)
            .finish()
    }
}

impl Event {
    /// A new timing event.
    pub fn new(gpu: &Gpu) -> Result<Event, CudaError> {
        gpu.inner.bind()?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(drv(&gpu.inner.label, "cuEventCreate"))?;
        Ok(Event {
            gpu: gpu.clone(),
            raw,
        })
    }

    /// Records the event on `stream` (capturable).
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        self.gpu.inner.bind()?;
        // SAFETY: both handles are live and belong to this context.
        unsafe { result::event::record(self.raw, stream.raw()) }
            .map_err(drv(&self.gpu.inner.label, "cuEventRecord"))
    }

    /// Waits until the event completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.inner.bind()?;
        // SAFETY: the event is live.
        unsafe { result::event::synchronize(self.raw) }
            .map_err(drv(&self.gpu.inner.label, "cuEventSynchronize"))
    }

    /// Milliseconds from `start` to this event (both completed).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, CudaError> {
        self.gpu.inner.bind()?;
        // SAFETY: both events are live, created by `Event::new`.
        unsafe { result::event::elapsed(start.raw, self.raw) }
            .map_err(drv(&self.gpu.inner.label, "cuEventElapsedTime"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.inner.bind().is_ok() {
            // SAFETY: we own the event; destroying a pending event is allowed.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}
