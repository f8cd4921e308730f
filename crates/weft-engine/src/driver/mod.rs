//! The threads that drive the engine: each group's worker thread
//! ([`worker`]: runs the group's [`WorkerCore`](crate::core::WorkerCore)),
//! the shared callback thread ([`callback`]: runs user callbacks, receive
//! callbacks on messages the worker already copied out) and the UVM
//! watcher thread
//! ([`watcher_main`]). In manual mode `TransferEngine::progress` runs the
//! same steps on the caller's thread instead.

#[allow(unsafe_code)]
pub(crate) mod block;
pub(crate) mod callback;
pub(crate) mod worker;

use crate::config::{Idle, IdleState};
use crate::core::{Control, Event, GroupInfo};
use crate::error::EngineError;
use crate::mem::SendPool;
use crate::request::Submitted;
use crate::stats::GroupCounters;
use crate::watcher::WatcherShared;
use crossbeam_channel::Sender;
use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::Duration;
use weft_transport::{Device, Imm};

/// A message to the callback thread.
pub(crate) enum CbMsg {
    Event(Event),
    Excess(Imm, u64),
    Stop,
}

/// What a group's worker shares with submitters and the engine handle.
pub(crate) struct GroupShared {
    pub(crate) index: usize,
    pub(crate) device: Device,
    /// Requests by value: no allocation per submit to free on the worker.
    pub(crate) queue: ArrayQueue<Submitted>,
    pub(crate) ctrl: Sender<Control>,
    /// Control messages sent so far (counted after each send): the worker
    /// looks into `ctrl` only when this moved, not on every lap (an empty
    /// channel receive was ~6 % of a busy shm worker's time on the H200
    /// host).
    pub(crate) ctrl_sent: CachePadded<AtomicU64>,
    pub(crate) info: OnceLock<GroupInfo>,
    pub(crate) send_pool: OnceLock<Arc<SendPool>>,
    // Each flag on a cache line of its own: `submitting` is written twice
    // per submit by submitters, `closing` read on every worker lap and
    // `sleeping` written by the worker around each sleep and read per
    // submit. Sharing a line, every submit cost the worker a miss on its
    // next lap and the submitter a miss on its next submit.
    pub(crate) submitting: CachePadded<AtomicUsize>,
    pub(crate) closing: CachePadded<AtomicBool>,
    pub(crate) sleeping: CachePadded<AtomicBool>,
    pub(crate) thread: OnceLock<Thread>,
    /// Written to wake the worker when it sleeps in its NICs' wait fds
    /// (`None`: no eventfd; the worker then only parks).
    pub(crate) wake_fd: Option<block::WakeFd>,
    /// Set once the worker panicked: later submits fail with it.
    pub(crate) failed: OnceLock<EngineError>,
    /// Load and per-NIC counters the worker publishes.
    pub(crate) counters: Arc<GroupCounters>,
    /// The group's worker (threaded mode, while its thread runs): the
    /// thread holds the lock while it works on the group's state and
    /// releases it between laps and while it sleeps; a submitting thread
    /// that finds it free posts its request itself
    /// ([`EngineConfig::caller_posts`](crate::EngineConfig::caller_posts);
    /// `try_lock` only, so a submitter never waits for it).
    pub(crate) slot: parking_lot::Mutex<Option<worker::Worker>>,
}

impl GroupShared {
    /// Wakes the worker if it sleeps (parked or in its wait fds). Callers
    /// store what it should see first; the worker re-checks after
    /// announcing `sleeping`.
    pub(crate) fn wake(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            self.kick();
        }
    }

    /// Wakes the worker whether or not it announced sleeping (shutdown, a
    /// full queue, control requests).
    pub(crate) fn kick(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
        if let Some(w) = &self.wake_fd {
            w.signal();
        }
    }
}

impl crate::mem::PoolGroup for GroupShared {
    fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    fn wake(&self) {
        GroupShared::wake(self);
    }
}

/// The UVM watcher thread: scans the watched words, idling per `idle`.
pub(crate) fn watcher_main(w: &Arc<WatcherShared>, idle: Idle) {
    w.set_thread();
    let mut idle_n = IdleState::default();
    while !w.stop.load(Ordering::SeqCst) {
        if w.scan() {
            idle_n.reset();
            continue;
        }
        if !w.has_entries() {
            std::thread::park_timeout(Duration::from_millis(5));
            continue;
        }
        if let Some(d) = idle.step(&mut idle_n) {
            std::thread::park_timeout(d);
        }
    }
    w.running.store(false, Ordering::SeqCst);
}
