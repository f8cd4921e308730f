//! The prefill side on the engine: registers the application's KV cache
//! (the source), runs [`PrefillerCore`] on the engine's receive and
//! completion callbacks, the UVM watcher and a heartbeat timer, and hands
//! requests to the application as [`Incoming`]s to accept and serve.

mod actions;
mod checks;
mod core;
mod ids;

pub use self::core::{Incoming, PreAction, PrefillerCore, TaskKey, Write};
pub use self::ids::ID_WINDOW;

use crate::completion::{Completion, CompletionFuture};
use crate::decoder::KvConfig;
use crate::regions::{layer_region, Registered};
use crate::timer::{drive, Role, Ticker};
use crate::wire::{encode, Auth, Msg};
use crate::CacheRegions;
use crate::{KvError, KvLayout};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{GroupAddress, MrHandle, OnDone, Registration, TransferEngine, UvmWatcher};

/// Host-side cost of reporting layers: from a layer report (a watcher
/// change or a call) until all its writes were handed to the engine.
#[derive(Debug, Default)]
pub struct PrefillStats {
    /// Layer reports that posted something.
    pub reports: AtomicU64,
    /// Steps (layers, tails) posted.
    pub steps: AtomicU64,
    /// Sum of the reports' host time (ns).
    pub report_ns: AtomicU64,
    /// Longest report (ns).
    pub report_ns_max: AtomicU64,
}

/// The outcome of serving one request at the prefiller.
pub type ServeOutcome = Result<(), KvError>;

struct Shared {
    engine: Arc<TransferEngine>,
    me: GroupAddress,
    core: Mutex<PrefillerCore>,
    /// The KV regions: one for the whole cache or one per layer.
    kv: Vec<MrHandle>,
    tail: Option<MrHandle>,
    /// The registrations of `kv` and `tail`, released at shutdown.
    mrs: Mutex<Vec<Registration>>,
    serving: Mutex<BTreeMap<TaskKey, Completion<ServeOutcome>>>,
    incoming: Mutex<Option<Sender<Incoming>>>,
    stats: PrefillStats,
    outcomes: crate::Outcomes,
}

/// The prefill side: serves decoders' requests from the application's
/// paged KV cache.
pub struct Prefiller {
    sh: Arc<Shared>,
    incoming: Receiver<Incoming>,
    ticker: Mutex<Option<Ticker>>,
}

/// A request being served: tell it which layers are computed (calls, or a
/// watcher word a kernel bumps); it completes once all its writes were
/// delivered, or failed, or it was cancelled or its decoder died.
#[derive(Clone)]
pub struct Serve {
    key: TaskKey,
    steps: u32,
    sh: Arc<Shared>,
    done: Completion<ServeOutcome>,
}

impl std::fmt::Debug for Serve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serve")
            .field("key", &self.key)
            .field("steps", &self.steps)
            .finish()
    }
}

impl Prefiller {
    /// Registers the application's cache (`regions`, shaped as `layout`)
    /// with `engine`, posts receive buffers (the prefiller owns the engine's
    /// receives) and starts the heartbeat timer.
    pub fn new(
        engine: Arc<TransferEngine>,
        layout: KvLayout,
        regions: CacheRegions,
        cfg: KvConfig,
    ) -> Result<Self, KvError> {
        let core = PrefillerCore::new(layout, cfg.heartbeat)?
            .with_max_pending(cfg.max_pending_requests)
            .with_max_decoders(cfg.max_decoders);
        let regs = Registered::new(&engine, &layout, &regions)?;
        let (kv, tail) = regs.handles();
        let (tx, rx) = crossbeam_channel::unbounded();
        let sh = Arc::new(Shared {
            me: engine.main_address(),
            engine: engine.clone(),
            core: Mutex::new(core),
            kv,
            tail,
            mrs: Mutex::new(regs.into_vec()),
            serving: Mutex::new(BTreeMap::new()),
            outcomes: crate::Outcomes::default(),
            incoming: Mutex::new(Some(tx)),
            stats: PrefillStats::default(),
        });
        let ticker = drive(&engine, &sh, &cfg, "prefiller", "kv-prefill-hb")?;
        Ok(Self {
            sh,
            incoming: rx,
            ticker: Mutex::new(Some(ticker)),
        })
    }

    /// This prefiller's address (what decoders add).
    pub fn address(&self) -> GroupAddress {
        self.sh.me.clone()
    }

    /// Requests handed to serving and how they ended.
    pub fn outcomes(&self) -> &crate::Outcomes {
        &self.sh.outcomes
    }

    /// Frames dropped so far: unauthentic, duplicate or replayed.
    pub fn dropped_frames(&self) -> u64 {
        self.sh.core.lock().dropped()
    }

    /// Host-side cost of the layer reports so far.
    pub fn stats(&self) -> &PrefillStats {
        &self.sh.stats
    }

    /// Requests not yet finished (incoming or being served).
    pub fn pending(&self) -> usize {
        self.sh.core.lock().pending()
    }

    /// The next request (blocks); [`KvError::ShutDown`] once shut down and
    /// every request that came before was taken.
    pub fn next_request(&self) -> Result<Incoming, KvError> {
        self.incoming.recv().map_err(|_| KvError::ShutDown)
    }

    /// The next request, if one comes within `timeout`.
    pub fn next_request_timeout(&self, timeout: Duration) -> Option<Incoming> {
        self.incoming.recv_timeout(timeout).ok()
    }

    /// The channel of incoming requests (for `select!`).
    pub fn incoming(&self) -> &Receiver<Incoming> {
        &self.incoming
    }

    /// Serves `inc` from this cache's pages `src_pages` (prompt order) and
    /// tail slot `tail_slot`.
    pub fn accept(
        &self,
        inc: &Incoming,
        src_pages: &[u32],
        tail_slot: u32,
    ) -> Result<Serve, KvError> {
        let done = Completion::new();
        let steps = {
            let mut c = self.sh.core.lock();
            c.accept(&inc.key, src_pages, tail_slot)?;
            self.sh.serving.lock().insert(inc.key.clone(), done.clone());
            self.sh.outcomes.started();
            c.steps(&inc.key).unwrap_or(0)
        };
        Ok(Serve {
            key: inc.key.clone(),
            steps,
            sh: self.sh.clone(),
            done,
        })
    }

    /// Decoder `addr` is gone (its rendezvous record left, or the
    /// application knows it died): its requests end with
    /// [`KvError::DecoderDead`] carrying `loss` once their posted writes
    /// completed, nothing more is written to it and its later requests are
    /// ignored (for ten heartbeat timeouts and while it has requests left;
    /// after that they are taken as a new decoder's, and their writes fail:
    /// the engine never writes to a removed incarnation again, see
    /// [`KvConfig::max_decoders`](crate::KvConfig)).
    pub fn remove_decoder(&self, addr: &GroupAddress, loss: crate::PeerLoss) {
        self.sh.step(|c| c.decoder_gone(addr, loss, Instant::now()));
    }

    /// Refuses `inc`; its decoder gets [`KvError::Refused`].
    pub fn reject(&self, inc: &Incoming, reason: &str) {
        let key = inc.key.clone();
        let reason = reason.to_string();
        self.sh.step(|c| c.reject(&key, reason, Instant::now()));
    }

    /// Refuses new requests, stops every request (each ends once its posted
    /// writes completed; decoders are told), stops the timer and — once
    /// nothing is in flight or `drain` passed — deregisters the cache.
    pub fn shutdown(&self, drain: Duration) {
        self.sh.step(|c| c.shutdown(Instant::now()));
        // wakes `next_request` callers with `ShutDown`
        drop(self.sh.incoming.lock().take());
        if let Some(mut t) = self.ticker.lock().take() {
            t.stop();
        }
        let pending: Vec<_> = self.sh.serving.lock().values().cloned().collect();
        let deadline = Instant::now() + drain;
        for p in pending {
            let _ = p.wait_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        for r in self.sh.mrs.lock().drain(..) {
            if let Err(e) = r.release() {
                tracing::warn!("prefiller: deregistering the cache: {e}");
            }
        }
    }
}

impl Drop for Prefiller {
    fn drop(&mut self) {
        if self.ticker.lock().is_some() {
            self.shutdown(Duration::from_secs(5));
        }
    }
}

/// The watched word of a request being served (see [`Serve::watch`]).
/// Dropping it stops the watch; after that the word must not be written.
#[derive(Debug)]
pub struct LayerWatch {
    w: UvmWatcher,
}

impl LayerWatch {
    /// The word, for a kernel (host memory the engine allocated).
    pub fn ptr(&self) -> NonNull<AtomicU64> {
        self.w.ptr()
    }

    /// The word, for host code and tests.
    pub fn word(&self) -> &AtomicU64 {
        self.w.word()
    }
}

impl Serve {
    /// Which request.
    pub fn key(&self) -> &TaskKey {
        &self.key
    }

    /// Steps: the layers, plus one for the tail if this prefiller writes it.
    pub fn steps(&self) -> u32 {
        self.steps
    }

    /// Layer `layer` is computed: posts it (and every earlier layer not yet
    /// posted).
    pub fn layer_ready(&self, layer: u32) -> Result<(), KvError> {
        self.ready(u64::from(layer) + 1)
    }

    /// The tail is computed (and so is every layer): posts what is left.
    pub fn tail_ready(&self) -> Result<(), KvError> {
        self.ready(u64::from(self.steps))
    }

    /// Steps `0..steps` are computed.
    pub fn ready(&self, steps: u64) -> Result<(), KvError> {
        self.sh.report(&self.key, steps)
    }

    /// A UVM watcher word for this request: a kernel (or host code) stores
    /// the number of steps computed into it (e.g. `scalar_inc` after each
    /// layer, once more for the tail); each change posts the new steps from
    /// the engine's watcher thread. The word stays valid, and watched, as
    /// long as the returned [`LayerWatch`] lives: keep it until every kernel
    /// that may write the word has finished, even if the request ends first.
    pub fn watch(&self) -> LayerWatch {
        let weak = Arc::downgrade(&self.sh);
        let key = self.key.clone();
        let w = self.sh.engine.alloc_uvm_watcher(move |_old, new| {
            if let Some(sh) = weak.upgrade() {
                if let Err(e) = sh.report(&key, new) {
                    tracing::warn!(id = key.id, "prefiller: watcher: {e}");
                }
            }
        });
        LayerWatch { w }
    }

    /// Watches an external word — e.g. a `weft_cuda::WatchWord`: a host-mapped
    /// pinned word whose device pointer a kernel (or a CUDA graph) bumps with
    /// `scalar_inc` after each layer and once more for the tail. The steps
    /// computed are `value - base` (a word reused across requests: pass its
    /// value at the start of this one).
    ///
    /// # Safety
    /// `ptr` must point to an 8-byte aligned word that stays valid until the
    /// returned [`LayerWatch`] is dropped, and is only ever written
    /// atomically or by a device.
    // Unsafe API: forwards the caller's promises to the engine's watcher.
    #[allow(unsafe_code)]
    pub unsafe fn watch_word(&self, ptr: NonNull<AtomicU64>, base: u64) -> LayerWatch {
        let weak = Arc::downgrade(&self.sh);
        let key = self.key.clone();
        let cb = move |_old: u64, new: u64| {
            if let Some(sh) = weak.upgrade() {
                if let Err(e) = sh.report(&key, new.saturating_sub(base)) {
                    tracing::warn!(id = key.id, "prefiller: watcher: {e}");
                }
            }
        };
        // SAFETY: the caller guarantees `ptr` outlives the returned watcher
        // and is written only atomically or by a device (this function's
        // contract, which is `watch_word`'s).
        let w = unsafe { self.sh.engine.watch_word(ptr, cb) };
        LayerWatch { w }
    }

    /// Whether it ended.
    pub fn is_done(&self) -> bool {
        self.done.is_done()
    }

    /// Blocks until it ended.
    pub fn wait(&self) -> ServeOutcome {
        self.done.wait()
    }

    /// Blocks until it ended or `timeout` passed.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<ServeOutcome> {
        self.done.wait_timeout(timeout)
    }

    /// Runs `cb` with the outcome once it ended.
    pub fn on_complete(&self, cb: impl FnOnce(&ServeOutcome) + Send + 'static) {
        self.done.on_complete(cb)
    }

    /// A future of the outcome.
    pub fn future(&self) -> CompletionFuture<ServeOutcome> {
        self.done.future()
    }
}

impl Role for Shared {
    fn on_msg(self: &Arc<Self>, from: &GroupAddress, auth: Auth, msg: Msg, now: Instant) {
        self.step(|c| c.on_msg(from, auth, msg, now));
    }

    fn tick(self: &Arc<Self>, now: Instant) {
        self.step(|c| c.tick(now));
    }
}

impl Shared {
    /// A layer report: posts the new steps and accounts its host time.
    fn report(self: &Arc<Self>, key: &TaskKey, steps: u64) -> Result<(), KvError> {
        let t0 = Instant::now();
        let mut res = Ok(());
        let mut posted = 0u64;
        self.step(|c| match c.ready(key, steps) {
            Ok(a) => {
                posted = a
                    .iter()
                    .filter(|x| matches!(x, PreAction::Post { .. }))
                    .count() as u64;
                a
            }
            Err(e) => {
                res = Err(e);
                Vec::new()
            }
        });
        if posted > 0 {
            let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let st = &self.stats;
            st.reports.fetch_add(1, Ordering::Relaxed);
            st.steps.fetch_add(posted, Ordering::Relaxed);
            st.report_ns.fetch_add(ns, Ordering::Relaxed);
            st.report_ns_max.fetch_max(ns, Ordering::Relaxed);
        }
        res
    }

    /// Runs one core step: its posts under the core lock (so a request's
    /// writes are posted in step order, the tail last), its sends and
    /// completions after.
    fn step(self: &Arc<Self>, f: impl FnOnce(&mut PrefillerCore) -> Vec<PreAction>) {
        let mut finished = Vec::new();
        let mut sends = Vec::new();
        let mut forget = Vec::new();
        {
            let mut c = self.core.lock();
            let mut queue = std::collections::VecDeque::from(f(&mut c));
            while let Some(a) = queue.pop_front() {
                match a {
                    PreAction::Send { to, auth, msg } => sends.push((to, auth, msg)),
                    PreAction::Post { key, step, write } => {
                        if let Err(e) = self.post(&key, step, &write) {
                            queue.extend(c.on_posted(&key, step, Err(e), Instant::now()));
                        }
                    }
                    PreAction::Incoming(inc) => {
                        if let Some(tx) = self.incoming.lock().as_ref() {
                            let _ = tx.send(inc);
                        }
                    }
                    PreAction::Finish { key, result } => finished.push((key, result)),
                    PreAction::Forget { peer } => forget.push(peer),
                }
            }
        }
        for (to, auth, msg) in sends {
            if let Err(e) = self.send(&to, auth, &msg) {
                tracing::error!("prefiller: {e}");
            }
        }
        // After the sends, outside the core lock (a control call waits for
        // the worker).
        for peer in forget {
            if let Err(e) = self.engine.remove_peer(&peer) {
                tracing::warn!(peer = ?peer, "prefiller: removing a dead decoder: {e}");
            }
        }
        for (key, result) in finished {
            let done = self.serving.lock().remove(&key);
            if let Some(d) = done {
                self.outcomes.ended(&result);
                d.complete(result);
            }
        }
    }

    fn send(self: &Arc<Self>, to: &GroupAddress, auth: Auth, msg: &Msg) -> Result<(), String> {
        let bytes = encode(&self.me, auth, msg).map_err(|e| e.to_string())?;
        let weak = Arc::downgrade(self);
        let to2 = to.clone();
        // A failure reports through the callback (never inline: the core
        // lock is held here).
        let engine = self.engine.clone();
        let fail = move |e: weft::EngineError| {
            if let Some(sh) = weak.upgrade() {
                sh.step(|c| c.on_send_failed(&to2, e.to_string(), Instant::now()));
            }
        };
        crate::send::send(&engine, to, bytes, fail);
        Ok(())
    }

    fn post(self: &Arc<Self>, key: &TaskKey, step: u32, w: &Write) -> Result<(), String> {
        let weak = Arc::downgrade(self);
        let k = key.clone();
        let on_done = OnDone::callback(move |r| {
            if let Some(sh) = weak.upgrade() {
                let r = r.map_err(|e| e.to_string());
                sh.step(|c| c.on_posted(&k, step, r, Instant::now()));
            }
        });
        let r = match w {
            Write::Layer {
                layer,
                page_len,
                src,
                dst,
                dst_pages,
                imm,
            } => {
                let Some((h, src)) = layer_region(&self.kv, *layer, src.clone()) else {
                    return Err(format!("layer {layer} has no KV region"));
                };
                self.engine.submit_paged_writes(
                    *page_len,
                    Some(*imm),
                    (&h, &src),
                    (dst, dst_pages),
                    on_done,
                )
            }
            Write::Tail {
                len,
                src_off,
                dst,
                dst_off,
                imm,
            } => {
                let Some(tail) = &self.tail else {
                    return Err("this prefiller has no tail region".into());
                };
                self.engine.submit_single_write(
                    *len,
                    Some(*imm),
                    (tail, *src_off),
                    (dst, *dst_off),
                    on_done,
                )
            }
        };
        r.map(|_| ()).map_err(|e| e.to_string())
    }
}
