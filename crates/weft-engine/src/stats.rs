//! Engine statistics: what [`TransferEngine::stats`](crate::TransferEngine::stats)
//! reports, and the per-group counters the workers publish for it.
//!
//! Each group's counters have one writer at a time (its worker, or a
//! submitting thread that posts while it holds the worker's lock; the lock
//! orders them), so they are updated with plain loads and stores (the
//! stores `Release`, the reads `Acquire`), not read-modify-write atomics:
//! no locked instruction on the posting path. Readers see a recent value.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use weft_transport::NetAddr;

/// Engine statistics.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EngineStats {
    /// Immediates reported as never consumed.
    pub imm_excess: u64,
    /// Immediates of values outside the allocator's range that were not
    /// tracked because too many distinct such values were outstanding
    /// (a misbehaving peer); they are counted here and never fire a round.
    pub imm_dropped: u64,
    /// One entry per domain group, in group order.
    pub groups: Vec<GroupStats>,
}

/// The load of one domain group, for backpressure decisions and for
/// checking how evenly sharded writes spread over the NICs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct GroupStats {
    /// Requests in the group's request queue, not yet taken by its worker
    /// (at most [`EngineConfig::queue_capacity`](crate::EngineConfig::queue_capacity)).
    pub queued: usize,
    /// Transfers the worker has taken and not yet resolved (their `OnDone`
    /// has not been reported).
    pub in_flight: usize,
    /// Planned WRs waiting for send-queue room (the worker stops taking
    /// requests at [`EngineConfig::max_pending_wrs`](crate::EngineConfig::max_pending_wrs)).
    pub pending_wrs: usize,
    /// Times the group's worker, idle, slept in its NICs' wait fds
    /// ([`weft_transport::Domain::wait_fd`]) instead of polling them (see
    /// [`PollPolicy`](crate::PollPolicy)).
    pub fd_sleeps: u64,
    /// SENDs received (receive pools are on group 0) that were meant for
    /// another incarnation of this engine's addresses — normally the
    /// process that answered there before this one restarted in its place
    /// — and were dropped, never handed to a receive callback (see
    /// docs/engine.md, "SEND frames").
    pub recv_stale: u64,
    /// Messages received without a valid SEND frame (too short, not a weft
    /// frame, another frame version or unknown flags): dropped, never
    /// handed to a receive callback.
    pub recv_malformed: u64,
    /// One entry per NIC of the group, in NIC order.
    pub nics: Vec<NicStats>,
    /// Transfers (writes, scatters, barriers, SENDs) that finished
    /// successfully.
    pub transfers_ok: u64,
    /// Transfers that failed, by [`EngineError::kind`](crate::EngineError::kind)
    /// of their error (requests refused at submit, before reaching the
    /// group's queue, are not counted: the caller got their error).
    pub transfers_failed: BTreeMap<&'static str, u64>,
    /// What each resolved peer was sent, by NIC then address (a peer's
    /// entry goes when it is removed or replaced).
    pub peers: Vec<PeerStats>,
    /// Requests the submitting thread planned and posted itself, without
    /// the hand-off to the worker
    /// ([`EngineConfig::caller_posts`](crate::EngineConfig::caller_posts)).
    pub caller_posted: u64,
}

/// What one NIC of a group has posted to one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerStats {
    /// NIC index inside the group.
    pub nic: usize,
    /// The peer's NIC address.
    pub addr: NetAddr,
    /// WRs (WRITE pieces and SENDs) the NIC accepted for this peer.
    pub wrs_posted: u64,
    /// Payload bytes of those WRs.
    pub bytes_posted: u64,
}

/// What one NIC of a group has carried since the engine started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct NicStats {
    /// WRs (WRITE pieces and SENDs) the NIC accepted.
    pub wrs_posted: u64,
    /// Payload bytes of those WRs.
    pub bytes_posted: u64,
    /// Of those WRs, the ones whose completion the worker has handled
    /// (successful or failed), or that it failed when the NIC died:
    /// `wrs_posted - wrs_completed` are on the NIC now (a snapshot reads
    /// this count before `wrs_posted`, so it never exceeds it). WRs still
    /// posted when a shutdown gives up waiting for them (`drain_timeout`)
    /// or when the worker panics are failed without being counted here.
    pub wrs_completed: u64,
    /// Peers the NIC has resolved (added to its domain) and not removed
    /// with [`TransferEngine::remove_peer`](crate::TransferEngine::remove_peer):
    /// back to its earlier value after removing every peer added since.
    pub peers: u64,
}

/// A single-writer counter (see the module docs).
#[derive(Debug, Default)]
struct Counter(AtomicU64);

impl Counter {
    /// Release: a reader that sees this value also sees every count the
    /// worker stored before it (`wrs_completed` read before `wrs_posted`
    /// never exceeds it). A plain store on x86.
    #[inline]
    fn add(&self, n: u64) {
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Release,
        );
    }
    fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// What one NIC posted to one peer; written by the group's worker.
#[derive(Debug, Default)]
pub(crate) struct PeerCounters {
    wrs: Counter,
    bytes: Counter,
}

impl PeerCounters {
    /// `wrs` WRs carrying `bytes` bytes were posted to the peer.
    #[inline]
    pub(crate) fn posted(&self, wrs: u64, bytes: u64) {
        self.wrs.add(wrs);
        self.bytes.add(bytes);
    }
}

#[derive(Debug, Default)]
struct NicCounters {
    wrs: Counter,
    completed: Counter,
    bytes: Counter,
    peers: Counter,
}

/// The counters of one group, written by its worker.
#[derive(Debug)]
pub(crate) struct GroupCounters {
    in_flight: AtomicUsize,
    pending_wrs: AtomicUsize,
    fd_sleeps: Counter,
    recv_stale: Counter,
    recv_malformed: Counter,
    nics: Vec<NicCounters>,
    transfers_ok: Counter,
    caller_posted: Counter,
    /// Failures by kind (the error path only: a lock is fine).
    failed: Mutex<BTreeMap<&'static str, u64>>,
    /// Per-peer counters, shared with the worker's NICs (added and
    /// removed with the peers, on the control path).
    peers: Mutex<BTreeMap<(usize, NetAddr), Arc<PeerCounters>>>,
}

impl GroupCounters {
    /// Counters for a group of `nics` NICs.
    pub(crate) fn new(nics: usize) -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            pending_wrs: AtomicUsize::new(0),
            fd_sleeps: Counter::default(),
            recv_stale: Counter::default(),
            recv_malformed: Counter::default(),
            nics: (0..nics).map(|_| NicCounters::default()).collect(),
            transfers_ok: Counter::default(),
            caller_posted: Counter::default(),
            failed: Mutex::default(),
            peers: Mutex::default(),
        }
    }

    /// A submitting thread posted a request itself (written under the
    /// worker's lock, so still one writer at a time).
    #[inline]
    pub(crate) fn caller_posted(&self) {
        self.caller_posted.add(1);
    }

    /// A transfer finished successfully.
    #[inline]
    pub(crate) fn transfer_ok(&self) {
        self.transfers_ok.add(1);
    }

    /// A transfer failed with an error of kind `kind`.
    pub(crate) fn transfer_failed(&self, kind: &'static str) {
        *self
            .failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(kind)
            .or_default() += 1;
    }

    /// NIC `nic` resolved the peer at `addr`: its counters, fresh.
    pub(crate) fn peer_added(&self, nic: usize, addr: &NetAddr) -> Arc<PeerCounters> {
        let c = Arc::new(PeerCounters::default());
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((nic, addr.clone()), Arc::clone(&c));
        c
    }

    /// NIC `nic` dropped the peer at `addr`.
    pub(crate) fn peer_dropped(&self, nic: usize, addr: &NetAddr) {
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(nic, addr.clone()));
    }

    /// NIC `nic` accepted `wrs` WRs carrying `bytes` bytes.
    #[inline]
    pub(crate) fn posted(&self, nic: usize, wrs: u64, bytes: u64) {
        if let Some(c) = self.nics.get(nic) {
            c.wrs.add(wrs);
            c.bytes.add(bytes);
        }
    }

    /// `wrs` WRs posted on NIC `nic` completed (or failed with it).
    #[inline]
    pub(crate) fn completed(&self, nic: usize, wrs: u64) {
        if let Some(c) = self.nics.get(nic) {
            c.completed.add(wrs);
        }
    }

    /// NIC `nic` has `n` peers resolved.
    pub(crate) fn set_peers(&self, nic: usize, n: usize) {
        if let Some(c) = self.nics.get(nic) {
            c.peers.0.store(n as u64, Ordering::Relaxed);
        }
    }

    /// A received frame was dropped: meant for another incarnation
    /// (`stale`) or malformed. Returns the new count of its kind.
    pub(crate) fn recv_dropped(&self, stale: bool) -> u64 {
        let c = if stale {
            &self.recv_stale
        } else {
            &self.recv_malformed
        };
        c.add(1);
        c.get()
    }

    /// The worker slept once in its NICs' wait fds.
    pub(crate) fn fd_slept(&self) {
        self.fd_sleeps.add(1);
    }

    /// The worker's current load.
    #[inline]
    pub(crate) fn publish(&self, in_flight: usize, pending_wrs: usize) {
        self.in_flight.store(in_flight, Ordering::Relaxed);
        self.pending_wrs.store(pending_wrs, Ordering::Relaxed);
    }

    /// A snapshot, with the queue depth read by the caller.
    pub(crate) fn snapshot(&self, queued: usize) -> GroupStats {
        GroupStats {
            queued,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            pending_wrs: self.pending_wrs.load(Ordering::Relaxed),
            fd_sleeps: self.fd_sleeps.get(),
            recv_stale: self.recv_stale.get(),
            recv_malformed: self.recv_malformed.get(),
            nics: self
                .nics
                .iter()
                .map(|c| {
                    // Completed first: the worker counts a WR posted before
                    // it counts it completed.
                    let wrs_completed = c.completed.get();
                    NicStats {
                        wrs_posted: c.wrs.get(),
                        bytes_posted: c.bytes.get(),
                        wrs_completed,
                        peers: c.peers.get(),
                    }
                })
                .collect(),
            transfers_ok: self.transfers_ok.get(),
            caller_posted: self.caller_posted.get(),
            transfers_failed: self
                .failed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            peers: self
                .peers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .map(|((nic, addr), c)| PeerStats {
                    nic: *nic,
                    addr: addr.clone(),
                    wrs_posted: c.wrs.get(),
                    bytes_posted: c.bytes.get(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_accumulate_per_nic() {
        let c = GroupCounters::new(2);
        c.posted(0, 3, 300);
        c.posted(1, 1, 10);
        c.posted(0, 1, 5);
        c.posted(7, 1, 1); // no such NIC: ignored
        c.completed(0, 2);
        c.completed(7, 1);
        c.transfer_ok();
        c.transfer_failed("peer_unreachable");
        c.transfer_failed("peer_unreachable");
        c.transfer_failed("remote_access");
        let a = NetAddr(vec![1, 2]);
        let b = NetAddr(vec![3]);
        c.peer_added(1, &a).posted(2, 64);
        c.peer_added(0, &b).posted(1, 8);
        c.peer_added(0, &a);
        c.peer_dropped(0, &a);
        c.publish(4, 2);
        let s = c.snapshot(9);
        assert_eq!((s.queued, s.in_flight, s.pending_wrs), (9, 4, 2));
        assert_eq!(
            s.nics,
            vec![
                NicStats {
                    wrs_posted: 4,
                    bytes_posted: 305,
                    wrs_completed: 2,
                    peers: 0,
                },
                NicStats {
                    wrs_posted: 1,
                    bytes_posted: 10,
                    wrs_completed: 0,
                    peers: 0,
                }
            ]
        );
        assert_eq!(s.transfers_ok, 1);
        assert_eq!(
            s.transfers_failed.into_iter().collect::<Vec<_>>(),
            vec![("peer_unreachable", 2), ("remote_access", 1)]
        );
        let peers: Vec<_> = s
            .peers
            .iter()
            .map(|p| (p.nic, p.addr.clone(), p.wrs_posted, p.bytes_posted))
            .collect();
        assert_eq!(peers, vec![(0, b, 1, 8), (1, a, 2, 64)]);
    }
}
