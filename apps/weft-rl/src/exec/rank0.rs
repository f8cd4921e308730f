//! The Rank0 baseline (what verl / slime / NeMo-RL style frameworks do),
//! in the same code and over the same engine and plan, for side-by-side
//! runs:
//!
//! 1. every trainer writes its shards into trainer 0's full-model buffer
//!    (gather; replicated pieces are sent by their first holder only);
//! 2. trainer 0 builds every inference rank's weight image from the full
//!    model — the same plan units, the same fusion and fp8 quantisation —
//!    and writes all of them over **one link** into inference rank 0;
//! 3. inference rank 0 scatters each image into its rank's weight buffer
//!    (double-buffered like the P2P path) and every inference rank acks.

use std::sync::Arc;

use weft::{
    DoneCounter, DoneFlag, HostBuffer, Imm, MrDesc, MrHandle, OnDone, Resources, TransferEngine,
};

use super::{eng, imm_count, pages, ImmPlan, StepConfig};
use crate::fp8::quantize_block;
use crate::meta::{ModelLayout, Quant, Rank};
use crate::plan::{box_run, Plan, Run, Xfer};
use crate::RlError;

const T: &str = "trainer";
const I: &str = "inference";

/// What the Rank0 ranks need of each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rank0Directory {
    /// Trainer 0's full-model buffer.
    pub full: MrDesc,
    /// Every trainer's ack target.
    pub trainer_acks: Vec<MrDesc>,
    /// Inference rank 0's staging buffer (all images).
    pub staging: MrDesc,
    /// Every inference rank's two weight buffers.
    pub weights: Vec<[MrDesc; 2]>,
}

/// The Rank0 baseline's immediates: below the P2P path's, so both run on
/// the same engines.
fn rank0_imms(plan: &Plan, e: &TransferEngine) -> Result<ImmPlan, RlError> {
    let skip =
        u32::try_from(ImmPlan::len(plan)).map_err(|_| RlError::Plan("too many groups".into()))?;
    ImmPlan::below(plan, e.imm_capacity(), skip)
}

/// Byte offset of each parameter in the full-model buffer, and its length.
fn full_layout(m: &ModelLayout) -> (Vec<u64>, u64) {
    let mut at = 0;
    let offs = m
        .params
        .iter()
        .map(|p| {
            let o = at;
            at += p.rows * p.cols * p.dtype.size();
            o
        })
        .collect();
    (offs, at.max(1))
}

/// Byte offset of each inference image in the staging buffer.
fn image_layout(plan: &Plan) -> (Vec<u64>, u64) {
    let mut at = 0;
    let offs = plan
        .inference
        .iter()
        .map(|r| {
            let o = at;
            at += r.len;
            o
        })
        .collect();
    (offs, at.max(1))
}

fn wait(
    f: &DoneFlag,
    cfg: &StepConfig,
    role: &'static str,
    rank: u32,
    phase: &str,
) -> Result<(), RlError> {
    match f.wait_timeout(cfg.timeout) {
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => Err(eng(role, rank, phase)(e)),
        None => Err(RlError::Timeout {
            role,
            rank,
            phase: phase.into(),
            waited_ms: cfg.timeout.as_millis() as u64,
        }),
    }
}

fn wait_n(
    c: &DoneCounter,
    n: u64,
    cfg: &StepConfig,
    role: &'static str,
    rank: u32,
    phase: &str,
) -> Result<(), RlError> {
    if !c.wait_for_timeout(n, cfg.timeout) {
        return Err(RlError::Timeout {
            role,
            rank,
            phase: phase.into(),
            waited_ms: cfg.timeout.as_millis() as u64,
        });
    }
    c.first_error()
        .map_or(Ok(()), |e| Err(eng(role, rank, phase)(e)))
}

#[allow(clippy::too_many_arguments)]
fn post(
    e: &TransferEngine,
    x: &Xfer,
    src: &MrHandle,
    dst: &MrDesc,
    imm: Imm,
    done: &Arc<DoneCounter>,
    role: &'static str,
    rank: u32,
    phase: &str,
) -> Result<(), RlError> {
    let r = if x.is_single() {
        e.submit_single_write(
            x.dst.bytes(),
            Some(imm),
            (src, x.src.offset),
            (dst, x.dst.offset),
            OnDone::counter(done),
        )
    } else {
        e.submit_paged_writes(
            x.dst.page_len,
            Some(imm),
            (src, &pages(&x.src)?),
            (dst, &pages(&x.dst)?),
            OnDone::counter(done),
        )
    };
    r.map(|_| ()).map_err(eng(role, rank, phase))
}

/// The pieces trainer `r` sends to trainer 0: `(shards → full)` transfers.
fn gathers_of(m: &ModelLayout, plan: &Plan, full: &[u64], r: Rank) -> Vec<Xfer> {
    plan.trainers[r as usize]
        .pieces
        .iter()
        // One sender per box: its first holder (replicas stay silent).
        .filter(|(p, b, _)| {
            m.pieces(*p)
                .iter()
                .any(|(holders, x)| x == b && holders.first() == Some(&r))
        })
        .map(|(p, b, off)| {
            let q = &m.params[*p];
            let e = q.dtype.size();
            let src = Run::contiguous(*off, b.elems() * e);
            let dst = box_run(full[*p], q.cols, e, 0, 0, b);
            let src = if dst.is_contiguous() {
                src
            } else {
                Run {
                    offset: *off,
                    page_len: dst.page_len,
                    stride: dst.page_len,
                    count: dst.count,
                }
            };
            Xfer { src, dst }
        })
        .collect()
}

/// A trainer of the Rank0 baseline.
pub struct Rank0Trainer {
    engine: Arc<TransferEngine>,
    rank: Rank,
    model: Arc<ModelLayout>,
    plan: Arc<Plan>,
    cfg: StepConfig,
    imms: ImmPlan,
    /// Every registration below and the reserved immediates.
    held: Resources,
    shards: HostBuffer,
    shards_mr: MrHandle,
    /// Rank 0: the full model and the images.
    full: Option<(HostBuffer, MrHandle, MrDesc, HostBuffer, MrHandle)>,
    ack: (HostBuffer, MrHandle, MrDesc),
    full_offs: Vec<u64>,
    gathers: Vec<Xfer>,
}

impl Rank0Trainer {
    /// Registers this rank's shards (same layout as the P2P trainer's),
    /// and on rank 0 the full model and the image buffer.
    pub fn new(
        engine: Arc<TransferEngine>,
        rank: Rank,
        model: Arc<ModelLayout>,
        plan: Arc<Plan>,
        cfg: StepConfig,
    ) -> Result<Rank0Trainer, RlError> {
        let region = plan
            .trainers
            .get(rank as usize)
            .ok_or(RlError::UnknownRank { role: T, rank })?;
        let buf = |n: u64| {
            HostBuffer::new(n.max(1) as usize)
                .map_err(|e| RlError::Buffer(format!("rank0 trainer {rank}: {e}")))
        };
        let (full_offs, full_len) = full_layout(&model);
        // Every buffer first, then `held`: on an early return the
        // registrations go before the memory.
        let shards = buf(region.len)?;
        let full_bufs = if rank == 0 {
            Some((buf(full_len)?, buf(image_layout(&plan).1)?))
        } else {
            None
        };
        let a = buf(1)?;
        let mut held = Resources::new();
        let (shards_mr, _) =
            held.register(&engine, shards.region())
                .map_err(eng(T, rank, "registering shards"))?;
        let full = match full_bufs {
            Some((f, img)) => {
                let (fm, fd) = held.register(&engine, f.region()).map_err(eng(
                    T,
                    rank,
                    "registering full model",
                ))?;
                let (im, _) = held.register(&engine, img.region()).map_err(eng(
                    T,
                    rank,
                    "registering images",
                ))?;
                Some((f, fm, fd, img, im))
            }
            None => None,
        };
        let (am, ad) =
            held.register(&engine, a.region())
                .map_err(eng(T, rank, "registering ack word"))?;
        let imms = rank0_imms(&plan, &engine)?;
        imms.reserve(&engine, &mut held, T, rank)?;
        let gathers = gathers_of(&model, &plan, &full_offs, rank);
        Ok(Rank0Trainer {
            engine,
            rank,
            model,
            plan,
            cfg,
            imms,
            held,
            shards,
            shards_mr,
            full,
            ack: (a, am, ad),
            full_offs,
            gathers,
        })
    }

    /// The shard memory (same layout as [`super::Trainer::shards`]).
    pub fn shards(&self) -> &HostBuffer {
        &self.shards
    }

    /// Trainer 0's full-model buffer (rank 0 only).
    pub fn full_desc(&self) -> Option<MrDesc> {
        self.full.as_ref().map(|f| f.2.clone())
    }

    /// Where inference ranks ack.
    pub fn ack_desc(&self) -> MrDesc {
        self.ack.2.clone()
    }

    /// One Rank0 update of version `version`.
    pub fn step(&self, version: u64, dir: &Rank0Directory) -> Result<(), RlError> {
        let r = self.rank;
        let c = &self.cfg;
        let acked = {
            let (od, f) = OnDone::flag();
            self.engine
                .expect_imm_count_with(self.imms.ack, dir.weights.len() as u64, od)
                .map_err(eng(T, r, "arming acks"))?;
            f
        };
        let done = Arc::new(DoneCounter::new());
        match &self.full {
            None => {
                for x in &self.gathers {
                    post(
                        &self.engine,
                        x,
                        &self.shards_mr,
                        &dir.full,
                        self.imms.gather[0],
                        &done,
                        T,
                        r,
                        "gather to rank 0",
                    )?;
                }
                wait_n(
                    &done,
                    self.gathers.len() as u64,
                    c,
                    T,
                    r,
                    "gather to rank 0",
                )?;
            }
            Some((full, _, _, img, img_mr)) => {
                let counts = self.engine.imm_counts(0).map_err(eng(T, r, "imm counts"))?;
                let expect: u64 = (1..self.plan.trainers.len() as u32)
                    .flat_map(|s| gathers_of(&self.model, &self.plan, &self.full_offs, s))
                    .map(|x| imm_count(&counts, &x))
                    .sum();
                let (od, f) = OnDone::flag();
                self.engine
                    .expect_imm_count_with(self.imms.gather[0], expect, od)
                    .map_err(eng(T, r, "arming gather"))?;
                for x in &self.gathers {
                    copy(&self.shards, full, x)
                        .ok_or_else(|| RlError::Plan("rank 0 local gather out of bounds".into()))?;
                }
                wait(&f, c, T, r, "gather to rank 0")?;
                self.build_images(full, img)?;
                let (offs, _) = image_layout(&self.plan);
                for (i, reg) in self.plan.inference.iter().enumerate() {
                    let x = Xfer {
                        src: Run::contiguous(offs[i], reg.len),
                        dst: Run::contiguous(offs[i], reg.len),
                    };
                    post(
                        &self.engine,
                        &x,
                        img_mr,
                        &dir.staging,
                        self.imms.barrier[0][0],
                        &done,
                        T,
                        r,
                        "link to inference 0",
                    )?;
                }
                wait_n(
                    &done,
                    self.plan.inference.len() as u64,
                    c,
                    T,
                    r,
                    "link to inference 0",
                )?;
            }
        }
        let _ = version;
        wait(&acked, c, T, r, "inference acks")
    }

    /// Clears partial counts after a failed step.
    pub fn recover(&self) -> Result<(), RlError> {
        self.held.reset_imms();
        Ok(())
    }

    /// Fusion + quantisation of every unit from the full model into the
    /// images (same plan, same kernels as the P2P path).
    fn build_images(&self, full: &HostBuffer, img: &HostBuffer) -> Result<(), RlError> {
        let bad = || RlError::Plan("rank 0 image build out of bounds".into());
        let (offs, _) = image_layout(&self.plan);
        for u in &self.plan.units {
            let q = &self.model.params[u.param];
            let e = q.dtype.size();
            let (h, w) = (u.src.height() as usize, u.src.width() as usize);
            let mut boxb = Vec::with_capacity(h * w * e as usize);
            for row in u.src.rows.clone() {
                let o = self.full_offs[u.param] + (row * q.cols + u.src.cols.start) * e;
                boxb.extend(full.read(o as usize, w * e as usize).ok_or_else(bad)?);
            }
            let (data, scales) = if u.quant == Quant::Fp8Block {
                let sl = u
                    .dests
                    .first()
                    .and_then(|d| d.scales)
                    .map_or(0, |s| s.dst.bytes());
                let mut qd = vec![0u8; h * w];
                let mut sd = vec![0u8; sl as usize];
                if !quantize_block(
                    &boxb,
                    h,
                    w,
                    self.plan.unit_block(u) as usize,
                    &mut qd,
                    &mut sd,
                ) {
                    return Err(bad());
                }
                (qd, Some(sd))
            } else {
                (boxb, None)
            };
            for d in &u.dests {
                place(img, offs[d.inf as usize], &d.data.dst, &data).ok_or_else(bad)?;
                if let (Some(s), Some(sd)) = (&d.scales, &scales) {
                    place(img, offs[d.inf as usize], &s.dst, sd).ok_or_else(bad)?;
                }
            }
        }
        Ok(())
    }
}

/// Writes `bytes` (in page order) into `buf` at `base + run`.
fn place(buf: &HostBuffer, base: u64, run: &Run, bytes: &[u8]) -> Option<()> {
    let pl = run.page_len as usize;
    for k in 0..run.count as usize {
        let o = base + run.offset + k as u64 * run.stride;
        let chunk = bytes.get(k * pl..(k + 1) * pl)?;
        buf.write(o as usize, chunk).then_some(())?;
    }
    Some(())
}

/// `x` from `src` into `dst`, in this process.
fn copy(src: &HostBuffer, dst: &HostBuffer, x: &Xfer) -> Option<()> {
    for k in 0..x.src.count {
        let b = src.read(
            (x.src.offset + k * x.src.stride) as usize,
            x.src.page_len as usize,
        )?;
        dst.write((x.dst.offset + k * x.dst.stride) as usize, &b)
            .then_some(())?;
    }
    Some(())
}

/// An inference rank of the Rank0 baseline.
pub struct Rank0Inference {
    engine: Arc<TransferEngine>,
    rank: u32,
    plan: Arc<Plan>,
    cfg: StepConfig,
    imms: ImmPlan,
    /// Every registration below and the reserved immediates.
    held: Resources,
    bufs: [HostBuffer; 2],
    mrs: [MrHandle; 2],
    descs: [MrDesc; 2],
    staging: Option<(HostBuffer, MrHandle, MrDesc)>,
}

impl Rank0Inference {
    /// Registers two weight buffers (and on rank 0 the staging buffer).
    pub fn new(
        engine: Arc<TransferEngine>,
        rank: u32,
        plan: Arc<Plan>,
        cfg: StepConfig,
    ) -> Result<Rank0Inference, RlError> {
        let len = plan
            .inference
            .get(rank as usize)
            .ok_or(RlError::UnknownRank { role: I, rank })?
            .len;
        let buf = |n: u64| {
            HostBuffer::new(n.max(1) as usize)
                .map_err(|e| RlError::Buffer(format!("rank0 inference {rank}: {e}")))
        };
        let bufs = [buf(len)?, buf(len)?];
        let staging_buf = if rank == 0 {
            Some(buf(image_layout(&plan).1)?)
        } else {
            None
        };
        let mut held = Resources::new();
        let (m0, d0) = held.register(&engine, bufs[0].region()).map_err(eng(
            I,
            rank,
            "registering buffer 0",
        ))?;
        let (m1, d1) = held.register(&engine, bufs[1].region()).map_err(eng(
            I,
            rank,
            "registering buffer 1",
        ))?;
        let staging = match staging_buf {
            Some(s) => {
                let (sm, sd) = held.register(&engine, s.region()).map_err(eng(
                    I,
                    rank,
                    "registering staging",
                ))?;
                Some((s, sm, sd))
            }
            None => None,
        };
        let imms = rank0_imms(&plan, &engine)?;
        imms.reserve(&engine, &mut held, I, rank)?;
        Ok(Rank0Inference {
            engine,
            rank,
            plan,
            cfg,
            imms,
            held,
            bufs,
            mrs: [m0, m1],
            descs: [d0, d1],
            staging,
        })
    }

    /// The two weight buffers.
    pub fn weights_desc(&self) -> [MrDesc; 2] {
        self.descs.clone()
    }

    /// Rank 0's staging buffer.
    pub fn staging_desc(&self) -> Option<MrDesc> {
        self.staging.as_ref().map(|s| s.2.clone())
    }

    /// Buffer `i` (version `v` lives in buffer `v % 2`).
    pub fn buffer(&self, i: usize) -> Option<&HostBuffer> {
        self.bufs.get(i)
    }

    /// One Rank0 update of version `version`, inference side.
    pub fn step(&self, version: u64, dir: &Rank0Directory) -> Result<(), RlError> {
        let v = (version % 2) as usize;
        let (r, c) = (self.rank, &self.cfg);
        let counts = self.engine.imm_counts(0).map_err(eng(I, r, "imm counts"))?;
        let my_len = self.plan.inference[r as usize].len;
        if let Some((stg, smr, _)) = &self.staging {
            let expect: u64 = self
                .plan
                .inference
                .iter()
                .map(|reg| counts.single_write(reg.len))
                .sum();
            let (od, f) = OnDone::flag();
            self.engine
                .expect_imm_count_with(self.imms.barrier[0][0], expect, od)
                .map_err(eng(I, r, "arming link"))?;
            wait(&f, c, I, r, "link from trainer 0")?;
            let (offs, _) = image_layout(&self.plan);
            copy(
                stg,
                &self.bufs[v],
                &Xfer {
                    src: Run::contiguous(offs[0], my_len),
                    dst: Run::contiguous(0, my_len),
                },
            )
            .ok_or_else(|| RlError::Plan("rank0 scatter out of bounds".into()))?;
            let done = Arc::new(DoneCounter::new());
            for (i, reg) in self.plan.inference.iter().enumerate().skip(1) {
                let x = Xfer {
                    src: Run::contiguous(offs[i], reg.len),
                    dst: Run::contiguous(0, reg.len),
                };
                post(
                    &self.engine,
                    &x,
                    smr,
                    &dir.weights[i][v],
                    self.imms.weights[v],
                    &done,
                    I,
                    r,
                    "scatter",
                )?;
            }
            wait_n(
                &done,
                self.plan.inference.len() as u64 - 1,
                c,
                I,
                r,
                "scatter",
            )?;
        } else {
            let (od, f) = OnDone::flag();
            self.engine
                .expect_imm_count_with(self.imms.weights[v], counts.single_write(my_len), od)
                .map_err(eng(I, r, "arming scatter"))?;
            wait(&f, c, I, r, "scatter from inference 0")?;
        }
        let done = Arc::new(DoneCounter::new());
        for t in &dir.trainer_acks {
            self.engine
                .submit_single_write(
                    0,
                    Some(self.imms.ack),
                    (&self.mrs[0], 0),
                    (t, 0),
                    OnDone::counter(&done),
                )
                .map_err(eng(I, r, "ack"))?;
        }
        let _ = done.wait_for_timeout(dir.trainer_acks.len() as u64, c.timeout);
        Ok(())
    }

    /// Clears partial counts after a failed step.
    pub fn recover(&self) -> Result<(), RlError> {
        self.held.reset_imms();
        Ok(())
    }
}

impl Drop for Rank0Trainer {
    /// Deregisters before the buffers are freed.
    fn drop(&mut self) {
        if let Err(e) = self.held.release() {
            tracing::debug!(rank = self.rank, "rank0 trainer: releasing: {e}");
        }
    }
}

impl Drop for Rank0Inference {
    /// Deregisters before the buffers are freed.
    fn drop(&mut self) {
        if let Err(e) = self.held.release() {
            tracing::debug!(rank = self.rank, "rank0 inference: releasing: {e}");
        }
    }
}

impl std::fmt::Debug for Rank0Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rank0Trainer")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Rank0Inference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rank0Inference")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}
