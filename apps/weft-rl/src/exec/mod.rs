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

use crate::plan::{GatherPost, Plan, Run, Xfer};
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

/// Immediates the writer of a gather post sees: one transfer as
/// [`imm_count`], a batch as paged writes of its pages (however
/// [`page_sets`] cuts it: the count is linear in the pages).
pub(crate) fn post_imm_count(c: &ImmCounts, p: &GatherPost) -> u64 {
    match p {
        GatherPost::One { xfer, .. } => imm_count(c, xfer),
        GatherPost::Batch { page_len, src, .. } => c.paged_writes(*page_len, src.len() as u64),
    }
}

/// Page offsets `src[i] → dst[i]` as engine page lists, as few as fit: each
/// side's offsets become `offset + index × stride` with the stride the
/// greatest common divisor of their distances from the smallest, and a new
/// list starts where an index would not fit in `u32`.
pub(crate) fn page_sets(src: &[u64], dst: &[u64]) -> Vec<(Pages, Pages)> {
    /// One side of a list being built: smallest offset, stride (0 while
    /// every offset is equal).
    #[derive(Clone, Copy)]
    struct Side {
        lo: u64,
        hi: u64,
        g: u64,
    }
    impl Side {
        fn with(self, o: u64) -> Side {
            let (lo, hi) = (self.lo.min(o), self.hi.max(o));
            // The distances from the new smallest offset keep the same
            // divisors: every old distance moves by `self.lo - lo`.
            let g = gcd(gcd(self.g, self.lo - lo), o - lo);
            Side { lo, hi, g }
        }
        fn fits(&self) -> bool {
            self.g == 0 || (self.hi - self.lo) / self.g <= u64::from(u32::MAX)
        }
        fn pages(&self, offs: &[u64]) -> Pages {
            let stride = self.g.max(1);
            Pages {
                // `fits` held when the list was closed.
                indices: offs
                    .iter()
                    .map(|o| ((o - self.lo) / stride) as u32)
                    .collect(),
                stride,
                offset: self.lo,
            }
        }
    }
    let new = |o: u64| Side { lo: o, hi: o, g: 0 };
    let mut out = Vec::new();
    let mut start = 0;
    let mut cur: Option<(Side, Side)> = None;
    for (i, (&s, &d)) in src.iter().zip(dst).enumerate() {
        cur = Some(match cur {
            None => (new(s), new(d)),
            Some((a, b)) => {
                let (a2, b2) = (a.with(s), b.with(d));
                if a2.fits() && b2.fits() {
                    (a2, b2)
                } else {
                    out.push((a.pages(&src[start..i]), b.pages(&dst[start..i])));
                    start = i;
                    (new(s), new(d))
                }
            }
        });
    }
    if let Some((a, b)) = cur {
        out.push((a.pages(&src[start..]), b.pages(&dst[start..])));
    }
    out
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
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

#[cfg(test)]
mod tests {
    use super::*;

    fn offsets(p: &Pages) -> Vec<u64> {
        (0..p.len()).map(|i| p.page_offset(i).unwrap()).collect()
    }

    #[test]
    fn page_sets_keep_every_pair_in_order() {
        let src = [8192, 0, 16384, 40960, 8192 * 3];
        let dst = [0, 2048, 4096, 6144, 8192];
        let sets = page_sets(&src, &dst);
        assert_eq!(sets.len(), 1);
        let (s, d) = &sets[0];
        assert_eq!(offsets(s), src);
        assert_eq!(offsets(d), dst);
        assert_eq!((s.stride, s.offset), (8192, 0));
        assert_eq!((d.stride, d.offset), (2048, 0));
    }

    #[test]
    fn page_sets_split_where_an_index_would_overflow() {
        // Distance 1 then a page 2^33 bytes away: stride 1 cannot reach it.
        let src = [0, 1, 1 << 33, (1 << 33) + 2];
        let dst = [0, 10, 20, 30];
        let sets = page_sets(&src, &dst);
        assert_eq!(sets.len(), 2);
        let all_src: Vec<u64> = sets.iter().flat_map(|(s, _)| offsets(s)).collect();
        let all_dst: Vec<u64> = sets.iter().flat_map(|(_, d)| offsets(d)).collect();
        assert_eq!(all_src, src);
        assert_eq!(all_dst, dst);
        assert!(page_sets(&[], &[]).is_empty());
        let one = page_sets(&[7], &[9]);
        assert_eq!((offsets(&one[0].0), offsets(&one[0].1)), (vec![7], vec![9]));
    }
}
