//! Synchronisation primitives, swapped for loom's model-checked versions
//! under `--cfg loom` (in the style of s2n-quic-core's `sync` module).
//!
//! Only the lock-free parts that loom checks (the immediate counter and the
//! shutdown [`crate::gate::Gate`]) use these shims; everything else uses
//! std / parking_lot directly.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};

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
