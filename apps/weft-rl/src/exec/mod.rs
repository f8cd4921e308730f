//! Per-step execution over the engine: [`Trainer`] (active) and
//! [`Inference`] (passive) ranks following one [`Plan`].
//!
//! Step protocol (one weight version):
//! 1. Every inference rank arms one ImmCounter round on the immediate of
//!    the target buffer, with the count computed from the plan
//!    ([`Inference::expected`], through the engine's `ImmCounts`).
//! 2. Every trainer runs its mesh groups in plan order; per wave: a
//!    barrier among the group's ranks (zero-length WRITEIMMs: "my arena
//!    half is free"), the gathers it sources (WRITEs into the writers'
//!    arenas), its direct units (WRITEs from its shards into inference
//!    memory), then — once its gather round is complete — quantisation and
//!    WRITEs of its staged units. Waves overlap: the arena has two halves,
//!    consecutive waves (numbered across groups, `Plan::arena_half`) stage
//!    in alternate halves, and a rank enters a wave as soon as the previous
//!    one is posted and the last wave that used the same half completed,
//!    so one wave's WRITEs fly while the next one barriers, gathers and
//!    quantises.
//! 3. When its round fires, an inference rank makes the target buffer the
//!    live one and acknowledges to every trainer (one zero-length WRITEIMM
//!    each); a trainer's step succeeds once every inference rank acked.
//!
//! **Keeping the old weights**: double buffer. Each inference rank
//! registers two weight regions; version `v` is written into buffer `v % 2`
//! and becomes live only when its round completed, so the live buffer is
//! never written. A failed step leaves the live buffer as it was; the retry
//! writes the same version into the same (not live) buffer again.
//!
//! **Failure**: every wait has a deadline ([`StepConfig::timeout`]); a dead
//! or stalled peer makes the waits that depend on it fail with
//! [`RlError::Timeout`], and failed WRITEs with [`RlError::Engine`], on
//! every rank (trainers that share no group with the dead one still miss
//! the inference acks). After a failed step, call `recover` on every rank
//! (it clears partial immediate counts) before retrying.
//!
//! Immediates are reserved values from the top of the engine's range (the
//! same on every rank; see [`ImmPlan`]).

mod inference;
mod rank0;
mod trainer;

use std::time::Duration;

use weft::{Imm, ImmCounts, MrDesc, Pages, Resources, TransferEngine};

use crate::plan::{Plan, Run, Xfer};
use crate::RlError;

pub use inference::Inference;
pub use rank0::{Rank0Directory, Rank0Inference, Rank0Trainer};
pub use trainer::{StepStats, Trainer};

/// What every rank must know of every other (exchanged once, out of band;
/// descriptors are serializable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directory {
    /// Per trainer: its shard region and its arena.
    pub trainers: Vec<TrainerEndpoint>,
    /// Per inference rank: its two weight buffers.
    pub inference: Vec<InferEndpoint>,
}

/// A trainer's registered memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainerEndpoint {
    /// Where its shards live (read by its own WRITEs only).
    pub shards: MrDesc,
    /// Its staging arena (target of gathers, barriers and acks).
    pub arena: MrDesc,
}

/// An inference rank's registered memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferEndpoint {
    /// Buffer 0 and buffer 1.
    pub weights: [MrDesc; 2],
}

/// Step options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepConfig {
    /// Deadline of each wait of a step.
    pub timeout: Duration,
}

impl Default for StepConfig {
    fn default() -> Self {
        StepConfig {
            timeout: Duration::from_secs(10),
        }
    }
}

/// The reserved immediate values (from the top of `imm_capacity` down):
/// weights buffer 0 and 1, the trainers' ack, then per mesh group a gather
/// value and two barrier values (one per arena half: consecutive waves of
/// a group alternate, so a peer's barrier of the next wave is never
/// counted for this one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImmPlan {
    /// Immediate of writes into weight buffer 0 / 1.
    pub weights: [Imm; 2],
    /// Inference → trainer acknowledgement.
    pub ack: Imm,
    /// Per group (plan order): gather writes into arenas.
    pub gather: Vec<Imm>,
    /// Per group: barriers of even and odd waves.
    pub barrier: Vec<[Imm; 2]>,
}

impl ImmPlan {
    /// The values for `plan` on an engine with `capacity` immediates.
    pub fn new(plan: &Plan, capacity: u32) -> Result<ImmPlan, RlError> {
        Self::below(plan, capacity, 0)
    }

    /// Values per step: `3 + 3 * groups`.
    pub fn len(plan: &Plan) -> u64 {
        3 + 3 * plan.groups.len() as u64
    }

    /// The values below the `skip` topmost ones (a second protocol on the
    /// same engine, e.g. the Rank0 baseline next to the P2P path).
    pub fn below(plan: &Plan, capacity: u32, skip: u32) -> Result<ImmPlan, RlError> {
        let need = Self::len(plan) + u64::from(skip);
        if u64::from(capacity) < need {
            return Err(RlError::Plan(format!(
                "{need} reserved immediates needed, the engine has {capacity}"
            )));
        }
        let top = capacity - 1 - skip;
        let g = plan.groups.len() as u32;
        Ok(ImmPlan {
            weights: [top, top - 1],
            ack: top - 2,
            gather: (0..g).map(|i| top - 3 - 3 * i).collect(),
            barrier: (0..g).map(|i| [top - 4 - 3 * i, top - 5 - 3 * i]).collect(),
        })
    }

    /// Every value, for reserving and resetting.
    pub fn all(&self) -> Vec<Imm> {
        let mut v = vec![self.weights[0], self.weights[1], self.ack];
        v.extend(&self.gather);
        v.extend(self.barrier.iter().flatten());
        v
    }

    /// Reserves every value on `engine`, keeping the leases in `held`.
    pub(crate) fn reserve(
        &self,
        engine: &TransferEngine,
        held: &mut Resources,
        role: &'static str,
        rank: u32,
    ) -> Result<(), RlError> {
        for imm in self.all() {
            held.lease_imm_value(engine, imm)
                .map_err(|source| RlError::Engine {
                    role,
                    rank,
                    phase: format!("reserving immediate {imm}"),
                    source,
                })?;
        }
        Ok(())
    }
}

/// Immediates the receiver of `x`'s destination sees (a single write when
/// both sides are contiguous, else paged writes: the same choice as the
/// submit).
pub(crate) fn imm_count(c: &ImmCounts, x: &Xfer) -> u64 {
    if x.is_single() {
        c.single_write(x.dst.bytes())
    } else {
        c.paged_writes(x.dst.page_len, x.dst.count)
    }
}

/// A run as engine pages (indices `0..count`).
pub(crate) fn pages(r: &Run) -> Result<Pages, RlError> {
    let n = u32::try_from(r.count)
        .map_err(|_| RlError::Plan(format!("{} pages in one run", r.count)))?;
    Ok(Pages {
        indices: (0..n).collect(),
        stride: r.stride,
        offset: r.offset,
    })
}

/// `engine error` → [`RlError::Engine`].
pub(crate) fn eng(
    role: &'static str,
    rank: u32,
    phase: impl Into<String>,
) -> impl FnOnce(weft::EngineError) -> RlError {
    let phase = phase.into();
    move |source| RlError::Engine {
        role,
        rank,
        phase,
        source,
    }
}
