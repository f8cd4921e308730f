//! The UVM watcher: one thread polling host words (GPU-writable when backed
//! by host-mapped pinned memory) and calling `cb(old, new)` on change.
//! Changes may be coalesced (a word going 0 → 3 → 5 between two scans is
//! reported once as `(0, 5)`).

use crossbeam_channel::{Receiver, Sender};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{Thread, ThreadId};

/// Change callback: `(old, new)`.
pub type WatchCallback = Box<dyn FnMut(u64, u64) + Send + 'static>;

enum Word {
    Owned(Box<AtomicU64>),
    External(NonNull<AtomicU64>),
}

struct WatchState {
    cancelled: AtomicBool,
    word: Word,
}

// SAFETY: `Word::Owned` is an ordinary atomic; `Word::External` points to an
// atomic the creator of the watch (`watch_word`, an unsafe fn) promised stays
// valid until the `UvmWatcher` is dropped, and is only accessed atomically.
unsafe impl Send for WatchState {}
// SAFETY: see `Send`; all access is through `&AtomicU64`.
unsafe impl Sync for WatchState {}

impl WatchState {
    fn word(&self) -> &AtomicU64 {
        match &self.word {
            Word::Owned(b) => b,
            // SAFETY: valid while the watch is not cancelled-and-acknowledged
            // (see `UvmWatcher::drop`), which outlives every access.
            Word::External(p) => unsafe { p.as_ref() },
        }
    }
}

struct Entry {
    state: Arc<WatchState>,
    last: u64,
    cb: WatchCallback,
}

/// State shared by the engine, the watcher thread and the handles.
pub(crate) struct WatcherShared {
    tx: Sender<Entry>,
    rx: Receiver<Entry>,
    entries: parking_lot::Mutex<Vec<Entry>>,
    epoch: AtomicU64,
    pub(crate) running: AtomicBool,
    pub(crate) stop: AtomicBool,
    thread: OnceLock<(ThreadId, Thread)>,
}

impl WatcherShared {
    pub(crate) fn new() -> Arc<Self> {
        let (tx, rx) = crossbeam_channel::unbounded();
        Arc::new(Self {
            tx,
            rx,
            entries: parking_lot::Mutex::new(Vec::new()),
            epoch: AtomicU64::new(0),
            running: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            thread: OnceLock::new(),
        })
    }

    pub(crate) fn set_thread(&self) {
        let t = std::thread::current();
        let _ = self.thread.set((t.id(), t));
    }

    pub(crate) fn unpark(&self) {
        if let Some((_, t)) = self.thread.get() {
            t.unpark();
        }
    }

    /// One scan over all words. Returns whether any callback ran or any
    /// watch was added/removed. Only one scanner runs at a time.
    pub(crate) fn scan(&self) -> bool {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        let mut entries = self.entries.lock();
        let mut did = false;
        while let Ok(e) = self.rx.try_recv() {
            entries.push(e);
            did = true;
        }
        let before = entries.len();
        entries.retain(|e| !e.state.cancelled.load(Ordering::SeqCst));
        did |= entries.len() != before;
        for e in entries.iter_mut() {
            let v = e.state.word().load(Ordering::Acquire);
            if v != e.last && !e.state.cancelled.load(Ordering::SeqCst) {
                let old = e.last;
                e.last = v;
                let cb = &mut e.cb;
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(old, v))).is_err() {
                    tracing::error!("UVM watcher callback panicked");
                }
                did = true;
            }
        }
        self.epoch.fetch_add(1, Ordering::SeqCst);
        did
    }

    pub(crate) fn has_entries(&self) -> bool {
        !self.rx.is_empty() || !self.entries.lock().is_empty()
    }

    /// Drops every watch (shutdown).
    pub(crate) fn clear(&self) {
        self.entries.lock().clear();
        while self.rx.try_recv().is_ok() {}
    }

    fn add(self: &Arc<Self>, word: Word, cb: WatchCallback) -> UvmWatcher {
        let state = Arc::new(WatchState {
            cancelled: AtomicBool::new(false),
            word,
        });
        let last = state.word().load(Ordering::Acquire);
        let _ = self.tx.send(Entry {
            state: Arc::clone(&state),
            last,
            cb,
        });
        self.unpark();
        UvmWatcher {
            state,
            shared: Arc::clone(self),
        }
    }

    pub(crate) fn alloc(self: &Arc<Self>, cb: WatchCallback) -> UvmWatcher {
        self.add(Word::Owned(Box::new(AtomicU64::new(0))), cb)
    }

    /// # Safety
    /// See [`crate::TransferEngine::watch_word`].
    pub(crate) unsafe fn external(
        self: &Arc<Self>,
        ptr: NonNull<AtomicU64>,
        cb: WatchCallback,
    ) -> UvmWatcher {
        self.add(Word::External(ptr), cb)
    }
}

/// A watched 64-bit word. Dropping it stops the watch; once `drop` returns
/// the callback is not running and will not run again, and the engine no
/// longer reads the word.
pub struct UvmWatcher {
    state: Arc<WatchState>,
    shared: Arc<WatcherShared>,
}

impl std::fmt::Debug for UvmWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UvmWatcher")
            .field("ptr", &self.ptr())
            .finish()
    }
}

impl UvmWatcher {
    /// The watched word (host memory; for an engine-allocated word, valid
    /// as long as this handle lives).
    pub fn ptr(&self) -> NonNull<AtomicU64> {
        NonNull::from(self.state.word())
    }

    /// The watched word, for host-side writers and tests.
    pub fn word(&self) -> &AtomicU64 {
        self.state.word()
    }
}

impl Drop for UvmWatcher {
    fn drop(&mut self) {
        self.state.cancelled.store(true, Ordering::SeqCst);
        let on_watcher = self
            .shared
            .thread
            .get()
            .is_some_and(|(id, _)| *id == std::thread::current().id());
        if on_watcher || !self.shared.running.load(Ordering::SeqCst) {
            // Either we are inside a callback on the watcher thread (the
            // scan re-checks `cancelled` before each call), or no thread
            // scans concurrently (manual mode / stopped): if a manual scan
            // is in progress on another thread, wait for it via the lock.
            if !on_watcher {
                drop(self.shared.entries.lock());
            }
            return;
        }
        // Wait until any scan that may have seen the word un-cancelled has
        // finished: the epoch is odd during a scan.
        let e0 = self.shared.epoch.load(Ordering::SeqCst);
        let target = if e0 % 2 == 1 { e0 + 1 } else { e0 };
        self.shared.unpark();
        while self.shared.epoch.load(Ordering::SeqCst) < target
            && self.shared.running.load(Ordering::SeqCst)
        {
            std::thread::yield_now();
        }
    }
}
