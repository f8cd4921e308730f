//! [`EngineRank`]: one rank of a MoE group on the GPU with its own
//! [`TransferEngine`] and proxy thread, in whatever process owns it (one
//! process per GPU, as serving stacks run, or several ranks in one); and
//! [`EngineGroup`], N such ranks in one process (tests, benchmarks).
//!
//! A rank in its own process: build an engine on a provider that registers
//! GPU memory (its [`weft::DomainGroupSpec`] naming the GPU), create the
//! rank ([`EngineRank::new`]: allocates and registers its buffers, reserves
//! its immediates), exchange [`RankInfo`]s (out of band or through
//! [`crate::MoeRendezvous`]), [`EngineRank::connect`] (starts the proxy),
//! then launch the rank's kernels ([`super::MoeKernels`]) on a stream of
//! the caller's, step after step. Every rank of the group must run the same
//! steps before [`EngineRank::shutdown`].

use super::proxy::{eng, Net, Proxy, RankShared};
use super::{GpuError, GpuRank, ProxyGroup, ProxyTimes};
use crate::config::Dims;
use crate::core::RankCore;
use crate::error::{MoeError, Phase};
use crate::exec::{check_infos, config_hash, Peers, RankInfo};
use crate::imm::ImmValues;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use weft::{DomainGroupSpec, EngineConfig, ImmCounts, MrDesc, MrHandle, Resources, TransferEngine};
use weft_cuda::Gpu;

/// The provider rank `r`'s engine opens its NICs on.
pub type HostFn =
    Arc<dyn Fn(u32) -> Result<Arc<dyn weft::Provider>, weft::TransportError> + Send + Sync>;

/// How an [`EngineGroup`] builds its engines.
#[derive(Clone)]
pub struct EngineGroupConfig {
    /// The provider of each rank (called once per rank, in rank order).
    pub hosts: HostFn,
    /// NICs per rank's engine (indices `0..nics` of its provider).
    pub nics: usize,
    /// Every rank's engine configuration.
    pub engine: EngineConfig,
    /// How long a proxy waits for a peer's round, its own submits or its
    /// own kernel within a step before it stops with an error (waits for
    /// the caller have no bound: [`EngineRank::new`]).
    pub timeout: Duration,
}

impl std::fmt::Debug for EngineGroupConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineGroupConfig")
            .field("nics", &self.nics)
            .field("engine", &self.engine)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl EngineGroupConfig {
    /// One NIC per rank on the provider `hosts(rank)` gives, default
    /// engines, `timeout`.
    pub fn new(hosts: HostFn, timeout: Duration) -> EngineGroupConfig {
        EngineGroupConfig {
            hosts,
            nics: 1,
            engine: EngineConfig::default(),
            timeout,
        }
    }

    /// Every rank over the same-host backend (`nvlink`) with `gpu`'s peer
    /// memory: WRITEs into another rank's GPU buffers are copies on the
    /// GPU's copy engines (one-sided, no lock shared by the ranks).
    pub fn nvlink(gpu: &Gpu, timeout: Duration) -> Result<EngineGroupConfig, GpuError> {
        let pm: Arc<dyn weft::PeerMemory> = Arc::new(
            gpu.peer_memory()
                .map_err(GpuError::cuda(None, Phase::Setup))?,
        );
        let backend = weft::provider_with(
            &weft::ProviderSpec::Nvlink,
            &weft::ProviderConfig::default()
                .with_nvlink(weft::NvlinkOptions::default().with_peer_memory(pm)),
        )
        .map_err(|e| GpuError::Proxy {
            rank: 0,
            what: format!("opening nvlink: {e}"),
        })?;
        let backend = Arc::new(backend);
        Ok(Self::new(
            Arc::new(move |_| {
                backend.host().map_err(|e| weft::TransportError::Failed {
                    nic: "nvlink".into(),
                    wr: None,
                    what: e.to_string(),
                })
            }),
            timeout,
        ))
    }
}

/// Registers rank `r`'s route (host-mapped), send and receive buffers into
/// `held`. Returns the handles (route, send, recv) and the descriptors of
/// route and recv.
#[allow(unsafe_code)]
fn register(
    engine: &TransferEngine,
    r: &GpuRank,
    held: &mut Resources,
) -> Result<([MrHandle; 3], MrDesc, MrDesc), GpuError> {
    let e = eng(r.rank, Phase::Setup);
    // SAFETY: the buffers live in the rank's `RankShared`, which the
    // `EngineRank` drops only after the registrations are gone: they sit in
    // its `Setup` (declared before the shared state, so dropped first) until
    // `connect` hands them to the proxy, whose thread releases them before
    // it ends, and the rank joins that thread before its fields drop.
    let (route, send, recv) = unsafe { (r.route.region(), r.send.region(), r.recv.region()) };
    let (route_h, route_d) = held.register(engine, route).map_err(&e)?;
    let (send_h, _) = held.register(engine, send).map_err(&e)?;
    let (recv_h, recv_d) = held.register(engine, recv).map_err(&e)?;
    Ok(([route_h, send_h, recv_h], route_d, recv_d))
}

/// What a rank holds between `new` and `connect`.
struct Setup {
    handles: [MrHandle; 3],
    /// The registrations and the reserved immediates.
    held: Resources,
    imms: ImmValues,
    ic: ImmCounts,
}

/// One rank of a MoE group on the GPU, over its own engine (module docs).
pub struct EngineRank {
    /// Until `connect`; declared before `sh`: the registrations go before
    /// the memory.
    setup: Option<Setup>,
    thread: Option<JoinHandle<Result<(), GpuError>>>,
    engine: Arc<TransferEngine>,
    info: RankInfo,
    sh: Arc<RankShared>,
}

impl std::fmt::Debug for EngineRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineRank")
            .field("rank", &self.info.rank)
            .field("ranks", &self.sh.dims.ranks)
            .field("connected", &self.thread.is_some())
            .finish()
    }
}

impl EngineRank {
    /// Allocates rank `rank`'s buffers on `gpu`, registers them with
    /// `engine` (whose domain group must name `gpu`'s device, on a provider
    /// that registers GPU memory) and reserves the group's immediates on it.
    /// `timeout` bounds the proxy's waits on peers and on the rank's own
    /// kernels (a round, its own submits, a kernel's signal within a
    /// step): a peer that dies or stalls ends the proxy with an error
    /// within it. Waits for the caller (the next step's launch, the
    /// combine's launch after the experts) have no bound: an idle rank
    /// naps 50 µs between checks after 10 ms.
    ///
    /// `rank` is the rank in the whole group. With masked ranks
    /// (`MoeConfig::masked`) the group runs over the active ranks: a masked
    /// `rank` is [`MoeError::Masked`], top-k ids name whole-group experts
    /// (a masked rank's are dropped), rows report whole-group source ranks,
    /// and errors name peers by whole-group rank.
    pub fn new(
        gpu: &Gpu,
        dims: &Dims,
        rank: u32,
        engine: Arc<TransferEngine>,
        timeout: Duration,
    ) -> Result<EngineRank, GpuError> {
        let global = dims.mask.global_ranks();
        if rank >= global {
            return Err(MoeError::NoSuchRank {
                rank,
                ranks: global,
            }
            .into());
        }
        // Errors name the whole-group rank; the protocol numbers the active
        // ranks only.
        let e = eng(rank, Phase::Setup);
        let rank = dims
            .mask
            .active_index(rank)
            .ok_or(MoeError::Masked { rank })?;
        let gr = Arc::new(GpuRank::new(gpu, dims, rank)?);
        let mut held = Resources::new();
        let (handles, route, recv) = register(&engine, &gr, &mut held)?;
        let imms = ImmValues::for_instance(dims.instance, engine.imm_capacity())
            .map_err(|e| GpuError::Moe(MoeError::from(e)))?;
        for v in imms.all() {
            held.lease_imm_value(&engine, v).map_err(&e)?;
        }
        let ic = engine.imm_counts(0).map_err(&e)?;
        let info = RankInfo {
            rank,
            addr: engine.main_address(),
            route,
            recv,
            config_hash: config_hash(dims, &imms),
        };
        Ok(EngineRank {
            setup: Some(Setup {
                handles,
                held,
                imms,
                ic,
            }),
            thread: None,
            engine,
            info,
            sh: Arc::new(RankShared {
                dims: dims.clone(),
                rank: gr,
                stop: AtomicBool::new(false),
                timeout,
                times: Mutex::new(Vec::new()),
            }),
        })
    }

    /// What this rank tells its peers (its engine's address and its route
    /// and receive buffers).
    pub fn info(&self) -> &RankInfo {
        &self.info
    }

    /// Checks every rank's info (`all[r]` is rank r's; with masked ranks,
    /// the active ranks' infos in rank order; from peers or a store, so
    /// untrusted: wrong rank numbers, another shape or buffers too short
    /// are [`MoeError::PeerInfo`]), adds the peers to the engine and starts
    /// the proxy thread. Once only.
    pub fn connect(&mut self, all: &[RankInfo]) -> Result<(), GpuError> {
        let r = self.info.rank;
        if self.setup.is_none() {
            return Err(MoeError::OutOfOrder {
                expected: "one connect per rank",
            }
            .into());
        }
        let members = check_infos(&self.sh.dims, r, self.info.config_hash, all)
            .map_err(|e| self.sh.dims.mask.globalise(e))?;
        let peers = Peers::connect(&self.engine, &members)?;
        let Some(s) = self.setup.take() else {
            return Err(MoeError::NotConnected.into());
        };
        let proxy = Proxy {
            core: RankCore::new(self.sh.dims.clone(), r, s.imms, s.ic),
            sh: self.sh.clone(),
            r,
            net: Net::new(self.engine.clone(), r, s.handles, s.held, peers),
        };
        let handle = std::thread::Builder::new()
            .name(format!("moe-engine-proxy-{r}"))
            .spawn(move || proxy.run())
            .map_err(|e| GpuError::Proxy {
                rank: r,
                what: format!("spawning the proxy thread: {e}"),
            })?;
        self.thread = Some(handle);
        Ok(())
    }

    /// The rank's GPU state: launch its kernels with it, read its results.
    pub fn gpu_rank(&self) -> &Arc<GpuRank> {
        &self.sh.rank
    }

    /// The rank's engine.
    pub fn engine(&self) -> &Arc<TransferEngine> {
        &self.engine
    }

    /// Takes the timestamps the proxy recorded so far (one per step).
    pub fn take_times(&self) -> Vec<ProxyTimes> {
        std::mem::take(&mut *self.sh.times.lock())
    }

    /// Whether the proxy runs (connected and not stopped by an error).
    pub fn healthy(&self) -> bool {
        self.thread.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// Asks the proxy to stop (it still finishes a clean end between
    /// steps); [`EngineRank::shutdown`] waits for it.
    pub fn request_stop(&self) {
        self.sh.stop.store(true, Ordering::Release);
    }

    fn stop(&mut self) -> Result<(), GpuError> {
        self.request_stop();
        let r = self.sh.rank.global_rank();
        let res = match self.thread.take() {
            Some(h) => h.join().unwrap_or_else(|_| {
                Err(GpuError::Proxy {
                    rank: r,
                    what: "proxy thread panicked".into(),
                })
            }),
            None => Ok(()),
        };
        // What the proxy saw names peers by active rank.
        res.map_err(|e| match e {
            GpuError::Moe(m) => GpuError::Moe(self.sh.dims.mask.globalise(m)),
            other => other,
        })
    }

    /// Stops the proxy (between steps it first waits for the last BAR_C
    /// round and its own submits, so every rank should have run the same
    /// steps), releases the registrations and immediates, and returns the
    /// error the proxy stopped with, if any. The engine stays the caller's.
    pub fn shutdown(mut self) -> Result<(), GpuError> {
        self.stop()
    }
}

impl Drop for EngineRank {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(rank = self.info.rank, %e, "MoE engine proxy failed");
        }
    }
}

/// N ranks on one GPU in this process, an engine and a proxy thread each
/// (the module docs of [`EngineRank`]).
pub struct EngineGroup {
    ranks: Vec<EngineRank>,
}

impl std::fmt::Debug for EngineGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineGroup")
            .field("ranks", &self.ranks.len())
            .finish()
    }
}

impl EngineGroup {
    /// Allocates `dims.ranks` ranks on `gpu`, builds one engine per rank on
    /// its provider ([`EngineGroupConfig::hosts`]), registers the buffers,
    /// connects every rank to the others and starts the proxies.
    pub fn new(gpu: &Gpu, dims: &Dims, cfg: EngineGroupConfig) -> Result<EngineGroup, GpuError> {
        let mut group = EngineGroup { ranks: Vec::new() };
        for r in 0..dims.ranks {
            let provider = (cfg.hosts)(r).map_err(|e| GpuError::Proxy {
                rank: r,
                what: format!("the rank's provider: {e}"),
            })?;
            let engine = TransferEngine::builder()
                .group(
                    DomainGroupSpec::new(provider, (0..cfg.nics.max(1)).collect::<Vec<_>>())
                        .device(gpu.device()),
                )
                .config(cfg.engine.clone())
                .build()
                .map_err(eng(r, Phase::Setup))?;
            let g = dims.mask.global_rank(r);
            let rank = EngineRank::new(gpu, dims, g, Arc::new(engine), cfg.timeout)?;
            group.ranks.push(rank);
        }
        let infos: Vec<RankInfo> = group.ranks.iter().map(|r| r.info().clone()).collect();
        for rank in &mut group.ranks {
            rank.connect(&infos)?;
        }
        Ok(group)
    }

    /// Rank `r`'s engine.
    pub fn engine(&self, r: u32) -> Option<&Arc<TransferEngine>> {
        self.ranks.get(r as usize).map(EngineRank::engine)
    }

    fn stop_all(&mut self) -> Result<(), GpuError> {
        for r in &self.ranks {
            r.request_stop();
        }
        let mut first = Ok(());
        let mut engines = Vec::new();
        for r in self.ranks.drain(..) {
            engines.push(r.engine.clone());
            let res = r.shutdown();
            if first.is_ok() {
                first = res;
            }
        }
        for e in engines {
            e.shutdown();
        }
        first
    }
}

impl ProxyGroup for EngineGroup {
    fn rank(&self, r: u32) -> Option<&Arc<GpuRank>> {
        self.ranks.get(r as usize).map(EngineRank::gpu_rank)
    }

    fn take_times(&self, r: u32) -> Vec<ProxyTimes> {
        self.ranks
            .get(r as usize)
            .map(EngineRank::take_times)
            .unwrap_or_default()
    }

    fn healthy(&self) -> bool {
        self.ranks.iter().all(EngineRank::healthy)
    }

    /// Stops the proxies (each first waits for its last BAR_C round and its
    /// own submits, so every rank should have run the same steps), shuts
    /// the engines down and returns the first error a proxy hit.
    fn shutdown(mut self: Box<Self>) -> Result<(), GpuError> {
        self.stop_all()
    }
}

impl Drop for EngineGroup {
    fn drop(&mut self) {
        if let Err(e) = self.stop_all() {
            tracing::warn!(%e, "MoE engine proxy failed");
        }
    }
}
