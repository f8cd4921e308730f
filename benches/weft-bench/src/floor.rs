//! Floors: a bare cross-thread hand-off through a lock-free queue (what
//! "submit → worker picked it up" costs at best), and the wake-up of a
//! thread blocked in a channel receive (what a callback after idleness
//! costs at best, with the callback thread blocking when idle).

use crate::pin::PinGuard;
use crossbeam_queue::ArrayQueue;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A consumer thread spinning on an `ArrayQueue<Instant>`; each pop records
/// `now - stamp` and acknowledges, so hand-offs are measured one at a time
/// (like a request reaching an idle-but-spinning worker).
pub struct HandoffFloor {
    q: Arc<ArrayQueue<Instant>>,
    last_ns: Arc<AtomicU64>,
    acks: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for HandoffFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandoffFloor").finish_non_exhaustive()
    }
}

impl Default for HandoffFloor {
    fn default() -> Self {
        Self::new()
    }
}

impl HandoffFloor {
    /// Starts the consumer thread.
    pub fn new() -> Self {
        Self::on(None)
    }

    /// Starts the consumer thread pinned to `cpu` (`None`: not pinned).
    pub fn on(cpu: Option<usize>) -> Self {
        let q: Arc<ArrayQueue<Instant>> = Arc::new(ArrayQueue::new(1024));
        let last_ns = Arc::new(AtomicU64::new(0));
        let acks = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (q2, l2, a2, s2) = (q.clone(), last_ns.clone(), acks.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("weft-bench-floor".into())
            .spawn(move || {
                let _pin = PinGuard::new(cpu);
                let mut idle = 0u32;
                while !s2.load(Ordering::Relaxed) {
                    match q2.pop() {
                        Some(t) => {
                            let d = t.elapsed().as_nanos();
                            l2.store(u64::try_from(d).unwrap_or(u64::MAX), Ordering::Relaxed);
                            a2.fetch_add(1, Ordering::Release);
                            idle = 0;
                        }
                        None => {
                            idle = idle.wrapping_add(1);
                            if idle.is_multiple_of(64) {
                                std::thread::yield_now();
                            } else {
                                std::hint::spin_loop();
                            }
                        }
                    }
                }
            })
            .ok();
        HandoffFloor {
            q,
            last_ns,
            acks,
            stop,
            thread,
        }
    }

    /// One hand-off; returns its latency in ns (push → pop on the other
    /// thread), or `None` if the consumer thread could not be started.
    pub fn once(&self) -> Option<f64> {
        self.thread.as_ref()?;
        let before = self.acks.load(Ordering::Acquire);
        let mut t = Instant::now();
        while let Err(back) = self.q.push(t) {
            t = back;
            std::hint::spin_loop();
        }
        Some(wait_ack(&self.acks, before, &self.last_ns))
    }
}

impl Drop for HandoffFloor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A consumer thread blocked in `recv` on a crossbeam channel, as the
/// engine's callback thread is under `PollPolicy::Adaptive`; each
/// [`WakeFloor::once`] lets it fall asleep, sends a time stamp and waits
/// for the consumer to record `now - stamp`: one thread wake-up. How long
/// the consumer was idle before it matters (a CPU idle longer sleeps
/// deeper): [`WakeFloor::once_after`] sets it.
pub struct WakeFloor {
    tx: Option<crossbeam_channel::Sender<Instant>>,
    last_ns: Arc<AtomicU64>,
    acks: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for WakeFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WakeFloor").finish_non_exhaustive()
    }
}

/// How long [`WakeFloor::once`] leaves the consumer idle before the send:
/// past the channel's short spin before it blocks.
const WAKE_IDLE: Duration = Duration::from_micros(200);

impl WakeFloor {
    /// Starts the consumer thread pinned to `cpu` (`None`: not pinned).
    pub fn on(cpu: Option<usize>) -> Self {
        let (tx, rx) = crossbeam_channel::unbounded::<Instant>();
        let last_ns = Arc::new(AtomicU64::new(0));
        let acks = Arc::new(AtomicU64::new(0));
        let (l2, a2) = (last_ns.clone(), acks.clone());
        let thread = std::thread::Builder::new()
            .name("weft-bench-wake".into())
            .spawn(move || {
                let _pin = PinGuard::new(cpu);
                // Until the sender is dropped.
                while let Ok(t) = rx.recv() {
                    let d = t.elapsed().as_nanos();
                    l2.store(u64::try_from(d).unwrap_or(u64::MAX), Ordering::Relaxed);
                    a2.fetch_add(1, Ordering::Release);
                }
            })
            .ok();
        WakeFloor {
            tx: Some(tx),
            last_ns,
            acks,
            thread,
        }
    }

    /// One wake-up after 200 µs of idleness; returns its latency in
    /// ns (send → the woken consumer's clock read), or `None` if the
    /// consumer thread could not be started or is gone.
    pub fn once(&self) -> Option<f64> {
        self.once_after(WAKE_IDLE)
    }

    /// [`once`](Self::once) after `idle` of idleness (at least 200 µs, so
    /// the consumer is blocked).
    pub fn once_after(&self, idle: Duration) -> Option<f64> {
        self.thread.as_ref()?;
        let before = self.acks.load(Ordering::Acquire);
        std::thread::sleep(idle.max(WAKE_IDLE));
        self.tx.as_ref()?.send(Instant::now()).ok()?;
        Some(wait_ack(&self.acks, before, &self.last_ns))
    }
}

impl Drop for WakeFloor {
    fn drop(&mut self) {
        // Disconnects the channel: the consumer's `recv` fails and it exits.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits (spinning, yielding every 64 spins) until a consumer acknowledged
/// past `before`, then returns the latency it recorded, in ns.
fn wait_ack(acks: &AtomicU64, before: u64, last_ns: &AtomicU64) -> f64 {
    let mut spins = 0u32;
    while acks.load(Ordering::Acquire) == before {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    last_ns.load(Ordering::Relaxed) as f64
}
