//! # weft-moe: MoE dispatch/combine over the weft TransferEngine
//!
//! Decode-optimised expert-parallel dispatch and combine (user guide:
//! `docs/apps.md`). N ranks, E experts (E/N per rank), each rank
//! dispatches up to T tokens to its top-R experts:
//!
//! 1. every rank counts its (token, k) pairs per expert ([`count_pairs`]),
//!    scatters its route row to all peers and, at the same time, sends up
//!    to P pairs per destination speculatively into private per-source
//!    receive regions;
//! 2. once all rows have arrived, the [`StepPlan`] says where each source's
//!    remaining pairs go in one contiguous region (bounded by
//!    N·T·max(R, E/N) slots, so it never overflows) and the remainder is
//!    written there;
//! 3. the receiver gathers rows into the expert layout ([`ExpertTokens`]);
//! 4. combine reuses the routes: one scatter back, then a weighted sum per
//!    token with a fixed, bit-exact accumulation order.
//!
//! Every round completes on an immediate count the receiver computes from
//! the route matrix ([`ExpectedCounts`]); nothing depends on the order of
//! writes.
//!
//! Parts: the config ([`MoeConfig`] → [`Dims`]), routes ([`RouteMatrix`]),
//! the [`StepPlan`], the counts, the CPU device operations ([`pack`]), a
//! naive [`reference`](mod@reference), and [`MoeRank`], the blocking CPU driver over a
//! [`weft::TransferEngine`] with host buffers. The GPU path (feature `cuda`)
//! is in the `cuda` module: NVRTC kernels, GPU buffers and a proxy per rank.
//! Ranks in separate processes exchange their [`RankInfo`]s out of band or
//! through a rendezvous store ([`MoeRendezvous`]).

#![deny(unsafe_code)]

mod config;
pub mod core;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod exec;
mod expert;
mod imm;
pub mod mask;
pub mod num;
pub mod pack;
mod plan;
pub mod quant;
mod rank;
pub mod reference;
pub mod rendezvous;
mod routes;
pub mod sim;

pub use config::{Dims, DispatchFormat, MoeConfig, OutDtype, ORIGIN_BYTES};
pub use core::{Action, Entry, Event, RankCore, Wait};
pub use error::{ConfigError, MoeError, Phase};
pub use exec::RankInfo;
pub use expert::{ExpertTokens, RankInput, RowOrigin, TopkWeights, NO_EXPERT};
pub use imm::{ExpectedCounts, ImmValues, COMBINE_MODE, DISPATCH_MODE};
pub use mask::RankMask;
pub use plan::{
    member_index, member_rank, n_to_rank, CombineSend, CombineSlot, DispatchDest, Overflow,
    SrcSlot, StepPlan,
};
pub use rank::{Layout, MoeRank};
pub use rendezvous::MoeRendezvous;
pub use routes::{count_pairs, row_to_le_bytes, CountedPairs, RouteMatrix};
