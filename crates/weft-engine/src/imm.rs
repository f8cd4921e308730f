//! The ImmCounter: counts immediates per value and fires a callback exactly
//! once when a value's armed count is reached.
//!
//! # Contract
//!
//! * Every arrival of an immediate counts. Arrivals before
//!   [`ImmTable::arm`] are kept ("early arrivals") and count toward the round
//!   that is armed next.
//! * An armed round with target `n` fires exactly once, at the arrival (or
//!   the arm call) that makes the number of unconsumed arrivals reach `n`,
//!   never earlier. Firing consumes exactly `n` arrivals and disarms.
//! * Arrivals beyond a round's target are *carried over* as early arrivals of
//!   the next round of the same value (a peer may legitimately start round
//!   `k+1` before the receiver re-arms). They are never silently dropped:
//!   [`ImmTable::reset`] (on `free_imm`, returning the value to the
//!   allocator) and engine shutdown report every unconsumed arrival as an
//!   excess, and [`ImmTable::pending`] shows them at any time.
//! * Per arrival the cost is one compare-and-swap on a per-value word (values
//!   below the table capacity, which is what `alloc_imm` hands out); no
//!   global lock. Values outside the table go through a mutex-protected
//!   overflow map (cold path, still correct).
//!
//! The per-value state is one `AtomicU64` packing `target << 32 | arrived`,
//! so "count reached" and "consume the round" are a single atomic step; the
//! callbacks of successive rounds live in a per-value FIFO that is only
//! touched when arming and when firing. Model-checked with loom
//! (module `loom_model` below).
//!
//! The engine stores an [`ImmDone`] per armed round: the caller's `OnDone`
//! and an [`ArmedRound`] that holds one count of [`ImmWaits::armed`] until
//! the round was reported (or dropped unreported), so idle workers keep
//! polling while a round waits.

use crate::ondone::{DoneCallback, DoneResult, OnDone};
use crate::sync::{AtomicU64, Mutex, Ordering};
// `ImmWaits` is read by the workers' idle loop, outside the loom model:
// plain std atomics, under loom too.
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic as std_atomic;
use std::sync::Arc;

const LOW: u64 = 0xffff_ffff;

/// Why arming an immediate failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArmError {
    /// The value already has an armed round that has not fired.
    AlreadyArmed,
}

/// One value's counter.
#[derive(Debug, Default)]
pub(crate) struct ImmSlot<C> {
    /// `target << 32 | arrived`; `target == 0` means disarmed.
    state: AtomicU64,
    /// Callbacks of armed rounds, oldest first.
    cbs: Mutex<VecDeque<C>>,
    /// Arrivals that did not fit the 32-bit counter (never expected in
    /// practice; reported as excess rather than wrapped).
    saturated: AtomicU64,
}

impl<C> ImmSlot<C> {
    pub(crate) fn new() -> Self {
        Self {
            state: AtomicU64::new(0),
            cbs: Mutex::new(VecDeque::new()),
            saturated: AtomicU64::new(0),
        }
    }

    /// Counts one arrival. Returns the callback of the round it completed.
    pub(crate) fn arrive(&self) -> Option<C> {
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            let target = cur >> 32;
            let arrived = cur & LOW;
            if arrived == LOW {
                self.saturated.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            let arrived = arrived + 1;
            let (next, fires) = if target != 0 && arrived >= target {
                (arrived - target, true)
            } else {
                ((target << 32) | arrived, false)
            };
            match self
                .state
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return if fires { self.take_cb() } else { None };
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Arms a round expecting `count` arrivals (1..=u32::MAX). Returns the
    /// callback back (`Ok(Some)`) when the count is already reached by early
    /// arrivals, so the caller fires it.
    pub(crate) fn arm(&self, count: u32, cb: C) -> Result<Option<C>, (ArmError, C)> {
        let count = u64::from(count.max(1));
        let mut cb = Some(cb);
        // Arms of one value are serialised by this lock (arrivals take it
        // only when they fire a round).
        let mut cbs = self.cbs.lock();
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            if cur >> 32 != 0 {
                return Err((ArmError::AlreadyArmed, take(&mut cb)));
            }
            let arrived = cur & LOW;
            let fires = arrived >= count;
            let next = if fires {
                arrived - count
            } else {
                (count << 32) | arrived
            };
            if !fires {
                // Publish the callback before the target: the arrival that
                // fires takes it after its (acquiring) CAS.
                cbs.push_back(take(&mut cb));
            }
            match self
                .state
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if fires => {
                    let mine = take(&mut cb);
                    if cbs.is_empty() {
                        return Ok(Some(mine));
                    }
                    // An older, already fired round's callback is still
                    // queued for its firing thread: keep FIFO order.
                    cbs.push_back(mine);
                    return Ok(cbs.pop_front());
                }
                Ok(_) => return Ok(None),
                Err(actual) => {
                    if !fires {
                        // Nobody else pushes while we hold the lock.
                        cb = cbs.pop_back();
                    }
                    cur = actual;
                }
            }
        }
    }

    fn take_cb(&self) -> Option<C> {
        self.cbs.lock().pop_front()
    }

    /// Unconsumed arrivals (early arrivals or carried-over excess).
    pub(crate) fn pending(&self) -> u64 {
        (self.state.load(Ordering::Acquire) & LOW) + self.saturated.load(Ordering::Relaxed)
    }

    /// Whether a round is armed and not yet fired.
    pub(crate) fn is_armed(&self) -> bool {
        self.state.load(Ordering::Acquire) >> 32 != 0
    }

    /// Takes back the armed, unfired round if `mine` says its callback is
    /// the caller's, keeping the arrivals counted so far. `None` when no
    /// round is armed (it fired) or the armed one is another's.
    pub(crate) fn disarm_if(&self, mine: impl Fn(&C) -> bool) -> Option<C> {
        // Arms and the firing arrival's `take_cb` take this lock: while it
        // is held, an armed round's callback is the last queued.
        let mut cbs = self.cbs.lock();
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            if cur >> 32 == 0 || !cbs.back().is_some_and(&mine) {
                return None;
            }
            match self.state.compare_exchange_weak(
                cur,
                cur & LOW,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return cbs.pop_back(),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Resets the value: returns the unconsumed arrivals and the callbacks of
    /// rounds that were armed but never fired (oldest first).
    pub(crate) fn reset(&self) -> (u64, Vec<C>) {
        let mut cbs = self.cbs.lock();
        let old = self.state.swap(0, Ordering::AcqRel);
        let sat = self.saturated.swap(0, Ordering::Relaxed);
        let unfired: Vec<C> = if old >> 32 != 0 {
            cbs.drain(..).collect()
        } else {
            Vec::new()
        };
        ((old & LOW) + sat, unfired)
    }
}

fn take<C>(cb: &mut Option<C>) -> C {
    match cb.take() {
        Some(c) => c,
        // The loop above always refills `cb` before using it again.
        None => unreachable!("callback taken twice"),
    }
}

/// The table of all values: a dense array for values handed out by the
/// allocator, and an overflow map for any other value a peer may use.
pub(crate) struct ImmTable<C> {
    dense: Box<[ImmSlot<C>]>,
    sparse: Mutex<BTreeMap<u32, Arc<ImmSlot<C>>>>,
    /// Arrivals of values outside the dense range that found the sparse map
    /// full and no slot of their own: counted here, never stored, so a peer
    /// spraying random immediates cannot grow our memory without bound.
    dropped: AtomicU64,
}

/// Most values outside the dense range tracked at once. Values a local
/// caller arms always get a slot; peer-driven arrivals beyond this bound are
/// only counted (see [`ImmTable::dropped`]).
pub(crate) const SPARSE_MAX: usize = 1 << 16;

impl<C> ImmTable<C> {
    /// A table with `capacity` fast slots (values `0..capacity`).
    pub(crate) fn new(capacity: u32) -> Self {
        let dense = (0..capacity).map(|_| ImmSlot::new()).collect();
        Self {
            dense,
            sparse: Mutex::new(BTreeMap::new()),
            dropped: AtomicU64::new(0),
        }
    }

    /// Number of fast slots.
    pub(crate) fn capacity(&self) -> u32 {
        u32::try_from(self.dense.len()).unwrap_or(u32::MAX)
    }

    fn with_slot<R>(&self, imm: u32, f: impl FnOnce(&ImmSlot<C>) -> R) -> R {
        if let Some(slot) = usize::try_from(imm).ok().and_then(|i| self.dense.get(i)) {
            return f(slot);
        }
        let slot = {
            let mut map = self.sparse.lock();
            Arc::clone(map.entry(imm).or_insert_with(|| Arc::new(ImmSlot::new())))
        };
        f(&slot)
    }

    /// Counts one arrival of `imm`. An arrival of a value outside the dense
    /// range with no slot yet, while [`SPARSE_MAX`] sparse values are already
    /// tracked, is counted in [`ImmTable::dropped`] instead.
    pub(crate) fn arrive(&self, imm: u32) -> Option<C> {
        if let Some(slot) = usize::try_from(imm).ok().and_then(|i| self.dense.get(i)) {
            return slot.arrive();
        }
        let slot = {
            let mut map = self.sparse.lock();
            match map.get(&imm) {
                Some(slot) => Arc::clone(slot),
                None if map.len() < SPARSE_MAX => {
                    Arc::clone(map.entry(imm).or_insert_with(|| Arc::new(ImmSlot::new())))
                }
                None => {
                    drop(map);
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(imm, "immediate dropped: too many distinct unarmed values");
                    return None;
                }
            }
        };
        slot.arrive()
    }

    /// Arrivals not tracked because the sparse map was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Arms a round of `imm` expecting `count` (> 0) arrivals.
    pub(crate) fn arm(&self, imm: u32, count: u32, cb: C) -> Result<Option<C>, (ArmError, C)> {
        self.with_slot(imm, |s| s.arm(count, cb))
    }

    /// Unconsumed arrivals of `imm`.
    pub(crate) fn pending(&self, imm: u32) -> u64 {
        if let Some(slot) = usize::try_from(imm).ok().and_then(|i| self.dense.get(i)) {
            return slot.pending();
        }
        self.sparse.lock().get(&imm).map_or(0, |s| s.pending())
    }

    /// Whether `imm` has an armed round.
    pub(crate) fn is_armed(&self, imm: u32) -> bool {
        if let Some(slot) = usize::try_from(imm).ok().and_then(|i| self.dense.get(i)) {
            return slot.is_armed();
        }
        self.sparse.lock().get(&imm).is_some_and(|s| s.is_armed())
    }

    /// [`ImmSlot::disarm_if`] of `imm`.
    pub(crate) fn disarm_if(&self, imm: u32, mine: impl Fn(&C) -> bool) -> Option<C> {
        if let Some(slot) = usize::try_from(imm).ok().and_then(|i| self.dense.get(i)) {
            return slot.disarm_if(mine);
        }
        let slot = self.sparse.lock().get(&imm).cloned();
        slot.and_then(|s| s.disarm_if(mine))
    }

    /// Resets `imm` (see [`ImmSlot::reset`]).
    pub(crate) fn reset(&self, imm: u32) -> (u64, Vec<C>) {
        if let Some(slot) = usize::try_from(imm).ok().and_then(|i| self.dense.get(i)) {
            return slot.reset();
        }
        let slot = self.sparse.lock().remove(&imm);
        slot.map_or((0, Vec::new()), |s| s.reset())
    }

    /// Resets every value; returns `(imm, excess, unfired callbacks)` for
    /// each value that had anything, in value order.
    pub(crate) fn reset_all(&self) -> Vec<(u32, u64, Vec<C>)> {
        let mut out = Vec::new();
        for (i, slot) in self.dense.iter().enumerate() {
            let (n, cbs) = slot.reset();
            if n != 0 || !cbs.is_empty() {
                out.push((u32::try_from(i).unwrap_or(u32::MAX), n, cbs));
            }
        }
        let sparse = std::mem::take(&mut *self.sparse.lock());
        for (imm, slot) in sparse {
            let (n, cbs) = slot.reset();
            if n != 0 || !cbs.is_empty() {
                out.push((imm, n, cbs));
            }
        }
        out
    }
}

/// The armed `expect_imm_count` rounds, for the workers' idle loop: while a
/// round waits, a worker with nothing in flight keeps polling (yielding)
/// rather than sleeping `idle_sleep` between polls, so the immediates it
/// waits for are seen when they land, not after a sleep. As with WRs in
/// flight, this lasts `inflight_spin` past the last progress or arm.
#[derive(Debug, Default)]
pub(crate) struct ImmWaits {
    /// Rounds armed and not yet fired (or dropped).
    pub(crate) armed: std_atomic::AtomicU64,
    /// Bumped by every arm that leaves a round waiting: a worker that sees
    /// it change restarts its `inflight_spin` clock.
    pub(crate) arms: std_atomic::AtomicU64,
}

/// Holds one count of [`ImmWaits::armed`] for as long as it lives; it
/// travels with the round's `OnDone` (inside the callback, for a callback),
/// so the count drops once the round was reported, or dropped unreported.
pub(crate) struct ArmedRound(Arc<ImmWaits>);

impl ArmedRound {
    /// Counted before the round is armed, so the count never drops below
    /// zero when the round fires at once on another thread.
    pub(crate) fn new(w: &Arc<ImmWaits>) -> Self {
        w.armed.fetch_add(1, std_atomic::Ordering::SeqCst);
        Self(Arc::clone(w))
    }
}

impl Drop for ArmedRound {
    fn drop(&mut self) {
        self.0.armed.fetch_sub(1, std_atomic::Ordering::SeqCst);
    }
}

/// What an armed immediate round reports to, stored in the immediate
/// table: the caller's `OnDone` and the round's [`ArmedRound`] count.
pub(crate) struct ImmDone {
    on_done: OnDone,
    round: ArmedRound,
    /// Set for a round that waits on named peers: the engine's watch list
    /// holds it weakly, so the watch ends when the round does.
    watch: Option<Arc<RoundWatch>>,
}

/// The identity of a round armed with the peers it waits on.
#[derive(Debug, Default)]
pub(crate) struct RoundWatch;

impl ImmDone {
    pub(crate) fn new(on_done: OnDone, waits: &Arc<ImmWaits>) -> Self {
        Self {
            on_done,
            round: ArmedRound::new(waits),
            watch: None,
        }
    }

    /// The same, for a round watched by `watch`.
    pub(crate) fn watched(on_done: OnDone, waits: &Arc<ImmWaits>, watch: Arc<RoundWatch>) -> Self {
        Self {
            watch: Some(watch),
            ..Self::new(on_done, waits)
        }
    }

    /// Whether this is the round `watch` identifies.
    pub(crate) fn is(&self, watch: &Arc<RoundWatch>) -> bool {
        self.watch.as_ref().is_some_and(|w| Arc::ptr_eq(w, watch))
    }

    /// Resolves a round that never waited (a zero count): its count is
    /// dropped at once, before the result is reported.
    pub(crate) fn resolve_unarmed(self, r: DoneResult) -> Option<RoundCallback> {
        let ImmDone { on_done, round, .. } = self;
        drop(round);
        let (cb, result) = on_done.resolve_inline(r)?;
        Some(RoundCallback {
            cb,
            result,
            round: None,
        })
    }

    /// Resolves a flag or counter at once; a callback comes back to be run
    /// on the callback thread, with the round's count (dropped once the
    /// callback returned; no second box around it).
    pub(crate) fn resolve(self, r: DoneResult) -> Option<RoundCallback> {
        let ImmDone { on_done, round, .. } = self;
        let (cb, result) = on_done.resolve_inline(r)?;
        Some(RoundCallback {
            cb,
            result,
            round: Some(round),
        })
    }
}

/// A resolved round whose callback must run on the callback thread.
pub(crate) struct RoundCallback {
    /// The callback.
    pub(crate) cb: DoneCallback,
    /// What it is told.
    pub(crate) result: DoneResult,
    /// The round's count, held until the callback returned (`None`: a
    /// round that never waited, already dropped).
    pub(crate) round: Option<ArmedRound>,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn disarm_if_takes_only_the_named_armed_round() {
        let t: ImmTable<u32> = ImmTable::new(4);
        assert_eq!(t.arrive(2), None);
        assert_eq!(t.arm(2, 3, 9), Ok(None));
        // Not ours: nothing happens.
        assert_eq!(t.disarm_if(2, |&c| c == 8), None);
        assert!(t.is_armed(2));
        // Ours: taken, the arrival stays counted.
        assert_eq!(t.disarm_if(2, |&c| c == 9), Some(9));
        assert!(!t.is_armed(2));
        assert_eq!(t.pending(2), 1);
        // A fired round cannot be disarmed.
        assert_eq!(t.arm(2, 1, 10), Ok(Some(10)));
        assert_eq!(t.disarm_if(2, |_| true), None);
        // Values outside the dense range too.
        assert_eq!(t.arm(1000, 1, 11), Ok(None));
        assert_eq!(t.disarm_if(1000, |&c| c == 11), Some(11));
        assert_eq!(t.disarm_if(1001, |_| true), None);
    }

    #[test]
    fn early_arrivals_count() {
        let t: ImmTable<u32> = ImmTable::new(4);
        assert_eq!(t.arrive(1), None);
        assert_eq!(t.arrive(1), None);
        assert_eq!(t.arm(1, 3, 7), Ok(None));
        assert_eq!(t.arrive(1), Some(7));
        assert_eq!(t.pending(1), 0);
        assert!(!t.is_armed(1));
    }

    #[test]
    fn arm_after_all_arrivals_fires_at_once() {
        let t: ImmTable<u32> = ImmTable::new(4);
        for _ in 0..5 {
            assert_eq!(t.arrive(2), None);
        }
        assert_eq!(t.arm(2, 5, 9), Ok(Some(9)));
        assert_eq!(t.pending(2), 0);
    }

    #[test]
    fn sparse_arrivals_are_bounded() {
        let t: ImmTable<u32> = ImmTable::new(4);
        for v in 0..(SPARSE_MAX as u32 + 100) {
            assert!(t.arrive(1000 + v).is_none());
        }
        assert_eq!(t.sparse.lock().len(), SPARSE_MAX);
        assert_eq!(t.dropped(), 100);
        // Values already tracked keep counting; dense values are unaffected.
        assert!(t.arrive(1000).is_none());
        assert_eq!(t.pending(1000), 2);
        assert!(t.arrive(1).is_none());
        assert_eq!(t.pending(1), 1);
        assert_eq!(t.dropped(), 100);
    }

    #[test]
    fn excess_carries_over_and_is_reported_on_reset() {
        let t: ImmTable<u32> = ImmTable::new(4);
        assert_eq!(t.arm(0, 2, 1), Ok(None));
        assert_eq!(t.arrive(0), None);
        assert_eq!(t.arrive(0), Some(1));
        assert_eq!(t.arrive(0), None);
        assert_eq!(t.pending(0), 1);
        // next round: the carried arrival counts
        assert_eq!(t.arm(0, 2, 2), Ok(None));
        assert_eq!(t.arrive(0), Some(2));
        assert_eq!(t.arrive(0), None);
        assert_eq!(t.reset(0), (1, vec![]));
    }

    #[test]
    fn double_arm_rejected() {
        let t: ImmTable<u32> = ImmTable::new(1);
        assert_eq!(t.arm(0, 2, 1), Ok(None));
        assert_eq!(t.arm(0, 2, 2), Err((ArmError::AlreadyArmed, 2)));
        assert_eq!(t.reset(0), (0, vec![1]));
    }

    #[test]
    fn sparse_values_work() {
        let t: ImmTable<u32> = ImmTable::new(2);
        assert_eq!(t.arrive(u32::MAX), None);
        assert_eq!(t.arm(u32::MAX, 2, 5), Ok(None));
        assert_eq!(t.arrive(u32::MAX), Some(5));
        assert_eq!(t.arrive(1000), None);
        let all = t.reset_all();
        assert_eq!(all, vec![(1000, 1, vec![])]);
    }
}

/// Model checks of the lock-free counter. Run with
/// `RUSTFLAGS="--cfg loom" cargo test -p weft-engine --lib --release imm::loom_model`.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use ::loom::sync::Arc;
    use ::loom::thread;

    /// Two workers deliver one arrival each while the user arms a round
    /// of `count`: exactly one fire when `count <= 2`, only after `count`
    /// arrivals began, and the rest stays pending.
    fn arrivals_race_arm(count: u32) {
        ::loom::model(move || {
            let slot = Arc::new(ImmSlot::<u32>::new());
            let fired = Arc::new(crate::sync::AtomicU64::new(0));
            let arrived = Arc::new(crate::sync::AtomicU64::new(0));
            let mut hs = Vec::new();
            for _ in 0..2 {
                let (s, f, a) = (slot.clone(), fired.clone(), arrived.clone());
                hs.push(thread::spawn(move || {
                    a.fetch_add(1, Ordering::SeqCst);
                    if let Some(cb) = s.arrive() {
                        assert_eq!(cb, 7);
                        // never early
                        assert!(a.load(Ordering::SeqCst) >= u64::from(count));
                        f.fetch_add(1, Ordering::SeqCst);
                    }
                }));
            }
            match slot.arm(count, 7) {
                Ok(Some(cb)) => {
                    assert_eq!(cb, 7);
                    assert!(arrived.load(Ordering::SeqCst) >= u64::from(count));
                    fired.fetch_add(1, Ordering::SeqCst);
                }
                Ok(None) => {}
                Err(_) => panic!("arm failed"),
            }
            for h in hs {
                h.join().unwrap();
            }
            assert_eq!(fired.load(Ordering::SeqCst), 1);
            assert_eq!(slot.pending(), 2 - u64::from(count));
        });
    }

    #[test]
    fn arrivals_race_arm_exact() {
        arrivals_race_arm(2);
    }

    #[test]
    fn arrivals_race_arm_excess_carried() {
        arrivals_race_arm(1);
    }

    /// Re-arming right after a fire races the firing thread's callback
    /// take: both rounds fire exactly once, each callback exactly once.
    #[test]
    fn rearm_races_fire() {
        ::loom::model(|| {
            let slot = Arc::new(ImmSlot::<u32>::new());
            assert_eq!(slot.arm(1, 1), Ok(None));
            let s = slot.clone();
            let t = thread::spawn(move || {
                let a = s.arrive();
                let b = s.arrive();
                (a, b)
            });
            // Arm round 2 as soon as round 1 is disarmed.
            let mine = loop {
                match slot.arm(1, 2) {
                    Ok(x) => break x,
                    Err((ArmError::AlreadyArmed, _)) => thread::yield_now(),
                }
            };
            let (a, b) = t.join().unwrap();
            let mut got: Vec<u32> = [a, b, mine].into_iter().flatten().collect();
            got.sort_unstable();
            assert_eq!(got, vec![1, 2]);
            assert_eq!(slot.pending(), 0);
        });
    }

    /// A peer's removal disarms a round while its last arrival fires it:
    /// the callback is taken exactly once, by one of them, and the
    /// arrival is counted either way (consumed by the fire, or pending).
    #[test]
    fn disarm_races_fire() {
        ::loom::model(|| {
            let slot = Arc::new(ImmSlot::<u32>::new());
            assert_eq!(slot.arm(1, 5), Ok(None));
            let s = slot.clone();
            let t = thread::spawn(move || s.arrive());
            let disarmed = slot.disarm_if(|&c| c == 5);
            let fired = t.join().unwrap();
            match (disarmed, fired) {
                (Some(5), None) => assert_eq!(slot.pending(), 1),
                (None, Some(5)) => assert_eq!(slot.pending(), 0),
                other => panic!("callback taken {other:?}"),
            }
            assert!(!slot.is_armed());
        });
    }
}
