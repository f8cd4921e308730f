//! The EAGAIN backlog: accepted work the provider answered EAGAIN for,
//! re-issued by `poll` in order per peer.

use std::collections::VecDeque;

use weft_transport::{Completion, PeerId, TransportError};

use super::clock::Clock;
use super::post::Native;
use super::slots::SlotUse;
use super::LibfabricDomain;
use crate::ffi;

/// Work the provider answered EAGAIN for: reserved slot `i`, never issued.
#[derive(Debug, Clone, Copy)]
pub(super) struct Parked {
    pub(super) i: usize,
    pub(super) native: Native,
    /// Target peer (`None` for receives); kept here because `sweep` may
    /// turn the slot into a zombie while the entry is still queued.
    pub(super) peer: Option<PeerId>,
}

/// Accepted work the provider answered EAGAIN for (e.g. while
/// tcp;ofi_rxm connects to a new peer, or while shm's inject pool is
/// full): slots reserved, re-issued by `poll` in order (per peer), failed
/// if the peer turns out unreachable.
#[derive(Debug, Default)]
pub(super) struct Backlog {
    /// The entries, oldest first.
    pub(super) queue: VecDeque<Parked>,
    /// Receives in `queue`.
    pub(super) recvs: usize,
    /// Scratch for `flush_backlog`: peers that answered EAGAIN in this pass.
    pub(super) blocked: Vec<PeerId>,
}

impl LibfabricDomain {
    /// Appends never-issued work to the backlog.
    pub(super) fn park(&mut self, i: usize, native: Native, peer: Option<PeerId>) {
        self.count_parked(peer, true);
        self.backlog.queue.push_back(Parked { i, native, peer });
    }

    /// Counts an entry of `peer` (or a receive) into or out of the
    /// backlog.
    fn count_parked(&mut self, peer: Option<PeerId>, add: bool) {
        let n = match peer {
            Some(p) => match self.peers.table.get_mut(p.0 as usize) {
                Some(p) => &mut p.backlogged,
                None => return,
            },
            None => &mut self.backlog.recvs,
        };
        *n = if add { *n + 1 } else { n.saturating_sub(1) };
    }

    /// Fails a backlogged (never issued) slot with `e`.
    fn fail_backlogged(&mut self, i: usize, e: TransportError, out: &mut Vec<Completion>) {
        let used = self.slots.table.get(i).copied().unwrap_or(SlotUse::Free);
        self.slots.unreserve(i);
        self.complete(used, Err(e), out);
    }

    /// Re-issues backlogged work (one pass, no FI_MORE), in order. Once the
    /// provider answers EAGAIN for a peer (or for a receive), the rest of
    /// that peer's entries stay queued untried until the next pass: its
    /// resources (shm's inject pool, tcp;ofi_rxm's pending connection) are
    /// not freed within the pass, and retrying every entry would make each
    /// `poll` cost O(backlog). Every entry ends exactly once: issued (its
    /// completion comes from the CQ), failed into `out`, or queued again.
    pub(super) fn flush_backlog(&mut self, out: &mut Vec<Completion>, clock: &mut Clock) {
        let mut blocked = std::mem::take(&mut self.backlog.blocked);
        blocked.clear();
        let mut recvs_blocked = false;
        // Entries still ahead in this pass that belong to blocked peers:
        // once only those are left, the pass ends without touching them.
        let mut skippable = 0usize;
        let mut left = self.backlog.queue.len();
        while left > 0 {
            if left == skippable {
                // Keep the order: the untouched entries go behind the ones
                // already queued again in this pass (all earlier work).
                self.backlog.queue.rotate_left(left);
                break;
            }
            left -= 1;
            let Some(e) = self.backlog.queue.pop_front() else {
                break;
            };
            let Parked { i, native, peer } = e;
            let slot = self.slots.table.get(i).copied().unwrap_or(SlotUse::Free);
            if matches!(slot, SlotUse::Zombie | SlotUse::Free) {
                // Already failed by `sweep` (dead peer) while still queued:
                // never issued, so nothing of it is left in libfabric.
                self.count_parked(peer, false);
                self.slots.unreserve(i);
                continue;
            }
            if let Some(p) = peer {
                if let Err(err) = self.live_peer(p) {
                    self.count_parked(peer, false);
                    self.fail_backlogged(i, err, out);
                    continue;
                }
            }
            let skip = match peer {
                Some(p) => blocked.contains(&p),
                None => recvs_blocked,
            };
            if skip {
                skippable = skippable.saturating_sub(1);
                self.backlog.queue.push_back(e);
                continue;
            }
            let rc = match self.issue(i, native, false) {
                Ok(rc) => rc,
                Err(err) => {
                    self.count_parked(peer, false);
                    self.fail_backlogged(i, err, out);
                    continue;
                }
            };
            if rc == 0 {
                self.count_parked(peer, false);
                if let Some(p) = peer {
                    self.on_posted(i, p);
                }
            } else if rc == -ffi::FI_EAGAIN {
                match peer {
                    Some(p) => match self.on_eagain(p, clock) {
                        Err(err) => {
                            // Declared unreachable: this entry fails here,
                            // the peer's later ones by `live_peer` above.
                            self.count_parked(peer, false);
                            self.fail_backlogged(i, err, out);
                        }
                        Ok(()) => {
                            // This entry and the peer's later ones, all
                            // still ahead (none was skipped before).
                            blocked.push(p);
                            skippable += self
                                .peers
                                .table
                                .get(p.0 as usize)
                                .map_or(0, |p| p.backlogged.saturating_sub(1));
                            self.backlog.queue.push_back(e);
                        }
                    },
                    None => {
                        recvs_blocked = true;
                        skippable += self.backlog.recvs.saturating_sub(1);
                        self.backlog.queue.push_back(e);
                    }
                }
            } else {
                let err = self.post_error(slot, rc);
                if let TransportError::PeerUnreachable { reason, .. } = &err {
                    if let Some(p) = peer {
                        self.mark_dead(p, reason.clone());
                    }
                }
                self.count_parked(peer, false);
                self.fail_backlogged(i, err, out);
            }
        }
        self.backlog.blocked = blocked;
    }
}
