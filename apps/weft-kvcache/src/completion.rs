//! A one-shot result that can be waited for (blocking, with a timeout, or as
//! a future), polled as a flag, or delivered to callbacks.

use parking_lot::{Condvar, Mutex};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

type Callback<T> = Box<dyn FnOnce(&T) + Send>;

struct Slot<T> {
    value: Option<T>,
    wakers: Vec<Waker>,
    callbacks: Vec<Callback<T>>,
}

struct Inner<T> {
    slot: Mutex<Slot<T>>,
    cv: Condvar,
}

/// A one-shot result shared by its producer and any number of waiters.
pub struct Completion<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for Completion<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<T> std::fmt::Debug for Completion<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("done", &self.inner.slot.lock().value.is_some())
            .finish()
    }
}

impl<T: Clone + Send + 'static> Default for Completion<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Clone + Send + 'static> Completion<T> {
    /// Not yet complete.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                slot: Mutex::new(Slot {
                    value: None,
                    wakers: Vec::new(),
                    callbacks: Vec::new(),
                }),
                cv: Condvar::new(),
            }),
        }
    }

    /// Sets the result (the first call wins); wakes waiters and runs the
    /// callbacks on this thread.
    pub(crate) fn complete(&self, value: T) {
        let (wakers, callbacks) = {
            let mut s = self.inner.slot.lock();
            if s.value.is_some() {
                return;
            }
            s.value = Some(value.clone());
            (
                std::mem::take(&mut s.wakers),
                std::mem::take(&mut s.callbacks),
            )
        };
        self.inner.cv.notify_all();
        for w in wakers {
            w.wake();
        }
        for cb in callbacks {
            cb(&value);
        }
    }

    /// Whether the result is in (the flag).
    pub fn is_done(&self) -> bool {
        self.inner.slot.lock().value.is_some()
    }

    /// The result, if in.
    pub fn result(&self) -> Option<T> {
        self.inner.slot.lock().value.clone()
    }

    /// Blocks until the result is in.
    pub fn wait(&self) -> T {
        let mut s = self.inner.slot.lock();
        loop {
            if let Some(v) = &s.value {
                return v.clone();
            }
            self.inner.cv.wait(&mut s);
        }
    }

    /// Blocks until the result is in or `timeout` passed.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<T> {
        let deadline = std::time::Instant::now() + timeout;
        let mut s = self.inner.slot.lock();
        loop {
            if let Some(v) = &s.value {
                return Some(v.clone());
            }
            if self.inner.cv.wait_until(&mut s, deadline).timed_out() {
                return s.value.clone();
            }
        }
    }

    /// Runs `cb` with the result once it is in (at once, on this thread, if
    /// it already is; else on the thread that completes it).
    pub fn on_complete(&self, cb: impl FnOnce(&T) + Send + 'static) {
        let value = {
            let mut s = self.inner.slot.lock();
            match &s.value {
                Some(v) => v.clone(),
                None => {
                    s.callbacks.push(Box::new(cb));
                    return;
                }
            }
        };
        cb(&value);
    }

    /// A future of the result.
    pub fn future(&self) -> CompletionFuture<T> {
        CompletionFuture(self.clone())
    }
}

/// Future of a [`Completion`].
pub struct CompletionFuture<T>(Completion<T>);

impl<T: Clone + Send + 'static> Future for CompletionFuture<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut s = self.0.inner.slot.lock();
        match &s.value {
            Some(v) => Poll::Ready(v.clone()),
            None => {
                if !s.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                    s.wakers.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}
