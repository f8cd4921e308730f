//! Passive peers: peers created by a message from an address this domain
//! was never asked to reach.
//!
//! A message names its sender in its header, and the answer goes there, so
//! every message from a new address costs a peer entry and an entry in the
//! address vector (for tcp, a connection to that address too). Anyone who
//! can reach the endpoint can name any address. So at most
//! [`LibfabricConfig::max_passive_peers`](crate::LibfabricConfig) passive
//! peers are kept: when a message from a new address finds them all in
//! use, the oldest idle one (nothing of its in flight, waiting for an ACK
//! slot, waiting for a receive buffer or in the backlog) is removed as
//! `Domain::remove_peer` would (its address-vector entry goes once nothing
//! can use it; its table entry stays, as a removed peer's does). If none is
//! idle, the message is dropped unanswered; its sender's SEND fails after
//! its `ack_timeout`. Once a removed passive peer's AV entry is gone, its
//! table slot is reused, so the table too stays within the bound plus the
//! peers still being retired (on tcp; shm keeps the AV entries of removed
//! peers, so there neither the AV nor the table shrinks).
//!
//! Not bounded this way: AV entries are retired only while no zombie slot
//! exists in the domain (`retire_av_entries`), so a flood whose ACKs
//! become zombies (a claimed address that swallows packets, past
//! `write_timeout`) holds removed entries until the provider hands those
//! slots back; and a flood that keeps every passive peer busy locks out
//! new senders for as long as it lasts.
//!
//! A passive peer stops being passive once this side adds it with
//! `add_peer`: the user knows its [`PeerId`] from then on.

use weft_transport::{NetAddr, PassivePeers, PeerId};

use super::messages::dropped;
use super::LibfabricDomain;

/// The passive peers, oldest first, and the table slots of removed ones
/// whose AV entry is gone.
#[derive(Default)]
pub(super) struct Passive {
    pub(super) list: PassivePeers,
    /// Slots of evicted passive peers whose AV entry was removed: nothing
    /// refers to their ids any more (`retire_av_entries` waited for that).
    pub(super) free: Vec<PeerId>,
    /// Passive peers removed to make room, for [`LibfabricDomain::passive_evicted`].
    pub(super) evicted: u64,
    /// Messages from new addresses dropped: no passive peer was idle.
    pub(super) refused: u64,
}

impl Passive {
    /// A free table slot, unless the removal of its last peer is still to
    /// be settled (`removing`).
    pub(super) fn take_free(&mut self, removing: &[PeerId]) -> Option<PeerId> {
        let i = self.free.iter().position(|p| !removing.contains(p))?;
        Some(self.free.swap_remove(i))
    }
}

impl LibfabricDomain {
    /// The passive peer for a message from `addr`, which maps to no peer
    /// yet; `None` (logged, the message to be dropped unanswered) when the
    /// address cannot be a peer's (checked first: it removes no one) or
    /// no passive peer can make room.
    pub(super) fn new_passive_peer(&mut self, addr: &NetAddr) -> Option<PeerId> {
        if let Err(e) = self.check_new_addr(addr) {
            dropped!(&mut self.msgs.dropped.unusable_sender, nic = %self.nic.name, peer = %addr, error = %e, "message from an unusable address dropped (not answered)");
            return None;
        }
        if !self.room_for_passive() {
            self.passive.refused += 1;
            tracing::debug!(nic = %self.nic.name, peer = %addr, "message from a new address dropped (not answered): every passive peer is busy");
            return None;
        }
        match self.insert_peer(addr) {
            Ok(p) => {
                self.passive.list.push(p);
                Some(p)
            }
            Err(e) => {
                dropped!(&mut self.msgs.dropped.unusable_sender, nic = %self.nic.name, peer = %addr, error = %e, "message from an unusable address dropped (not answered)");
                None
            }
        }
    }

    /// Whether a message from a new address may create a passive peer:
    /// there is room under `max_passive_peers`, or the oldest idle passive
    /// peer was removed to make it.
    fn room_for_passive(&mut self) -> bool {
        let max = self.opts.max_passive_peers.max(1);
        if self.passive.list.len() < max {
            return true;
        }
        let idle = self.passive.list.oldest_where(|pid| self.peer_idle(pid));
        match idle {
            Some(pid) => {
                self.passive.list.remove(pid);
                if let Some(p) = self.peers.table.get_mut(pid.0 as usize) {
                    p.evicted = true;
                }
                self.remove(pid);
                self.passive.evicted += 1;
                tracing::debug!(nic = %self.nic.name, peer = pid.0, "idle passive peer removed to make room");
                self.passive.list.len() < max
            }
            None => false,
        }
    }

    /// Nothing of peer `pid` is in flight, backlogged, in limbo, waiting
    /// for an ACK slot or for a receive buffer.
    fn peer_idle(&self, pid: PeerId) -> bool {
        let Some(p) = self.peers.table.get(pid.0 as usize) else {
            return false;
        };
        p.inflight == 0
            && p.backlogged == 0
            && !self.limbo.entries.iter().any(|l| l.peer == pid)
            && !self.msgs.acks_out.iter().any(|(q, _, _)| *q == pid)
            && !self.msgs.held.iter().any(|m| m.from == pid)
    }

    /// Passive peers removed so far to make room for new ones.
    pub fn passive_evicted(&self) -> u64 {
        self.passive.evicted
    }

    /// Messages from new addresses dropped so far because every passive
    /// peer was busy.
    pub fn passive_refused(&self) -> u64 {
        self.passive.refused
    }
}
