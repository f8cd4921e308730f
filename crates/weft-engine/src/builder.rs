//! [`EngineBuilder`]: collects the domain groups and settings, then opens
//! every group (on its worker thread) and starts the engine's threads.

use crate::config::{DomainGroupSpec, EngineConfig, ExcessHandler, Idle};
use crate::driver::callback::callback_main;
use crate::driver::worker::{worker_main, WorkerCtx};
use crate::driver::{watcher_main, CbMsg, GroupShared};
use crate::engine::{ImmAlloc, Inner, ManualState, Threads, TransferEngine, NEXT_ENGINE_ID};
use crate::error::EngineError;
use crate::gate::Gate;
use crate::imm::{ImmDone, ImmTable, ImmWaits};
use crate::request::AddrBook;
use crate::stats::GroupCounters;
use crate::watcher::WatcherShared;
use crate::MAX_NICS;
use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use weft_transport::Imm;

/// Builds a [`TransferEngine`].
#[derive(Default)]
pub struct EngineBuilder {
    groups: Vec<DomainGroupSpec>,
    config: EngineConfig,
    manual: bool,
    excess: Option<ExcessHandler>,
    incarnation: Option<weft_transport::Incarnation>,
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("groups", &self.groups)
            .field("config", &self.config)
            .field("manual", &self.manual)
            .field("incarnation", &self.incarnation)
            .finish()
    }
}

impl TransferEngine {
    /// Starts a builder.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::new()
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

    /// Sets the engine's incarnation instead of drawing one (for
    /// deterministic tests). By default an engine draws a fresh one at
    /// build: the wall clock in nanoseconds since the Unix epoch, its low
    /// 16 bits replaced by a mix of the process id, and strictly larger
    /// than any this process drew before, so that a process restarted on
    /// the same host gets a larger incarnation than its predecessor. Peers
    /// refuse an incarnation older than the one they use at the same NIC
    /// address, and adopt a newer one only once that one ended (see
    /// [`TransferEngine::incarnation`] and docs/engine.md, "Peer
    /// lifecycle").
    pub fn incarnation(mut self, incarnation: weft_transport::Incarnation) -> Self {
        self.incarnation = Some(incarnation);
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
        let probes = crate::probe::Probes::new();
        let mut groups = Vec::new();
        let mut ctrl_rxs = Vec::new();
        for (i, spec) in self.groups.iter().enumerate() {
            if spec.nics.is_empty() || spec.nic_count() > MAX_NICS {
                return Err(EngineError::Setup {
                    group: i,
                    what: format!(
                        "a group needs 1..={MAX_NICS} NICs, got {}",
                        spec.nic_count()
                    ),
                    source: None,
                });
            }
            let (ctrl, ctrl_rx) = crossbeam_channel::unbounded();
            groups.push(Arc::new(GroupShared {
                index: i,
                device: spec.device,
                queue: ArrayQueue::new(cfg.queue_capacity.max(1)),
                ctrl,
                ctrl_sent: CachePadded::new(AtomicU64::new(0)),
                info: OnceLock::new(),
                send_pool: OnceLock::new(),
                submitting: CachePadded::new(AtomicUsize::new(0)),
                closing: CachePadded::new(AtomicBool::new(false)),
                sleeping: CachePadded::new(AtomicBool::new(false)),
                thread: OnceLock::new(),
                wake_fd: crate::driver::block::WakeFd::new(),
                failed: OnceLock::new(),
                counters: Arc::new(GroupCounters::new(spec.nic_count())),
                slot: parking_lot::Mutex::new(None),
            }));
            ctrl_rxs.push(ctrl_rx);
        }
        let imm_waits = Arc::new(ImmWaits::default());
        let addrs = Arc::new(AddrBook::default());
        let inner = Arc::new(Inner {
            id: NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed),
            incarnation: self.incarnation.unwrap_or_else(crate::incarnation::fresh),
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
            arm_gate: Gate::default(),
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
            watches: Default::default(),
            probes: probes.clone(),
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
                probes: probes.clone(),
                incarnation: inner.incarnation,
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
            let cb_excess = Arc::clone(&inner.excess);
            let cb_idle = Idle::from(&cfg);
            let cb = std::thread::Builder::new()
                .name("weft-callbacks".into())
                .spawn(move || callback_main(&cb_excess, &cb_rx, cb_idle))
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
