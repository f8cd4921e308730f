//! Synchronisation primitives, swapped for loom's model-checked versions
//! under `--cfg loom` (in the style of s2n-quic-core's `sync` module).
//!
//! Only the parts that loom checks (the immediate counter, the shutdown
//! [`crate::gate::Gate`] and the completion flag and counter of
//! [`crate::ondone`]) use these shims; everything else uses std /
//! parking_lot directly.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// One step of a wait loop: a model-checker yield under loom, a spin hint
/// otherwise.
pub(crate) fn spin() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// A mutex with a non-poisoning `lock()`.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(
    #[cfg(loom)] loom::sync::Mutex<T>,
    #[cfg(not(loom))] parking_lot::Mutex<T>,
);

#[cfg(loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;
#[cfg(not(loom))]
pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(loom)]
        {
            Self(loom::sync::Mutex::new(value))
        }
        #[cfg(not(loom))]
        {
            Self(parking_lot::Mutex::new(value))
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(loom)]
        {
            // A poisoned lock means another (model) thread panicked, which
            // already fails the model; keep going with the data.
            self.0.lock().unwrap_or_else(|p| p.into_inner())
        }
        #[cfg(not(loom))]
        {
            self.0.lock()
        }
    }
}

/// A condition variable for [`Mutex`], its guard passed by value (the
/// form both parking_lot and loom can serve).
#[derive(Debug, Default)]
pub(crate) struct Condvar(
    #[cfg(loom)] loom::sync::Condvar,
    #[cfg(not(loom))] parking_lot::Condvar,
);

impl Condvar {
    /// Releases `g`, sleeps until notified (or spuriously), relocks.
    pub(crate) fn wait<'a, T>(&self, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        #[cfg(loom)]
        {
            self.0.wait(g).unwrap_or_else(|p| p.into_inner())
        }
        #[cfg(not(loom))]
        {
            let mut g = g;
            self.0.wait(&mut g);
            g
        }
    }

    /// [`Condvar::wait`] until `deadline` at the latest; the guard and
    /// whether the deadline passed. (Under loom, time is not modelled:
    /// it waits for a notification.)
    pub(crate) fn wait_until<'a, T>(
        &self,
        g: MutexGuard<'a, T>,
        deadline: std::time::Instant,
    ) -> (MutexGuard<'a, T>, bool) {
        #[cfg(loom)]
        {
            let _ = deadline;
            (self.wait(g), false)
        }
        #[cfg(not(loom))]
        {
            let mut g = g;
            let timed_out = self.0.wait_until(&mut g, deadline).timed_out();
            (g, timed_out)
        }
    }

    /// Wakes every waiter.
    pub(crate) fn notify_all(&self) {
        #[cfg(loom)]
        self.0.notify_all();
        #[cfg(not(loom))]
        {
            let _ = self.0.notify_all();
        }
    }
}
