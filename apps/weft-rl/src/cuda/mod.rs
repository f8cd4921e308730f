//! The GPU path (feature `cuda`): the trainer-side stages of a weight
//! update as NVRTC kernels on device memory, and one trainer and one
//! inference rank on one GPU moving the result with one-sided WRITEs.
//!
//! - [`RlKernels`] ([`kernels`]): **unshard** (assemble a full tensor from
//!   its FSDP / TP shards, `Shard(0)` or `Shard(1)`, uneven splits),
//!   **fuse** (stack boxes of full tensors into one fused tensor, as the
//!   planner's [`crate::InferTensor`] segments describe `qkv_proj`,
//!   `gate_up_proj`, stacked experts) and **quantise** (bf16 → fp8 e4m3
//!   with one f32 scale per `block × block` tile, bit-identical to
//!   [`crate::fp8::quantize_block`]: same scale convention, rounding,
//!   saturation, NaN handling and partial edge tiles).
//! - [`GpuTrainer`] (`trainer.rs`): one trainer holding every trainer
//!   region of a [`crate::Plan`] in device memory; a step runs unshard →
//!   fuse → quantise into a registered device staging image of one
//!   inference rank's region, then WRITEs every tensor (and its scales)
//!   into that rank's [`GpuTarget`], in this process or another.
//! - [`GpuInference`] (`target.rs`): one inference rank's weight region in
//!   device memory, registered with its own engine, which counts the
//!   immediates of an update.
//! - [`GpuUpdate`] (`pipeline.rs`): both in one process, an engine each,
//!   by default over the same-host backend `nvlink`.
//!
//! Needs a CUDA 13 driver and NVRTC at run time (see `weft-cuda`); builds
//! without either.

#[allow(unsafe_code)] // kernel launches with raw device pointers
mod kernels;
mod kernels_cu;
mod pipeline;
#[allow(unsafe_code)] // registering device memory with the engine
mod target;
#[allow(unsafe_code)] // registering device memory with the engine
mod trainer;

pub use kernels::{DevMat, RlKernels, MAX_BOXES};
pub use kernels_cu::RL_CU;
pub use pipeline::{GpuStepTimes, GpuUpdate, GpuUpdateConfig, RoleHosts};
pub use target::{GpuInference, GpuTarget, UpdateRound};
pub use trainer::GpuTrainer;

use weft_cuda::CudaError;

/// Errors of the GPU path, with what it was doing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// A CUDA call (allocation, copy, compilation, launch) failed.
    #[error("{what}: {source}")]
    Cuda {
        /// What the GPU path was doing.
        what: String,
        /// The CUDA error.
        #[source]
        source: CudaError,
    },
    /// An engine call failed (registration, a WRITE, an immediate round).
    #[error("{role}, {what}: {source}")]
    Engine {
        /// `trainer` or `inference`.
        role: &'static str,
        /// What it was doing.
        what: String,
        /// The engine's error.
        #[source]
        source: weft::EngineError,
    },
    /// A view, a shard tiling or a plan that does not fit the buffers.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A wait ran past its deadline.
    #[error("{role}, {what}: no completion within {waited_ms} ms")]
    Timeout {
        /// `trainer` or `inference`.
        role: &'static str,
        /// What it waited for.
        what: String,
        /// How long it waited.
        waited_ms: u64,
    },
}

impl GpuError {
    pub(crate) fn cuda(what: impl Into<String>) -> impl FnOnce(CudaError) -> GpuError {
        let what = what.into();
        move |source| GpuError::Cuda { what, source }
    }

    pub(crate) fn engine(
        role: &'static str,
        what: impl Into<String>,
    ) -> impl FnOnce(weft::EngineError) -> GpuError {
        let what = what.into();
        move |source| GpuError::Engine { role, what, source }
    }
}
