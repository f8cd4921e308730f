//! # weft-rl: RL weight transfer over the weft TransferEngine
//!
//! Trainers push new weights straight into inference ranks' memory with
//! one-sided WRITEs, following a static routing table computed once:
//!
//! - [`meta`]: what trainers hold and inference ranks want (shapes, FSDP /
//!   TP / EP placement, fused targets, fp8 targets).
//! - [`plan`](mod@plan): the pure, deterministic planner ([`plan::plan`]): every
//!   inference byte written by exactly one trainer, load balanced, cut into
//!   watermark-bounded waves per mesh group.
//! - [`fp8`]: bf16 → e4m3 with per-128×128-tile f32 scales.
//! - [`exec`]: the per-step pipeline over the engine ([`exec::Trainer`],
//!   [`exec::Inference`]) and the Rank0 baseline in the same code.
//! - [`sim`]: the scale simulation: the same plan's WRITEs over the
//!   loopback fabric's NIC model in simulated time, next to an event-level
//!   cost model.
//! - `cuda` (feature `cuda`): the unshard / fuse / fp8-quantise stages as
//!   NVRTC kernels on device memory, and one trainer and one inference rank
//!   on one GPU writing through the engine.
//! - [`models`]: parameter tables of Qwen3-235B-A22B, DeepSeek-V3 and
//!   Kimi-K2 from their published configs, and the paper's layouts.
//!
//! See `docs/apps.md` and `docs/benchmarks.md` ("RL weight transfer").

#![deny(unsafe_code)]

#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod exec;
pub mod fp8;
pub mod meta;
pub mod models;
pub mod plan;
pub mod sim;
pub mod summary;

pub use error::RlError;
pub use meta::{
    Box2, Concat, DType, Fp8Fallback, InferTensor, Layout, ModelLayout, Placement, Quant, Rank,
    Segment, TrainParam,
};
pub use plan::{plan, Dest, Plan, PlanConfig, Run, Unit, Xfer};
