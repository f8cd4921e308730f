//! The decode side on the engine: registers the application's KV cache,
//! runs [`DecoderCore`] on the engine's receive and immediate callbacks and
//! a heartbeat timer, and hands out [`RequestHandle`]s.

mod core;

pub use self::core::{DecAction, DecoderCore, PrefillerId, Route, Source, Started};

use crate::completion::{Completion, CompletionFuture};
use crate::pages::{ForeignLease, PageLease};
use crate::regions::Registered;
use crate::timer::{drive, Role, Ticker};
use crate::wire::{encode, Auth, Msg};
use crate::CacheRegions;
use crate::{Heartbeat, KvError, KvLayout};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use weft::{GroupAddress, ImmCounts, ImmLease, Registration, TransferEngine};

/// Settings of a decoder or prefiller driver.
#[derive(Debug, Clone, Copy)]
pub struct KvConfig {
    /// Heartbeats.
    pub heartbeat: Heartbeat,
    /// Bytes of each receive buffer (the largest message: a request with
    /// its page list and metadata).
    pub recv_len: u64,
    /// Receive buffers.
    pub recv_count: u32,
    /// Prefiller: most requests held at once (waiting for the application
    /// or being served). A request beyond it is refused with
    /// [`Refusal::Busy`](crate::Refusal::Busy), so decoders (or anything
    /// that can send to the prefiller) cannot grow its memory without
    /// bound. At least 1. Default 4096.
    pub max_pending_requests: usize,
    /// Prefiller: most decoders known at once, counting dead ones still
    /// kept (a dead decoder is kept, its late messages ignored, while it
    /// has requests left and for ten heartbeat timeouts after its death;
    /// its later messages reach a new entry, whose requests fail: the
    /// engine never writes to a removed incarnation again). A message from a
    /// new decoder beyond it is dropped unless a dead one can be forgotten
    /// to make room. At least 1. Default 4096.
    pub max_decoders: usize,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            heartbeat: Heartbeat::default(),
            recv_len: 64 * 1024,
            recv_count: 128,
            max_pending_requests: 4096,
            max_decoders: 4096,
        }
    }
}

/// A request that completed: every byte of it is in the lease's pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    /// Request id.
    pub id: u64,
    /// Immediates counted.
    pub imms: u64,
}

/// The outcome of a request.
pub type Outcome = Result<Completed, KvError>;

/// A request in flight. Completes (flag, wait, callback or future) when the
/// engine's immediate count says all its data is in place, or with an error
/// once no write of it can land any more.
#[derive(Debug, Clone)]
pub struct RequestHandle {
    id: u64,
    done: Completion<Outcome>,
}

impl RequestHandle {
    /// Request id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether it completed (the flag).
    pub fn is_done(&self) -> bool {
        self.done.is_done()
    }

    /// The outcome, if in.
    pub fn result(&self) -> Option<Outcome> {
        self.done.result()
    }

    /// Blocks until the outcome is in.
    pub fn wait(&self) -> Outcome {
        self.done.wait()
    }

    /// Blocks until the outcome is in or `timeout` passed.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Outcome> {
        self.done.wait_timeout(timeout)
    }

    /// Runs `cb` with the outcome (on the engine's callback thread, or at
    /// once if it is in).
    pub fn on_complete(&self, cb: impl FnOnce(&Outcome) + Send + 'static) {
        self.done.on_complete(cb)
    }

    /// A future of the outcome.
    pub fn future(&self) -> CompletionFuture<Outcome> {
        self.done.future()
    }
}

/// Bytes of a request frame besides its pages, heads, metadata, address,
/// layout and descriptors (version, auth, ids, message tags: well below
/// this).
const FRAME_OVERHEAD: usize = 256;

/// A request's completion, its immediate count and the lease of its
/// immediate value.
type Pending = (Completion<Outcome>, u64, ImmLease);

struct Shared {
    engine: Arc<TransferEngine>,
    core: Mutex<DecoderCore>,
    /// Per request: its completion, its immediate count and the lease of
    /// its immediate value (returned when the request ends).
    handles: Mutex<BTreeMap<u64, Pending>>,
    counts: ImmCounts,
    /// Receive buffer bytes: a request frame must fit the prefiller's
    /// (both sides are meant to share a `KvConfig`).
    recv_len: u64,
    /// Bytes of a request frame besides its pages, heads and metadata.
    frame_fixed: usize,
    mrs: Mutex<Vec<Registration>>,
    outcomes: crate::Outcomes,
}

/// The decode side: the application's paged KV cache, registered with the
/// engine, filled by prefillers.
pub struct Decoder {
    sh: Arc<Shared>,
    ticker: Mutex<Option<Ticker>>,
}

impl Decoder {
    /// Registers the application's cache (`regions`, shaped as `layout`)
    /// with `engine`, posts receive buffers (the decoder owns the engine's
    /// receives) and starts the heartbeat timer.
    pub fn new(
        engine: Arc<TransferEngine>,
        layout: KvLayout,
        regions: CacheRegions,
        cfg: KvConfig,
    ) -> Result<Self, KvError> {
        let regs = Registered::new(&engine, &layout, &regions)?;
        let (kv_desc, tail_desc) = regs.descs();
        // What every request frame carries besides pages, heads and
        // metadata: this decoder's address, layout and descriptors.
        let fixed = postcard::to_stdvec(&(engine.main_address(), layout, &kv_desc, &tail_desc))
            .map_or(usize::MAX, |b| b.len().saturating_add(FRAME_OVERHEAD));
        let mrs = regs.into_vec();
        let counts = engine
            .imm_counts(0)
            .map_err(KvError::engine("imm counts"))?;
        let core = DecoderCore::new(
            engine.main_address(),
            layout,
            kv_desc,
            tail_desc,
            cfg.heartbeat,
        )?;
        let sh = Arc::new(Shared {
            engine: engine.clone(),
            core: Mutex::new(core),
            handles: Mutex::new(BTreeMap::new()),
            counts,
            recv_len: cfg.recv_len,
            frame_fixed: fixed,
            mrs: Mutex::new(mrs),
            outcomes: crate::Outcomes::default(),
        });
        let ticker = drive(&engine, &sh, &cfg, "decoder", "kv-decoder-hb")?;
        Ok(Self {
            sh,
            ticker: Mutex::new(Some(ticker)),
        })
    }

    /// Requests taken and how they ended.
    pub fn outcomes(&self) -> &crate::Outcomes {
        &self.sh.outcomes
    }

    /// Frames dropped so far: from strangers, unauthentic, or answers that
    /// count for no request.
    pub fn dropped_frames(&self) -> u64 {
        self.sh.core.lock().dropped()
    }

    /// This decoder's address (what prefillers see as the sender).
    pub fn address(&self) -> GroupAddress {
        self.sh.core.lock().address().clone()
    }

    /// The cache layout.
    pub fn layout(&self) -> KvLayout {
        *self.sh.core.lock().layout()
    }

    /// Adds a prefiller (greets it and starts heartbeating it).
    pub fn add_prefiller(&self, addr: GroupAddress) -> PrefillerId {
        let mut id = PrefillerId(0);
        self.sh.step(|c| {
            let (p, a) = c.add_prefiller(addr, Instant::now());
            id = p;
            a
        });
        id
    }

    /// Prefiller `addr` is gone (its rendezvous record left, or the
    /// application knows it died): its requests fail with
    /// [`KvError::PrefillerDead`] carrying `loss`, and routes to it are
    /// refused from now on.
    pub fn remove_prefiller(&self, addr: &GroupAddress, loss: crate::PeerLoss) {
        self.sh
            .step(|c| c.prefiller_gone(addr, loss, Instant::now()));
    }

    /// The address of prefiller `p`.
    pub fn prefiller_address(&self, p: PrefillerId) -> Option<GroupAddress> {
        self.sh.core.lock().prefiller_address(p).cloned()
    }

    /// Why prefiller `p` is dead, if it is.
    pub fn prefiller_dead(&self, p: PrefillerId) -> Option<crate::PeerLoss> {
        self.sh.core.lock().prefiller_dead(p).cloned()
    }

    /// Free pages now.
    pub fn free_pages(&self) -> u32 {
        self.sh.core.lock().pool().free_pages()
    }

    /// Whether page `p` is free (not held by a lease).
    pub fn is_page_free(&self, p: u32) -> bool {
        self.sh.core.lock().pool().is_free(p)
    }

    /// Requests in flight.
    pub fn pending(&self) -> usize {
        self.sh.core.lock().pending()
    }

    /// Takes `pages` pages (per head) and a tail slot for one prompt.
    pub fn alloc(&self, pages: u32) -> Result<PageLease, KvError> {
        self.sh.core.lock().alloc(pages)
    }

    /// Takes exactly `pages` and a tail slot, for a serving stack that
    /// allocates its blocks itself (vLLM's block manager): each must be in
    /// range and not held by a lease whose request may still write it
    /// ([`KvError::PageTaken`]).
    pub fn alloc_pages(&self, pages: &[u32]) -> Result<PageLease, KvError> {
        self.sh.core.lock().alloc_pages(pages)
    }

    /// Returns a lease's pages to the pool: at once, or — while a request
    /// on them is in flight — after cancelling it, once every prefiller
    /// confirmed no write can land.
    /// A lease of another decoder is dropped with a warning
    /// ([`Self::try_free`] gives it back).
    pub fn free(&self, lease: PageLease) {
        self.sh.step(|c| c.free(lease, Instant::now()));
    }

    /// [`Self::free`], giving a lease of another decoder back untouched.
    pub fn try_free(&self, lease: PageLease) -> Result<(), ForeignLease> {
        let mut res = Ok(());
        self.sh.step(|c| match c.try_free(lease, Instant::now()) {
            Ok(a) => a,
            Err(e) => {
                res = Err(e);
                Vec::new()
            }
        });
        res
    }

    /// Starts filling `lease` along `route`; `meta` travels to the
    /// prefillers (prompt id, tokens, ...).
    pub fn request(
        &self,
        route: &Route,
        lease: &PageLease,
        meta: &[u8],
    ) -> Result<RequestHandle, KvError> {
        let sh = &self.sh;
        // A frame too long for the prefiller's receive buffers would fail
        // its SEND, which counts as the prefiller's death: refuse it here.
        // Upper bound: varints of at most 5 bytes per page, 10 per head.
        let heads: usize = route
            .sources
            .iter()
            .map(|s| s.heads.len())
            .max()
            .unwrap_or(0);
        let frame =
            (meta.len() + 5 * lease.pages().len() + 10 * heads).saturating_add(sh.frame_fixed);
        if frame as u64 > sh.recv_len {
            return Err(KvError::InvalidRoute {
                what: format!(
                    "a request of {} pages with {} bytes of metadata needs ~{frame} bytes, \
                     receive buffers hold {}",
                    lease.pages().len(),
                    meta.len(),
                    sh.recv_len
                ),
            });
        }
        let imm_lease = sh
            .engine
            .lease_imm()
            .map_err(KvError::engine("alloc imm"))?;
        let imm = imm_lease.value();
        let done = Completion::new();
        let started = {
            let mut c = sh.core.lock();
            match c.begin(route, lease, imm, &sh.counts, meta, Instant::now()) {
                Ok(s) => {
                    sh.handles
                        .lock()
                        .insert(s.id, (done.clone(), s.imm_count, imm_lease));
                    sh.outcomes.started();
                    s
                }
                // The lease is dropped: the value returns.
                Err(e) => return Err(e),
            }
        };
        let id = started.id;
        let weak: Weak<Shared> = Arc::downgrade(sh);
        let armed = sh
            .engine
            .expect_imm_count(imm, started.imm_count, move |r| {
                if let Some(sh) = weak.upgrade() {
                    sh.step(|c| c.on_imms(id, r));
                }
            });
        match armed {
            Ok(()) => sh.exec(started.actions),
            Err(e) => sh.step(|c| c.abort_unsent(id, KvError::engine("arm imm count")(e))),
        }
        Ok(RequestHandle { id, done })
    }

    /// Cancels a request: its handle ends with [`KvError::Cancelled`] once
    /// every prefiller confirmed, or `Ok` if all data landed first.
    pub fn cancel(&self, h: &RequestHandle) {
        let id = h.id;
        self.sh.step(|c| c.cancel(id, Instant::now()));
    }

    /// Stops the timer, ends every request with [`KvError::ShutDown`] and
    /// deregisters the cache: once this returns, a prefiller's late write
    /// fails at its NIC instead of landing, so the cache memory may be
    /// freed. The engine itself is the caller's.
    pub fn shutdown(&self) {
        if let Some(mut t) = self.ticker.lock().take() {
            t.stop();
        }
        self.sh.step(|c| c.shutdown());
        for r in self.sh.mrs.lock().drain(..) {
            if let Err(e) = r.release() {
                tracing::warn!("decoder: deregistering the cache: {e}");
            }
        }
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        self.shutdown();
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
    /// Runs one core step and its actions.
    fn step(self: &Arc<Self>, f: impl FnOnce(&mut DecoderCore) -> Vec<DecAction>) {
        let actions = f(&mut self.core.lock());
        self.exec(actions);
    }

    fn exec(self: &Arc<Self>, actions: Vec<DecAction>) {
        let me = self.core.lock().address().clone();
        for a in actions {
            match a {
                DecAction::Send { to, auth, msg } => {
                    let bytes = match encode(&me, auth, &msg) {
                        Ok(b) => b,
                        Err(e) => {
                            tracing::error!("decoder: {e}");
                            continue;
                        }
                    };
                    let weak = Arc::downgrade(self);
                    let to2 = to.clone();
                    crate::send::send(&self.engine, &to, bytes, move |e| {
                        if let Some(sh) = weak.upgrade() {
                            sh.step(|c| c.on_send_failed(&to2, e.to_string(), Instant::now()));
                        }
                    });
                }
                DecAction::Finish { id, imm: _, result } => {
                    let h = self.handles.lock().remove(&id);
                    if let Some((done, imms, imm_lease)) = h {
                        // The value returns before the caller hears.
                        drop(imm_lease);
                        self.outcomes.ended(&result);
                        done.complete(result.map(|()| Completed { id, imms }));
                    }
                }
                DecAction::Forget { peer } => {
                    if let Err(e) = self.engine.remove_peer(&peer) {
                        tracing::warn!(peer = ?peer, "decoder: removing a dead prefiller: {e}");
                    }
                }
            }
        }
    }
}
