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
//! its `ack_timeout`.
//!
//! A passive peer stops being passive once this side adds it with
//! `add_peer`: the user knows its [`PeerId`] from then on.

use std::collections::VecDeque;

use weft_transport::PeerId;

use super::LibfabricDomain;

/// The passive peers, oldest first.
#[derive(Default)]
pub(super) struct Passive {
    order: VecDeque<PeerId>,
    /// Passive peers removed to make room, for [`LibfabricDomain::passive_evicted`].
    pub(super) evicted: u64,
    /// Messages from new addresses dropped: no passive peer was idle.
    pub(super) refused: u64,
}

impl LibfabricDomain {
    /// Records new peer `pid`, created by a message, as passive.
    pub(super) fn list_passive(&mut self, pid: PeerId) {
        if let Some(p) = self.peers.table.get_mut(pid.0 as usize) {
            p.passive = true;
            self.passive.order.push_back(pid);
        }
    }

    /// The user added peer `pid`: it is no longer passive (nothing if it was
    /// not).
    pub(super) fn unlist_passive(&mut self, pid: PeerId) {
        let Some(p) = self.peers.table.get_mut(pid.0 as usize) else {
            return;
        };
        if !p.passive {
            return;
        }
        p.passive = false;
        if let Some(i) = self.passive.order.iter().position(|q| *q == pid) {
            self.passive.order.remove(i);
        }
    }

    /// Whether a message from a new address may create a passive peer:
    /// there is room under `max_passive_peers`, or the oldest idle passive
    /// peer was removed to make it.
    pub(super) fn room_for_passive(&mut self) -> bool {
        let max = self.opts.max_passive_peers.max(1);
        if self.passive.order.len() < max {
            return true;
        }
        let idle = self
            .passive
            .order
            .iter()
            .copied()
            .find(|pid| self.peer_idle(*pid));
        match idle {
            Some(pid) => {
                self.unlist_passive(pid);
                self.remove(pid);
                self.passive.evicted += 1;
                tracing::debug!(nic = %self.nic.name, peer = pid.0, "idle passive peer removed to make room");
                self.passive.order.len() < max
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
