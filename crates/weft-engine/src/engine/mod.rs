//! The [`TransferEngine`] handle and the state it shares with the engine's
//! threads: group info, the UVM watcher API, manual driving and shutdown.
//! Registrations, peer groups and receive pools are in `control`, submits
//! in `submit` (scatters to prepared destinations in `targets`), immediates
//! and their rounds in `rounds`.

mod control;
mod owned;
mod report;
mod rounds;
mod submit;
mod targets;
mod watches;

pub use owned::{ImmLease, Registration, Resources};
pub use report::{DataPathReport, NicReport, Reach};
pub use targets::{ScatterSlice, ScatterTargets};

use crate::config::{EngineConfig, ExcessHandler};
use crate::core::GroupInfo;
use crate::driver::callback::{run_msg, IN_CALLBACK};
use crate::driver::worker::Worker;
use crate::driver::{CbMsg, GroupShared};
use crate::error::EngineError;
use crate::gate::Gate;
use crate::imm::{ImmDone, ImmTable, ImmWaits};
use crate::mem::MrHandle;
use crate::request::{AddrBook, GroupAddress};
use crate::shard::{self, ScatterMode, ShardConfig};
use crate::stats::EngineStats;
use crate::watcher::{UvmWatcher, WatchCallback, WatcherShared};
use crossbeam_channel::{Receiver, Sender};
use crossbeam_utils::Backoff;
use parking_lot::Mutex;
use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The immediate-value allocator (`alloc_imm` / `free_imm`).
pub(crate) struct ImmAlloc {
    /// Values below it were handed out (or skipped as reserved) at least
    /// once; values from it up never were.
    pub(crate) next: u32,
    /// Values handed out, then freed.
    pub(crate) free: Vec<u32>,
    /// `in_use[v]` for values handed out or reserved and not freed (the
    /// vector may be shorter than the value space: missing means unused).
    pub(crate) in_use: Vec<bool>,
}

impl ImmAlloc {
    pub(crate) fn is_used(&self, v: u32) -> bool {
        self.in_use.get(v as usize).copied().unwrap_or(false)
    }

    pub(crate) fn mark(&mut self, v: u32) {
        let i = v as usize;
        if self.in_use.len() <= i {
            self.in_use.resize(i + 1, false);
        }
        self.in_use[i] = true;
    }

    pub(crate) fn unmark(&mut self, v: u32) {
        if let Some(u) = self.in_use.get_mut(v as usize) {
            *u = false;
        }
    }
}

/// The engine's threads, joined at shutdown.
#[derive(Default)]
pub(crate) struct Threads {
    pub(crate) workers: Vec<JoinHandle<()>>,
    pub(crate) callback: Option<JoinHandle<()>>,
    pub(crate) watcher: Option<JoinHandle<()>>,
}

/// Manual mode: the workers and the callback queue `progress` drives.
pub(crate) struct ManualState {
    pub(crate) workers: Vec<Worker>,
    pub(crate) cb_rx: Receiver<CbMsg>,
}

/// Source of [`Inner::id`].
pub(crate) static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// What every handle of one engine shares.
pub(crate) struct Inner {
    /// Process-unique engine id: peer group handles name their engine.
    pub(crate) id: u64,
    /// This engine's incarnation, in its addresses and descriptors.
    pub(crate) incarnation: weft_transport::Incarnation,
    pub(crate) groups: Vec<Arc<GroupShared>>,
    pub(crate) imms: Arc<ImmTable<ImmDone>>,
    pub(crate) imm_waits: Arc<ImmWaits>,
    pub(crate) addrs: Arc<AddrBook>,
    pub(crate) imm_free: Mutex<ImmAlloc>,
    pub(crate) config: EngineConfig,
    pub(crate) cb_tx: Sender<CbMsg>,
    pub(crate) threads: Mutex<Threads>,
    pub(crate) watcher: Arc<WatcherShared>,
    pub(crate) shut: AtomicBool,
    /// `expect_imm_count` arms pass through it; `shutdown` closes it before
    /// failing the armed rounds, so no arm lands after that.
    pub(crate) arm_gate: Gate,
    pub(crate) done: AtomicBool,
    pub(crate) manual: Option<Mutex<ManualState>>,
    pub(crate) next_id: AtomicU64,
    pub(crate) next_pool: AtomicU16,
    pub(crate) excess: ExcessHandler,
    pub(crate) excess_total: AtomicU64,
    /// Rounds armed with the peers they wait on.
    pub(crate) watches: watches::Watches,
    /// Read by `take_probe_records` only (feature `latency-probe`);
    /// zero-sized without it.
    #[allow(dead_code)]
    pub(crate) probes: crate::probe::Probes,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Last handle gone without `shutdown`: stop the threads. They hold
        // no `Inner` reference except the callback thread, which exits on
        // `Stop` once the workers are gone.
        if !self.done.load(Ordering::SeqCst) {
            self.shut.store(true, Ordering::SeqCst);
            for g in &self.groups {
                g.closing.store(true, Ordering::SeqCst);
                g.kick();
            }
            self.watcher.stop.store(true, Ordering::SeqCst);
            self.watcher.unpark();
            let _ = self.cb_tx.send(CbMsg::Stop);
        }
    }
}

/// The immediate-count parameters of one group, for receivers computing how
/// many immediates a peer's submit produces (see [`crate::shard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImmCounts {
    /// NICs of the group: a submit spreads over this many when the peer has
    /// as many.
    pub nics: usize,
    /// Smallest `max_write_len` of the group's NICs.
    pub max_write_len: u64,
    /// The sharding plan.
    pub shard: ShardConfig,
}

impl ImmCounts {
    /// Immediates of one `submit_single_write` of `len` bytes.
    pub fn single_write(&self, len: u64) -> u64 {
        shard::imm_count_single_write(len, self.nics, self.max_write_len, &self.shard)
    }
    /// Immediates of one `submit_paged_writes` of `pages` pages.
    pub fn paged_writes(&self, page_len: u64, pages: u64) -> u64 {
        shard::imm_count_paged_writes(page_len, pages, self.max_write_len, &self.shard)
    }
    /// Immediates one scatter destination of `len` bytes receives.
    pub fn scatter_dst(&self, len: u64, mode: ScatterMode) -> u64 {
        shard::imm_count_scatter_dst(len, self.nics, self.max_write_len, mode, &self.shard)
    }
    /// Immediates one barrier produces at each destination: always 1.
    pub fn barrier(&self) -> u64 {
        1
    }
}

/// A set of peers for scatter and barrier, resolved on every group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerGroupHandle {
    /// The engine that resolved the group (handles are per engine).
    pub(super) engine: u64,
    pub(super) ids: Vec<u32>,
    /// The members' addresses, to match destinations to members at submit.
    pub(super) members: Arc<[GroupAddress]>,
}

impl PeerGroupHandle {
    /// Number of peers.
    pub fn len(&self) -> usize {
        self.members.len()
    }
    /// Whether the group is empty.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

/// The TransferEngine. Cheap to clone (a handle); callbacks may capture a
/// clone and submit from the callback thread.
#[derive(Clone)]
pub struct TransferEngine {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("groups", &self.inner.groups.len())
            .finish()
    }
}

pub(crate) fn no_group(g: usize) -> EngineError {
    EngineError::InvalidArgument {
        what: format!("no domain group {g}"),
    }
}

impl TransferEngine {
    pub(super) fn group(&self, g: usize) -> Result<&Arc<GroupShared>, EngineError> {
        self.inner.groups.get(g).ok_or_else(|| no_group(g))
    }

    /// The group of a memory handle, after checking that this engine
    /// registered it: a foreign handle's slot and group numbers name
    /// another engine's regions.
    pub(super) fn own_group(&self, h: &MrHandle) -> Result<&Arc<GroupShared>, EngineError> {
        if h.engine != self.inner.id {
            return Err(EngineError::InvalidArgument {
                what: format!(
                    "memory handle of engine {} used on engine {}",
                    h.engine, self.inner.id
                ),
            });
        }
        self.group(h.group as usize)
    }

    pub(super) fn info(&self, g: usize) -> Result<&GroupInfo, EngineError> {
        self.group(g)?.info.get().ok_or(EngineError::ShutDown)
    }

    /// Number of domain groups.
    pub fn groups(&self) -> usize {
        self.inner.groups.len()
    }

    /// NICs of group `g`.
    pub fn nic_count(&self, g: usize) -> Result<usize, EngineError> {
        Ok(self.info(g)?.addrs.len())
    }

    /// Names of group `g`'s NICs, in NIC order.
    pub fn nic_names(&self, g: usize) -> Result<Vec<String>, EngineError> {
        Ok(self.info(g)?.names.clone())
    }

    /// Addresses of group `g`'s NICs, in NIC order.
    pub fn group_address(&self, g: usize) -> Result<GroupAddress, EngineError> {
        Ok(GroupAddress {
            nics: self.info(g)?.addrs.clone(),
            incarnation: self.inner.incarnation,
        })
    }

    /// Address of group 0 (its NIC 0 takes sends).
    pub fn main_address(&self) -> GroupAddress {
        self.group_address(0).unwrap_or(GroupAddress {
            nics: Vec::new(),
            incarnation: self.inner.incarnation,
        })
    }

    /// This engine's incarnation: drawn at build time (see
    /// [`EngineBuilder::incarnation`](crate::EngineBuilder::incarnation)),
    /// carried by its [`GroupAddress`]es and the descriptors
    /// [`TransferEngine::reg_mr`] returns, so peers tell it apart from an
    /// earlier or later process at the same NIC addresses, and by every
    /// SEND it makes (a receiver drops SENDs meant for another
    /// incarnation). A peer adopts a newer incarnation at the same NIC
    /// addresses only once the one it used ended (removed, or reported
    /// unreachable by the transport); until then descriptors naming the
    /// newer one fail with [`EngineError::IncarnationUnproven`]
    /// (docs/engine.md, "Peer lifecycle").
    pub fn incarnation(&self) -> weft_transport::Incarnation {
        self.inner.incarnation
    }

    /// Immediate-count parameters of group `g`.
    pub fn imm_counts(&self, g: usize) -> Result<ImmCounts, EngineError> {
        let i = self.info(g)?;
        Ok(ImmCounts {
            nics: i.addrs.len(),
            max_write_len: i.max_write_len,
            shard: self.inner.config.shard,
        })
    }

    /// Statistics.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            imm_excess: self.inner.excess_total.load(Ordering::Relaxed),
            imm_dropped: self.inner.imms.dropped(),
            groups: self
                .inner
                .groups
                .iter()
                .map(|g| g.counters.snapshot(g.queue.len()))
                .collect(),
        }
    }

    /// Allocates a host word watched by the UVM watcher thread; `cb(old,
    /// new)` runs on that thread when it changes (changes may coalesce).
    pub fn alloc_uvm_watcher(&self, cb: impl FnMut(u64, u64) + Send + 'static) -> UvmWatcher {
        self.inner.watcher.alloc(Box::new(cb) as WatchCallback)
    }

    /// Watches an externally allocated word (e.g. host-mapped pinned memory
    /// a GPU writes).
    ///
    /// # Safety
    /// `ptr` must point to an 8-byte aligned word that stays valid (mapped,
    /// not freed) until the returned [`UvmWatcher`] is dropped, and that is
    /// only ever written atomically or by a device.
    // Unsafe API: forwards the caller's promises to the watcher.
    #[allow(unsafe_code)]
    pub unsafe fn watch_word(
        &self,
        ptr: NonNull<AtomicU64>,
        cb: impl FnMut(u64, u64) + Send + 'static,
    ) -> UvmWatcher {
        // SAFETY: forwarded to the caller.
        unsafe {
            self.inner
                .watcher
                .external(ptr, Box::new(cb) as WatchCallback)
        }
    }

    /// Manual mode only: runs one iteration of every worker, then the
    /// callbacks it produced, then one watcher scan, all on this thread.
    /// Returns whether anything happened. Do not call from a callback.
    ///
    /// A panic inside a worker's iteration (a backend's, say) does not
    /// unwind out of here: as on a worker thread, the group's transfers in
    /// flight and queued fail with [`EngineError::WorkerFailed`], later
    /// submits to it fail with that error, and the other groups go on.
    pub fn progress(&self) -> bool {
        let Some(m) = &self.inner.manual else {
            return false;
        };
        let mut did = false;
        let msgs: Vec<CbMsg> = {
            let mut st = m.lock();
            for w in st.workers.iter_mut() {
                did |= w.step_manual();
            }
            st.cb_rx.try_iter().collect()
        };
        for msg in msgs {
            did = true;
            run_msg(&self.inner.excess, msg);
        }
        did |= self.inner.watcher.scan();
        did
    }

    /// Latency-probe records collected so far (feature `latency-probe`).
    #[cfg(feature = "latency-probe")]
    pub fn take_probe_records(&self) -> Vec<crate::probe::Record> {
        self.inner.probes.drain()
    }

    /// Whether [`shutdown`](Self::shutdown) has begun: calls that start
    /// work fail with [`EngineError::ShutDown`] from then on.
    pub fn is_shut_down(&self) -> bool {
        self.inner.shut.load(Ordering::SeqCst)
    }

    /// Stops the engine: new submits fail with `ShutDown`, queued and
    /// not-yet-posted work fails with `ShutDown`, posted work is drained
    /// (up to `drain_timeout`, then failed), armed immediate rounds fail,
    /// unconsumed immediates are reported as excess, every callback already
    /// due is run, then all threads exit. Idempotent. Must not be called
    /// from a callback.
    pub fn shutdown(&self) {
        if self.inner.shut.swap(true, Ordering::SeqCst) {
            // Someone else is/was shutting down: return only once that
            // shutdown has finished (unless called from inside a callback,
            // which that shutdown may be waiting for).
            if IN_CALLBACK.with(Cell::get) {
                return;
            }
            let b = Backoff::new();
            while !self.inner.done.load(Ordering::SeqCst) {
                if b.is_completed() {
                    std::thread::sleep(Duration::from_micros(100));
                } else {
                    b.snooze();
                }
            }
            return;
        }
        // No arm may land in the immediate table after its rounds are
        // failed below: arms in progress finish now, later ones are refused.
        self.inner.arm_gate.close();
        // No submitter may be between its shutdown check and its push.
        for g in &self.inner.groups {
            let b = Backoff::new();
            while g.submitting.load(Ordering::SeqCst) != 0 {
                b.snooze();
            }
            g.closing.store(true, Ordering::SeqCst);
            g.kick();
        }
        if let Some(m) = &self.inner.manual {
            let deadline = Instant::now() + self.inner.config.drain_timeout;
            loop {
                let all_done = {
                    let mut st = m.lock();
                    for w in st.workers.iter_mut() {
                        w.step_manual();
                        w.drain_step(deadline);
                    }
                    st.workers.iter().all(|w| w.finished)
                };
                while self.progress_callbacks() {}
                if all_done {
                    break;
                }
            }
            let workers = std::mem::take(&mut m.lock().workers);
            for w in workers {
                w.close();
            }
        } else {
            let workers = std::mem::take(&mut self.inner.threads.lock().workers);
            for h in workers {
                let _ = h.join();
            }
        }
        // Unfired rounds and unconsumed immediates.
        for (imm, n, cbs) in self.inner.imms.reset_all() {
            self.report_excess(imm, n);
            for d in cbs {
                self.finish_imm(d, Err(EngineError::ShutDown));
            }
        }
        self.inner.watcher.stop.store(true, Ordering::SeqCst);
        self.inner.watcher.unpark();
        let _ = self.inner.cb_tx.send(CbMsg::Stop);
        if self.inner.manual.is_some() {
            while self.progress_callbacks() {}
        } else {
            let (cb, w) = {
                let mut t = self.inner.threads.lock();
                (t.callback.take(), t.watcher.take())
            };
            let me = std::thread::current().id();
            if let Some(h) = cb {
                if h.thread().id() != me {
                    let _ = h.join();
                }
            }
            if let Some(h) = w {
                if h.thread().id() != me {
                    let _ = h.join();
                }
            }
        }
        self.inner.watcher.clear();
        self.inner.done.store(true, Ordering::SeqCst);
    }

    fn progress_callbacks(&self) -> bool {
        let Some(m) = &self.inner.manual else {
            return false;
        };
        let msgs: Vec<CbMsg> = m.lock().cb_rx.try_iter().collect();
        let any = !msgs.is_empty();
        for msg in msgs {
            run_msg(&self.inner.excess, msg);
        }
        any
    }
}
