//! [`GpuUpdate`]: one trainer and one inference rank on one GPU.
//!
//! The trainer holds every trainer region of the plan back to back in one
//! device buffer (the FSDP / TP shards as the training ranks hold them;
//! here all on the one GPU), so the **unshard** stage reads real shards
//! with their real, possibly uneven, splits. A step:
//! 1. unshard every parameter the inference rank needs into a device
//!    buffer of full tensors;
//! 2. per inference tensor, **fuse** its segments (q/k/v, gate/up,
//!    stacked experts) — straight into a registered device *image* of the
//!    inference region for bf16 targets, into a bf16 staging buffer for fp8
//!    ones, which are then **quantised** into the image (fp8 bytes and
//!    scales at the plan's offsets);
//! 3. WRITE every tensor's bytes and scales from the image into the
//!    inference rank's registered device region (one-sided, with an
//!    immediate the inference engine counts), over the provider the
//!    configuration gives each side ([`GpuUpdateConfig::hosts`]; by default
//!    the same-host backend `nvlink`, whose copies run on the GPU's copy
//!    engines).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::{
    DomainGroupSpec, DoneCounter, EngineConfig, MrDesc, MrHandle, OnDone, Resources, TransferEngine,
};
use weft_cuda::{DeviceBuffer, Gpu, Stream};

use super::kernels::{DevMat, RlKernels};
use super::GpuError;
use crate::meta::{ModelLayout, Quant};
use crate::plan::Plan;

/// The provider a side's engine opens its NICs on, by role (`"trainer"`,
/// `"inference"`).
pub type RoleHosts =
    Arc<dyn Fn(&str) -> Result<Arc<dyn weft::Provider>, weft::TransportError> + Send + Sync>;

/// Options of a [`GpuUpdate`].
#[derive(Clone)]
pub struct GpuUpdateConfig {
    /// The inference rank of the plan this GPU plays.
    pub inference_rank: u32,
    /// Each side's provider; `None`: the same-host backend (`nvlink`)
    /// with the GPU's peer memory.
    pub hosts: Option<RoleHosts>,
    /// NICs per engine.
    pub nics: usize,
    /// Engine options.
    pub engine: EngineConfig,
    /// Deadline of each wait of a step.
    pub timeout: Duration,
}

impl Default for GpuUpdateConfig {
    fn default() -> Self {
        GpuUpdateConfig {
            inference_rank: 0,
            hosts: None,
            nics: 2,
            engine: {
                let mut c = EngineConfig::default();
                c.idle_sleep = Some(Duration::from_micros(200));
                c
            },
            timeout: Duration::from_secs(30),
        }
    }
}

impl std::fmt::Debug for GpuUpdateConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuUpdateConfig")
            .field("inference_rank", &self.inference_rank)
            .field("nics", &self.nics)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Wall-clock times of one [`GpuUpdate::step`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuStepTimes {
    /// Unshard + fuse + quantise, enqueue to stream completion.
    pub stages: Duration,
    /// First WRITE posted to the inference rank's round complete.
    pub writes: Duration,
    /// WRITEs posted.
    pub write_count: u64,
    /// Bytes written into the inference region.
    pub bytes: u64,
}

const TRAINER: &str = "trainer";
const INFERENCE: &str = "inference";

/// One trainer and one inference rank on one GPU (see the module docs).
pub struct GpuUpdate {
    // Engines first: they are shut down (in `Drop`) before the buffers
    // they have registered are freed.
    trainer: Arc<TransferEngine>,
    inference: Arc<TransferEngine>,
    /// The registrations of `image` (trainer) and `target` (inference),
    /// and the inference side's immediate.
    held: Resources,
    image_mr: MrHandle,
    target_desc: MrDesc,
    imm: u32,
    cfg: GpuUpdateConfig,
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
    /// The inference rank's weight region (registered).
    target: DeviceBuffer,
}

impl std::fmt::Debug for GpuUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuUpdate")
            .field("inference_rank", &self.cfg.inference_rank)
            .field("shards", &self.shards.len())
            .field("image", &self.image.len())
            .finish_non_exhaustive()
    }
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a.max(1)) * a.max(1)
}

impl GpuUpdate {
    /// Allocates the device buffers for `plan` (of `ml`), compiles the
    /// kernels, builds the two engines and registers the image (trainer)
    /// and the weight region (inference).
    pub fn new(
        gpu: &Gpu,
        ml: ModelLayout,
        plan: Arc<Plan>,
        cfg: GpuUpdateConfig,
    ) -> Result<GpuUpdate, GpuError> {
        let inf = cfg.inference_rank as usize;
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
        let target = alloc(region.len, "inference weights")?;
        let kernels = RlKernels::compile(gpu)?;
        let stream = gpu.stream().map_err(GpuError::cuda("creating a stream"))?;

        let nics = cfg.nics.max(1);
        let hosts = match &cfg.hosts {
            Some(h) => h.clone(),
            None => nvlink_hosts(gpu, nics)?,
        };
        let engine = |role: &'static str| -> Result<Arc<TransferEngine>, GpuError> {
            let provider = hosts(role).map_err(|e| {
                GpuError::engine(role, "opening its provider")(weft::EngineError::Setup {
                    group: 0,
                    what: "the provider".into(),
                    source: Some(Box::new(e)),
                })
            })?;
            TransferEngine::builder()
                .group(
                    DomainGroupSpec::new(provider, (0..nics).collect::<Vec<_>>())
                        .device(gpu.device()),
                )
                .config(cfg.engine.clone())
                .build()
                .map(Arc::new)
                .map_err(GpuError::engine(role, "building the engine"))
        };
        let trainer = engine(TRAINER)?;
        let inference = engine(INFERENCE)?;
        // SAFETY: `image` and `target` are fields of the returned value,
        // whose Drop deregisters them and shuts the engines down before the
        // buffers are freed; on the error paths below the engines are shut
        // down before the buffers go out of scope.
        let (image_region, target_region) = unsafe { (image.region(), target.region()) };
        let fail = |e: GpuError| {
            trainer.shutdown();
            inference.shutdown();
            e
        };
        let mut held = Resources::new();
        let (image_mr, _) = held
            .register(&trainer, image_region)
            .map_err(GpuError::engine(TRAINER, "registering the image"))
            .map_err(fail)?;
        let (_, target_desc) = held
            .register(&inference, target_region)
            .map_err(GpuError::engine(INFERENCE, "registering the weights"))
            .map_err(fail)?;
        let imm = inference.imm_capacity().saturating_sub(1);
        held.lease_imm_value(&inference, imm)
            .map_err(GpuError::engine(INFERENCE, "reserving the immediate"))
            .map_err(fail)?;
        Ok(GpuUpdate {
            trainer,
            inference,
            held,
            image_mr,
            target_desc,
            imm,
            cfg,
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
            target,
        })
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
        let inf = self.cfg.inference_rank as usize;
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

    /// WRITEs every tensor's bytes (and scales) from the image into the
    /// inference rank's region; returns once the inference engine counted
    /// every immediate and every WRITE completed at the trainer.
    pub fn write(&self) -> Result<(u64, u64), GpuError> {
        let inf = self.cfg.inference_rank as usize;
        let mut ranges = Vec::new();
        for slot in &self.plan.inference[inf].tensors {
            ranges.push(slot.data);
            ranges.extend(slot.scales);
        }
        ranges.retain(|&(_, len)| len > 0);
        let counts = self
            .inference
            .imm_counts(0)
            .map_err(GpuError::engine(INFERENCE, "immediate counts"))?;
        let expected: u64 = ranges.iter().map(|&(_, l)| counts.single_write(l)).sum();
        let (od, flag) = OnDone::flag();
        self.inference
            .expect_imm_count_with(self.imm, expected, od)
            .map_err(GpuError::engine(INFERENCE, "arming the weights round"))?;
        let done = Arc::new(DoneCounter::new());
        let mut bytes = 0;
        for &(off, len) in &ranges {
            self.trainer
                .submit_single_write(
                    len,
                    Some(self.imm),
                    (&self.image_mr, off),
                    (&self.target_desc, off),
                    OnDone::counter(&done),
                )
                .map_err(GpuError::engine(
                    TRAINER,
                    format!("WRITE of {len} bytes at {off}"),
                ))?;
            bytes += len;
        }
        let t = self.cfg.timeout;
        let timeout = |role, what: &str| GpuError::Timeout {
            role,
            what: what.to_string(),
            waited_ms: t.as_millis() as u64,
        };
        let n = ranges.len() as u64;
        if !done.wait_for_timeout(n, t) {
            return Err(timeout(TRAINER, "WRITE completions"));
        }
        if let Some(e) = done.first_error() {
            return Err(GpuError::engine(TRAINER, "WRITE")(e));
        }
        match flag.wait_timeout(t) {
            Some(Ok(())) => Ok((n, bytes)),
            Some(Err(e)) => Err(GpuError::engine(INFERENCE, "weights round")(e)),
            None => Err(timeout(INFERENCE, "weights round")),
        }
    }

    /// One update: [`Self::run_stages`] then [`Self::write`], timed.
    pub fn step(&self) -> Result<GpuStepTimes, GpuError> {
        let t0 = Instant::now();
        self.run_stages()?;
        let t1 = Instant::now();
        let (write_count, bytes) = self.write()?;
        Ok(GpuStepTimes {
            stages: t1 - t0,
            writes: t1.elapsed(),
            write_count,
            bytes,
        })
    }

    /// The inference rank's whole weight region (device → host), laid out
    /// as `plan.inference[rank]` says.
    pub fn read_inference(&self) -> Result<Vec<u8>, GpuError> {
        self.target
            .to_vec()
            .map_err(GpuError::cuda("reading the inference weights"))
    }

    /// The trainer's staging image of the inference region (what the
    /// stages produced, before the WRITEs).
    pub fn read_image(&self) -> Result<Vec<u8>, GpuError> {
        self.image
            .to_vec()
            .map_err(GpuError::cuda("reading the trainer image"))
    }
}

impl Drop for GpuUpdate {
    fn drop(&mut self) {
        if let Err(e) = self.held.release() {
            tracing::debug!("GPU update: releasing: {e}");
        }
        self.trainer.shutdown();
        self.inference.shutdown();
    }
}

/// Both sides over the same-host backend with `gpu`'s peer memory
/// (`nics` lanes).
fn nvlink_hosts(gpu: &Gpu, nics: usize) -> Result<RoleHosts, GpuError> {
    let pm: Arc<dyn weft::PeerMemory> = Arc::new(
        gpu.peer_memory()
            .map_err(GpuError::cuda("the GPU's peer memory"))?,
    );
    let backend = weft::provider_with(
        &weft::ProviderSpec::Nvlink,
        &weft::ProviderConfig::default()
            .with_nics(nics)
            .with_nvlink(weft::NvlinkOptions::default().with_peer_memory(pm)),
    )
    .map_err(|e| {
        GpuError::engine("both", "opening nvlink")(weft::EngineError::Setup {
            group: 0,
            what: e.to_string(),
            source: None,
        })
    })?;
    let backend = Arc::new(backend);
    Ok(Arc::new(move |_| {
        backend.host().map_err(|e| weft::TransportError::Failed {
            nic: "nvlink".into(),
            wr: None,
            what: e.to_string(),
        })
    }))
}
