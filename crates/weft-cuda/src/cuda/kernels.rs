//! weft's CUDA kernels, compiled at run time with NVRTC.

use super::{drv, probe_nvrtc};
use crate::{CudaError, DeviceBuffer, Gpu, HostFlag, Stream, WatchWord};
use cudarc::driver::{result, sys};
use std::ffi::{c_void, CString};
use std::fmt;
use std::sync::Arc;

/// CUDA C++ source of the element conversions of host code (`weft::dtype`), for kernels to prepend: `weft_e4m3(float)` is f32 → e4m3fn,
/// round to nearest even, saturating to ±448, NaN → 0x7F, operation for
/// operation the host's `f32_to_e4m3`, so host and device agree bit for
/// bit.
pub const DTYPE_CU: &str = r#"
__device__ __forceinline__ unsigned char weft_e4m3(float x) {
    if (x != x) return 0x7F;
    const unsigned char sign = (__float_as_uint(x) >> 31) ? 0x80 : 0;
    const float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7E;
    const unsigned bits = __float_as_uint(a);
    const int exp = (int)(bits >> 23) - 127;
    if (exp < -6) {
        const unsigned q = (unsigned)rintf(a * 512.0f);
        return sign | (unsigned char)(q < 8 ? q : 8);
    }
    unsigned e = (unsigned)(exp + 7);
    const unsigned m = bits & 0x7FFFFF;
    unsigned r = m >> 20;
    const unsigned rem = m & 0xFFFFF;
    if (rem > 0x80000 || (rem == 0x80000 && (r & 1))) r += 1;
    if (r == 8) { r = 0; e += 1; }
    if (e > 15 || (e == 15 && r == 7)) return sign | 0x7E;
    return sign | (unsigned char)(e << 3) | (unsigned char)r;
}
"#;

/// CUDA C++ source of weft's kernels and device functions. MoE or KvCache
/// kernels can prepend it to their own source to reuse the device functions
/// (`weft_ld_acquire_sys`, `weft_st_release_sys`, `weft_wait_flag`,
/// `weft_block_wait_flag`).
pub const KERNELS_CU: &str = r#"
typedef unsigned long long weft_u64;

// Acquire load at system scope: sees host (and peer) writes made before a
// release store of the value observed.
__device__ __forceinline__ weft_u64 weft_ld_acquire_sys(const weft_u64* p) {
    weft_u64 v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Release store at system scope: all earlier writes of this thread (e.g. a
// layer's output in GPU memory) are visible before the value is.
__device__ __forceinline__ void weft_st_release_sys(weft_u64* p, weft_u64 v) {
    asm volatile("st.release.sys.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

// Relaxed (unordered) accesses at system scope: no fence.
__device__ __forceinline__ weft_u64 weft_ld_relaxed_sys(const weft_u64* p) {
    weft_u64 v;
    asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void weft_st_relaxed_sys(weft_u64* p, weft_u64 v) {
    asm volatile("st.relaxed.sys.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ weft_u64 weft_globaltimer() {
    weft_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Spins until *flag >= target. Returns 1, or 0 once timeout_ns (GPU global
// timer) passed; timeout_ns == 0 waits forever.
__device__ int weft_wait_flag(const weft_u64* flag, weft_u64 target, weft_u64 timeout_ns) {
    weft_u64 start = weft_globaltimer();
    while (weft_ld_acquire_sys(flag) < target) {
        if (timeout_ns != 0 && weft_globaltimer() - start > timeout_ns) return 0;
    }
    return 1;
}

// Block-wide wait: thread 0 polls, the block joins at a barrier. Call from
// every thread of the block.
__device__ int weft_block_wait_flag(const weft_u64* flag, weft_u64 target, weft_u64 timeout_ns) {
    __shared__ int ok;
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        ok = weft_wait_flag(flag, target, timeout_ns);
    }
    __syncthreads();
    return ok;
}

// word += delta, where `word` is a host-mapped watcher word and `shadow` its
// device-memory copy (so the GPU never reads across PCIe). One thread.
__device__ __forceinline__ void weft_bump(weft_u64* word, weft_u64* shadow, weft_u64 delta) {
    weft_u64 v = *shadow + delta;
    weft_st_release_sys(word, v);
    *shadow = v;
}

// SplitMix64 finaliser of seed + i: the deterministic test/benchmark
// pattern (weft_cuda::pattern_word computes the same on the host).
__device__ __forceinline__ weft_u64 weft_pattern_word(weft_u64 seed, weft_u64 i) {
    weft_u64 x = seed + i + 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

extern "C" __global__ void weft_fill_pattern(weft_u64* dst, weft_u64 n, weft_u64 seed) {
    weft_u64 stride = (weft_u64)gridDim.x * blockDim.x;
    for (weft_u64 i = (weft_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = weft_pattern_word(seed, i);
    }
}

// flags bit 0: relaxed store instead of a release store (see
// Kernels::scalar_inc_relaxed for when that is enough).
extern "C" __global__ void weft_scalar_inc(weft_u64* word, weft_u64* shadow, weft_u64 delta,
                                           weft_u64 flags) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        if (flags & 1) {
            weft_u64 v = *shadow + delta;
            weft_st_relaxed_sys(word, v);
            *shadow = v;
        } else {
            weft_bump(word, shadow, delta);
        }
    }
}

// Every thread waits (block-wide) for *flag >= target, then writes
// out[tid] = value + tid, or ~0 on timeout.
extern "C" __global__ void weft_wait_flag_write(const weft_u64* flag, weft_u64 target,
                                                weft_u64 timeout_ns, weft_u64* out,
                                                weft_u64 value) {
    weft_u64 tid = (weft_u64)blockIdx.x * blockDim.x + threadIdx.x;
    int ok = weft_block_wait_flag(flag, target, timeout_ns);
    out[tid] = ok ? value + tid : ~0ull;
}

// Latency probe: v = shadow + delta; announce v in *armed; wait for
// *gate >= v; then bump the word to v. All state is on the device, so the
// same launch (or graph) can be replayed. On a gate timeout it bumps anyway.
// flags bit 0: bump with a relaxed store instead of a release store;
// bit 1: poll the gate with relaxed instead of acquire loads.
extern "C" __global__ void weft_gated_inc(const weft_u64* gate, weft_u64* armed, weft_u64* word,
                                          weft_u64* shadow, weft_u64 delta, weft_u64 timeout_ns,
                                          weft_u64 flags) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        weft_u64 v = *shadow + delta;
        weft_st_relaxed_sys(armed, v);
        weft_u64 start = weft_globaltimer();
        for (;;) {
            weft_u64 g = (flags & 2) ? weft_ld_relaxed_sys(gate) : weft_ld_acquire_sys(gate);
            if (g >= v) break;
            if (timeout_ns != 0 && weft_globaltimer() - start > timeout_ns) break;
        }
        if (flags & 1) weft_st_relaxed_sys(word, v); else weft_st_release_sys(word, v);
        *shadow = v;
    }
}
"#;

/// Memory ordering of [`Kernels::gated_inc`]'s accesses (the latency
/// benchmark compares them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeOrdering {
    /// Poll the gate with `ld.acquire.sys` (else `ld.relaxed.sys`).
    pub acquire_poll: bool,
    /// Bump the word with `st.release.sys` (else `st.relaxed.sys`).
    pub release_store: bool,
}

impl ProbeOrdering {
    /// Acquire poll, release bump (what `weft_wait_flag` / `scalar_inc` do).
    pub const STRONG: ProbeOrdering = ProbeOrdering {
        acquire_poll: true,
        release_store: true,
    };
    /// Relaxed poll and bump, no fences.
    pub const RELAXED: ProbeOrdering = ProbeOrdering {
        acquire_poll: false,
        release_store: false,
    };
}

/// weft's kernels, compiled with NVRTC for one GPU and loaded as a module.
pub struct Kernels {
    inner: Arc<KernelsInner>,
}

struct KernelsInner {
    gpu: Gpu,
    module: sys::CUmodule,
    scalar_inc: sys::CUfunction,
    wait_flag_write: sys::CUfunction,
    gated_inc: sys::CUfunction,
    fill_pattern: sys::CUfunction,
}

// SAFETY: module/function handles are driver objects usable from any thread
// with the context bound (every launch binds it).
unsafe impl Send for KernelsInner {}
// SAFETY: see `Send`; the handles are never mutated.
unsafe impl Sync for KernelsInner {}

impl Drop for KernelsInner {
    fn drop(&mut self) {
        if self.gpu.inner.synchronize().is_ok() {
            // SAFETY: we own the module; the device is idle, so no kernel of
            // it runs. Graphs holding these functions keep `self` alive.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels")
            .field("device", &self.inner.gpu.inner.label)
            .finish()
    }
}

fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

impl Kernels {
    pub(crate) fn compile(gpu: &Gpu) -> Result<Self, CudaError> {
        probe_nvrtc()?;
        let label = &gpu.inner.label;
        let (major, minor) = gpu.compute_capability();
        // `arch` wants a &'static str; the set of architectures is small.
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS_CU, opts).map_err(|e| {
            CudaError::Compile {
                device: label.clone(),
                what: "weft KERNELS_CU".into(),
                log: format!("{e:?}"),
            }
        })?;
        let src = CString::new(ptx.to_src()).map_err(|e| CudaError::Compile {
            device: label.clone(),
            what: "weft KERNELS_CU".into(),
            log: format!("PTX contains NUL: {e}"),
        })?;
        gpu.inner.bind()?;
        // SAFETY: `src` is a NUL-terminated PTX image; the context is current.
        let module = unsafe { result::module::load_data(src.as_ptr().cast()) }
            .map_err(drv(label, "cuModuleLoadData"))?;
        let get = |name: &str| {
            let c = CString::new(name).unwrap_or_default();
            // SAFETY: `module` is loaded; `c` is a NUL-terminated name.
            unsafe { result::module::get_function(module, c) }
                .map_err(drv(label, "cuModuleGetFunction"))
        };
        let funcs = (|| {
            Ok::<_, CudaError>((
                get("weft_scalar_inc")?,
                get("weft_wait_flag_write")?,
                get("weft_gated_inc")?,
                get("weft_fill_pattern")?,
            ))
        })();
        let (scalar_inc, wait_flag_write, gated_inc, fill_pattern) = match funcs {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: unload the module we just loaded; nothing uses it.
                let _ = unsafe { result::module::unload(module) };
                return Err(e);
            }
        };
        tracing::debug!(device = %label, arch, "weft kernels compiled");
        Ok(Kernels {
            inner: Arc::new(KernelsInner {
                gpu: gpu.clone(),
                module,
                scalar_inc,
                wait_flag_write,
                gated_inc,
                fill_pattern,
            }),
        })
    }

    fn same_gpu(&self, what: &str, gpu: &Gpu) -> Result<(), CudaError> {
        if Arc::ptr_eq(&gpu.inner, &self.inner.gpu.inner) {
            Ok(())
        } else {
            Err(CudaError::InvalidArgument {
                device: self.inner.gpu.inner.label.clone(),
                what: format!("{what} belongs to {}", gpu.inner.label),
            })
        }
    }

    /// # Safety
    /// `params` must match the kernel's signature; the memory they point to
    /// must stay alive until the launch completes (ensured by the callers:
    /// weft-cuda memory syncs the device before it is freed, and captured
    /// launches are kept alive by the graph through `note_use`).
    unsafe fn launch(
        &self,
        f: sys::CUfunction,
        name: &'static str,
        stream: &Stream,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        self.same_gpu("stream", stream.gpu())?;
        self.inner.gpu.inner.bind()?;
        // SAFETY: forwarded from the caller (see above); the function belongs
        // to our loaded module in the current context.
        unsafe { result::launch_kernel(f, (grid, 1, 1), (block, 1, 1), 0, stream.raw(), params) }
            .map_err(drv(&self.inner.gpu.inner.label, name))?;
        stream.note_use(self.inner.clone());
        Ok(())
    }

    /// Enqueues `word += delta` on `stream` (one thread; release store at
    /// system scope, so the GPU's earlier writes are visible first).
    /// Capturable: inside a capture it becomes a graph node, and each replay
    /// bumps the word again.
    pub fn scalar_inc(
        &self,
        stream: &Stream,
        word: &WatchWord,
        delta: u64,
    ) -> Result<(), CudaError> {
        self.bump(stream, word, delta, 0)
    }

    /// Like [`Kernels::scalar_inc`] but with a relaxed store (no
    /// `fence.sys` before it): about 0.5 µs less latency on an H200 (see
    /// docs/benchmarks.md, "GPU: the UVM watcher"). Enough when the data the
    /// bump announces was written by *earlier kernels* on the same stream (or
    /// graph edge): a kernel starts only after its predecessor completed, and
    /// a completed kernel's writes are in device memory, where the NIC and
    /// the copy engine read them. Use `scalar_inc` (or `weft_st_release_sys`
    /// in your own kernel) when the same kernel both writes the data and
    /// bumps.
    pub fn scalar_inc_relaxed(
        &self,
        stream: &Stream,
        word: &WatchWord,
        delta: u64,
    ) -> Result<(), CudaError> {
        self.bump(stream, word, delta, 1)
    }

    fn bump(
        &self,
        stream: &Stream,
        word: &WatchWord,
        delta: u64,
        flags: u64,
    ) -> Result<(), CudaError> {
        self.same_gpu("watch word", word.gpu())?;
        let (w, s) = (word.device_ptr(), word.shadow_device_ptr());
        let mut params = [arg(&w), arg(&s), arg(&delta), arg(&flags)];
        // SAFETY: params match `weft_scalar_inc(u64*, u64*, u64, u64)`; the
        // word is kept alive (note_use below / device sync on drop).
        unsafe {
            self.launch(
                self.inner.scalar_inc,
                "cuLaunchKernel(weft_scalar_inc)",
                stream,
                1,
                1,
                &mut params,
            )?
        };
        stream.note_use(word.inner.clone());
        Ok(())
    }

    /// Enqueues a kernel of `blocks × threads` threads that waits (each block
    /// on its own) until `flag >= target`, then writes
    /// `out[tid] = value + tid` as u64s, or `u64::MAX` if `timeout_ns`
    /// (0: forever) passed first. `out` must hold `blocks × threads` u64s.
    #[allow(clippy::too_many_arguments)]
    pub fn wait_flag_write(
        &self,
        stream: &Stream,
        flag: &HostFlag,
        target: u64,
        timeout_ns: u64,
        out: &DeviceBuffer,
        value: u64,
        blocks: u32,
        threads: u32,
    ) -> Result<(), CudaError> {
        self.same_gpu("flag", &flag.inner_gpu())?;
        self.same_gpu("output buffer", out.gpu())?;
        let label = &self.inner.gpu.inner.label;
        let n = u64::from(blocks) * u64::from(threads);
        if blocks == 0
            || threads == 0
            || threads > 1024
            || n.checked_mul(8).is_none_or(|b| b > out.len() as u64)
        {
            return Err(CudaError::InvalidArgument {
                device: label.clone(),
                what: format!("{blocks}x{threads} threads need {n} u64s; output holds {} bytes (threads <= 1024)", out.len()),
            });
        }
        let (f, o) = (flag.device_ptr(), out.device_ptr());
        let mut params = [
            arg(&f),
            arg(&target),
            arg(&timeout_ns),
            arg(&o),
            arg(&value),
        ];
        // SAFETY: params match `weft_wait_flag_write(const u64*, u64, u64, u64*, u64)`;
        // `out` holds one u64 per thread (checked).
        unsafe {
            self.launch(
                self.inner.wait_flag_write,
                "cuLaunchKernel(weft_wait_flag_write)",
                stream,
                blocks,
                threads,
                &mut params,
            )?
        };
        stream.note_use(flag.inner.clone());
        stream.note_use(out.inner.clone());
        Ok(())
    }

    /// Enqueues a kernel that writes `words` u64s at byte `offset` of `buf`:
    /// word `i` = [`crate::pattern_word`]`(seed, i)`. A deterministic data
    /// generator for tests and benchmarks ("compute a layer"); capturable.
    pub fn fill_pattern(
        &self,
        stream: &Stream,
        buf: &DeviceBuffer,
        offset: usize,
        words: usize,
        seed: u64,
    ) -> Result<(), CudaError> {
        self.same_gpu("buffer", buf.gpu())?;
        let fits = words
            .checked_mul(8)
            .and_then(|b| b.checked_add(offset))
            .is_some_and(|end| end <= buf.len());
        if !offset.is_multiple_of(8) || !fits {
            return Err(CudaError::InvalidArgument {
                device: self.inner.gpu.inner.label.clone(),
                what: format!(
                    "fill of {words} words at byte {offset} (must be 8-aligned) outside buffer of {} bytes",
                    buf.len()
                ),
            });
        }
        if words == 0 {
            return Ok(());
        }
        let dst = buf.device_ptr() + offset as u64;
        let n = words as u64;
        let blocks = u32::try_from(words.div_ceil(256).min(1024)).unwrap_or(1024);
        let mut params = [arg(&dst), arg(&n), arg(&seed)];
        // SAFETY: params match `weft_fill_pattern(u64*, u64, u64)`; the range
        // lies inside `buf` (checked); `buf` is kept alive (note_use / drop
        // synchronises the device).
        unsafe {
            self.launch(
                self.inner.fill_pattern,
                "cuLaunchKernel(weft_fill_pattern)",
                stream,
                blocks,
                256,
                &mut params,
            )?
        };
        stream.note_use(buf.inner.clone());
        Ok(())
    }

    /// Enqueues the latency probe: with `v = word + delta` (from the device
    /// shadow) it stores `v` into `armed`, waits until `gate >= v` (at most
    /// `timeout_ns`, 0: forever), then bumps `word` to `v`. Replayable, so
    /// it can be captured once and launched many times. `ordering` selects
    /// the memory-ordering strength of the gate poll and of the bump.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_inc(
        &self,
        stream: &Stream,
        gate: &HostFlag,
        armed: &HostFlag,
        word: &WatchWord,
        delta: u64,
        timeout_ns: u64,
        ordering: ProbeOrdering,
    ) -> Result<(), CudaError> {
        self.same_gpu("gate", &gate.inner_gpu())?;
        self.same_gpu("armed flag", &armed.inner_gpu())?;
        self.same_gpu("watch word", word.gpu())?;
        let (g, a, w, s) = (
            gate.device_ptr(),
            armed.device_ptr(),
            word.device_ptr(),
            word.shadow_device_ptr(),
        );
        let flags: u64 =
            u64::from(!ordering.release_store) | (u64::from(!ordering.acquire_poll) << 1);
        let mut params = [
            arg(&g),
            arg(&a),
            arg(&w),
            arg(&s),
            arg(&delta),
            arg(&timeout_ns),
            arg(&flags),
        ];
        // SAFETY: params match `weft_gated_inc(const u64*, u64*, u64*, u64*, u64, u64, u64)`.
        unsafe {
            self.launch(
                self.inner.gated_inc,
                "cuLaunchKernel(weft_gated_inc)",
                stream,
                1,
                1,
                &mut params,
            )?
        };
        stream.note_use(gate.inner.clone());
        stream.note_use(armed.inner.clone());
        stream.note_use(word.inner.clone());
        Ok(())
    }
}
