//! A group's worker thread: pins itself, opens the group's domains, then
//! loops over its [`WorkerCore`] in priority order (control, new requests,
//! backlog, completion queues), hands the core's events to the callback
//! thread and idles per the engine's idle policy.

use super::block::Blocker;
use super::{CbMsg, GroupShared};
use crate::affinity;
use crate::config::{DomainGroupSpec, EngineConfig, Idle, IdleState, PollPolicy};
use crate::core::{Control, Event, WorkerCore};
use crate::error::EngineError;
use crate::imm::{ImmDone, ImmTable, ImmWaits};
use crate::request::{AddrBook, Submitted};
use crossbeam_channel::{Receiver, Sender};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a worker is built from.
pub(crate) struct WorkerCtx {
    pub(crate) spec: DomainGroupSpec,
    pub(crate) shared: Arc<GroupShared>,
    pub(crate) ctrl_rx: Receiver<Control>,
    pub(crate) imms: Arc<ImmTable<ImmDone>>,
    pub(crate) imm_waits: Arc<ImmWaits>,
    pub(crate) addrs: Arc<AddrBook>,
    pub(crate) cfg: EngineConfig,
    pub(crate) cb_tx: Sender<CbMsg>,
    pub(crate) probes: crate::probe::Probes,
    /// The engine's incarnation (frames to another one are dropped).
    pub(crate) incarnation: weft_transport::Incarnation,
}

impl WorkerCtx {
    /// Opens the domains (on the calling thread) and builds the worker.
    pub(crate) fn open(self) -> Result<Worker, EngineError> {
        let g = self.shared.index;
        let mut domains = Vec::with_capacity(self.spec.nic_count());
        let nics = self.spec.nics.iter().map(|&n| (&self.spec.provider, n));
        for (p, n) in nics.chain(self.spec.local.iter().map(|(p, n)| (p, *n))) {
            let d = p.open(n).map_err(|e| EngineError::Setup {
                group: g,
                what: format!("opening NIC {n} of provider {}", p.name()),
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
            self.cfg.max_inflight_per_nic,
            // Windows of half the bound keep what waits for room under
            // 1.5 times the bound where each page is one WR (a page longer
            // than the largest WR is several). `new` makes it at least 1.
            self.cfg.max_pending_wrs / 2,
            Arc::clone(&self.shared.counters),
            self.probes,
            self.incarnation,
        )?;
        let info = core.info();
        info.log_data_paths(g);
        let _ = self.shared.info.set(info);
        let _ = self.shared.send_pool.set(core.send_pool());
        Ok(Worker {
            core,
            ctrl_rx: self.ctrl_rx,
            shared: self.shared,
            imm_waits: self.imm_waits,
            cb_tx: self.cb_tx,
            events: Vec::new(),
            max_pending: self.cfg.max_pending_wrs.max(1),
            ctrl_seen: 0,
            paged_first: false,
            draining: None,
            finished: false,
            broken: false,
            taken_here: false,
        })
    }
}

/// A group's worker: its core and the channels around it.
pub(crate) struct Worker {
    pub(crate) core: WorkerCore,
    pub(crate) ctrl_rx: Receiver<Control>,
    pub(crate) shared: Arc<GroupShared>,
    pub(crate) imm_waits: Arc<ImmWaits>,
    pub(crate) cb_tx: Sender<CbMsg>,
    pub(crate) events: Vec<Event>,
    pub(crate) max_pending: usize,
    /// `GroupShared::ctrl_sent` when `ctrl_rx` was last drained.
    pub(crate) ctrl_seen: u64,
    /// Whether this lap plans the next window of a partly planned paged
    /// write before taking new requests (alternates lap by lap).
    pub(crate) paged_first: bool,
    pub(crate) draining: Option<Instant>,
    pub(crate) finished: bool,
    /// Set once `iterate` panicked: the core may be half-updated, so the
    /// worker never iterates again, it only refuses (`refuse_queued`).
    broken: bool,
    /// A submitting thread took a request since the last lap
    /// (`try_take`): the next lap counts as progress, as taking it from
    /// the queue would have, so the in-flight window restarts and the
    /// worker polls for its completions rather than parking.
    taken_here: bool,
}

const BURST: usize = 64;

/// Longest single sleep in the wait fds: a bound on what a provider that
/// missed a wake-up could delay, not a poll interval (the fds wake the
/// worker).
const FD_SLEEP_MAX: Duration = Duration::from_millis(10);

impl Worker {
    /// One loop iteration in SPEC priority order. Returns whether anything
    /// happened.
    pub(crate) fn iterate(&mut self) -> bool {
        let mut did = std::mem::take(&mut self.taken_here);
        // Every message counted in `ctrl_sent` is in the channel already;
        // those sent since are counted (and found) on a later lap.
        let sent = self.shared.ctrl_sent.load(Ordering::Acquire);
        if sent != self.ctrl_seen {
            self.ctrl_seen = sent;
            while let Ok(c) = self.ctrl_rx.try_recv() {
                self.core.handle_control(c);
                did = true;
            }
        }
        // (1) new requests and their first WRs, and the next window of a
        // paged write planned in windows (`core::paged`): first one, then
        // the other, lap by lap, so that neither starves the other.
        let partial = self.core.has_partial();
        if partial && self.paged_first {
            did |= self.core.continue_paged(self.max_pending);
        }
        if self.draining.is_none() {
            // `is_empty` first: an empty `pop` costs a full fence, and most
            // laps find nothing.
            let mut n = 0;
            while n < BURST
                && self.core.pending_pieces() < self.max_pending
                && !self.shared.queue.is_empty()
            {
                let Some(r) = self.shared.queue.pop() else {
                    break;
                };
                self.core.take_request(r);
                n += 1;
            }
            did |= n > 0;
        }
        if partial {
            if !self.paged_first {
                did |= self.core.continue_paged(self.max_pending);
            }
            self.paged_first = !self.paged_first;
        }
        // (2) more WRs of pending requests (after dropping peers another
        // group replaced by a newer incarnation: their queued WRs must fail,
        // never be posted to whatever now answers at their address)
        self.core.sync_incarnations();
        did |= self.core.post_backlog();
        // Receive buffers a pool held back at its backlog bound, once its
        // callbacks returned messages.
        did |= self.core.release_held();
        // (3) completion queues
        did |= self.core.poll() > 0;
        self.publish_and_flush();
        did
    }

    /// Announces `sleeping` and checks, with the lock held, whether the
    /// worker may sleep in its NICs' wait fds: nothing arrived since the
    /// last poll and no NIC has work pending ([`WorkerCore::try_wait`],
    /// which also arms the fds). `None`: the group has no wake fd (no fd
    /// sleep; `sleeping` left clear); `Some(may)` otherwise, with
    /// `sleeping` set for [`sleep_in_fds`] to clear. A submitter that
    /// posts after the lock is released sees `sleeping` and wakes the fd,
    /// so its completions are never slept through.
    fn prepare_fd_sleep(&mut self, seen_arms: u64) -> Option<bool> {
        self.shared.wake_fd.as_ref()?;
        self.shared.sleeping.store(true, Ordering::SeqCst);
        Some(self.nothing_to_wake_for(seen_arms) && self.core.try_wait())
    }

    /// Takes `req` on the submitting thread (see
    /// [`EngineConfig::caller_posts`](crate::EngineConfig::caller_posts)):
    /// plans it and posts its first WRs as a worker lap's step (1) would,
    /// hands the events to the callback thread and publishes the load.
    /// Gives the request back when the worker must take it instead: the
    /// group failed or is shutting down, control messages are waiting
    /// (they come first), or the pending bound is reached.
    #[allow(clippy::result_large_err)]
    pub(crate) fn try_take(&mut self, req: Submitted) -> Result<(), Submitted> {
        if self.broken
            || self.finished
            || self.draining.is_some()
            || self.shared.closing.load(Ordering::SeqCst)
            || self.shared.ctrl_sent.load(Ordering::Acquire) != self.ctrl_seen
            || self.core.pending_pieces() >= self.max_pending
            || self.core.has_partial()
        {
            // (A paged write with pages left to plan takes turns with new
            // requests lap by lap in `iterate`; taking requests here would
            // let a stream of small submits starve it.)
            return Err(req);
        }
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.core.sync_incarnations();
            self.core.take_request(req);
        }));
        if let Err(p) = r {
            // As if the worker had panicked: the group fails.
            self.fail_now(&*p);
            return Ok(());
        }
        self.taken_here = true;
        self.shared.counters.caller_posted();
        self.publish_and_flush();
        Ok(())
    }

    /// Whether nothing a waker announces is pending: no request, control
    /// message, shutdown or new arm since `seen_arms`. Checked after
    /// storing `sleeping`; each check pairs with its waker's `wake` after
    /// the waker's store, so a wake-up is never lost. Control messages
    /// count by `ctrl_sent`, not by the channel: one sent but not yet
    /// counted would otherwise keep the worker awake without `iterate`
    /// taking it (its sender kicks the worker after counting it).
    fn nothing_to_wake_for(&self, seen_arms: u64) -> bool {
        self.shared.queue.is_empty()
            && self.shared.ctrl_sent.load(Ordering::SeqCst) == self.ctrl_seen
            && !self.shared.closing.load(Ordering::SeqCst)
            && self.imm_waits.arms.load(Ordering::SeqCst) == seen_arms
            && !self.core.held_releasable()
            && !self.taken_here
    }

    /// Publishes the load for `stats()` and hands the events to the
    /// callback thread: the end of a lap, and of a request taken on a
    /// submitting thread.
    fn publish_and_flush(&mut self) {
        self.shared
            .counters
            .publish(self.core.live_transfers(), self.core.pending_pieces());
        self.flush();
    }

    pub(crate) fn flush(&mut self) {
        self.core.take_events(&mut self.events);
        for e in self.events.drain(..) {
            match e {
                // A polled pool's messages skip the callback thread.
                Event::Recv { pool, result, from } if pool.queue().is_some() => {
                    if let Some(q) = pool.queue() {
                        q.deliver(&pool, result, from);
                    }
                }
                e => {
                    let _ = self.cb_tx.send(CbMsg::Event(e));
                }
            }
        }
    }

    /// The worker panicked: fail everything it holds with `WorkerFailed`,
    /// mark the group failed, then refuse work until shutdown (the worker
    /// thread's ending; manual mode uses [`Worker::step_manual`]).
    pub(crate) fn failed(&mut self, payload: &(dyn std::any::Any + Send)) {
        self.fail_now(payload);
        self.refuse_until_closed();
    }

    /// A failed worker's thread from the failure to the shutdown: refuses
    /// what is queued (every millisecond) until the group closes. Runs with
    /// the worker's lock held; submitters never wait for it (they queue,
    /// and are refused here).
    fn refuse_until_closed(&mut self) {
        while !(self.shared.closing.load(Ordering::SeqCst) && self.shared.queue.is_empty()) {
            std::thread::park_timeout(Duration::from_millis(1));
            self.refuse_queued();
        }
        self.finished = true;
    }

    /// Marks the group failed with `WorkerFailed` (what the panic said),
    /// fails the work in flight and refuses what is queued; from here on
    /// the worker only refuses.
    fn fail_now(&mut self, payload: &(dyn std::any::Any + Send)) {
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
        self.broken = true;
        self.refuse_queued();
    }

    /// A failed worker's lap: queued requests fail with the group's error,
    /// control requests are dropped (their callers see a closed reply
    /// channel), events already due go to the callback channel.
    fn refuse_queued(&mut self) {
        let e = self
            .shared
            .failed
            .get()
            .cloned()
            .unwrap_or(EngineError::ShutDown);
        while let Some(r) = self.shared.queue.pop() {
            self.core.reject(r, e.clone());
        }
        while self.ctrl_rx.try_recv().is_ok() {}
        self.flush();
    }

    /// One lap in manual mode (`TransferEngine::progress` and its
    /// shutdown): `iterate` with a panic caught, as the worker thread
    /// catches it. A panic fails the group as on a worker thread; later
    /// laps refuse what is queued, and a closing failed worker is finished.
    pub(crate) fn step_manual(&mut self) -> bool {
        let did = if self.broken {
            let any = !self.shared.queue.is_empty();
            self.refuse_queued();
            any
        } else {
            match std::panic::catch_unwind(AssertUnwindSafe(|| self.iterate())) {
                Ok(did) => did,
                Err(p) => {
                    self.fail_now(&*p);
                    true
                }
            }
        };
        // A failed core is never touched again: its shutdown ends here,
        // before `drain_step`.
        if self.broken && self.shared.closing.load(Ordering::SeqCst) {
            self.finished = true;
        }
        did
    }

    /// Manual mode: answers the control requests waiting in the channel on
    /// the caller's thread, with a panic caught as in `step_manual` (the
    /// request that panicked sees its reply channel closed, hence the
    /// group's `WorkerFailed`). A failed worker drops them unanswered.
    pub(crate) fn control_manual(&mut self) {
        if self.broken {
            self.refuse_queued();
            return;
        }
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            while let Ok(c) = self.ctrl_rx.try_recv() {
                self.core.handle_control(c);
            }
        }));
        if let Err(p) = r {
            self.fail_now(&*p);
        }
    }

    /// Closes the group's domains (last step of a shutdown), with a panic
    /// caught and logged.
    pub(crate) fn close(self) {
        let g = self.shared.index;
        let Worker { core, .. } = self;
        if std::panic::catch_unwind(AssertUnwindSafe(|| core.close())).is_err() {
            tracing::error!(group = g, "closing the group's domains panicked");
        }
    }

    /// Shutdown handling; call after `iterate` while closing.
    pub(crate) fn drain_step(&mut self, deadline: Instant) {
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

/// The worker thread's main loop. The worker sits in its group's
/// [`slot`](super::GroupShared::slot): each lap takes the lock, and every
/// wait (yield, park, sleep in the wait fds) happens with it released, so
/// a submitting thread can post in between (`Worker::try_take`).
pub(crate) fn worker_main(ctx: WorkerCtx, init: Sender<(usize, Result<(), EngineError>)>) {
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
    let progress_spins = ctx.cfg.progress_spins;
    let drain = ctx.cfg.drain_timeout;
    let shared = Arc::clone(&ctx.shared);
    let w = match ctx.open() {
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
    let mut idle_n = IdleState::default();
    let mut last_progress = Instant::now();
    let mut seen_arms = w.imm_waits.arms.load(Ordering::SeqCst);
    let software_progress = w.core.software_progress();
    if software_progress {
        // See `EngineConfig::idle_spins` and `progress_spins`.
        idle.spins = progress_spins;
        idle.yield_in_spin = true;
    }
    // Software-progress groups with wait fds sleep in them (`PollPolicy`).
    let mut blocker = if software_progress {
        Blocker::new(w.core.wait_fds(), shared.wake_fd.as_ref())
    } else {
        None
    };
    let block_after = block_after_of(&idle, blocker.is_some());
    *shared.slot.lock() = Some(w);
    let mut idle_since: Option<Instant> = None;
    // Progress is stamped lazily, by the first idle lap that may park, rather
    // than with a clock read on every productive lap (no measurable change on
    // the H200 host; it is one clock read less per lap). Both windows it feeds
    // (`inflight_spin`, `idle_block_after`) then start up to one
    // spin-and-yield phase late.
    let mut progressed = false;
    let mut dead_nics = 0;
    // A panic of this thread outside a lap (shutdown handling, the idle
    // code) must not leave the worker in its slot for submitters to post
    // to with nobody polling: the guard fails the group and vacates it.
    let _vacate = Vacate(&shared);
    loop {
        let mut slot = shared.slot.lock();
        let Some(w) = slot.as_mut() else { break };
        if w.broken {
            // A request taken on a submitting thread panicked (`try_take`):
            // as after a panic here, the core is never touched again.
            w.refuse_until_closed();
            break;
        }
        let did = match std::panic::catch_unwind(AssertUnwindSafe(|| w.iterate())) {
            Ok(did) => did,
            Err(p) => {
                w.failed(&*p);
                break;
            }
        };
        if shared.closing.load(Ordering::SeqCst) {
            w.drain_step(Instant::now() + drain);
            if w.finished {
                break;
            }
        }
        if did {
            idle_n.reset();
            idle_since = None;
            progressed = true;
            continue;
        }
        // Spins and yields with the lock released: a submitter may post
        // meanwhile (then the next lap counts it as progress).
        drop(slot);
        let Some(d) = idle.step(&mut idle_n) else {
            continue;
        };
        let mut slot = shared.slot.lock();
        let Some(w) = slot.as_mut() else { break };
        if w.taken_here {
            continue;
        }
        let stamp_idle = block_after.is_some() && idle_since.is_none();
        if progressed || stamp_idle {
            let now = Instant::now();
            if progressed {
                // The in-flight window (`inflight_spin`) runs from here,
                // for every group: a software-progress group under
                // `SpinThenPark` parks with WRs in flight once it has
                // passed (tests/spin_then_park.rs in weft-libfabric).
                last_progress = now;
            }
            progressed = false;
            if stamp_idle {
                idle_since = Some(now);
            }
        }
        let arms = w.imm_waits.arms.load(Ordering::SeqCst);
        if arms != seen_arms {
            // A round was armed since: its immediates are due.
            seen_arms = arms;
            last_progress = Instant::now();
        }
        let awaited = w.core.in_flight() || w.imm_waits.armed.load(Ordering::SeqCst) > 0;
        if blocker.is_some() && w.core.dead_nics() != dead_nics {
            // A NIC died: sleep on the live NICs' fds only.
            dead_nics = w.core.dead_nics();
            blocker = Blocker::new(w.core.wait_fds(), shared.wake_fd.as_ref());
        }
        if let (Some(after), Some(b)) = (block_after, blocker.as_mut()) {
            // Adaptive, software progress, wait fds: poll (yielding)
            // for `after`, then sleep in the fds while nothing is
            // awaited.
            // (`idle_since` was set when this idle stretch first got
            // here.)
            if awaited || idle_since.is_none_or(|s| s.elapsed() < after) {
                drop(slot);
                std::thread::yield_now();
                continue;
            }
            let may = w.prepare_fd_sleep(seen_arms);
            drop(slot);
            match sleep_in_fds(&shared, b, may, FD_SLEEP_MAX) {
                // A peer sent something (e.g. a WRITE into this host,
                // which completes nothing here): poll at full speed
                // for `after` again rather than once per wake-up.
                Some(true) => idle_since = Some(Instant::now()),
                Some(false) => {}
                None => std::thread::yield_now(),
            }
            continue;
        }
        // Without wait fds, `SpinThenPark` parks software-progress
        // groups too: what peers write into this host then waits for
        // the next poll (at most `idle_sleep`), the price of a bounded
        // idle CPU.
        let keep_polling = software_progress && idle.poll == PollPolicy::Adaptive;
        if keep_polling || (awaited && last_progress.elapsed() < inflight_spin) {
            // Completions are due, or the NIC moves data (also what
            // peers write into this host) only while polled: keep
            // polling, only yield the core.
            drop(slot);
            std::thread::yield_now();
            continue;
        }
        if let Some(b) = blocker.as_mut() {
            // SpinThenPark with wait fds: the fds wake it for what
            // peers send, so it needs no `idle_sleep` bound. A NIC
            // with work pending (`try_wait` false) parks as below.
            let may = w.prepare_fd_sleep(seen_arms);
            if may.is_some() {
                drop(slot);
                if sleep_in_fds(&shared, b, may, d.max(FD_SLEEP_MAX)).is_some() {
                    continue;
                }
                slot = shared.slot.lock();
            }
        }
        let Some(w) = slot.as_mut() else { break };
        shared.sleeping.store(true, Ordering::SeqCst);
        let park = w.nothing_to_wake_for(seen_arms);
        drop(slot);
        if park {
            std::thread::park_timeout(d);
        }
        shared.sleeping.store(false, Ordering::SeqCst);
    }
    let Some(mut w) = shared.slot.lock().take() else {
        return;
    };
    // Leftover control requests get an answer.
    if w.shared.failed.get().is_none() {
        while let Ok(c) = w.ctrl_rx.try_recv() {
            w.core.handle_control(c);
        }
    }
    w.flush();
    w.close();
}

/// Fails the group and takes the worker out of its slot if the worker
/// thread unwinds outside a lap (see `worker_main`).
struct Vacate<'a>(&'a GroupShared);

impl Drop for Vacate<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let g = self.0.index;
        tracing::error!(
            group = g,
            "worker thread panicked outside a lap; failing the group"
        );
        let _ = self.0.failed.set(EngineError::WorkerFailed {
            group: g,
            what: "the worker thread panicked outside a lap".into(),
        });
        // The unwinding lap's guard is gone already; a submitter may hold
        // the lock for a moment, then the worker stays (it refuses nothing
        // more, but `failed` makes every later submit fail).
        if let Some(mut slot) = self.0.slot.try_lock() {
            drop(slot.take());
        }
    }
}

/// Sleeps in the NICs' wait fds for at most `timeout` if `may` (from
/// [`Worker::prepare_fd_sleep`], with the worker's lock released since):
/// `Some(woken by a NIC's fd)` when it slept, `None` when it did not.
/// Clears `sleeping` either way.
fn sleep_in_fds(
    shared: &GroupShared,
    blocker: &mut Blocker,
    may: Option<bool>,
    timeout: Duration,
) -> Option<bool> {
    let slept = match (may, shared.wake_fd.as_ref()) {
        (Some(true), Some(wake)) => {
            shared.counters.fd_slept();
            Some(blocker.sleep(wake, timeout))
        }
        _ => None,
    };
    shared.sleeping.store(false, Ordering::SeqCst);
    slept
}

/// When an idle `Adaptive` worker with wait fds sleeps in them (`None`:
/// it never does; other policies decide in their own branch).
fn block_after_of(idle: &crate::config::Idle, has_fds: bool) -> Option<Duration> {
    if !has_fds || idle.poll != PollPolicy::Adaptive || idle.sleep.is_none() {
        return None;
    }
    idle.block_after
}
