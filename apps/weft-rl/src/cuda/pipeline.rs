//! [`GpuUpdate`]: a [`GpuTrainer`] and the [`GpuInference`] it updates, in
//! one process, each with its own engine on the provider the configuration
//! gives its side ([`GpuUpdateConfig::hosts`]; by default the same-host
//! backend `nvlink`, whose copies run on the GPU's copy engines). The two
//! sides also run in separate processes: build each with its own engine
//! and pass the inference side's [`super::GpuTarget`] across.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_cuda::Gpu;

use super::kernels::RlKernels;
use super::target::{GpuInference, INFERENCE};
use super::trainer::{GpuTrainer, TRAINER};
use super::GpuError;
use crate::meta::ModelLayout;
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

/// A trainer and the inference rank it updates, in this process (see the
/// module docs).
pub struct GpuUpdate {
    // Taken in `Drop`: their registrations are released before the engines
    // are shut down.
    sides: Option<(GpuTrainer, GpuInference)>,
    trainer: Arc<TransferEngine>,
    inference: Arc<TransferEngine>,
    /// The version the next [`GpuUpdate::write`] pushes.
    next: AtomicU64,
}

impl std::fmt::Debug for GpuUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuUpdate")
            .field("sides", &self.sides)
            .finish_non_exhaustive()
    }
}

impl GpuUpdate {
    /// Builds the two engines, then the [`GpuTrainer`] and the
    /// [`GpuInference`] of `cfg.inference_rank` on them.
    pub fn new(
        gpu: &Gpu,
        ml: ModelLayout,
        plan: Arc<Plan>,
        cfg: GpuUpdateConfig,
    ) -> Result<GpuUpdate, GpuError> {
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
        let inference = match engine(INFERENCE) {
            Ok(e) => e,
            Err(e) => {
                trainer.shutdown();
                return Err(e);
            }
        };
        let rank = cfg.inference_rank;
        let sides =
            GpuInference::new(gpu, &plan, rank, inference.clone(), cfg.timeout).and_then(|i| {
                GpuTrainer::new(gpu, ml, plan, rank, trainer.clone(), cfg.timeout).map(|t| (t, i))
            });
        match sides {
            Ok(sides) => Ok(GpuUpdate {
                sides: Some(sides),
                trainer,
                inference,
                next: AtomicU64::new(0),
            }),
            Err(e) => {
                trainer.shutdown();
                inference.shutdown();
                Err(e)
            }
        }
    }

    fn sides(&self) -> &(GpuTrainer, GpuInference) {
        self.sides.as_ref().expect("present until dropped")
    }

    /// The trainer side.
    pub fn trainer(&self) -> &GpuTrainer {
        &self.sides().0
    }

    /// The inference side.
    pub fn inference(&self) -> &GpuInference {
        &self.sides().1
    }

    /// The kernels (compiled for this GPU).
    pub fn kernels(&self) -> &RlKernels {
        self.trainer().kernels()
    }

    /// Puts trainer `t`'s shard bytes (its plan region) into device memory
    /// ([`GpuTrainer::load_trainer`]).
    pub fn load_trainer(&self, t: usize, region: &[u8]) -> Result<(), GpuError> {
        self.trainer().load_trainer(t, region)
    }

    /// Unshard → fuse → quantise ([`GpuTrainer::run_stages`]).
    pub fn run_stages(&self) -> Result<(), GpuError> {
        self.trainer().run_stages()
    }

    /// WRITEs the image into the inference rank as the next version and
    /// waits until its engine counted every immediate (the version is then
    /// live); returns the WRITEs and the bytes. After a failure the last
    /// good version stays live and the next call pushes the same version
    /// again.
    pub fn write(&self) -> Result<(u64, u64), GpuError> {
        let (t, i) = self.sides();
        let v = self.next.load(Ordering::Acquire);
        let round = i.arm(v)?;
        let r = t
            .write(i.target(), v)
            .and_then(|r| i.wait(round).map(|()| r));
        match r {
            Ok(r) => {
                self.next.store(v + 1, Ordering::Release);
                Ok(r)
            }
            Err(e) => {
                i.recover();
                Err(e)
            }
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

    /// The inference rank's live weights (device → host), laid out as
    /// `plan.inference[rank]` says, with their version; `None` before the
    /// first [`GpuUpdate::write`] completed.
    pub fn read_inference(&self) -> Result<Option<(u64, Vec<u8>)>, GpuError> {
        self.inference().read()
    }

    /// The trainer's staging image of the inference region (what the
    /// stages produced, before the WRITEs).
    pub fn read_image(&self) -> Result<Vec<u8>, GpuError> {
        self.trainer().read_image()
    }
}

impl Drop for GpuUpdate {
    fn drop(&mut self) {
        drop(self.sides.take());
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
