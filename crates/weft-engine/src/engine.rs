//! The TransferEngine: builder, handle, worker / callback / watcher threads.

use crate::affinity;
use crate::core::{Control, Event, GroupInfo, WorkerCore};
use crate::error::{EngineError, TransferId};
use crate::imm::{ArmError, ImmTable};
use crate::imm::{ImmDone, ImmWaits};
use crate::mem::{MrHandle, RawBuf, SendPayload, SendPool};
use crate::mem::{RecvCallback, RecvPool};
use crate::ondone::{DoneResult, OnDone};
use crate::request::{routed_dsts, AddrBook, Body, Dsts, GroupAddress, PlainDst, Submitted};
use crate::shard::{self, ScatterMode, ShardConfig};
use crate::watcher::{UvmWatcher, WatchCallback, WatcherShared};
use crate::MAX_NICS;
use crossbeam_channel::{Receiver, Sender};
use crossbeam_queue::ArrayQueue;
use crossbeam_utils::Backoff;
use parking_lot::Mutex;
use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};
use weft_transport::{Device, Imm, MemRegion, MrDesc, Pages, Provider, ScatterDst};

/// What a submit does when its group's request queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueFullPolicy {
    /// Wait (spin, then yield) until the worker frees room. Cannot deadlock:
    /// workers never wait for submitters or for the callback thread, so the
    /// queue always drains; a callback that re-submits just waits a little.
    #[default]
    Block,
    /// Return [`EngineError::QueueFull`] at once (the submit's `on_done` is
    /// not called).
    Fail,
}

/// Engine-wide settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Capacity of each group's lock-free request queue. Requests sit in
    /// it by value (about 200 bytes each, allocated once with the queue),
    /// so a submit allocates nothing for the hand-off itself.
    pub queue_capacity: usize,
    /// Behaviour on a full request queue.
    pub queue_full: QueueFullPolicy,
    /// A worker stops taking new requests while this many planned WRs wait
    /// for send-queue room (bounds its memory; the request queue then fills
    /// and applies `queue_full`).
    pub max_pending_wrs: usize,
    /// Immediate values handed out by `alloc_imm` (`0..imm_capacity`).
    pub imm_capacity: u32,
    /// Sharding plan (part of the immediate-count contract).
    pub shard: ShardConfig,
    /// Default spreading of `submit_scatter`.
    pub scatter_mode: ScatterMode,
    /// Send slots per group (each `send_slot_len` bytes, on NIC 0).
    pub send_slots: u32,
    /// Bytes per send slot; larger messages are registered one by one.
    pub send_slot_len: u64,
    /// Idle loop iterations spent spinning before yielding. A group whose
    /// NICs need software progress ([`Capabilities::software_progress`]:
    /// libfabric tcp, shm, EFA's emulated protocols) skips this phase and
    /// yields after every empty poll instead: each poll already is a round of
    /// provider progress (system calls), and a worker that keeps the core
    /// through a run of them starves the threads it is waiting on, such as a
    /// peer's worker or the submitter on the same core. A yield with nothing
    /// else runnable returns at once, so a dedicated core loses nothing.
    ///
    /// [`Capabilities::software_progress`]: weft_transport::Capabilities::software_progress
    pub idle_spins: u32,
    /// Idle loop iterations (after spinning) spent yielding before sleeping.
    pub idle_yields: u32,
    /// Sleep of an idle worker/watcher; `None` = never sleep (lowest
    /// latency, burns a core). A worker with WRs in flight, or while an
    /// [`TransferEngine::expect_imm_count`] round of its engine waits, does
    /// not sleep (it yields between polls, so completions and the awaited
    /// immediates are not delayed) until `inflight_spin` passes without any
    /// progress or new arm.
    pub idle_sleep: Option<Duration>,
    /// How long a worker with WRs in flight (or an armed immediate round)
    /// keeps polling without sleeping while nothing completes, gets posted
    /// or is armed. Past it (a WR that never
    /// completes, e.g. to a peer that hangs) the worker falls back to
    /// `idle_sleep` between polls instead of burning a core indefinitely.
    pub inflight_spin: Duration,
    /// How long `shutdown` waits for in-flight WRs before failing them.
    pub drain_timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 4096,
            queue_full: QueueFullPolicy::Block,
            max_pending_wrs: 1 << 16,
            imm_capacity: 1 << 16,
            shard: ShardConfig::default(),
            scatter_mode: ScatterMode::ByPeer,
            send_slots: 64,
            send_slot_len: 16 * 1024,
            idle_spins: 64,
            idle_yields: 256,
            idle_sleep: Some(Duration::from_micros(200)),
            inflight_spin: Duration::from_millis(100),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

/// One DomainGroup (one GPU): a provider, the NICs to open, where to run.
#[derive(Clone)]
pub struct DomainGroupSpec {
    provider: Arc<dyn Provider>,
    nics: Vec<usize>,
    device: Device,
    cpu: Option<usize>,
    numa: Option<u32>,
}

impl std::fmt::Debug for DomainGroupSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DomainGroupSpec")
            .field("provider", &self.provider.name())
            .field("nics", &self.nics)
            .field("device", &self.device)
            .field("cpu", &self.cpu)
            .field("numa", &self.numa)
            .finish()
    }
}

impl DomainGroupSpec {
    /// A group of `nics` (indices into `provider.nics()`, 1..=8 of them).
    pub fn new(provider: Arc<dyn Provider>, nics: impl Into<Vec<usize>>) -> Self {
        Self {
            provider,
            nics: nics.into(),
            device: Device::Host,
            cpu: None,
            numa: None,
        }
    }

    /// The device (GPU) this group serves; `reg_mr` of that device's memory
    /// goes to this group. Default [`Device::Host`].
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Pin the worker to this CPU.
    pub fn cpu(mut self, cpu: usize) -> Self {
        self.cpu = Some(cpu);
        self
    }

    /// Pin the worker to a CPU of this NUMA node (when sysfs knows it).
    pub fn numa_node(mut self, node: u32) -> Self {
        self.numa = Some(node);
        self
    }
}

/// Called with `(imm, count)` for immediates that arrived but were never
/// consumed by a round (see the ImmCounter contract).
pub type ExcessHandler = Arc<dyn Fn(Imm, u64) + Send + Sync + 'static>;

/// Builds a [`TransferEngine`].
#[derive(Default)]
pub struct EngineBuilder {
    groups: Vec<DomainGroupSpec>,
    config: EngineConfig,
    manual: bool,
    excess: Option<ExcessHandler>,
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("groups", &self.groups)
            .field("config", &self.config)
            .field("manual", &self.manual)
            .finish()
    }
}

impl EngineBuilder {
    /// An empty builder with default settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a domain group. Group `i` is the `i`-th added.
    pub fn group(mut self, spec: DomainGroupSpec) -> Self {
        self.groups.push(spec);
        self
    }

    /// Replaces the settings.
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// Manual mode: no threads. The caller drives everything (workers,
    /// callbacks, watcher) with [`TransferEngine::progress`] on one thread.
    /// Used for deterministic tests under a step-mode simulator. Full
    /// request queues always fail with `QueueFull` in this mode.
    pub fn manual(mut self) -> Self {
        self.manual = true;
        self
    }

    /// Handler for never-consumed immediates (default: a `tracing` warning).
    pub fn on_imm_excess(mut self, f: impl Fn(Imm, u64) + Send + Sync + 'static) -> Self {
        self.excess = Some(Arc::new(f));
        self
    }

    /// Opens every group (each on its own worker thread, after pinning it)
    /// and starts the engine.
    pub fn build(self) -> Result<TransferEngine, EngineError> {
        if self.groups.is_empty() {
            return Err(EngineError::InvalidArgument {
                what: "an engine needs at least one domain group".into(),
            });
        }
        let cfg = self.config;
        let imms: Arc<ImmTable<ImmDone>> = Arc::new(ImmTable::new(cfg.imm_capacity));
        let (cb_tx, cb_rx) = crossbeam_channel::unbounded::<CbMsg>();
        let watcher = WatcherShared::new();
        #[cfg(feature = "latency-probe")]
        let probes = Arc::new(crate::probe::ProbeSink::new(1 << 20));
        let mut groups = Vec::new();
        let mut ctrl_rxs = Vec::new();
        for (i, spec) in self.groups.iter().enumerate() {
            if spec.nics.is_empty() || spec.nics.len() > MAX_NICS {
                return Err(EngineError::Setup {
                    group: i,
                    what: format!("a group needs 1..={MAX_NICS} NICs, got {}", spec.nics.len()),
                    source: None,
                });
            }
            let (ctrl, ctrl_rx) = crossbeam_channel::unbounded();
            groups.push(Arc::new(GroupShared {
                index: i,
                device: spec.device,
                queue: ArrayQueue::new(cfg.queue_capacity.max(1)),
                ctrl,
                info: OnceLock::new(),
                send_pool: OnceLock::new(),
                submitting: AtomicUsize::new(0),
                closing: AtomicBool::new(false),
                sleeping: AtomicBool::new(false),
                thread: OnceLock::new(),
                failed: OnceLock::new(),
            }));
            ctrl_rxs.push(ctrl_rx);
        }
        let imm_waits = Arc::new(ImmWaits::default());
        let addrs = Arc::new(AddrBook::default());
        let inner = Arc::new(Inner {
            id: NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed),
            groups: groups.clone(),
            imms: Arc::clone(&imms),
            imm_waits: Arc::clone(&imm_waits),
            addrs: Arc::clone(&addrs),
            imm_free: Mutex::new(ImmAlloc {
                next: 0,
                free: Vec::new(),
                in_use: Vec::new(),
            }),
            config: cfg.clone(),
            cb_tx: cb_tx.clone(),
            threads: Mutex::new(Threads::default()),
            watcher: Arc::clone(&watcher),
            shut: AtomicBool::new(false),
            done: AtomicBool::new(false),
            manual: self.manual.then(|| {
                Mutex::new(ManualState {
                    workers: Vec::new(),
                    cb_rx: cb_rx.clone(),
                })
            }),
            next_id: AtomicU64::new(1),
            next_pool: AtomicU16::new(0),
            excess: self.excess.unwrap_or_else(|| {
                Arc::new(|imm, n| tracing::warn!(imm, count = n, "immediates never consumed"))
            }),
            excess_total: AtomicU64::new(0),
            #[cfg(feature = "latency-probe")]
            probes: Arc::clone(&probes),
        });
        let engine = TransferEngine {
            inner: Arc::clone(&inner),
        };

        let (init_tx, init_rx) = crossbeam_channel::unbounded::<(usize, Result<(), EngineError>)>();
        let mut manual_workers = Vec::new();
        for ((i, spec), ctrl_rx) in self.groups.into_iter().enumerate().zip(ctrl_rxs) {
            let shared = Arc::clone(&groups[i]);
            let ctx = WorkerCtx {
                spec,
                shared,
                ctrl_rx,
                imms: Arc::clone(&imms),
                imm_waits: Arc::clone(&imm_waits),
                addrs: Arc::clone(&addrs),
                cfg: cfg.clone(),
                cb_tx: cb_tx.clone(),
                #[cfg(feature = "latency-probe")]
                probes: Arc::clone(&probes),
            };
            if self.manual {
                match ctx.open() {
                    Ok(w) => manual_workers.push(w),
                    Err(e) => return Err(e),
                }
            } else {
                let tx = init_tx.clone();
                let h = std::thread::Builder::new()
                    .name(format!("weft-worker-{i}"))
                    .spawn(move || worker_main(ctx, tx))
                    .map_err(|e| EngineError::Setup {
                        group: i,
                        what: format!("spawning worker: {e}"),
                        source: None,
                    })?;
                inner.threads.lock().workers.push(h);
            }
        }
        drop(init_tx);
        if let Some(m) = &inner.manual {
            m.lock().workers = manual_workers;
        } else {
            let mut first_err = None;
            for _ in 0..groups.len() {
                match init_rx.recv() {
                    Ok((_, Ok(()))) => {}
                    Ok((_, Err(e))) => {
                        first_err.get_or_insert(e);
                    }
                    Err(_) => {
                        first_err.get_or_insert(EngineError::Setup {
                            group: 0,
                            what: "worker exited during setup".into(),
                            source: None,
                        });
                        break;
                    }
                }
            }
            // Callback and watcher threads.
            let cb_groups = inner.groups.clone();
            let cb_excess = Arc::clone(&inner.excess);
            let cb = std::thread::Builder::new()
                .name("weft-callbacks".into())
                .spawn(move || callback_main(&cb_groups, &cb_excess, &cb_rx))
                .map_err(|e| EngineError::Setup {
                    group: 0,
                    what: format!("spawning callback thread: {e}"),
                    source: None,
                })?;
            let w2 = Arc::clone(&watcher);
            let idle = Idle::from(&cfg);
            watcher.running.store(true, Ordering::SeqCst);
            let wt = std::thread::Builder::new()
                .name("weft-uvm-watcher".into())
                .spawn(move || watcher_main(&w2, idle))
                .map_err(|e| EngineError::Setup {
                    group: 0,
                    what: format!("spawning watcher thread: {e}"),
                    source: None,
                })?;
            {
                let mut t = inner.threads.lock();
                t.callback = Some(cb);
                t.watcher = Some(wt);
            }
            if let Some(e) = first_err {
                engine.shutdown();
                return Err(e);
            }
        }
        Ok(engine)
    }
}

enum CbMsg {
    Event(Event),
    Excess(Imm, u64),
    Stop,
}

struct GroupShared {
    index: usize,
    device: Device,
    /// Requests by value: no allocation per submit to free on the worker.
    queue: ArrayQueue<Submitted>,
    ctrl: Sender<Control>,
    info: OnceLock<GroupInfo>,
    send_pool: OnceLock<Arc<SendPool>>,
    submitting: AtomicUsize,
    closing: AtomicBool,
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
    /// Set once the worker panicked: later submits fail with it.
    failed: OnceLock<EngineError>,
}

impl GroupShared {
    fn wake(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }
}

struct ImmAlloc {
    next: u32,
    free: Vec<u32>,
    /// `in_use[v]` for values handed out and not freed.
    in_use: Vec<bool>,
}

#[derive(Default)]
struct Threads {
    workers: Vec<JoinHandle<()>>,
    callback: Option<JoinHandle<()>>,
    watcher: Option<JoinHandle<()>>,
}

struct ManualState {
    workers: Vec<Worker>,
    cb_rx: Receiver<CbMsg>,
}

/// Source of [`Inner::id`].
static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

struct Inner {
    /// Process-unique engine id: peer group handles name their engine.
    id: u64,
    groups: Vec<Arc<GroupShared>>,
    imms: Arc<ImmTable<ImmDone>>,
    imm_waits: Arc<ImmWaits>,
    addrs: Arc<AddrBook>,
    imm_free: Mutex<ImmAlloc>,
    config: EngineConfig,
    cb_tx: Sender<CbMsg>,
    threads: Mutex<Threads>,
    watcher: Arc<WatcherShared>,
    shut: AtomicBool,
    done: AtomicBool,
    manual: Option<Mutex<ManualState>>,
    next_id: AtomicU64,
    next_pool: AtomicU16,
    excess: ExcessHandler,
    excess_total: AtomicU64,
    #[cfg(feature = "latency-probe")]
    probes: Arc<crate::probe::ProbeSink>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Last handle gone without `shutdown`: stop the threads. They hold
        // no `Inner` reference except the callback thread, which exits on
        // `Stop` once the workers are gone.
        if !self.done.load(Ordering::SeqCst) {
            self.shut.store(true, Ordering::SeqCst);
            for g in &self.groups {
                g.closing.store(true, Ordering::SeqCst);
                if let Some(t) = g.thread.get() {
                    t.unpark();
                }
            }
            self.watcher.stop.store(true, Ordering::SeqCst);
            self.watcher.unpark();
            let _ = self.cb_tx.send(CbMsg::Stop);
        }
    }
}

/// The immediate-count parameters of one group, for receivers computing how
/// many immediates a peer's submit produces (see [`crate::shard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImmCounts {
    /// NICs of the group (= lanes when the peer has as many).
    pub lanes: usize,
    /// Smallest `max_write_len` of the group's NICs.
    pub max_write_len: u64,
    /// The sharding plan.
    pub shard: ShardConfig,
}

impl ImmCounts {
    /// Immediates of one `submit_single_write` of `len` bytes.
    pub fn single_write(&self, len: u64) -> u64 {
        shard::imm_count_single_write(len, self.lanes, self.max_write_len, &self.shard)
    }
    /// Immediates of one `submit_paged_writes` of `pages` pages.
    pub fn paged_writes(&self, page_len: u64, pages: u64) -> u64 {
        shard::imm_count_paged_writes(page_len, pages, self.max_write_len, &self.shard)
    }
    /// Immediates one scatter destination of `len` bytes receives.
    pub fn scatter_dst(&self, len: u64, mode: ScatterMode) -> u64 {
        shard::imm_count_scatter_dst(len, self.lanes, self.max_write_len, mode, &self.shard)
    }
    /// Immediates one barrier produces at each destination: always 1.
    pub fn barrier(&self) -> u64 {
        1
    }
}

/// A set of peers for scatter and barrier, resolved on every group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerGroupHandle {
    /// The engine that resolved the group (handles are per engine).
    engine: u64,
    ids: Vec<u32>,
    /// The members' addresses, to match destinations to members at submit.
    members: Arc<[GroupAddress]>,
}

impl PeerGroupHandle {
    /// Number of peers.
    pub fn len(&self) -> usize {
        self.members.len()
    }
    /// Whether the group is empty.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

/// Engine statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    /// Immediates reported as never consumed.
    pub imm_excess: u64,
    /// Immediates of values outside the allocator's range that were not
    /// tracked because too many distinct such values were outstanding
    /// (a misbehaving peer); they are counted here and never fire a round.
    pub imm_dropped: u64,
}

/// The TransferEngine. Cheap to clone (a handle); callbacks may capture a
/// clone and submit from the callback thread.
#[derive(Clone)]
pub struct TransferEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("groups", &self.inner.groups.len())
            .finish()
    }
}

fn no_group(g: usize) -> EngineError {
    EngineError::InvalidArgument {
        what: format!("no domain group {g}"),
    }
}

impl TransferEngine {
    /// Starts a builder.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::new()
    }

    fn group(&self, g: usize) -> Result<&Arc<GroupShared>, EngineError> {
        self.inner.groups.get(g).ok_or_else(|| no_group(g))
    }

    fn info(&self, g: usize) -> Result<&GroupInfo, EngineError> {
        self.group(g)?.info.get().ok_or(EngineError::ShutDown)
    }

    /// Number of domain groups.
    pub fn groups(&self) -> usize {
        self.inner.groups.len()
    }

    /// NICs of group `g`.
    pub fn nic_count(&self, g: usize) -> Result<usize, EngineError> {
        Ok(self.info(g)?.addrs.len())
    }

    /// Names of group `g`'s NICs, in NIC order.
    pub fn nic_names(&self, g: usize) -> Result<Vec<String>, EngineError> {
        Ok(self.info(g)?.names.clone())
    }

    /// Addresses of group `g`'s NICs, in NIC order.
    pub fn group_address(&self, g: usize) -> Result<GroupAddress, EngineError> {
        Ok(GroupAddress {
            nics: self.info(g)?.addrs.clone(),
        })
    }

    /// Address of group 0 (its NIC 0 takes sends).
    pub fn main_address(&self) -> GroupAddress {
        self.group_address(0)
            .unwrap_or(GroupAddress { nics: Vec::new() })
    }

    /// Immediate-count parameters of group `g`.
    pub fn imm_counts(&self, g: usize) -> Result<ImmCounts, EngineError> {
        let i = self.info(g)?;
        Ok(ImmCounts {
            lanes: i.addrs.len(),
            max_write_len: i.max_write_len,
            shard: self.inner.config.shard,
        })
    }

    /// Statistics.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            imm_excess: self.inner.excess_total.load(Ordering::Relaxed),
            imm_dropped: self.inner.imms.dropped(),
        }
    }

    // ------------------------------------------------------------- control

    fn control<T>(
        &self,
        g: &GroupShared,
        make: impl FnOnce(Sender<Result<T, EngineError>>) -> Control,
    ) -> Result<T, EngineError> {
        if self.inner.shut.load(Ordering::SeqCst) {
            return Err(EngineError::ShutDown);
        }
        if let Some(e) = g.failed.get() {
            return Err(e.clone());
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        g.ctrl.send(make(tx)).map_err(|_| EngineError::ShutDown)?;
        if let Some(m) = &self.inner.manual {
            // Run the worker's control queue inline.
            let mut st = m.lock();
            if let Some(w) = st.workers.get_mut(g.index) {
                while let Ok(c) = w.ctrl_rx.try_recv() {
                    w.core.handle_control(c);
                }
            }
        } else {
            g.wake();
            if let Some(t) = g.thread.get() {
                t.unpark();
            }
        }
        rx.recv()
            .map_err(|_| g.failed.get().cloned().unwrap_or(EngineError::ShutDown))?
    }

    /// Registers memory with every NIC of the group serving its device
    /// (group 0 for host memory unless a group declares [`Device::Host`]
    /// explicitly first). Returns the local handle and the descriptor peers
    /// need to write into it (one `(NetAddr, rkey)` per NIC, in NIC order).
    pub fn reg_mr(&self, region: MemRegion) -> Result<(MrHandle, MrDesc), EngineError> {
        let g = self
            .inner
            .groups
            .iter()
            .position(|g| g.device == region.device())
            .or_else(|| (region.device() == Device::Host).then_some(0))
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("no domain group serves {}", region.device()),
            })?;
        self.reg_mr_on(g, region)
    }

    /// [`TransferEngine::reg_mr`] from a raw pointer.
    ///
    /// # Safety
    /// The promises of [`MemRegion::new`] for as long as the memory stays
    /// registered.
    pub unsafe fn reg_mr_ptr(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        device: Device,
    ) -> Result<(MrHandle, MrDesc), EngineError> {
        // SAFETY: forwarded to the caller.
        self.reg_mr(unsafe { MemRegion::new(ptr, len, device) })
    }

    /// Registers memory with every NIC of group `g`.
    pub fn reg_mr_on(
        &self,
        g: usize,
        region: MemRegion,
    ) -> Result<(MrHandle, MrDesc), EngineError> {
        let gs = self.group(g)?;
        let (key, lanes) = self.control(gs, |reply| Control::RegMr { region, reply })?;
        let (id, gen) = crate::wrid::split_mr_key(key);
        let info = self.info(g)?;
        let desc = MrDesc {
            addr: region.addr(),
            len: region.len() as u64,
            rkeys: info
                .addrs
                .iter()
                .zip(&lanes)
                .map(|(a, mr)| (a.clone(), mr.rkey))
                .collect(),
        };
        let h = MrHandle {
            group: g as u32,
            id,
            gen,
            addr: region.addr(),
            len: region.len() as u64,
            device: region.device(),
        };
        Ok((h, desc))
    }

    /// Deregisters memory from every NIC of its group. Transfers still
    /// using it fail with a local-access error.
    pub fn unreg_mr(&self, h: MrHandle) -> Result<(), EngineError> {
        let gs = self.group(h.group as usize)?;
        self.control(gs, |reply| Control::UnregMr { id: h.key(), reply })
    }

    /// Resolves a set of peers on every group, for scatter and barrier.
    /// Member `j` is the destination `dsts[j]` of later submits.
    pub fn add_peer_group(&self, addrs: &[GroupAddress]) -> Result<PeerGroupHandle, EngineError> {
        let mut ids = Vec::with_capacity(self.inner.groups.len());
        for gs in &self.inner.groups {
            let peers = addrs.to_vec();
            ids.push(self.control(gs, |reply| Control::AddPeerGroup { peers, reply })?);
        }
        Ok(PeerGroupHandle {
            engine: self.inner.id,
            ids,
            members: addrs.into(),
        })
    }

    /// Posts a rotating pool of `count` receive buffers of `len` bytes on
    /// NIC 0 of group 0. `cb` runs on the callback thread for every
    /// received message (or receive error); the buffer is re-posted after
    /// `cb` returns. Buffers flushed at shutdown are not reported.
    pub fn submit_recvs(
        &self,
        len: u64,
        count: u32,
        cb: impl FnMut(Result<&[u8], EngineError>) + Send + 'static,
    ) -> Result<(), EngineError> {
        if len == 0 || count == 0 {
            return Err(EngineError::InvalidArgument {
                what: "receive pool needs len > 0 and count > 0".into(),
            });
        }
        let total = len
            .checked_mul(u64::from(count))
            .and_then(|t| usize::try_from(t).ok())
            .ok_or_else(|| EngineError::InvalidArgument {
                what: "receive pool size overflows".into(),
            })?;
        // Pool ids are part of receive WR ids and never reused: refuse
        // rather than wrap onto a live pool.
        let id = self
            .inner
            .next_pool
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_add(1))
            .map_err(|_| EngineError::RecvPoolsExhausted {
                limit: u32::from(u16::MAX),
            })?;
        let pool = Arc::new(RecvPool {
            id,
            group: 0,
            buf: RawBuf::new(total)?,
            len,
            count,
            cb: parking_lot::Mutex::new(Box::new(cb) as RecvCallback),
        });
        let gs = self.group(0)?;
        self.control(gs, |reply| Control::RecvPool { pool, reply })
    }

    // ------------------------------------------------------------- submits

    fn enqueue(&self, gs: &GroupShared, req: Submitted) -> Result<TransferId, EngineError> {
        let id = req.id;
        gs.submitting.fetch_add(1, Ordering::SeqCst);
        let r = self.enqueue_inner(gs, req);
        gs.submitting.fetch_sub(1, Ordering::SeqCst);
        match r {
            Ok(()) => Ok(id),
            Err((e, req)) => {
                // Give back a send slot the rejected request held.
                if let Body::Send {
                    payload: SendPayload::Slot { slot, .. },
                    ..
                } = req.body
                {
                    if let Some(p) = gs.send_pool.get() {
                        let _ = p.free.push(slot);
                    }
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::result_large_err)]
    fn enqueue_inner(
        &self,
        gs: &GroupShared,
        mut req: Submitted,
    ) -> Result<(), (EngineError, Submitted)> {
        let backoff = Backoff::new();
        loop {
            if self.inner.shut.load(Ordering::SeqCst) {
                return Err((EngineError::ShutDown, req));
            }
            if let Some(e) = gs.failed.get() {
                return Err((e.clone(), req));
            }
            #[cfg(feature = "latency-probe")]
            {
                req.stamps.enqueued = Instant::now();
            }
            match gs.queue.push(req) {
                Ok(()) => {
                    gs.wake();
                    return Ok(());
                }
                Err(r) => {
                    req = r;
                    if self.inner.config.queue_full == QueueFullPolicy::Fail
                        || self.inner.manual.is_some()
                    {
                        return Err((EngineError::QueueFull { group: gs.index }, req));
                    }
                    if let Some(t) = gs.thread.get() {
                        t.unpark();
                    }
                    if backoff.is_completed() {
                        std::thread::yield_now();
                    } else {
                        backoff.snooze();
                    }
                }
            }
        }
    }

    fn new_req(&self, on_done: OnDone, body: Body) -> Submitted {
        #[cfg(feature = "latency-probe")]
        let now = Instant::now();
        Submitted {
            id: TransferId(self.inner.next_id.fetch_add(1, Ordering::Relaxed)),
            on_done,
            body,
            #[cfg(feature = "latency-probe")]
            stamps: crate::probe::Stamps {
                submit: now,
                enqueued: now,
            },
        }
    }

    /// The receiver's [`ImmCounts`] assume the sender spreads over as many
    /// NICs as the receiver has: refuse a destination with another count.
    /// The handle was made by this engine and has `n` members.
    fn check_peer_group(&self, peers: &PeerGroupHandle, n: usize) -> Result<(), EngineError> {
        if peers.engine != self.inner.id {
            return Err(EngineError::InvalidArgument {
                what: "peer group handle of another engine".into(),
            });
        }
        if n != peers.len() {
            return Err(EngineError::InvalidArgument {
                what: format!("{n} destinations for a peer group of {}", peers.len()),
            });
        }
        Ok(())
    }

    /// `dst` with its NIC addresses interned (see `AddrBook`).
    fn plain(&self, dst: &MrDesc) -> Result<PlainDst, EngineError> {
        PlainDst::new(dst, &self.inner.addrs).ok_or_else(|| EngineError::InvalidArgument {
            what: format!(
                "destination has {} rkeys, more than {MAX_NICS} NICs",
                dst.rkeys.len()
            ),
        })
    }

    fn check_lanes(&self, g: usize, dst: &MrDesc) -> Result<(), EngineError> {
        let local = self.nic_count(g)?;
        if dst.rkeys.len() != local {
            return Err(EngineError::NicCountMismatch {
                group: g,
                local,
                remote: dst.rkeys.len(),
            });
        }
        Ok(())
    }

    fn check_dst(
        dst: &MrDesc,
        what: impl std::fmt::Display,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        if dst.rkeys.is_empty() {
            return Err(EngineError::InvalidArgument {
                what: format!("{what}: descriptor has no rkeys"),
            });
        }
        match offset.checked_add(len) {
            Some(end) if end <= dst.len => Ok(()),
            _ => Err(EngineError::OutOfBounds {
                what: what.to_string(),
                offset,
                len,
                region_len: dst.len,
            }),
        }
    }

    /// SENDs a copy of `msg` from NIC 0 of group 0 to NIC 0 of `peer`.
    pub fn submit_send(
        &self,
        peer: &GroupAddress,
        msg: &[u8],
        on_done: OnDone,
    ) -> Result<TransferId, EngineError> {
        let addr = peer
            .nics
            .first()
            .ok_or_else(|| EngineError::InvalidArgument {
                what: "peer address has no NICs".into(),
            })?;
        let gs = self.group(0)?;
        let info = self.info(0)?;
        if msg.len() as u64 > info.max_send_len {
            return Err(EngineError::InvalidArgument {
                what: format!(
                    "message of {} bytes exceeds max_send_len {}",
                    msg.len(),
                    info.max_send_len
                ),
            });
        }
        let payload = match gs.send_pool.get().and_then(|p| p.try_fill(msg)) {
            Some(slot) => SendPayload::Slot {
                slot,
                len: msg.len() as u64,
            },
            None => SendPayload::Owned(msg.to_vec()),
        };
        let req = self.new_req(
            on_done,
            Body::Send {
                peer: addr.clone(),
                payload,
            },
        );
        self.enqueue(gs, req)
    }

    /// One WRITE of `len` bytes from `src.0` at offset `src.1` to `dst.0`
    /// at offset `dst.1`, sharded across the group's NICs (see
    /// [`crate::shard::plan_single_write`]); with `imm`, every piece
    /// carries it ([`ImmCounts::single_write`] immediates in total).
    pub fn submit_single_write(
        &self,
        len: u64,
        imm: Option<Imm>,
        src: (&MrHandle, u64),
        dst: (&MrDesc, u64),
        on_done: OnDone,
    ) -> Result<TransferId, EngineError> {
        let (h, src_off) = src;
        let (d, dst_off) = dst;
        h.check("source", src_off, len)?;
        Self::check_dst(d, "destination", dst_off, len)?;
        self.check_lanes(h.group as usize, d)?;
        let gs = self.group(h.group as usize)?;
        let req = self.new_req(
            on_done,
            Body::Single {
                len,
                imm,
                src: h.key(),
                src_off,
                dst: self.plain(d)?,
                dst_off,
            },
        );
        self.enqueue(gs, req)
    }

    /// Page `i` of `src` pages goes to page `i` of `dst` pages (`page_len`
    /// bytes each); pages are spread over the NICs (`i % nics`). With
    /// `imm`, [`ImmCounts::paged_writes`] immediates in total.
    pub fn submit_paged_writes(
        &self,
        page_len: u64,
        imm: Option<Imm>,
        src: (&MrHandle, &Pages),
        dst: (&MrDesc, &Pages),
        on_done: OnDone,
    ) -> Result<TransferId, EngineError> {
        let (h, sp) = src;
        let (d, dp) = dst;
        if sp.len() != dp.len() {
            return Err(EngineError::InvalidArgument {
                what: format!(
                    "{} source pages but {} destination pages",
                    sp.len(),
                    dp.len()
                ),
            });
        }
        // Page offsets grow with the page index, so checking the page with
        // the largest index of each side checks them all (one pass over
        // the indices instead of checked arithmetic per page).
        if let Some(i) = last_max_index(sp) {
            let so = sp
                .page_offset(i)
                .ok_or_else(|| EngineError::InvalidArgument {
                    what: format!("source page {i} offset overflows"),
                })?;
            h.check(format_args!("source page {i}"), so, page_len)?;
        }
        if let Some(i) = last_max_index(dp) {
            let d_o = dp
                .page_offset(i)
                .ok_or_else(|| EngineError::InvalidArgument {
                    what: format!("destination page {i} offset overflows"),
                })?;
            Self::check_dst(d, format_args!("destination page {i}"), d_o, page_len)?;
        }
        self.check_lanes(h.group as usize, d)?;
        let gs = self.group(h.group as usize)?;
        let req = self.new_req(
            on_done,
            Body::Paged {
                page_len,
                imm,
                src: h.key(),
                src_pages: sp.clone(),
                dst: self.plain(d)?,
                dst_pages: dp.clone(),
            },
        );
        self.enqueue(gs, req)
    }

    /// One WRITE per peer of the group (`dsts[j]` to member `j`), spread by
    /// the configured [`ScatterMode`].
    pub fn submit_scatter(
        &self,
        peers: &PeerGroupHandle,
        on_done: OnDone,
        imm: Option<Imm>,
        src: &MrHandle,
        dsts: &[ScatterDst],
    ) -> Result<TransferId, EngineError> {
        self.submit_scatter_mode(
            peers,
            on_done,
            imm,
            src,
            dsts,
            self.inner.config.scatter_mode,
        )
    }

    /// [`TransferEngine::submit_scatter`] with an explicit mode.
    pub fn submit_scatter_mode(
        &self,
        peers: &PeerGroupHandle,
        on_done: OnDone,
        imm: Option<Imm>,
        src: &MrHandle,
        dsts: &[ScatterDst],
        mode: ScatterMode,
    ) -> Result<TransferId, EngineError> {
        self.check_peer_group(peers, dsts.len())?;
        for (j, d) in dsts.iter().enumerate() {
            src.check(format_args!("scatter source {j}"), d.src_offset, d.len)?;
            Self::check_dst(
                &d.dst,
                format_args!("scatter destination {j}"),
                d.dst_offset,
                d.len,
            )?;
        }
        let g = src.group as usize;
        for d in dsts {
            self.check_lanes(g, &d.dst)?;
        }
        let gs = self.group(g)?;
        let pg = *peers.ids.get(g).ok_or_else(|| no_group(g))?;
        let req = self.new_req(
            on_done,
            Body::Scatter {
                imm,
                src: src.key(),
                peers: pg,
                dsts: routed_dsts(
                    &peers.members,
                    dsts.iter()
                        .map(|d| (&d.dst, d.len, d.src_offset, d.dst_offset)),
                )
                .unwrap_or_else(|| Dsts::Described(dsts.to_vec())),
                mode,
            },
        );
        self.enqueue(gs, req)
    }

    /// An immediate-only (zero-length) WRITE to every member of the peer
    /// group, from group 0: each destination receives exactly one `imm`.
    pub fn submit_barrier(
        &self,
        peers: &PeerGroupHandle,
        on_done: OnDone,
        imm: Imm,
        dsts: &[MrDesc],
    ) -> Result<TransferId, EngineError> {
        self.check_peer_group(peers, dsts.len())?;
        for (j, d) in dsts.iter().enumerate() {
            Self::check_dst(d, format_args!("barrier destination {j}"), 0, 0)?;
        }
        let gs = self.group(0)?;
        let pg = *peers.ids.first().ok_or_else(|| no_group(0))?;
        let req = self.new_req(
            on_done,
            Body::Barrier {
                imm,
                peers: pg,
                dsts: routed_dsts(&peers.members, dsts.iter().map(|d| (d, 0, 0, 0)))
                    .unwrap_or_else(|| {
                        Dsts::Described(
                            dsts.iter()
                                .map(|d| ScatterDst {
                                    len: 0,
                                    src_offset: 0,
                                    dst: d.clone(),
                                    dst_offset: 0,
                                })
                                .collect(),
                        )
                    }),
            },
        );
        self.enqueue(gs, req)
    }

    // ---------------------------------------------------------- immediates

    /// Allocates an immediate value (dense, from `0..imm_capacity`).
    pub fn alloc_imm(&self) -> Result<Imm, EngineError> {
        let mut a = self.inner.imm_free.lock();
        if let Some(v) = a.free.pop() {
            if let Some(u) = a.in_use.get_mut(v as usize) {
                *u = true;
            }
            return Ok(v);
        }
        if a.next < self.inner.imms.capacity() {
            let v = a.next;
            a.next += 1;
            a.in_use.push(true);
            return Ok(v);
        }
        Err(EngineError::ImmExhausted {
            capacity: self.inner.imms.capacity(),
        })
    }

    /// Returns an immediate value to the allocator. Arrivals of it that no
    /// round consumed are reported as excess (to the excess handler, and in
    /// [`EngineStats::imm_excess`]); an armed, unfired round fails with
    /// [`EngineError::InvalidArgument`].
    pub fn free_imm(&self, imm: Imm) {
        let (n, unfired) = self.inner.imms.reset(imm);
        self.report_excess(imm, n);
        for d in unfired {
            self.finish_imm(
                d,
                Err(EngineError::InvalidArgument {
                    what: format!("immediate {imm} freed while armed"),
                }),
            );
        }
        let mut a = self.inner.imm_free.lock();
        // Only values handed out and not yet freed return to the pool, so a
        // double free cannot make `alloc_imm` hand a value out twice.
        if let Some(u) = a.in_use.get_mut(imm as usize) {
            if *u {
                *u = false;
                a.free.push(imm);
            }
        }
    }

    fn report_excess(&self, imm: Imm, n: u64) {
        if n > 0 {
            self.inner.excess_total.fetch_add(n, Ordering::Relaxed);
            let _ = self.inner.cb_tx.send(CbMsg::Excess(imm, n));
        }
    }

    /// Reports a round: flags and counters here, callbacks on the callback
    /// thread.
    fn finish_imm(&self, d: ImmDone, r: DoneResult) {
        if let Some((cb, r)) = d.resolve(r) {
            self.dispatch(Event::Done(cb, r));
        }
    }

    fn dispatch(&self, e: Event) {
        let _ = self.inner.cb_tx.send(CbMsg::Event(e));
    }

    /// Calls `cb` (on the callback thread) once `count` immediates `imm`
    /// have arrived, counting arrivals that came before this call. Fires
    /// exactly once, never early; `count == 0` fires at once. Re-arm after
    /// it fired for the next round. Fails if a round is already armed.
    /// At shutdown an unfired round gets `Err(ShutDown)`. While a round
    /// waits, idle workers poll without sleeping (see
    /// [`EngineConfig::idle_sleep`]).
    pub fn expect_imm_count(
        &self,
        imm: Imm,
        count: u32,
        cb: impl FnOnce(DoneResult) + Send + 'static,
    ) -> Result<(), EngineError> {
        self.expect_imm_count_with(imm, count, OnDone::callback(cb))
    }

    /// [`expect_imm_count`](Self::expect_imm_count) reporting to any
    /// [`OnDone`]: a flag or a counter is set by the worker that counted the
    /// last immediate (or by this call, when early arrivals already reach
    /// `count`), with no hop through the callback thread. A refused arm
    /// drops `on_done` unresolved.
    pub fn expect_imm_count_with(
        &self,
        imm: Imm,
        count: u32,
        on_done: OnDone,
    ) -> Result<(), EngineError> {
        if self.inner.shut.load(Ordering::SeqCst) {
            return Err(EngineError::ShutDown);
        }
        if count == 0 {
            if let Some((cb, r)) = on_done.resolve_inline(Ok(())) {
                self.dispatch(Event::Done(cb, r));
            }
            return Ok(());
        }
        let d = ImmDone::new(on_done, &self.inner.imm_waits);
        match self.inner.imms.arm(imm, count, d) {
            Ok(Some(d)) => {
                self.finish_imm(d, Ok(()));
                Ok(())
            }
            Ok(None) => {
                // The round waits: sleeping workers poll again now (see
                // `ImmWaits`).
                self.inner.imm_waits.arms.fetch_add(1, Ordering::SeqCst);
                for g in &self.inner.groups {
                    g.wake();
                }
                Ok(())
            }
            Err((ArmError::AlreadyArmed, _)) => Err(EngineError::ImmAlreadyArmed { imm }),
        }
    }

    /// Whether `imm` has an armed round that has not fired.
    pub fn imm_armed(&self, imm: Imm) -> bool {
        self.inner.imms.is_armed(imm)
    }

    /// [`expect_imm_count`](Self::expect_imm_count) rounds (of every value)
    /// armed whose callbacks have not run yet: a round counts from its arm
    /// until its callback returned, or was dropped unrun (a refused arm).
    /// While it is non-zero, idle workers poll without sleeping (see
    /// [`EngineConfig::idle_sleep`]).
    pub fn armed_imm_rounds(&self) -> u64 {
        self.inner.imm_waits.armed.load(Ordering::SeqCst)
    }

    /// Arrivals of `imm` not yet consumed by a round.
    pub fn imm_pending(&self, imm: Imm) -> u64 {
        self.inner.imms.pending(imm)
    }

    // ------------------------------------------------------------- watcher

    /// Allocates a host word watched by the UVM watcher thread; `cb(old,
    /// new)` runs on that thread when it changes (changes may coalesce).
    pub fn alloc_uvm_watcher(&self, cb: impl FnMut(u64, u64) + Send + 'static) -> UvmWatcher {
        self.inner.watcher.alloc(Box::new(cb) as WatchCallback)
    }

    /// Watches an externally allocated word (e.g. host-mapped pinned memory
    /// a GPU writes).
    ///
    /// # Safety
    /// `ptr` must point to an 8-byte aligned word that stays valid (mapped,
    /// not freed) until the returned [`UvmWatcher`] is dropped, and that is
    /// only ever written atomically or by a device.
    pub unsafe fn watch_word(
        &self,
        ptr: NonNull<AtomicU64>,
        cb: impl FnMut(u64, u64) + Send + 'static,
    ) -> UvmWatcher {
        // SAFETY: forwarded to the caller.
        unsafe {
            self.inner
                .watcher
                .external(ptr, Box::new(cb) as WatchCallback)
        }
    }

    // ------------------------------------------------------------- driving

    /// Manual mode only: runs one iteration of every worker, then the
    /// callbacks it produced, then one watcher scan, all on this thread.
    /// Returns whether anything happened. Do not call from a callback.
    pub fn progress(&self) -> bool {
        let Some(m) = &self.inner.manual else {
            return false;
        };
        let mut did = false;
        let msgs: Vec<CbMsg> = {
            let mut st = m.lock();
            for w in st.workers.iter_mut() {
                did |= w.iterate();
            }
            st.cb_rx.try_iter().collect()
        };
        for msg in msgs {
            did = true;
            run_msg(&self.inner.groups, &self.inner.excess, msg);
        }
        did |= self.inner.watcher.scan();
        did
    }

    /// Latency-probe records collected so far (feature `latency-probe`).
    #[cfg(feature = "latency-probe")]
    pub fn take_probe_records(&self) -> Vec<crate::probe::Record> {
        self.inner.probes.drain()
    }

    /// Stops the engine: new submits fail with `ShutDown`, queued and
    /// not-yet-posted work fails with `ShutDown`, posted work is drained
    /// (up to `drain_timeout`, then failed), armed immediate rounds fail,
    /// unconsumed immediates are reported as excess, every callback already
    /// due is run, then all threads exit. Idempotent. Must not be called
    /// from a callback.
    pub fn shutdown(&self) {
        if self.inner.shut.swap(true, Ordering::SeqCst) {
            // Someone else is/was shutting down: return only once that
            // shutdown has finished (unless called from inside a callback,
            // which that shutdown may be waiting for).
            if IN_CALLBACK.with(Cell::get) {
                return;
            }
            let b = Backoff::new();
            while !self.inner.done.load(Ordering::SeqCst) {
                if b.is_completed() {
                    std::thread::sleep(Duration::from_micros(100));
                } else {
                    b.snooze();
                }
            }
            return;
        }
        // No submitter may be between its shutdown check and its push.
        for g in &self.inner.groups {
            let b = Backoff::new();
            while g.submitting.load(Ordering::SeqCst) != 0 {
                b.snooze();
            }
            g.closing.store(true, Ordering::SeqCst);
            if let Some(t) = g.thread.get() {
                t.unpark();
            }
        }
        if let Some(m) = &self.inner.manual {
            let deadline = Instant::now() + self.inner.config.drain_timeout;
            loop {
                let all_done = {
                    let mut st = m.lock();
                    for w in st.workers.iter_mut() {
                        w.iterate();
                        w.drain_step(deadline);
                    }
                    st.workers.iter().all(|w| w.finished)
                };
                while self.progress_callbacks() {}
                if all_done {
                    break;
                }
            }
            let workers = std::mem::take(&mut m.lock().workers);
            for w in workers {
                w.core.close();
            }
        } else {
            let workers = std::mem::take(&mut self.inner.threads.lock().workers);
            for h in workers {
                let _ = h.join();
            }
        }
        // Unfired rounds and unconsumed immediates.
        for (imm, n, cbs) in self.inner.imms.reset_all() {
            self.report_excess(imm, n);
            for d in cbs {
                self.finish_imm(d, Err(EngineError::ShutDown));
            }
        }
        self.inner.watcher.stop.store(true, Ordering::SeqCst);
        self.inner.watcher.unpark();
        let _ = self.inner.cb_tx.send(CbMsg::Stop);
        if self.inner.manual.is_some() {
            while self.progress_callbacks() {}
        } else {
            let (cb, w) = {
                let mut t = self.inner.threads.lock();
                (t.callback.take(), t.watcher.take())
            };
            let me = std::thread::current().id();
            if let Some(h) = cb {
                if h.thread().id() != me {
                    let _ = h.join();
                }
            }
            if let Some(h) = w {
                if h.thread().id() != me {
                    let _ = h.join();
                }
            }
        }
        self.inner.watcher.clear();
        self.inner.done.store(true, Ordering::SeqCst);
    }

    fn progress_callbacks(&self) -> bool {
        let Some(m) = &self.inner.manual else {
            return false;
        };
        let msgs: Vec<CbMsg> = m.lock().cb_rx.try_iter().collect();
        let any = !msgs.is_empty();
        for msg in msgs {
            run_msg(&self.inner.groups, &self.inner.excess, msg);
        }
        any
    }
}

// ----------------------------------------------------------------- threads

#[derive(Clone, Copy)]
struct Idle {
    spins: u32,
    yields: u32,
    sleep: Option<Duration>,
}

impl From<&EngineConfig> for Idle {
    fn from(c: &EngineConfig) -> Self {
        Self {
            spins: c.idle_spins,
            yields: c.idle_yields,
            sleep: c.idle_sleep,
        }
    }
}

impl Idle {
    /// Returns true when the caller should park for `sleep`.
    fn step(&self, idle: &mut u32) -> Option<Duration> {
        *idle = idle.saturating_add(1);
        if *idle <= self.spins {
            std::hint::spin_loop();
            None
        } else if *idle <= self.spins + self.yields || self.sleep.is_none() {
            std::thread::yield_now();
            None
        } else {
            self.sleep
        }
    }
}

struct WorkerCtx {
    spec: DomainGroupSpec,
    shared: Arc<GroupShared>,
    ctrl_rx: Receiver<Control>,
    imms: Arc<ImmTable<ImmDone>>,
    imm_waits: Arc<ImmWaits>,
    addrs: Arc<AddrBook>,
    cfg: EngineConfig,
    cb_tx: Sender<CbMsg>,
    #[cfg(feature = "latency-probe")]
    probes: Arc<crate::probe::ProbeSink>,
}

impl WorkerCtx {
    /// Opens the domains (on the calling thread) and builds the worker.
    fn open(self) -> Result<Worker, EngineError> {
        let g = self.shared.index;
        let mut domains = Vec::with_capacity(self.spec.nics.len());
        for &n in &self.spec.nics {
            let d = self.spec.provider.open(n).map_err(|e| EngineError::Setup {
                group: g,
                what: format!("opening NIC {n} of provider {}", self.spec.provider.name()),
                source: Some(Box::new(e)),
            })?;
            domains.push(d);
        }
        let core = WorkerCore::new(
            g,
            domains,
            self.imms,
            self.addrs,
            self.cfg.shard,
            self.cfg.send_slots,
            self.cfg.send_slot_len,
            #[cfg(feature = "latency-probe")]
            self.probes,
        )?;
        let _ = self.shared.info.set(core.info());
        let _ = self.shared.send_pool.set(core.send_pool());
        Ok(Worker {
            core,
            ctrl_rx: self.ctrl_rx,
            shared: self.shared,
            imm_waits: self.imm_waits,
            cb_tx: self.cb_tx,
            events: Vec::new(),
            max_pending: self.cfg.max_pending_wrs.max(1),
            draining: None,
            finished: false,
        })
    }
}

struct Worker {
    core: WorkerCore,
    ctrl_rx: Receiver<Control>,
    shared: Arc<GroupShared>,
    imm_waits: Arc<ImmWaits>,
    cb_tx: Sender<CbMsg>,
    events: Vec<Event>,
    max_pending: usize,
    draining: Option<Instant>,
    finished: bool,
}

const BURST: usize = 64;

impl Worker {
    /// One loop iteration in SPEC priority order. Returns whether anything
    /// happened.
    fn iterate(&mut self) -> bool {
        let mut did = false;
        while let Ok(c) = self.ctrl_rx.try_recv() {
            self.core.handle_control(c);
            did = true;
        }
        if self.draining.is_none() {
            // (1) new requests and their first WRs
            let mut n = 0;
            while n < BURST && self.core.pending_pieces() < self.max_pending {
                let Some(r) = self.shared.queue.pop() else {
                    break;
                };
                self.core.take_request(r);
                n += 1;
            }
            did |= n > 0;
        }
        // (2) more WRs of pending requests
        did |= self.core.post_backlog();
        // (3) completion queues
        did |= self.core.poll() > 0;
        self.flush();
        did
    }

    fn flush(&mut self) {
        self.core.take_events(&mut self.events);
        for e in self.events.drain(..) {
            let _ = self.cb_tx.send(CbMsg::Event(e));
        }
    }

    /// The worker panicked: fail everything it holds with `WorkerFailed`,
    /// mark the group failed, then refuse work until shutdown.
    fn failed(&mut self, payload: &(dyn std::any::Any + Send)) {
        let g = self.shared.index;
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".to_string());
        tracing::error!(group = g, what = %what, "worker panicked; failing the group");
        let e = EngineError::WorkerFailed { group: g, what };
        let _ = self.shared.failed.set(e.clone());
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.core.abandon_inflight(&e);
        }));
        if r.is_err() {
            tracing::error!(group = g, "failing in-flight work panicked too");
        }
        loop {
            while let Some(r) = self.shared.queue.pop() {
                self.core.reject(r, e.clone());
            }
            // Control requests are dropped: their callers see a closed
            // reply channel.
            while self.ctrl_rx.try_recv().is_ok() {}
            self.flush();
            if self.shared.closing.load(Ordering::SeqCst) && self.shared.queue.is_empty() {
                break;
            }
            std::thread::park_timeout(Duration::from_millis(1));
        }
        self.finished = true;
    }

    /// Shutdown handling; call after `iterate` while closing.
    fn drain_step(&mut self, deadline: Instant) {
        if self.finished || !self.shared.closing.load(Ordering::SeqCst) {
            return;
        }
        if self.draining.is_none() {
            self.draining = Some(deadline);
            while let Some(r) = self.shared.queue.pop() {
                self.core.reject(r, EngineError::ShutDown);
            }
            self.core.fail_unposted(&EngineError::ShutDown);
        }
        let deadline = self.draining.unwrap_or(deadline);
        if !self.core.busy() {
            self.finished = true;
        } else if Instant::now() >= deadline {
            tracing::warn!(
                group = self.shared.index,
                "shutdown: abandoning in-flight work"
            );
            self.core.abandon_inflight(&EngineError::ShutDown);
            self.finished = true;
        }
        self.flush();
    }
}

fn worker_main(ctx: WorkerCtx, init: Sender<(usize, Result<(), EngineError>)>) {
    let g = ctx.shared.index;
    let _ = ctx.shared.thread.set(std::thread::current());
    // Pin first, then allocate everything (domains, pools) on this thread.
    let numa = ctx.spec.numa.or_else(|| {
        ctx.spec.provider.nics().ok().and_then(|n| {
            ctx.spec
                .nics
                .first()
                .and_then(|&i| n.get(i))
                .and_then(|i| i.numa_node)
        })
    });
    match affinity::pick_cpu(ctx.spec.cpu, numa, g) {
        Some(cpu) => {
            if !affinity::pin_current(cpu) {
                tracing::warn!(group = g, cpu, "could not pin worker");
            }
        }
        None => tracing::debug!(group = g, "topology unknown: worker not pinned"),
    }
    let mut idle = Idle::from(&ctx.cfg);
    let inflight_spin = ctx.cfg.inflight_spin;
    let drain = ctx.cfg.drain_timeout;
    let mut w = match ctx.open() {
        Ok(w) => {
            let _ = init.send((g, Ok(())));
            w
        }
        Err(e) => {
            let _ = init.send((g, Err(e)));
            return;
        }
    };
    drop(init);
    let mut idle_n = 0u32;
    let mut last_progress = Instant::now();
    let mut seen_arms = w.imm_waits.arms.load(Ordering::SeqCst);
    let software_progress = w.core.software_progress();
    if software_progress {
        // See `EngineConfig::idle_spins`.
        idle.spins = 0;
    }
    loop {
        let did = match std::panic::catch_unwind(AssertUnwindSafe(|| w.iterate())) {
            Ok(did) => did,
            Err(p) => {
                w.failed(&*p);
                break;
            }
        };
        if w.shared.closing.load(Ordering::SeqCst) {
            w.drain_step(Instant::now() + drain);
            if w.finished {
                break;
            }
        }
        if did {
            idle_n = 0;
            if !software_progress {
                // Only the hardware path's in-flight spin limit reads it.
                last_progress = Instant::now();
            }
            continue;
        }
        if let Some(d) = idle.step(&mut idle_n) {
            let arms = w.imm_waits.arms.load(Ordering::SeqCst);
            if arms != seen_arms {
                // A round was armed since: its immediates are due.
                seen_arms = arms;
                last_progress = Instant::now();
            }
            let awaited = w.core.in_flight() || w.imm_waits.armed.load(Ordering::SeqCst) > 0;
            if software_progress || (awaited && last_progress.elapsed() < inflight_spin) {
                // Completions are due, or the NIC moves data (also what
                // peers write into this host) only while polled: keep
                // polling, only yield the core.
                std::thread::yield_now();
                continue;
            }
            w.shared.sleeping.store(true, Ordering::SeqCst);
            // Each check pairs with its waker's `wake` after its store.
            if w.shared.queue.is_empty()
                && w.ctrl_rx.is_empty()
                && !w.shared.closing.load(Ordering::SeqCst)
                && w.imm_waits.arms.load(Ordering::SeqCst) == seen_arms
            {
                std::thread::park_timeout(d);
            }
            w.shared.sleeping.store(false, Ordering::SeqCst);
        }
    }
    // Leftover control requests get an answer.
    if w.shared.failed.get().is_none() {
        while let Ok(c) = w.ctrl_rx.try_recv() {
            w.core.handle_control(c);
        }
    }
    w.flush();
    let Worker { core, .. } = w;
    if std::panic::catch_unwind(AssertUnwindSafe(|| core.close())).is_err() {
        tracing::error!(group = g, "closing the group's domains panicked");
    }
}

thread_local! {
    /// Set while this thread runs a user callback.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

fn run_msg(groups: &[Arc<GroupShared>], excess: &ExcessHandler, msg: CbMsg) {
    let outer = IN_CALLBACK.with(|c| c.replace(true));
    // A receive buffer is re-posted after its callback returned, even when
    // the callback panicked (the repost runs outside the unwind boundary).
    let mut repost = None;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match msg {
        CbMsg::Event(Event::Done(cb, r)) => cb(r),
        CbMsg::Event(Event::Recv { pool, idx, result }) => {
            repost = Some((pool.group, pool.id, idx));
            {
                let mut cb = pool.cb.lock();
                match result {
                    Ok(n) => {
                        // SAFETY: buffer `idx` completed and is re-posted
                        // only below, after the callback returned.
                        match unsafe { pool.bytes(idx, n) } {
                            Some(b) => cb(Ok(b)),
                            None => cb(Err(EngineError::InvalidArgument {
                                what: format!("receive of {n} bytes into buffer {idx}"),
                            })),
                        }
                    }
                    Err(e) => cb(Err(e)),
                }
            }
        }
        CbMsg::Excess(imm, n) => excess(imm, n),
        CbMsg::Stop => {}
    }));
    IN_CALLBACK.with(|c| c.set(outer));
    if r.is_err() {
        tracing::error!("a weft callback panicked");
    }
    if let Some((group, pool, idx)) = repost {
        if let Some(g) = groups.get(group) {
            let _ = g.ctrl.send(Control::Repost { pool, idx });
            g.wake();
        }
    }
}

fn callback_main(groups: &[Arc<GroupShared>], excess: &ExcessHandler, rx: &Receiver<CbMsg>) {
    while let Ok(msg) = rx.recv() {
        if matches!(msg, CbMsg::Stop) {
            // Run whatever is still queued, then exit.
            while let Ok(m) = rx.try_recv() {
                if !matches!(m, CbMsg::Stop) {
                    run_msg(groups, excess, m);
                }
            }
            break;
        }
        run_msg(groups, excess, msg);
    }
}

fn watcher_main(w: &Arc<WatcherShared>, idle: Idle) {
    w.set_thread();
    let mut idle_n = 0u32;
    while !w.stop.load(Ordering::SeqCst) {
        if w.scan() {
            idle_n = 0;
            continue;
        }
        if !w.has_entries() {
            std::thread::park_timeout(Duration::from_millis(5));
            continue;
        }
        if let Some(d) = idle.step(&mut idle_n) {
            std::thread::park_timeout(d);
        }
    }
    w.running.store(false, Ordering::SeqCst);
}

/// Position of a largest page index of `p` (`None` when `p` is empty).
fn last_max_index(p: &Pages) -> Option<usize> {
    p.indices
        .iter()
        .enumerate()
        .max_by_key(|(_, &idx)| idx)
        .map(|(i, _)| i)
}
