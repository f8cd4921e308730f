//! How a submit reports completion: a callback, a flag or a counter.

use crate::error::EngineError;
use parking_lot::{Condvar, Mutex};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
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
    /// Bump this counter (on the worker; cheap).
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
    inner: Mutex<FlagInner>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct FlagInner {
    error: Option<EngineError>,
    waker: Option<Waker>,
}

impl DoneFlag {
    /// A pending flag.
    pub fn new() -> Self {
        Self::default()
    }

    fn set(&self, r: DoneResult) {
        let mut g = self.inner.lock();
        let state = match r {
            Ok(()) => OK,
            Err(e) => {
                g.error = Some(e);
                FAILED
            }
        };
        self.state.store(state, Ordering::Release);
        let waker = g.waker.take();
        drop(g);
        self.cv.notify_all();
        if let Some(w) = waker {
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

    /// Blocks until the transfer finishes.
    pub fn wait(&self) -> DoneResult {
        let mut g = self.inner.lock();
        while self.state.load(Ordering::Acquire) == PENDING {
            self.cv.wait(&mut g);
        }
        drop(g);
        self.result().unwrap_or(Err(EngineError::ShutDown))
    }

    /// Blocks until the transfer finishes or `timeout` passes: the outcome,
    /// or `None` if it is still pending (the transfer goes on; wait again or
    /// drop the flag).
    pub fn wait_timeout(&self, timeout: Duration) -> Option<DoneResult> {
        let mut g = self.inner.lock();
        match Instant::now().checked_add(timeout) {
            Some(deadline) => {
                while self.state.load(Ordering::Acquire) == PENDING {
                    if self.cv.wait_until(&mut g, deadline).timed_out() {
                        break;
                    }
                }
            }
            // A timeout beyond the clock's range: no deadline.
            None => {
                while self.state.load(Ordering::Acquire) == PENDING {
                    self.cv.wait(&mut g);
                }
            }
        }
        drop(g);
        self.result()
    }

    /// A future resolving when the transfer finishes.
    pub fn wait_async(self: &Arc<Self>) -> DoneFuture {
        DoneFuture(Arc::clone(self))
    }
}

/// Future of [`DoneFlag::wait_async`].
#[derive(Debug)]
pub struct DoneFuture(Arc<DoneFlag>);

impl Future for DoneFuture {
    type Output = DoneResult;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<DoneResult> {
        if let Some(r) = self.0.result() {
            return Poll::Ready(r);
        }
        let mut g = self.0.inner.lock();
        // Re-check under the lock: `set` stores the state under it.
        if self.0.state.load(Ordering::Acquire) != PENDING {
            drop(g);
            return Poll::Ready(self.0.result().unwrap_or(Err(EngineError::ShutDown)));
        }
        g.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Counts finished transfers (ok and failed), keeping the first error.
#[derive(Debug, Default)]
pub struct DoneCounter {
    ok: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<EngineError>>,
    cv: Condvar,
}

impl DoneCounter {
    /// A zeroed counter.
    pub fn new() -> Self {
        Self::default()
    }

    fn add(&self, r: DoneResult) {
        let mut g = self.first_error.lock();
        match r {
            Ok(()) => {
                self.ok.fetch_add(1, Ordering::AcqRel);
            }
            Err(e) => {
                if g.is_none() {
                    *g = Some(e);
                }
                self.failed.fetch_add(1, Ordering::AcqRel);
            }
        }
        drop(g);
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

    /// The first error seen.
    pub fn first_error(&self) -> Option<EngineError> {
        self.first_error.lock().clone()
    }

    /// Blocks until at least `n` transfers finished.
    pub fn wait_for(&self, n: u64) {
        let mut g = self.first_error.lock();
        while self.total() < n {
            self.cv.wait(&mut g);
        }
    }

    /// Blocks until at least `n` transfers finished or `timeout` passes;
    /// whether `n` were reached.
    pub fn wait_for_timeout(&self, n: u64, timeout: Duration) -> bool {
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            self.wait_for(n);
            return true;
        };
        let mut g = self.first_error.lock();
        while self.total() < n {
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                break;
            }
        }
        self.total() >= n
    }
}
