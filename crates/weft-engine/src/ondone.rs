//! How a submit reports completion: a callback, a flag or a counter.

use crate::error::EngineError;
use crate::sync::{fence, AtomicU64, AtomicU8, AtomicUsize, Condvar, Mutex, Ordering};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// The outcome of a transfer.
pub type DoneResult = Result<(), EngineError>;

/// A completion callback. Runs on the engine's callback thread.
pub type DoneCallback = Box<dyn FnOnce(DoneResult) + Send + 'static>;

/// What to do when a transfer finishes (successfully or not). Every accepted
/// submit resolves its `OnDone` exactly once; a submit that returns `Err`
/// never resolves it.
///
/// A transfer is finished when every work request it posted has completed,
/// so after `on_done` no byte of it is still in flight, even when it failed.
/// One exception: a backend that gives up on a hung peer but cannot take
/// the WRs back from its provider (libfabric's `write_timeout`) fails them
/// with `PeerUnreachable` while the provider still holds them; if that peer
/// wakes up they may still be delivered (see that backend's docs).
pub enum OnDone {
    /// Run this on the callback thread.
    Callback(DoneCallback),
    /// Set this flag (on the worker; cheap). Wait on it or poll it.
    Flag(Arc<DoneFlag>),
    /// Bump this counter (on the worker; cheap). Successes are counted in
    /// runs: one add per run of transfers with the same counter, after each
    /// NIC's batch of completions and at the latest at the end of the
    /// worker's lap, before that lap's callbacks go to the callback thread.
    /// So a success is not ordered against the flags of other transfers
    /// finished in the same lap, nor against a failure on the same counter
    /// (failures are counted at once: `failed()` can move before `ok()`
    /// counts a success that finished earlier in the lap).
    Counter(Arc<DoneCounter>),
    /// Nothing to report.
    Ignore,
}

impl std::fmt::Debug for OnDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OnDone::Callback(_) => f.write_str("OnDone::Callback"),
            OnDone::Flag(_) => f.write_str("OnDone::Flag"),
            OnDone::Counter(_) => f.write_str("OnDone::Counter"),
            OnDone::Ignore => f.write_str("OnDone::Ignore"),
        }
    }
}

impl OnDone {
    /// A callback run on the callback thread.
    pub fn callback(f: impl FnOnce(DoneResult) + Send + 'static) -> Self {
        OnDone::Callback(Box::new(f))
    }

    /// A fresh flag and the `OnDone` that sets it.
    pub fn flag() -> (Self, Arc<DoneFlag>) {
        let f = Arc::new(DoneFlag::new());
        (OnDone::Flag(Arc::clone(&f)), f)
    }

    /// An `OnDone` bumping `counter`.
    pub fn counter(counter: &Arc<DoneCounter>) -> Self {
        OnDone::Counter(Arc::clone(counter))
    }

    /// Resolves inline if that is cheap (flag, counter); returns the
    /// callback and the result when it has to run on the callback thread.
    pub(crate) fn resolve_inline(self, r: DoneResult) -> Option<(DoneCallback, DoneResult)> {
        match self {
            OnDone::Callback(cb) => Some((cb, r)),
            OnDone::Flag(f) => {
                f.set(r);
                None
            }
            OnDone::Counter(c) => {
                c.add(r);
                None
            }
            OnDone::Ignore => None,
        }
    }
}

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;

/// A one-shot completion flag with blocking and async waiting.
#[derive(Debug, Default)]
pub struct DoneFlag {
    state: AtomicU8,
    /// Threads blocked in `wait`/`wait_timeout`, plus one per future that
    /// ever registered a waker (see [`Waiters`]).
    waiters: AtomicUsize,
    inner: Mutex<FlagInner>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct FlagInner {
    error: Option<EngineError>,
    /// One waker per pending future, by the future's key: futures of one
    /// flag polled by different tasks are all woken.
    wakers: Vec<(u64, Waker)>,
    next_key: u64,
}

impl DoneFlag {
    /// A pending flag.
    pub fn new() -> Self {
        Self::default()
    }

    fn set(&self, r: DoneResult) {
        match r {
            Ok(()) => {
                self.state.store(OK, Ordering::SeqCst);
                if !Waiters::any_after_publish(&self.waiters) {
                    return;
                }
            }
            Err(e) => {
                // The error is stored before the state that announces it.
                let mut g = self.inner.lock();
                g.error = Some(e);
                self.state.store(FAILED, Ordering::SeqCst);
            }
        }
        // Taken after a waiter that saw `PENDING` went to sleep (it holds
        // the lock from its check until then).
        let wakers = std::mem::take(&mut self.inner.lock().wakers);
        self.cv.notify_all();
        for (_, w) in wakers {
            w.wake();
        }
    }

    /// Whether the transfer has finished.
    pub fn is_done(&self) -> bool {
        self.state.load(Ordering::Acquire) != PENDING
    }

    /// The outcome, if finished.
    pub fn result(&self) -> Option<DoneResult> {
        match self.state.load(Ordering::Acquire) {
            PENDING => None,
            OK => Some(Ok(())),
            _ => Some(Err(self
                .inner
                .lock()
                .error
                .clone()
                .unwrap_or(EngineError::ShutDown))),
        }
    }

    fn pending(&self) -> bool {
        self.state.load(Ordering::SeqCst) == PENDING
    }

    /// Blocks until the transfer finishes.
    pub fn wait(&self) -> DoneResult {
        Waiters::block(&self.waiters, &self.cv, &self.inner, None, || {
            self.pending()
        });
        self.result().unwrap_or(Err(EngineError::ShutDown))
    }

    /// Blocks until the transfer finishes or `timeout` passes: the outcome,
    /// or `None` if it is still pending (the transfer goes on; wait again or
    /// drop the flag).
    pub fn wait_timeout(&self, timeout: Duration) -> Option<DoneResult> {
        // A timeout beyond the clock's range: no deadline.
        let deadline = Instant::now().checked_add(timeout);
        Waiters::block(&self.waiters, &self.cv, &self.inner, deadline, || {
            self.pending()
        });
        self.result()
    }

    /// A future resolving when the transfer finishes.
    pub fn wait_async(self: &Arc<Self>) -> DoneFuture {
        DoneFuture {
            flag: Arc::clone(self),
            key: None,
        }
    }
}

/// The waiter count of a [`DoneFlag`] or [`DoneCounter`]: finishing with
/// nobody waiting is a store (or an add) and a fence, without the lock or
/// the condition variable, which only waiters and failures take.
///
/// The handshake is the store-then-load one of `crate::gate`, with a
/// `SeqCst` fence on each side: a waiter, holding the lock, counts itself,
/// fences, then reads the state; the worker publishes the state, fences,
/// then reads the count. At least one sees the other's store: either the
/// waiter sees the new state, or the worker sees the waiter and takes the
/// lock (which the waiter holds until it sleeps in the condition
/// variable) before notifying. Model-checked with loom (`loom_model`
/// below). Measured together with the worker's batched counts
/// (`WorkerCore::flush_counts`; the two were not measured apart): 64 B
/// WRITEs on the null backend, 16 outstanding on one counter, took a
/// median 381 ns against 575 ns without either (`cgdrive tcount`, 16
/// alternating runs on the 2-core development machine).
struct Waiters<'a>(&'a AtomicUsize);

impl<'a> Waiters<'a> {
    /// Counts the caller a waiter until dropped; call holding the lock,
    /// before reading the state.
    fn enter(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        Waiters(n)
    }

    /// Locks `lock` and waits in `cv` (holding the lock between checks)
    /// while `pending()` and `deadline`, if any, has not passed, counted a
    /// waiter in `waiters` meanwhile. The waiting side of every blocking
    /// wait of [`DoneFlag`] and [`DoneCounter`].
    fn block<T>(
        waiters: &AtomicUsize,
        cv: &Condvar,
        lock: &Mutex<T>,
        deadline: Option<Instant>,
        pending: impl Fn() -> bool,
    ) {
        let mut g = lock.lock();
        let _w = Waiters::enter(waiters);
        while pending() {
            match deadline {
                None => g = cv.wait(g),
                Some(d) => {
                    let (g2, timed_out) = cv.wait_until(g, d);
                    g = g2;
                    if timed_out {
                        break;
                    }
                }
            }
        }
    }

    /// After publishing the state: whether anyone may be waiting for it.
    fn any_after_publish(n: &AtomicUsize) -> bool {
        fence(Ordering::SeqCst);
        n.load(Ordering::SeqCst) != 0
    }
}

impl Drop for Waiters<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Future of [`DoneFlag::wait_async`]. Any number of futures of one flag
/// may wait at once, each in its own task.
#[derive(Debug)]
pub struct DoneFuture {
    flag: Arc<DoneFlag>,
    /// This future's entry in the flag's wakers, once it registered one.
    key: Option<u64>,
}

impl Future for DoneFuture {
    type Output = DoneResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<DoneResult> {
        if let Some(r) = self.flag.result() {
            return Poll::Ready(r);
        }
        let this = &mut *self;
        // Wakers replaced or removed here are dropped after the lock is
        // released: dropping one may run executor code that drops another
        // future of this flag.
        let mut old = None;
        let mut g = this.flag.inner.lock();
        let entry = this
            .key
            .and_then(|k| g.wakers.iter_mut().find(|(key, _)| *key == k));
        match entry {
            Some((_, w)) => {
                if !w.will_wake(cx.waker()) {
                    old = Some(std::mem::replace(w, cx.waker().clone()));
                }
            }
            None => {
                let k = *this.key.get_or_insert_with(|| {
                    // Counted per future and never uncounted: `set` takes
                    // the wakers, and a future dropped unresolved only
                    // makes `set` take the lock.
                    std::mem::forget(Waiters::enter(&this.flag.waiters));
                    let k = g.next_key;
                    g.next_key += 1;
                    k
                });
                g.wakers.push((k, cx.waker().clone()));
            }
        }
        // Read after counting (see `Waiters`): either this sees the state
        // or `set` takes the waker.
        if !this.flag.pending() {
            let mine = this.key.and_then(|k| take_waker(&mut g.wakers, k));
            drop(g);
            drop((old, mine));
            return Poll::Ready(this.flag.result().unwrap_or(Err(EngineError::ShutDown)));
        }
        drop(g);
        drop(old);
        Poll::Pending
    }
}

/// Removes the waker of future `key` from `wakers`, for its caller to drop
/// outside the lock.
fn take_waker(wakers: &mut Vec<(u64, Waker)>, key: u64) -> Option<Waker> {
    let i = wakers.iter().position(|(k, _)| *k == key)?;
    Some(wakers.swap_remove(i).1)
}

impl Drop for DoneFuture {
    /// Removes this future's waker, if it still has one registered (once
    /// the flag is set, `set` takes or took every waker), and drops it
    /// outside the lock.
    fn drop(&mut self) {
        if let (Some(k), false) = (self.key, self.flag.is_done()) {
            let mine = take_waker(&mut self.flag.inner.lock().wakers, k);
            drop(mine);
        }
    }
}

/// Counts finished transfers (ok and failed), keeping the first error.
#[derive(Debug, Default)]
pub struct DoneCounter {
    ok: AtomicU64,
    failed: AtomicU64,
    /// Threads blocked in `wait_for`/`wait_for_timeout` (see [`Waiters`]).
    waiters: AtomicUsize,
    first_error: Mutex<Option<EngineError>>,
    cv: Condvar,
}

impl DoneCounter {
    /// A zeroed counter.
    pub fn new() -> Self {
        Self::default()
    }

    fn add(&self, r: DoneResult) {
        match r {
            Ok(()) => self.add_ok(1),
            Err(e) => {
                let mut g = self.first_error.lock();
                if g.is_none() {
                    *g = Some(e);
                }
                self.failed.fetch_add(1, Ordering::SeqCst);
                drop(g);
                self.cv.notify_all();
            }
        }
    }

    /// Counts `n` successful transfers at once.
    pub(crate) fn add_ok(&self, n: u64) {
        self.ok.fetch_add(n, Ordering::SeqCst);
        if !Waiters::any_after_publish(&self.waiters) {
            return;
        }
        // Taken after a waiter that saw the old count went to sleep (it
        // holds the lock from its check until then).
        drop(self.first_error.lock());
        self.cv.notify_all();
    }

    /// Transfers that finished successfully.
    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::Acquire)
    }

    /// Transfers that failed.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Acquire)
    }

    /// All finished transfers.
    pub fn total(&self) -> u64 {
        self.ok() + self.failed()
    }

    fn total_seq(&self) -> u64 {
        self.ok.load(Ordering::SeqCst) + self.failed.load(Ordering::SeqCst)
    }

    /// The first error seen.
    pub fn first_error(&self) -> Option<EngineError> {
        self.first_error.lock().clone()
    }

    /// Blocks until at least `n` transfers finished.
    pub fn wait_for(&self, n: u64) {
        Waiters::block(&self.waiters, &self.cv, &self.first_error, None, || {
            self.total_seq() < n
        });
    }

    /// Blocks until at least `n` transfers finished or `timeout` passes;
    /// whether `n` were reached.
    pub fn wait_for_timeout(&self, n: u64, timeout: Duration) -> bool {
        // A timeout beyond the clock's range: no deadline.
        let deadline = Instant::now().checked_add(timeout);
        Waiters::block(&self.waiters, &self.cv, &self.first_error, deadline, || {
            self.total_seq() < n
        });
        self.total() >= n
    }
}

/// The runs of consecutive entries that share one allocation, in order:
/// each run's first entry and its length (how the worker bumps a counter
/// once per run, `WorkerCore::flush_counts`).
pub(crate) fn runs<T>(items: &[Arc<T>]) -> impl Iterator<Item = (&Arc<T>, usize)> {
    let mut rest = items;
    std::iter::from_fn(move || {
        let first = rest.first()?;
        let n = rest.iter().take_while(|x| Arc::ptr_eq(first, x)).count();
        rest = &rest[n..];
        Some((first, n))
    })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::task::Wake;

    struct CountWakes(AtomicU64);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// `add_ok(n)` counts `n` at once; a failure keeps the first error
    /// only; a waiter blocked before either is woken.
    /// Runs are maximal stretches of the same allocation, in order; equal
    /// values in different allocations are different runs.
    #[test]
    fn runs_group_consecutive_entries() {
        let (a, b, a2) = (Arc::new(1), Arc::new(2), Arc::new(1));
        let items = [&a, &a, &b, &a, &a2, &a2, &a2].map(Arc::clone);
        let got: Vec<(i32, usize)> = runs(&items).map(|(x, n)| (**x, n)).collect();
        assert_eq!(got, vec![(1, 2), (2, 1), (1, 1), (1, 3)]);
        let firsts: Vec<bool> = runs(&items).map(|(x, _)| Arc::ptr_eq(x, &a)).collect();
        assert_eq!(firsts, vec![true, false, true, false]);
        assert_eq!(runs::<i32>(&[]).count(), 0);
    }

    #[test]
    fn counter_counts_batches_and_first_error() {
        let c = Arc::new(DoneCounter::new());
        let c2 = Arc::clone(&c);
        let waiter = std::thread::spawn(move || c2.wait_for(7));
        // The waiter is blocked (counted) before anything is added.
        while c.waiters.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        c.add_ok(5);
        c.add(Err(EngineError::QueueFull { group: 1 }));
        c.add(Err(EngineError::ShutDown));
        waiter.join().expect("waiter");
        assert_eq!((c.ok(), c.failed(), c.total()), (5, 2, 7));
        assert!(matches!(
            c.first_error(),
            Some(EngineError::QueueFull { group: 1 })
        ));
        assert_eq!(c.waiters.load(Ordering::SeqCst), 0, "the waiter left");
        // No waiter: the successful path takes neither lock nor cv.
        c.add_ok(1);
        assert!(c.wait_for_timeout(8, Duration::ZERO));
        assert!(!c.wait_for_timeout(9, Duration::from_millis(5)));
    }

    /// A future registers once however often it is polled, is woken by a
    /// success with nobody blocked, and a flag set before the poll is
    /// ready at once.
    #[test]
    fn flag_future_is_woken() {
        let f = Arc::new(DoneFlag::new());
        let wakes = Arc::new(CountWakes(AtomicU64::new(0)));
        let waker = Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let mut fut = f.wait_async();
        assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
        assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
        assert_eq!(f.waiters.load(Ordering::SeqCst), 1);
        f.set(Ok(()));
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(Pin::new(&mut fut).poll(&mut cx), Poll::Ready(Ok(())));
        let failed = Arc::new(DoneFlag::new());
        failed.set(Err(EngineError::ShutDown));
        let mut fut = failed.wait_async();
        assert_eq!(
            Pin::new(&mut fut).poll(&mut cx),
            Poll::Ready(Err(EngineError::ShutDown))
        );
        assert_eq!(
            failed.wait_timeout(Duration::ZERO),
            Some(Err(EngineError::ShutDown))
        );
        assert_eq!(DoneFlag::new().wait_timeout(Duration::from_millis(5)), None);
    }

    /// Two futures of one flag in two tasks (two wakers) are both woken; a
    /// future dropped unresolved leaves no waker behind, and one re-polled
    /// by another task is woken through the newer waker only.
    #[test]
    fn flag_futures_of_several_tasks_are_all_woken() {
        let f = Arc::new(DoneFlag::new());
        let counts: Vec<_> = (0..4)
            .map(|_| Arc::new(CountWakes(AtomicU64::new(0))))
            .collect();
        let wakers: Vec<Waker> = counts.iter().map(|c| Waker::from(Arc::clone(c))).collect();
        let mut futs: Vec<_> = (0..3).map(|_| f.wait_async()).collect();
        for (fut, w) in futs.iter_mut().zip(&wakers) {
            let mut cx = Context::from_waker(w);
            assert!(Pin::new(fut).poll(&mut cx).is_pending());
        }
        assert_eq!(f.inner.lock().wakers.len(), 3);
        // The third future moves to a fourth task.
        let mut cx = Context::from_waker(&wakers[3]);
        assert!(Pin::new(&mut futs[2]).poll(&mut cx).is_pending());
        assert_eq!(f.inner.lock().wakers.len(), 3);
        // The second is dropped unresolved.
        drop(futs.remove(1));
        assert_eq!(f.inner.lock().wakers.len(), 2);
        f.set(Ok(()));
        let woken: Vec<u64> = counts.iter().map(|c| c.0.load(Ordering::SeqCst)).collect();
        assert_eq!(woken, [1, 0, 0, 1]);
        for fut in &mut futs {
            assert_eq!(Pin::new(fut).poll(&mut cx), Poll::Ready(Ok(())));
        }
    }

    /// Many finishes racing a blocked waiter: it always wakes.
    #[test]
    fn blocked_waiters_always_wake() {
        for _ in 0..200 {
            let f = Arc::new(DoneFlag::new());
            let c = Arc::new(DoneCounter::new());
            let (f2, c2) = (Arc::clone(&f), Arc::clone(&c));
            let t = std::thread::spawn(move || {
                f2.set(Ok(()));
                for _ in 0..3 {
                    c2.add_ok(1);
                }
            });
            assert_eq!(f.wait(), Ok(()));
            c.wait_for(3);
            t.join().expect("finisher");
        }
    }
}

/// Model checks of the waiter handshake: a finish racing a blocked
/// waiter never leaves it asleep (loom reports a deadlock if it does).
/// Run with `RUSTFLAGS="--cfg loom" cargo test -p weft-engine --lib
/// --release ondone::loom_model`.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use ::loom::sync::Arc;
    use ::loom::thread;

    #[test]
    fn counter_add_races_wait_for() {
        ::loom::model(|| {
            let c = Arc::new(DoneCounter::new());
            let c2 = c.clone();
            let t = thread::spawn(move || c2.add(Ok(())));
            c.wait_for(1);
            assert_eq!(c.ok(), 1);
            t.join().unwrap();
        });
    }

    #[test]
    fn counter_failure_races_wait_for() {
        ::loom::model(|| {
            let c = Arc::new(DoneCounter::new());
            let c2 = c.clone();
            let t = thread::spawn(move || c2.add(Err(EngineError::ShutDown)));
            c.wait_for(1);
            assert_eq!((c.ok(), c.failed()), (0, 1));
            assert!(c.first_error().is_some());
            t.join().unwrap();
        });
    }

    /// A future polled (and re-polled on wake-ups) while the flag is set
    /// from another thread resolves; loom reports a lost wake-up as a
    /// deadlock of `block_on`.
    #[test]
    fn flag_set_races_future() {
        ::loom::model(|| {
            // `wait_async` takes a std `Arc`.
            let f = std::sync::Arc::new(DoneFlag::new());
            let f2 = f.clone();
            let t = thread::spawn(move || f2.set(Ok(())));
            assert_eq!(::loom::future::block_on(f.wait_async()), Ok(()));
            t.join().unwrap();
        });
    }

    /// Two futures of one flag, each awaited on its own thread, and a third
    /// future polled once and dropped unresolved, all racing `set`: both
    /// awaited futures resolve (a lost or overwritten waker deadlocks
    /// `block_on`), whichever way the drop and the set interleave.
    #[test]
    fn flag_set_races_two_futures_and_a_drop() {
        // Three threads: unbounded, the model takes over 20 minutes on two
        // cores; with four preemptions per execution, 5 s. A lost wake-up
        // needs one thread preempted between its check and its sleep (a
        // variant keeping one waker per flag fails this model at a bound
        // of 2).
        let mut b = ::loom::model::Builder::new();
        b.preemption_bound = Some(4);
        b.check(|| {
            let f = std::sync::Arc::new(DoneFlag::new());
            let (f2, f3) = (f.clone(), f.clone());
            let t = thread::spawn(move || {
                let mut dropped = f2.wait_async();
                let mut cx = Context::from_waker(Waker::noop());
                let _ = Pin::new(&mut dropped).poll(&mut cx);
                drop(dropped);
                ::loom::future::block_on(f2.wait_async())
            });
            let s = thread::spawn(move || f3.set(Ok(())));
            assert_eq!(::loom::future::block_on(f.wait_async()), Ok(()));
            assert_eq!(t.join().unwrap(), Ok(()));
            s.join().unwrap();
            assert!(f.inner.lock().wakers.is_empty());
        });
    }

    #[test]
    fn flag_set_races_wait() {
        for ok in [true, false] {
            ::loom::model(move || {
                let f = Arc::new(DoneFlag::new());
                let f2 = f.clone();
                let t = thread::spawn(move || {
                    f2.set(if ok {
                        Ok(())
                    } else {
                        Err(EngineError::ShutDown)
                    })
                });
                assert_eq!(f.wait().is_ok(), ok);
                t.join().unwrap();
            });
        }
    }
}
