//! Passive peers: peers created by a handshake from an address this domain
//! was never asked to reach.
//!
//! Anyone who can send a UD datagram with the weft Q_Key can send a
//! handshake, and each one from a new address costs a peer entry and two RC
//! QPs. A handshake must come from the address it claims (`ud_source`: the
//! device reports the sending QPN and GID or LID), but a sender can make as
//! many UD QPs, so as many addresses, as it likes. A passive peer that has
//! not finished its handshake is *half-open*; at most [`VerbsConfig::max_half_open`](super::VerbsConfig)
//! of them exist. When a handshake from a new address finds them all in
//! use, the oldest one to which `handshake_tries` handshakes went without
//! the connection completing (its own retransmissions and its answers to
//! datagrams claiming its address) is evicted: its QPs are destroyed, its
//! address forgotten and its peer slot reused. If none is spent, the new
//! handshake is refused (counted in
//! [`DomainStats::handshakes_refused`](super::DomainStats)); a real peer
//! retransmits, so it gets in once a half-open peer is spent (while a
//! flood keeps refreshing the table faster than that, it does not).
//!
//! A passive peer cannot connect by guessing either: the handshake that
//! completes a connection must echo this side's random starting PSNs
//! (`wire::Handshake`), which only the address that received this side's
//! handshake knows (a second line of defence, for a source check a device
//! could get wrong).
//!
//! A passive peer stops being passive once it connects (it answered at the
//! address it claimed) or once this side adds it with `add_peer` (the user
//! knows its [`PeerId`] from then on, so it is never evicted).

use super::VerbsDomain;
use crate::ops::VerbsOps;
use weft_transport::{PassivePeers, PeerId};

/// The half-open passive peers in creation order, and the peer slots freed
/// by evicting one (no one outside the domain ever held their ids).
#[derive(Default)]
pub(super) struct Passive {
    pub(super) list: PassivePeers,
    free: Vec<PeerId>,
}

impl Passive {
    /// A peer slot to reuse, if an eviction freed one.
    pub(super) fn take_free(&mut self) -> Option<PeerId> {
        self.free.pop()
    }
}

impl<O: VerbsOps> VerbsDomain<O> {
    /// Half-open passive peers now (at most
    /// [`VerbsConfig::max_half_open`](super::VerbsConfig)).
    pub fn half_open_peers(&self) -> usize {
        self.passive.list.len()
    }

    /// Whether peer `pid` is passive (created by a handshake, not connected,
    /// not added by the user).
    pub(super) fn is_passive(&self, pid: PeerId) -> bool {
        self.passive.list.contains(pid)
    }

    /// Whether a handshake from a new address may create a passive peer:
    /// there is room under `max_half_open`, or the oldest half-open peer
    /// whose retransmissions have run out was evicted to make it.
    pub(super) fn room_for_passive(&mut self) -> bool {
        let max = self.cfg.max_half_open.max(1);
        if self.passive.list.len() < max {
            return true;
        }
        // Spent: `handshake_tries` handshakes sent to it (its own
        // retransmissions, and answers to datagrams claiming its address),
        // none completing the connection.
        let tries = self.cfg.handshake_tries;
        let spent = self.passive.list.oldest_where(|pid| {
            self.peers
                .get(pid.0 as usize)
                .is_some_and(|p| p.conn.as_ref().is_none_or(|c| c.tries >= tries))
        });
        match spent {
            Some(pid) => {
                self.evict_passive(pid);
                self.passive.list.len() < max
            }
            None => false,
        }
    }

    /// Drops passive peer `pid`: its QPs are destroyed (nothing of ours is
    /// in flight on them: it never connected and no one could post to it),
    /// its address handle freed and its address forgotten, and its slot is
    /// reused for a later peer.
    pub(super) fn evict_passive(&mut self, pid: PeerId) {
        self.passive.list.remove(pid);
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        p.removed = true;
        let addr = p.addr.clone();
        let ah = p.ah.take();
        if let Some(c) = p.conn.take() {
            p.draining.push(c);
        }
        if self.by_addr.get(&addr) == Some(&pid) {
            self.by_addr.remove(&addr);
        }
        self.reap_draining(pid);
        self.drop_ah(ah);
        self.stats.half_open_evicted += 1;
        tracing::debug!(nic = %self.nic, peer = %addr, "half-open passive peer evicted");
        // A slot whose QPs still drain (none should) stays a tombstone.
        if self
            .peers
            .get(pid.0 as usize)
            .is_some_and(|p| p.draining.is_empty())
        {
            self.passive.free.push(pid);
        }
    }
}
