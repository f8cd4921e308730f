//! [`GpuTrainer`]: the trainer side of a GPU update for one inference
//! rank, in whatever process runs it.
//!
//! The trainer holds every trainer region of the plan back to back in one
//! device buffer (the FSDP / TP shards as the training ranks hold them;
//! here all on one GPU), so the **unshard** stage reads real shards with
//! their real, possibly uneven, splits. A step:
//! 1. unshard every parameter the inference rank needs into a device
//!    buffer of full tensors;
//! 2. per inference tensor, **fuse** its segments (q/k/v, gate/up,
//!    stacked experts) — straight into a registered device *image* of the
//!    inference region for bf16 targets, into a bf16 staging buffer for fp8
//!    ones, which are then **quantised** into the image (fp8 bytes and
//!    scales at the plan's offsets);
//! 3. WRITE every tensor's bytes and scales from the image into the
//!    inference rank's registered region ([`super::GpuTarget`]: in this
//!    process or another), one-sided, with the immediate its engine counts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use weft::{DoneCounter, MrHandle, OnDone, Resources, TransferEngine};
use weft_cuda::{DeviceBuffer, Gpu, Stream};

use super::kernels::{DevMat, RlKernels};
use super::target::{ranges, GpuTarget};
use super::GpuError;
use crate::meta::{ModelLayout, Quant};
use crate::plan::Plan;

pub(super) const TRAINER: &str = "trainer";

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a.max(1)) * a.max(1)
}

/// The trainer side of a GPU update for one inference rank (see the module
/// docs).
pub struct GpuTrainer {
    // The registration goes before the memory it covers.
    held: Resources,
    engine: Arc<TransferEngine>,
    image_mr: MrHandle,
    rank: u32,
    timeout: Duration,
    ml: ModelLayout,
    plan: Arc<Plan>,
    kernels: RlKernels,
    stream: Stream,
    /// Trainer regions back to back; region `t` at `shard_base[t]`.
    shards: DeviceBuffer,
    shard_base: Vec<u64>,
    /// Unsharded parameters: param → byte offset in `full`.
    full: DeviceBuffer,
    full_off: BTreeMap<usize, u64>,
    /// bf16 staging of one fused fp8 tensor.
    fused: DeviceBuffer,
    /// The trainer's image of the inference region (registered).
    image: DeviceBuffer,
}

impl std::fmt::Debug for GpuTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTrainer")
            .field("inference_rank", &self.rank)
            .field("shards", &self.shards.len())
            .field("image", &self.image.len())
            .finish_non_exhaustive()
    }
}

impl GpuTrainer {
    /// Allocates the device buffers that update inference rank `rank` of
    /// `plan` (of `ml`) needs, compiles the kernels and registers the image
    /// with `engine` (whose domain group names `gpu`'s device, on a
    /// provider that registers GPU memory). `timeout` bounds the wait for
    /// the WRITEs of [`GpuTrainer::write`].
    pub fn new(
        gpu: &Gpu,
        ml: ModelLayout,
        plan: Arc<Plan>,
        rank: u32,
        engine: Arc<TransferEngine>,
        timeout: Duration,
    ) -> Result<GpuTrainer, GpuError> {
        let inf = rank as usize;
        let (region, tensors) = match (plan.inference.get(inf), ml.inference.get(inf)) {
            (Some(r), Some(t)) if r.tensors.len() == t.len() => (r, t),
            _ => {
                return Err(GpuError::Invalid(format!(
                    "inference rank {inf} not in the plan or the layout"
                )))
            }
        };
        let a = plan.config.align.max(16);
        let mut shard_base = Vec::with_capacity(plan.trainers.len());
        let mut at = 0;
        for t in &plan.trainers {
            shard_base.push(at);
            at = align(at + t.len, a);
        }
        let shards_len = at;
        let mut full_off = BTreeMap::new();
        let mut at = 0;
        let mut fused_len = 0;
        for t in tensors {
            for s in &t.segments {
                let p = ml.params.get(s.param).ok_or_else(|| {
                    GpuError::Invalid(format!("{}: no parameter {}", t.name, s.param))
                })?;
                if p.dtype != crate::DType::Bf16 {
                    return Err(GpuError::Invalid(format!(
                        "{}: {:?} source (the GPU stages take bf16)",
                        p.name, p.dtype
                    )));
                }
                full_off.entry(s.param).or_insert_with(|| {
                    let o = at;
                    at = align(at + 2 * p.rows * p.cols, a);
                    o
                });
            }
            if t.quant == Quant::Fp8Block {
                fused_len = fused_len.max(2 * t.rows() * t.cols());
            }
        }
        let alloc = |len: u64, what: &str| {
            gpu.alloc(len.max(16) as usize)
                .map_err(GpuError::cuda(format!("allocating {what} ({len} bytes)")))
        };
        let shards = alloc(shards_len, "trainer shards")?;
        let full = alloc(at, "unsharded parameters")?;
        let fused = alloc(fused_len, "fused staging")?;
        let image = alloc(region.len, "trainer image of the inference region")?;
        let kernels = RlKernels::compile(gpu)?;
        let stream = gpu.stream().map_err(GpuError::cuda("creating a stream"))?;

        let mut held = Resources::new();
        // SAFETY: `image` is a field of the returned value, declared after
        // `held`, and its Drop releases the registration before the buffer
        // is freed; on the error path `held` (declared later) is dropped
        // first.
        let image_region = unsafe { image.region() };
        let (image_mr, _) = held
            .register(&engine, image_region)
            .map_err(GpuError::engine(TRAINER, "registering the image"))?;
        Ok(GpuTrainer {
            held,
            engine,
            image_mr,
            rank,
            timeout,
            ml,
            plan,
            kernels,
            stream,
            shards,
            shard_base,
            full,
            full_off,
            fused,
            image,
        })
    }

    /// The inference rank this trainer updates.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The kernels (compiled for this GPU).
    pub fn kernels(&self) -> &RlKernels {
        &self.kernels
    }

    /// Puts trainer `t`'s shard bytes (its plan region: every piece
    /// row-major bf16 at the offsets of `plan.trainers[t].pieces`) into
    /// device memory: the framework's host → device copy.
    pub fn load_trainer(&self, t: usize, region: &[u8]) -> Result<(), GpuError> {
        match (self.plan.trainers.get(t), self.shard_base.get(t)) {
            (Some(r), Some(&base)) if r.len == region.len() as u64 => self
                .shards
                .write(base as usize, region)
                .map_err(GpuError::cuda(format!("loading trainer {t}'s shards"))),
            _ => Err(GpuError::Invalid(format!(
                "trainer {t}: {} bytes for its region",
                region.len()
            ))),
        }
    }

    /// Enqueues unshard → fuse → quantise for every tensor of the inference
    /// rank and waits for the stream.
    pub fn run_stages(&self) -> Result<(), GpuError> {
        let s = &self.stream;
        let k = &self.kernels;
        for (&p, &off) in &self.full_off {
            let param = &self.ml.params[p];
            let dst = DevMat::dense(&self.full, off as usize, param.rows, param.cols);
            let pieces = self.ml.pieces(p);
            // The unshard kernel concatenates along one dimension: pieces
            // all of full width (rows split) or all of full height.
            let dim = if pieces.iter().all(|(_, b)| b.width() == param.cols) {
                0
            } else if pieces.iter().all(|(_, b)| b.height() == param.rows) {
                1
            } else {
                return Err(GpuError::Invalid(format!(
                    "{}: a 2-D grid of shards (unshard on the GPU takes one split dimension)",
                    param.name
                )));
            };
            let mut shards = Vec::new();
            for (holders, b) in pieces {
                let &t = holders.first().ok_or_else(|| {
                    GpuError::Invalid(format!("{}: a piece without holder", param.name))
                })?;
                let base = self.shard_base.get(t as usize).copied();
                let piece = self
                    .plan
                    .trainers
                    .get(t as usize)
                    .and_then(|r| r.piece(p, &b));
                let (Some(base), Some((_, pb, po))) = (base, piece) else {
                    return Err(GpuError::Invalid(format!(
                        "{}: trainer {t} does not hold {b:?}",
                        param.name
                    )));
                };
                let whole =
                    DevMat::dense(&self.shards, (base + po) as usize, pb.height(), pb.width());
                shards.push(whole.sub(
                    b.rows.start - pb.rows.start,
                    b.cols.start - pb.cols.start,
                    b.height(),
                    b.width(),
                )?);
            }
            k.unshard(s, dim, &shards, &dst)?;
        }
        let inf = self.rank as usize;
        for (t, slot) in self.ml.inference[inf]
            .iter()
            .zip(&self.plan.inference[inf].tensors)
        {
            let mut segs = Vec::with_capacity(t.segments.len());
            for seg in &t.segments {
                let param = &self.ml.params[seg.param];
                let off = self.full_off[&seg.param] as usize;
                let full = DevMat::dense(&self.full, off, param.rows, param.cols);
                segs.push(full.sub(
                    seg.src.rows.start,
                    seg.src.cols.start,
                    seg.src.height(),
                    seg.src.width(),
                )?);
            }
            let (rows, cols) = (t.rows(), t.cols());
            let segs: Vec<_> = segs.into_iter().zip(t.offsets()).collect();
            match (t.quant, slot.scales) {
                (Quant::Fp8Block, Some((so, _))) => {
                    let fused = DevMat::dense(&self.fused, 0, rows, cols);
                    k.fuse_at(s, &segs, &fused)?;
                    k.quantize(
                        s,
                        &fused,
                        slot.block,
                        (&self.image, slot.data.0 as usize),
                        (&self.image, so as usize),
                    )?;
                }
                (Quant::None, _) => {
                    let dst = DevMat::dense(&self.image, slot.data.0 as usize, rows, cols);
                    k.fuse_at(s, &segs, &dst)?;
                }
                _ => {
                    return Err(GpuError::Invalid(format!(
                        "{}: unsupported storage or missing scales",
                        t.name
                    )))
                }
            }
        }
        s.synchronize()
            .map_err(GpuError::cuda("waiting for the update kernels"))
    }

    /// WRITEs every tensor's bytes (and scales) from the image into
    /// `target`'s buffer of version `version`: one WRITE per run of
    /// tensors, the alignment padding between them included, each with
    /// that buffer's immediate. `target` is checked against the plan (it
    /// must be this trainer's inference rank). Returns the WRITEs posted
    /// and the bytes once every WRITE completed here (its bytes are in the
    /// target's memory).
    /// The target's engine counts the immediates: its
    /// [`super::GpuInference::wait`] says when all landed.
    pub fn write(&self, target: &GpuTarget, version: u64) -> Result<(u64, u64), GpuError> {
        self.check(target)?;
        let (dst, imm) = target.buffer(version);
        let ranges = ranges(&self.plan, self.rank as usize);
        let done = Arc::new(DoneCounter::new());
        let mut bytes = 0;
        for &(off, len) in &ranges {
            self.engine
                .submit_single_write(
                    len,
                    Some(imm),
                    (&self.image_mr, off),
                    (dst, off),
                    OnDone::counter(&done),
                )
                .map_err(GpuError::engine(
                    TRAINER,
                    format!("version {version}: WRITE of {len} bytes at {off}"),
                ))?;
            bytes += len;
        }
        self.wait_writes(&done, ranges.len() as u64)?;
        Ok((ranges.len() as u64, bytes))
    }

    /// The bound [`GpuTrainer::write`] is measured against: the whole
    /// image in one WRITE without an immediate to `target`'s buffer of
    /// version `version`, the same bytes over the same engines and path.
    /// Returns the bytes once the WRITE completed here. It overwrites that
    /// buffer with the image (the same bytes a [`GpuTrainer::write`] of
    /// the same version puts there).
    pub fn write_whole(&self, target: &GpuTarget, version: u64) -> Result<u64, GpuError> {
        self.check(target)?;
        let (dst, _) = target.buffer(version);
        let len = self.plan.inference[self.rank as usize].len;
        let done = Arc::new(DoneCounter::new());
        self.engine
            .submit_single_write(
                len,
                None,
                (&self.image_mr, 0),
                (dst, 0),
                OnDone::counter(&done),
            )
            .map_err(GpuError::engine(TRAINER, format!("WRITE of {len} bytes")))?;
        self.wait_writes(&done, 1)?;
        Ok(len)
    }

    /// `target` must be this trainer's inference rank, as the plan has it.
    fn check(&self, target: &GpuTarget) -> Result<(), GpuError> {
        target.check(&self.plan)?;
        if target.rank != self.rank {
            return Err(GpuError::Invalid(format!(
                "a target of inference rank {} for a trainer of rank {}",
                target.rank, self.rank
            )));
        }
        Ok(())
    }

    fn wait_writes(&self, done: &DoneCounter, n: u64) -> Result<(), GpuError> {
        if !done.wait_for_timeout(n, self.timeout) {
            return Err(GpuError::Timeout {
                role: TRAINER,
                what: "WRITE completions".into(),
                waited_ms: self.timeout.as_millis() as u64,
            });
        }
        match done.first_error() {
            Some(e) => Err(GpuError::engine(TRAINER, "WRITE")(e)),
            None => Ok(()),
        }
    }

    /// The trainer's staging image of the inference region (what the
    /// stages produced, before the WRITEs).
    pub fn read_image(&self) -> Result<Vec<u8>, GpuError> {
        self.image
            .to_vec()
            .map_err(GpuError::cuda("reading the trainer image"))
    }
}

impl Drop for GpuTrainer {
    fn drop(&mut self) {
        if let Err(e) = self.held.release() {
            tracing::debug!(
                "GPU trainer for inference rank {}: releasing: {e}",
                self.rank
            );
        }
    }
}
