//! # weft-cuda: GPU memory and GPU-driven signalling for weft
//!
//! Built **without** the `cuda` feature (the default, what CI builds) this
//! crate needs no GPU, no driver and no toolkit: [`probe`] returns
//! [`CudaError::NotBuilt`] and nothing else is exported.
//!
//! Built **with** `--features cuda` it provides (via `cudarc`, loaded
//! dynamically, so building still needs no toolkit):
//! - [`Gpu`]: one CUDA device (its primary context), opened only after
//!   [`probe`] found a working driver — `cudarc` panics on first use when
//!   `libcuda` is missing, so every entry point probes first and returns a
//!   typed [`CudaError`] instead;
//! - [`DeviceBuffer`]: device memory usable as a
//!   [`weft_transport::MemRegion`] with [`weft_transport::Device::Cuda`];
//! - [`CudaCopy`]: a [`weft_transport::DeviceCopy`] on a stream it owns (H2D,
//!   D2H, D2D through the copy engine), which the loopback fabric uses to move
//!   payload bytes to and from GPU memory;
//! - [`WatchWord`]: a host-mapped pinned word (`cuMemHostAlloc` with
//!   `DEVICEMAP | PORTABLE`) whose host pointer goes to the engine's UVM
//!   watcher and whose device pointer kernels (and CUDA graphs) write;
//! - [`HostFlag`]: a host-mapped word the host raises with release semantics
//!   and kernels wait on with acquire loads (the MoE proxy's building block);
//! - [`Kernels`]: NVRTC-compiled `scalar_inc` / `scalar_inc_relaxed` (bump
//!   a watcher word; capturable into CUDA graphs), `wait_flag_write` (wait
//!   on a flag, then write), `fill_pattern` (deterministic data, see
//!   [`pattern_word`]) and `gated_inc` (the latency benchmark's flag-gated
//!   bump); [`KERNELS_CU`] is their source, so other kernels can reuse the
//!   device functions;
//! - [`Stream`] and [`Graph`]: a non-blocking stream, stream capture into a
//!   CUDA graph and graph launch;
//! - [`Gpu::peer_memory`] / [`CudaPeerMemory`]: the
//!   [`weft_transport::PeerMemory`] of a GPU, with which the same-host
//!   backend (`weft-nvlink`) registers GPU memory and copies into peers'
//!   GPU memory on a stream per peer;
//! - [`Gpu::export`] / [`Gpu::import`] / [`ImportCache`]: device memory
//!   shared between processes (legacy IPC handles for `cuMemAlloc` memory,
//!   POSIX file descriptors for virtual-memory allocations such as
//!   [`Gpu::alloc_shareable`]'s), described by a [`SharedMemory`] (which,
//!   with its byte encoding, exists without the feature too).
//!
//! ## Engine integration
//! ```ignore
//! let word = gpu.watch_word()?;
//! // SAFETY: `word` outlives the watcher (drop the UvmWatcher first).
//! let watcher = unsafe { engine.watch_word(word.host_ptr(), |old, new| { /* post layers old+1..=new */ }) };
//! kernels.scalar_inc(&stream, &word, 1)?; // after each layer, direct or in a graph
//! ```
//! GPU memory: `engine.reg_mr(unsafe { buf.region() })` with a domain group
//! declared `.device(Device::Cuda(i))`; the loopback fabric needs
//! `FabricConfig::device_copy = Some(Arc::new(gpu.copy_engine()?))`.
//!
//! ## Tests
//! GPU tests skip with a `SKIP ...` message when no GPU is usable;
//! `crates/weft-cuda/run-gpu-tests.sh` runs them all (and the
//! `watcher_latency` example) on a GPU machine in one call.
//!
//! ## Runtime requirements (feature `cuda`)
//! `libcuda.so.1` from an NVIDIA driver supporting CUDA 13.0 (driver ≥ 580)
//! and, for [`Kernels`], NVRTC (`libnvrtc.so.13` or `libnvrtc.so`) on the
//! loader path (e.g. `LD_LIBRARY_PATH=/usr/local/cuda/lib64`).

#![deny(unsafe_code)]
// The crate docs link the items `--features cuda` builds; without it they
// do not exist.
#![cfg_attr(not(feature = "cuda"), allow(rustdoc::broken_intra_doc_links))]

mod error;
mod share;

pub use error::CudaError;
pub use share::{ShareKind, SharedMemory};

/// What [`probe`] found: the driver's CUDA version and how many devices it
/// reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverInfo {
    /// CUDA version the driver supports, as `cuDriverGetVersion` reports it
    /// (e.g. `13000` for 13.0).
    pub driver_version: i32,
    /// Number of CUDA devices visible to this process.
    pub device_count: u32,
}

/// Word `i` of the deterministic pattern `seed` (SplitMix64 of `seed + i`):
/// what `Kernels::fill_pattern` writes on the GPU, for checking data on
/// the host. Available without the `cuda` feature.
pub fn pattern_word(seed: u64, i: u64) -> u64 {
    let mut x = seed.wrapping_add(i).wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(feature = "cuda")]
mod cuda;

#[cfg(feature = "cuda")]
pub use cuda::{
    probe, probe_nvrtc, CudaCopy, CudaPeerMemory, DeviceBuffer, Event, Exported, Function, Gpu,
    Graph, HostFlag, ImportCache, Imported, Kernels, MappedBuffer, Module, ProbeOrdering, Stream,
    WatchWord, DTYPE_CU, KERNELS_CU,
};

/// Probes for a usable CUDA driver. This build has no CUDA support (the
/// `cuda` feature is off), so it always returns [`CudaError::NotBuilt`].
#[cfg(not(feature = "cuda"))]
pub fn probe() -> Result<DriverInfo, CudaError> {
    Err(CudaError::NotBuilt)
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    #[test]
    fn without_feature_probe_says_not_built() {
        let err = probe().unwrap_err();
        assert_eq!(err, CudaError::NotBuilt);
        assert!(err.to_string().contains("--features cuda"), "{err}");
        let t: weft_transport::TransportError = err.into();
        assert!(matches!(
            t,
            weft_transport::TransportError::Unsupported { .. }
        ));
    }
}
