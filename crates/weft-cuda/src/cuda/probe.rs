//! Probing for libcuda and libnvrtc before `cudarc` touches them.
//!
//! `cudarc` with `dynamic-loading` panics the first time it needs a library
//! (or a symbol) it cannot load. We open the same libraries ourselves with
//! `libloading`, check every symbol weft-cuda calls, and run `cuInit`, so a
//! machine without a GPU gets a [`CudaError`] instead of a panic.

use crate::{CudaError, DriverInfo};
use libloading::Library;
use std::ffi::{c_int, c_uint};
use std::sync::OnceLock;

/// Driver symbols weft-cuda calls (through cudarc), by the exact names cudarc
/// loads.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8Async",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuGetErrorName",
];

/// NVRTC symbols cudarc's `compile_ptx_with_opts` calls.
const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcDestroyProgram",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcVersion",
];

static DRIVER: OnceLock<Result<DriverInfo, CudaError>> = OnceLock::new();
static NVRTC: OnceLock<Result<(i32, i32), CudaError>> = OnceLock::new();
/// Keeps our handle of libcuda loaded for the life of the process (cudarc
/// holds its own handle of the same library).
static DRIVER_LIB: OnceLock<Library> = OnceLock::new();

/// Probes for a working CUDA driver (once per process; the result is
/// cached). Never panics: a missing `libcuda.so.1`, a missing symbol, or a
/// failing `cuInit` (no GPU) comes back as [`CudaError::DriverUnavailable`].
pub fn probe() -> Result<DriverInfo, CudaError> {
    DRIVER.get_or_init(probe_driver).clone()
}

/// Probes for NVRTC the way cudarc will load it (its list of candidate
/// library names), checking the symbols kernel compilation needs. Returns
/// NVRTC's `(major, minor)` version.
pub fn probe_nvrtc() -> Result<(i32, i32), CudaError> {
    NVRTC.get_or_init(probe_nvrtc_uncached).clone()
}

fn unavailable(reason: String) -> CudaError {
    CudaError::DriverUnavailable { reason }
}

fn probe_driver() -> Result<DriverInfo, CudaError> {
    // SAFETY: libcuda.so.1 is the NVIDIA driver's user-space library; loading
    // it runs only its own initialisers, which are designed for dlopen (it is
    // how every CUDA runtime finds the driver).
    let lib = unsafe { Library::new("libcuda.so.1") }
        .map_err(|e| unavailable(format!("cannot load libcuda.so.1: {e}")))?;
    for sym in DRIVER_SYMBOLS {
        // SAFETY: we only look the symbol up (as an untyped address) to check
        // that it exists; it is not called through this type.
        if let Err(e) = unsafe { lib.get::<*const ()>(sym.as_bytes()) } {
            return Err(unavailable(format!(
                "libcuda.so.1 lacks {sym} (driver too old for CUDA 13.0 bindings?): {e}"
            )));
        }
    }
    type InitFn = unsafe extern "C" fn(c_uint) -> c_int;
    type IntOutFn = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: the symbols exist (checked above) and have these C signatures
    // in every CUDA driver API version: CUresult cuInit(unsigned int),
    // CUresult cuDriverGetVersion(int*), CUresult cuDeviceGetCount(int*).
    let (init, version, count) = unsafe {
        (
            lib.get::<InitFn>(b"cuInit")
                .map_err(|e| unavailable(e.to_string()))?,
            lib.get::<IntOutFn>(b"cuDriverGetVersion")
                .map_err(|e| unavailable(e.to_string()))?,
            lib.get::<IntOutFn>(b"cuDeviceGetCount")
                .map_err(|e| unavailable(e.to_string()))?,
        )
    };
    // SAFETY: cuInit takes flags (must be 0) and may be called repeatedly.
    let rc = unsafe { init(0) };
    if rc != 0 {
        return Err(unavailable(format!(
            "cuInit failed with CUresult {rc}{}",
            match rc {
                100 => " (CUDA_ERROR_NO_DEVICE: no GPU visible)",
                35 => " (CUDA_ERROR_INSUFFICIENT_DRIVER)",
                999 => " (CUDA_ERROR_UNKNOWN)",
                _ => "",
            }
        )));
    }
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer for the call's duration.
    let rc = unsafe { version(&mut v) };
    if rc != 0 {
        return Err(unavailable(format!(
            "cuDriverGetVersion failed with CUresult {rc}"
        )));
    }
    if v < 13000 {
        return Err(unavailable(format!(
            "driver supports CUDA {}.{}, weft-cuda's bindings need 13.0 (driver >= 580)",
            v / 1000,
            (v % 1000) / 10
        )));
    }
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer for the call's duration.
    let rc = unsafe { count(&mut n) };
    if rc != 0 {
        return Err(unavailable(format!(
            "cuDeviceGetCount failed with CUresult {rc}"
        )));
    }
    // SAFETY: cudarc looks for the same library under its own list of names;
    // this only dlopens candidates and reports whether one loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable(
            "cudarc found none of its libcuda candidate names".to_string(),
        ));
    }
    let _ = DRIVER_LIB.set(lib);
    let info = DriverInfo {
        driver_version: v,
        device_count: u32::try_from(n).unwrap_or(0),
    };
    tracing::debug!(?info, "CUDA driver probed");
    Ok(info)
}

fn probe_nvrtc_uncached() -> Result<(i32, i32), CudaError> {
    let nv = |reason: String| CudaError::NvrtcUnavailable { reason };
    let candidates = cudarc::get_lib_name_candidates("nvrtc");
    let mut errors = Vec::new();
    for name in &candidates {
        // SAFETY: loading NVRTC runs only its own initialisers; it is a plain
        // shared library meant to be dlopened.
        let lib = match unsafe { Library::new(name) } {
            Ok(lib) => lib,
            Err(e) => {
                errors.push(format!("{name}: {e}"));
                continue;
            }
        };
        // This is the library cudarc will pick (its first loadable name).
        for sym in NVRTC_SYMBOLS {
            // SAFETY: existence check only; not called through this type.
            if let Err(e) = unsafe { lib.get::<*const ()>(sym.as_bytes()) } {
                return Err(nv(format!("{name} lacks {sym}: {e}")));
            }
        }
        type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
        // SAFETY: nvrtcResult nvrtcVersion(int *major, int *minor) in every
        // NVRTC release; the symbol exists (checked above).
        let version = unsafe { lib.get::<VersionFn>(b"nvrtcVersion") }
            .map_err(|e| nv(format!("{name}: {e}")))?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both out-pointers are valid for the call's duration.
        let rc = unsafe { version(&mut major, &mut minor) };
        if rc != 0 {
            return Err(nv(format!("{name}: nvrtcVersion returned {rc}")));
        }
        // Keep it loaded: cudarc will dlopen the same file again.
        std::mem::forget(lib);
        tracing::debug!(library = %name, major, minor, "NVRTC probed");
        return Ok((major, minor));
    }
    Err(nv(format!(
        "none of {} candidate names loaded (add the CUDA toolkit's lib64 to LD_LIBRARY_PATH); tried: {}",
        candidates.len(),
        errors.join("; ")
    )))
}
