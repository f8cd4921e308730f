//! Per-peer transmit endpoints: the workaround for providers whose
//! completions of one endpoint wait for each other (shm).
//!
//! libfabric's shm provider completes every operation that waits for its
//! target (all of weft's WRITEs and SENDs with bytes: `FI_DELIVERY_COMPLETE`)
//! through one response queue per *endpoint*, strictly in posting order
//! (`smr_progress_resp`, prov/shm/src/smr_progress.c, 1.17 and 2.1). A peer
//! killed before answering leaves its entry at the head for good, so no
//! later operation on that endpoint completes, whichever peer it went to.
//! Nothing in the API unblocks the queue (docs/backends.md, "Provider
//! limitations").
//!
//! With the quirk on, every operation to a peer (WRITE, SEND, ACK) is
//! issued on an endpoint of its own for that peer, opened on first use on
//! the same domain, AV and CQ (registrations, addresses and completions are
//! shared; slots identify operations whichever endpoint carried them). The
//! domain's published address stays the main endpoint, which posts the
//! receives and is where peers' WRITEs, immediates and messages arrive (the
//! message header names the main endpoint as the sender, so answers go
//! there too). A killed peer then blocks only its own endpoint's queue.
//! Once the peer is removed or declared unreachable, its work is failed
//! (`PeerRemoved` / `PeerUnreachable`), the CQ is read empty and the
//! endpoint closed: that frees its region in `/dev/shm` with the stuck
//! queue entry, and the slots of the operations that were inside it (they
//! can never complete now).
//!
//! At most `limit` such endpoints are open per domain
//! ([`crate::LibfabricConfig::max_peer_endpoints`]); a post that would need
//! one more fails with `Unsupported` (nothing is issued).

use weft_transport::{Completion, PeerId, TransportError};

use super::clock::Clock;
use super::shm::shm_peer;
use super::slots::SlotUse;
use super::LibfabricDomain;

/// Whether provider `prov` needs an endpoint per peer: shm, whose
/// completions wait for each other per endpoint. Every other provider
/// (tcp, verbs, EFA) issues everything on the main endpoint.
pub(super) fn needs_peer_endpoints(prov: &str) -> bool {
    prov == "shm"
}

/// The per-peer endpoints of a domain.
#[derive(Debug)]
pub(super) struct PeerEps {
    /// The provider needs them (shm); otherwise everything uses the main
    /// endpoint and nothing here is used.
    pub(super) enabled: bool,
    /// Most endpoints open at once.
    pub(super) limit: usize,
    /// Endpoints open now.
    pub(super) open: usize,
    /// Per slot: the per-peer endpoint its operation is inside of (set when
    /// issued, cleared when the provider hands it back).
    pub(super) slot_ep: Vec<Option<usize>>,
    /// Some peer was removed or declared unreachable since the last look:
    /// endpoints may be due for closing.
    pub(super) check: bool,
    /// Per endpoint index: its peer has answered at least one operation
    /// on it (so it has processed the connection request the endpoint
    /// sent first, and holds the endpoint's region mapped).
    answered: Vec<bool>,
    /// Endpoints of removed or unreachable peers left open for now (see
    /// `closable`); looked at again every sweep.
    pub(super) deferred: bool,
}

impl PeerEps {
    pub(super) fn new(enabled: bool, limit: usize, slots: usize) -> PeerEps {
        PeerEps {
            enabled,
            limit,
            open: 0,
            slot_ep: vec![None; slots],
            check: false,
            answered: Vec::new(),
            deferred: false,
        }
    }

    /// Slot `i`'s operation is no longer inside an endpoint: the provider
    /// handed it back, `answered` if it completed.
    pub(super) fn clear_slot(&mut self, i: usize, answered: bool) {
        let Some(ep) = self.slot_ep.get_mut(i).and_then(Option::take) else {
            return;
        };
        if answered {
            if self.answered.len() <= ep {
                self.answered.resize(ep + 1, false);
            }
            self.answered[ep] = true;
        }
    }
}

impl LibfabricDomain {
    /// The endpoint that issues reserved slot `i` and the peer's address
    /// there: the main one (0, `None`: the address the operation carries)
    /// without the quirk and for receives, else its peer's own, opened now
    /// if it has none yet.
    pub(super) fn ep_for(&mut self, i: usize) -> Result<(usize, Option<u64>), TransportError> {
        if !self.peer_eps.enabled {
            return Ok((0, None));
        }
        let Some(peer) = self.slots.table.get(i).and_then(|s| s.peer()) else {
            return Ok((0, None));
        };
        let p = self.peer(peer)?;
        if let Some((ep, dest)) = p.ep {
            return Ok((ep, Some(dest)));
        }
        // Gone since it was added (its region removed)? Opening an
        // endpoint to it would map a stale region.
        if let (_, Some(reason)) = shm_peer(&p.addr.0) {
            let addr = p.addr.clone();
            self.mark_dead(peer, reason.clone());
            return Err(TransportError::PeerUnreachable {
                nic: self.nic_name(),
                peer: addr,
                reason,
            });
        }
        if self.peer_eps.open >= self.peer_eps.limit {
            return Err(TransportError::Unsupported {
                nic: self.nic_name(),
                what: format!(
                    "an endpoint of its own for peer {}: {} per-peer endpoints are open, the \
                     most this domain may (max_peer_endpoints; the provider needs one per peer \
                     so that a dead peer cannot block the others)",
                    p.addr, self.peer_eps.limit
                ),
            });
        }
        let addr = p.addr.0.clone();
        let (ep, dest) = self.res.open_tx_ep(&self._info, &addr)?;
        self.peer_eps.open += 1;
        if let Some(a) = self.peer_eps.answered.get_mut(ep) {
            *a = false;
        }
        if let Some(p) = self.peers.table.get_mut(peer.0 as usize) {
            tracing::debug!(nic = %self.nic.name, peer = %p.addr, ep, "per-peer endpoint opened");
            p.ep = Some((ep, dest));
        }
        Ok((ep, Some(dest)))
    }

    /// Whether the endpoint of removed or unreachable `peer` may be closed
    /// now. Closing unlinks and unmaps its region, and the peer may still
    /// use it: a peer that processes our connection request after that
    /// crashes (shm 1.17's `smr_progress_connreq` dereferences the region
    /// it failed to map), and a peer in this process shares our mapping
    /// (shm hands out the region pointer of endpoints in the same process),
    /// so it must not write an answer into it after the close. So: at once
    /// if the peer is gone (process exited, or its region removed); else
    /// once it has answered something on the endpoint, and, for a peer in
    /// this process, nothing of ours is left inside it.
    fn closable(&self, peer: PeerId, ep: usize) -> bool {
        let Ok(p) = self.peer(peer) else {
            return true;
        };
        if shm_peer(&p.addr.0).1.is_some() {
            return true;
        }
        let answered = self.peer_eps.answered.get(ep).copied().unwrap_or(false);
        let own = p.pid == i32::try_from(std::process::id()).ok();
        let inside = self.peer_eps.slot_ep.contains(&Some(ep));
        answered && !(own && inside)
    }

    /// Closes the endpoints of peers removed or declared unreachable: their
    /// operations still inside are failed first (`fail_issued`), the CQ is
    /// read empty (so no completion of a slot freed here is left in it),
    /// the endpoint is closed and those slots are freed. Endpoints that
    /// cannot be closed yet (`closable`) are looked at again every sweep.
    pub(super) fn close_peer_eps(&mut self, out: &mut Vec<Completion>, clock: &mut Clock) {
        if !self.peer_eps.check {
            return;
        }
        self.peer_eps.check = false;
        let gone: Vec<(PeerId, usize)> = self
            .peers
            .table
            .iter()
            .enumerate()
            .filter(|(_, p)| p.removed || p.dead.is_some())
            .filter_map(|(k, p)| p.ep.map(|(ep, _)| (PeerId(k as u32), ep)))
            .collect();
        for &(peer, _) in &gone {
            self.fail_issued(peer, out);
        }
        let due: Vec<PeerId> = gone
            .iter()
            .filter(|&&(peer, ep)| self.closable(peer, ep))
            .map(|&(peer, _)| peer)
            .collect();
        self.peer_eps.deferred = due.len() < gone.len();
        if due.is_empty() {
            return;
        }
        // Read the CQ until it is empty; progress happens only inside
        // libfabric calls, so nothing of these endpoints can enter the CQ
        // between the last read and the close.
        let mut empty = false;
        for _ in 0..64 {
            match self.drain_cq_checked(out, clock) {
                Ok(true) => {
                    empty = true;
                    break;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(nic = %self.nic.name, error = %e, "CQ read failed before closing per-peer endpoints");
                    break;
                }
            }
        }
        if !empty {
            // Try again at the next sweep.
            self.peer_eps.deferred = true;
            return;
        }
        for peer in due {
            let Some((ep, _)) = self
                .peers
                .table
                .get_mut(peer.0 as usize)
                .and_then(|p| p.ep.take())
            else {
                continue;
            };
            self.peer_eps.open = self.peer_eps.open.saturating_sub(1);
            if let Err(e) = self.res.close_tx_ep(ep) {
                tracing::warn!(nic = %self.nic.name, error = %e, "closing a per-peer endpoint failed");
            }
            let mut freed = 0;
            for i in 0..self.slots.table.len() {
                if self.peer_eps.slot_ep[i] != Some(ep) {
                    continue;
                }
                self.peer_eps.slot_ep[i] = None;
                // Failed already (zombie): nothing else refers to it.
                if matches!(self.slots.table[i], SlotUse::Zombie) {
                    self.slots.unreserve(i);
                    freed += 1;
                }
            }
            tracing::debug!(
                nic = %self.nic.name,
                peer = %self.peer_addr(peer),
                ep,
                freed,
                "per-peer endpoint closed"
            );
        }
    }

    /// Per-peer endpoints open now (0 for providers that do not need them;
    /// back to 0 once every peer that had one is removed and `poll` ran).
    pub fn peer_endpoints(&self) -> usize {
        self.peer_eps.open
    }
}
