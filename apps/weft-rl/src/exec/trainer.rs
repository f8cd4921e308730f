//! [`Trainer`]: the active side of a weight update.

use std::sync::Arc;

use weft::{
    DoneCounter, HostBuffer, Imm, ImmCounts, MrDesc, MrHandle, OnDone, Resources, TransferEngine,
};

use super::{
    eng, page_sets, pages, post_imm_count, Directory, ImmPlan, StepConfig, TrainerEndpoint,
};
use crate::fp8::quantize_block;
use crate::meta::{Box2, Quant, Rank};
use crate::plan::{GatherPost, Plan, Unit, Xfer};
use crate::RlError;

const ROLE: &str = "trainer";

/// What one trainer did in a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    /// WRITEs into inference memory (single or paged submits).
    pub writes: u64,
    /// Bytes written into inference memory.
    pub bytes: u64,
    /// Gather submits into other trainers' arenas (small pieces to one
    /// writer in one wave share a paged submit: [`GatherPost`]).
    pub gathers: u64,
    /// Bytes gathered out to other trainers.
    pub gather_bytes: u64,
    /// Units quantised to fp8 here.
    pub quantised: u64,
    /// Waves (barriers) taken part in.
    pub waves: u64,
}

/// One training rank: its shard memory, its arena, and the step pipeline.
pub struct Trainer {
    engine: Arc<TransferEngine>,
    rank: Rank,
    plan: Arc<Plan>,
    cfg: StepConfig,
    imms: ImmPlan,
    /// The registrations of `shards` and `arena` and the reserved
    /// immediates.
    held: Resources,
    shards: HostBuffer,
    arena: HostBuffer,
    shards_mr: MrHandle,
    arena_mr: MrHandle,
    endpoint: TrainerEndpoint,
    /// Immediates of the gather round of each (group, wave) into this rank.
    gather_in: Vec<Vec<u64>>,
    /// The gathers this rank sources, per (group, wave).
    gather_out: Vec<Vec<Vec<GatherPost>>>,
}

impl Trainer {
    /// Registers this rank's shard memory and arena (sizes from the plan)
    /// on `engine` and reserves the plan's immediates.
    pub fn new(
        engine: Arc<TransferEngine>,
        rank: Rank,
        plan: Arc<Plan>,
        cfg: StepConfig,
    ) -> Result<Trainer, RlError> {
        let region = plan
            .trainers
            .get(rank as usize)
            .ok_or(RlError::UnknownRank { role: ROLE, rank })?;
        let buf = |len: u64, what: &str| {
            HostBuffer::new(len.max(1) as usize)
                .map_err(|e| RlError::Buffer(format!("trainer {rank} {what}: {e}")))
        };
        let shards = buf(region.len, "shards")?;
        // Two halves: consecutive waves stage in alternate halves.
        let arena = buf(
            plan.arena_len
                .checked_mul(2)
                .ok_or_else(|| RlError::Buffer(format!("trainer {rank} arena: too large")))?,
            "arena",
        )?;
        let mut held = Resources::new();
        let (shards_mr, shards_desc) = held.register(&engine, shards.region()).map_err(eng(
            ROLE,
            rank,
            "registering shards",
        ))?;
        let (arena_mr, arena_desc) =
            held.register(&engine, arena.region())
                .map_err(eng(ROLE, rank, "registering arena"))?;
        let imms = ImmPlan::new(&plan, engine.imm_capacity())?;
        imms.reserve(&engine, &mut held, ROLE, rank)?;
        let counts = engine
            .imm_counts(0)
            .map_err(eng(ROLE, rank, "imm counts"))?;
        let (gather_in, gather_out) = gathers_of(&plan, rank, &counts);
        Ok(Trainer {
            engine,
            rank,
            plan,
            cfg,
            imms,
            held,
            shards,
            arena,
            shards_mr,
            arena_mr,
            endpoint: TrainerEndpoint {
                shards: shards_desc,
                arena: arena_desc,
            },
            gather_in,
            gather_out,
        })
    }

    /// What the other ranks need of this one.
    pub fn endpoint(&self) -> TrainerEndpoint {
        self.endpoint.clone()
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The shard memory: the framework puts its bf16 shards here (the
    /// paper's host→device copy stage), at the offsets of [`Self::pieces`].
    pub fn shards(&self) -> &HostBuffer {
        &self.shards
    }

    /// `(param, box, offset)` of every piece this rank holds, row-major
    /// bf16 at `offset` of [`Self::shards`].
    pub fn pieces(&self) -> &[(usize, Box2, u64)] {
        &self.plan.trainers[self.rank as usize].pieces
    }

    /// Pushes weight version `version` (buffer `version % 2` of every
    /// inference rank); returns when every inference rank acknowledged.
    pub fn step(&self, version: u64, dir: &Directory) -> Result<StepStats, RlError> {
        let v = (version % 2) as usize;
        let t = self.cfg.timeout;
        let mut st = StepStats::default();
        let ack = self.arm(self.imms.ack, dir.inference.len() as u64, "inference acks")?;
        // Per arena half: the transfers of the last wave staged in it.
        let mut inflight: [Option<Inflight>; 2] = [None, None];
        let r = self.waves(dir, v, &mut inflight, &mut st);
        // Failed or not, nothing may still be in flight when the step
        // returns (a retry rewrites the same memory).
        let drained = inflight
            .iter_mut()
            .map(|slot| self.drain(slot))
            .collect::<Vec<_>>();
        r?;
        for d in drained {
            d?;
        }
        match ack.wait_timeout(t) {
            Some(Ok(())) => Ok(st),
            Some(Err(e)) => Err(eng(ROLE, self.rank, "inference acks")(e)),
            None => Err(self.timeout("inference acks")),
        }
    }

    /// Every wave of every group this rank is in, overlapped: each wave
    /// stages in the arena half [`Plan::arena_half`] gives it and starts
    /// once the last wave that used that half completed (its writes out of
    /// the half, and the gathers it sourced).
    fn waves(
        &self,
        dir: &Directory,
        v: usize,
        inflight: &mut [Option<Inflight>; 2],
        st: &mut StepStats,
    ) -> Result<(), RlError> {
        for (gi, g) in self.plan.groups.iter().enumerate() {
            if g.ranks.binary_search(&self.rank).is_err() {
                continue;
            }
            let peers: Vec<Rank> = g
                .ranks
                .iter()
                .copied()
                .filter(|&r| r != self.rank)
                .collect();
            for (k, wave) in g.waves.iter().enumerate() {
                st.waves += 1;
                let phase = |what: &str| format!("group {} wave {k}: {what}", g.id);
                let half = self.plan.arena_half(gi, k);
                self.drain(&mut inflight[half])?;
                // Barrier: every arena half of the group is free for this
                // wave (a value per half: consecutive waves alternate, so a
                // peer already at the next wave is not counted here).
                let imm = self.imms.barrier[gi][half];
                let bar = self.arm(imm, peers.len() as u64, &phase("barrier"))?;
                let sent = Arc::new(DoneCounter::new());
                for &p in &peers {
                    let d = self.trainer(dir, p)?;
                    self.engine
                        .submit_single_write(
                            0,
                            Some(imm),
                            (&self.arena_mr, 0),
                            (&d.arena, 0),
                            OnDone::counter(&sent),
                        )
                        .map_err(eng(ROLE, self.rank, phase("barrier")))?;
                }
                let barrier = self.wait_flag(&bar, &phase("barrier"));
                let sent_ok = self.wait_counter(&sent, peers.len() as u64, &phase("barrier sends"));
                barrier?;
                sent_ok?;
                let done = Arc::new(DoneCounter::new());
                let mut posted = 0u64;
                let base = half as u64 * self.plan.arena_len;
                let r = self.wave(gi, k, wave, dir, v, base, &done, &mut posted, st);
                inflight[half] = Some(Inflight {
                    done,
                    posted,
                    phase: phase("writes"),
                });
                r?;
            }
        }
        Ok(())
    }

    /// Waits for the transfers of the wave in `slot`, if any.
    fn drain(&self, slot: &mut Option<Inflight>) -> Result<(), RlError> {
        match slot.take() {
            Some(w) => self.wait_counter(&w.done, w.posted, &w.phase),
            None => Ok(()),
        }
    }

    /// One wave after its barrier: gathers out, direct writes, then (once
    /// the gather round is complete) quantisation and staged writes, in
    /// the arena half at `base` (the writers' halves of this wave are at
    /// the same offset). Every transfer it posts is counted in `posted`
    /// and reports to `done`.
    #[allow(clippy::too_many_arguments)]
    fn wave(
        &self,
        gi: usize,
        k: usize,
        wave: &std::ops::Range<usize>,
        dir: &Directory,
        v: usize,
        base: u64,
        done: &Arc<DoneCounter>,
        posted: &mut u64,
        st: &mut StepStats,
    ) -> Result<(), RlError> {
        let g = &self.plan.groups[gi];
        let phase = |what: &str| format!("group {} wave {k}: {what}", g.id);
        let units = &self.plan.units[wave.clone()];
        // Gathers this rank sources.
        for p in &self.gather_out[gi][k] {
            let d = self.trainer(dir, p.writer())?;
            match p {
                GatherPost::One { xfer, .. } => {
                    self.post(
                        &shifted(xfer, 0, base),
                        &self.shards_mr,
                        &d.arena,
                        self.imms.gather[gi],
                        done,
                        &phase("gather"),
                    )?;
                    *posted += 1;
                    st.gathers += 1;
                }
                GatherPost::Batch {
                    page_len, src, dst, ..
                } => {
                    let dst: Vec<u64> = dst.iter().map(|o| o + base).collect();
                    for (sp, dp) in page_sets(src, &dst) {
                        self.engine
                            .submit_paged_writes(
                                *page_len,
                                Some(self.imms.gather[gi]),
                                (&self.shards_mr, &sp),
                                (&d.arena, &dp),
                                OnDone::counter(done),
                            )
                            .map_err(eng(ROLE, self.rank, phase("gather")))?;
                        *posted += 1;
                        st.gathers += 1;
                    }
                }
            }
            st.gather_bytes += p.bytes();
        }
        let gathered = self.arm(
            self.imms.gather[gi],
            self.gather_in[gi][k],
            &phase("gather round"),
        )?;
        // Direct units: straight from the shards.
        for u in units
            .iter()
            .filter(|u| u.writer == self.rank && u.arena.is_none())
        {
            for d in &u.dests {
                let w = &self.infer(dir, d.inf)?.weights[v];
                self.post(
                    &d.data,
                    &self.shards_mr,
                    w,
                    self.imms.weights[v],
                    done,
                    &phase("write"),
                )?;
                *posted += 1;
                st.writes += 1;
                st.bytes += d.data.dst.bytes();
            }
        }
        // Staged units: own parts, then (after the gathers) fuse,
        // quantise, write.
        let mine: Vec<&Unit> = units
            .iter()
            .filter(|u| u.writer == self.rank && u.arena.is_some())
            .collect();
        for u in &mine {
            for x in &u.local {
                self.copy_local(&shifted(x, 0, base))?;
            }
        }
        self.wait_flag(&gathered, &phase("gather round"))?;
        for u in &mine {
            if u.quant == Quant::Fp8Block {
                self.quantise(u, base)?;
                st.quantised += 1;
            }
            for d in &u.dests {
                let w = &self.infer(dir, d.inf)?.weights[v];
                for x in d.xfers() {
                    self.post(
                        &shifted(x, base, 0),
                        &self.arena_mr,
                        w,
                        self.imms.weights[v],
                        done,
                        &phase("write"),
                    )?;
                    *posted += 1;
                    st.writes += 1;
                    st.bytes += x.dst.bytes();
                }
            }
        }
        Ok(())
    }

    /// Clears partial immediate counts after a failed step (call on every
    /// rank once all returned from the step).
    pub fn recover(&self) -> Result<(), RlError> {
        self.held.reset_imms();
        Ok(())
    }

    fn trainer<'a>(&self, dir: &'a Directory, r: Rank) -> Result<&'a TrainerEndpoint, RlError> {
        dir.trainers.get(r as usize).ok_or(RlError::UnknownRank {
            role: ROLE,
            rank: r,
        })
    }

    fn infer<'a>(&self, dir: &'a Directory, r: u32) -> Result<&'a super::InferEndpoint, RlError> {
        dir.inference.get(r as usize).ok_or(RlError::UnknownRank {
            role: "inference",
            rank: r,
        })
    }

    fn arm(&self, imm: Imm, n: u64, phase: &str) -> Result<Arc<weft::DoneFlag>, RlError> {
        let (od, flag) = OnDone::flag();
        self.engine
            .expect_imm_count_with(imm, n, od)
            .map_err(eng(ROLE, self.rank, phase))?;
        Ok(flag)
    }

    fn timeout(&self, phase: &str) -> RlError {
        RlError::Timeout {
            role: ROLE,
            rank: self.rank,
            phase: phase.to_string(),
            waited_ms: self.cfg.timeout.as_millis() as u64,
        }
    }

    fn wait_flag(&self, f: &weft::DoneFlag, phase: &str) -> Result<(), RlError> {
        match f.wait_timeout(self.cfg.timeout) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(eng(ROLE, self.rank, phase)(e)),
            None => Err(self.timeout(phase)),
        }
    }

    fn wait_counter(&self, c: &DoneCounter, n: u64, phase: &str) -> Result<(), RlError> {
        if !c.wait_for_timeout(n, self.cfg.timeout) {
            return Err(self.timeout(phase));
        }
        match c.first_error() {
            Some(e) => Err(eng(ROLE, self.rank, phase)(e)),
            None => Ok(()),
        }
    }

    fn post(
        &self,
        x: &Xfer,
        src: &MrHandle,
        dst: &MrDesc,
        imm: Imm,
        done: &Arc<DoneCounter>,
        phase: &str,
    ) -> Result<(), RlError> {
        let r = if x.is_single() {
            self.engine.submit_single_write(
                x.dst.bytes(),
                Some(imm),
                (src, x.src.offset),
                (dst, x.dst.offset),
                OnDone::counter(done),
            )
        } else {
            self.engine.submit_paged_writes(
                x.dst.page_len,
                Some(imm),
                (src, &pages(&x.src)?),
                (dst, &pages(&x.dst)?),
                OnDone::counter(done),
            )
        };
        r.map(|_| ()).map_err(eng(ROLE, self.rank, phase))
    }

    /// Shards → arena, in this process.
    fn copy_local(&self, x: &Xfer) -> Result<(), RlError> {
        for k in 0..x.src.count {
            let s = (x.src.offset + k * x.src.stride) as usize;
            let d = (x.dst.offset + k * x.dst.stride) as usize;
            let bytes = self
                .shards
                .read(s, x.src.page_len as usize)
                .ok_or_else(|| {
                    RlError::Plan(format!("trainer {}: local copy outside shards", self.rank))
                })?;
            if !self.arena.write(d, &bytes) {
                return Err(RlError::Plan(format!(
                    "trainer {}: local copy outside arena",
                    self.rank
                )));
            }
        }
        Ok(())
    }

    /// bf16 box → fp8 + scales, inside the arena half at `base`.
    fn quantise(&self, u: &Unit, base: u64) -> Result<(), RlError> {
        let bad = || {
            RlError::Plan(format!(
                "trainer {}: quantisation outside the arena",
                self.rank
            ))
        };
        let (off, _) = u.arena.ok_or_else(bad)?;
        let off = off + base;
        let (h, w) = (u.src.height() as usize, u.src.width() as usize);
        let d0 = u.dests.first().ok_or_else(bad)?;
        let sc = d0.scales.as_ref().ok_or_else(bad)?;
        let src = self.arena.read(off as usize, h * w * 2).ok_or_else(bad)?;
        let mut q = vec![0u8; h * w];
        let mut s = vec![0u8; sc.src.bytes() as usize];
        let block = self.plan.unit_block(u) as usize;
        if !quantize_block(&src, h, w, block, &mut q, &mut s) {
            return Err(bad());
        }
        if !self.arena.write((base + d0.data.src.offset) as usize, &q)
            || !self.arena.write((base + sc.src.offset) as usize, &s)
        {
            return Err(bad());
        }
        Ok(())
    }
}

/// The transfers of one posted wave.
struct Inflight {
    done: Arc<DoneCounter>,
    posted: u64,
    phase: String,
}

/// `x` with its source moved by `src` and its destination by `dst` bytes.
fn shifted(x: &Xfer, src: u64, dst: u64) -> Xfer {
    let mut y = *x;
    y.src.offset += src;
    y.dst.offset += dst;
    y
}

/// Per (group, wave): the immediates `rank`'s gather round receives, and
/// the gathers it sources.
#[allow(clippy::type_complexity)]
fn gathers_of(
    plan: &Plan,
    rank: Rank,
    c: &ImmCounts,
) -> (Vec<Vec<u64>>, Vec<Vec<Vec<GatherPost>>>) {
    let mut counts = Vec::with_capacity(plan.groups.len());
    let mut out = Vec::with_capacity(plan.groups.len());
    for gi in 0..plan.groups.len() {
        let (mut gc, mut go) = (Vec::new(), Vec::new());
        for k in 0..plan.groups[gi].waves.len() {
            let posts = plan.gather_posts(gi, k);
            gc.push(
                posts
                    .iter()
                    .filter(|p| p.writer() == rank)
                    .map(|p| post_imm_count(c, p))
                    .sum(),
            );
            go.push(posts.into_iter().filter(|p| p.from() == rank).collect());
        }
        counts.push(gc);
        out.push(go);
    }
    (counts, out)
}

impl Drop for Trainer {
    /// Deregisters the memory before it is freed (a no-op error after the
    /// engine shut down) and frees the reserved immediates.
    fn drop(&mut self) {
        if let Err(e) = self.held.release() {
            tracing::debug!(rank = self.rank, "trainer: releasing: {e}");
        }
    }
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}
