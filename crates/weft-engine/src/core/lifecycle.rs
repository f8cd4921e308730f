//! Peer lifecycle: removed and replaced incarnations on one group.
//!
//! Every remote NIC address is bound, engine-wide, to at most one live
//! [`Incarnation`] (the table is [`Incarnations`](crate::incarnation::Incarnations),
//! shared by all groups). An incarnation stops being live when
//! `TransferEngine::remove_peer` removes it, or when a *newer* incarnation
//! named at the same address (in a descriptor, a group address or a send
//! destination being resolved) replaces it — which it does only once the
//! bound one is known to have ended: removed, or reported unreachable by
//! the transport ([`WorkerCore::note_unreachable`]). Before that, a newer
//! incarnation is a claim nothing confirmed: the destination naming it is
//! refused with [`EngineError::IncarnationUnproven`] and nothing else
//! changes. A replaced incarnation is dropped exactly as if `remove_peer`
//! had been called for it. On each group, a peer whose incarnation stopped
//! being live is dropped:
//! * its WRs still waiting for send-queue room fail with
//!   [`TransportError::PeerRemoved`] (never posted);
//! * the domains forget it ([`weft_transport::Domain::remove_peer`]), which
//!   fails (or lets complete) what is already posted and frees its
//!   connection state; the core's own caches (address → peer, interned
//!   address → peer) drop it;
//! * peer groups with it as a member are refused from then on
//!   ([`EngineError::PeerRemoved`]).
//!
//! A destination naming a removed incarnation, or one older than the
//! incarnation bound to its address (a descriptor of a process that has
//! since restarted there), fails with `PeerRemoved` when it is resolved and
//! never reaches whichever process answers at that address now; the newer
//! incarnation is resolved with fresh domain state. Groups notice a
//! replacement found by another group through the table's epoch, one
//! atomic load before each request and control message
//! ([`WorkerCore::sync_incarnations`]); nothing is checked per WR.

use super::{transport, WorkerCore};
use crate::error::{EngineError, TransferId};
use crate::incarnation::Refused;
use std::collections::VecDeque;
use weft_transport::{Incarnation, NetAddr, PeerId, TransportError};

/// Why a destination could not be resolved to a domain peer.
#[derive(Debug)]
pub(super) enum Refusal {
    /// The backend's error, or a removed / replaced incarnation
    /// ([`TransportError::PeerRemoved`]).
    Transport(TransportError),
    /// A newer incarnation than the live one, unconfirmed.
    Unproven {
        /// The incarnation the destination names.
        named: Incarnation,
        /// The incarnation live at the address.
        live: Incarnation,
    },
}

impl From<TransportError> for Refusal {
    fn from(e: TransportError) -> Self {
        Refusal::Transport(e)
    }
}

impl Refusal {
    /// The engine error for a destination at `peer` on NIC `nic` of
    /// `group`: for `transfer`, or (`None`) for the control operation `op`.
    pub(super) fn into_error(
        self,
        group: usize,
        nic: usize,
        transfer: Option<TransferId>,
        peer: &NetAddr,
        op: &'static str,
    ) -> EngineError {
        match (self, transfer) {
            (Refusal::Transport(e), Some(t)) => transport(group, nic, t, Some(peer.clone()), e),
            (Refusal::Transport(e), None) => EngineError::Control {
                group,
                nic,
                op,
                source: Box::new(e),
            },
            (Refusal::Unproven { named, live }, transfer) => EngineError::IncarnationUnproven {
                transfer,
                nic,
                peer: peer.clone(),
                named,
                live,
            },
        }
    }
}

impl WorkerCore {
    /// Removes incarnation `inc` of the peer at `addrs` (see the module
    /// docs). Idempotent.
    pub(super) fn remove_peers(
        &mut self,
        addrs: &[NetAddr],
        inc: Incarnation,
    ) -> Result<(), EngineError> {
        for addr in addrs {
            self.addrs.incs.remove(addr, inc);
        }
        self.sync_now()
    }

    /// Drops the peers and refuses the peer groups whose incarnation is no
    /// longer live, if the incarnation table changed since the last look
    /// (one atomic load otherwise). Backend errors are logged.
    pub(crate) fn sync_incarnations(&mut self) {
        if self.addrs.incs.epoch() != self.inc_epoch {
            let _ = self.sync_now();
        }
    }

    /// [`WorkerCore::sync_incarnations`] without the epoch shortcut;
    /// returns the first backend error.
    fn sync_now(&mut self) -> Result<(), EngineError> {
        self.inc_epoch = self.addrs.incs.epoch();
        let mut first = Ok(());
        for nic in 0..self.nics.len() {
            let stale: Vec<(NetAddr, Incarnation)> = self.nics[nic]
                .peers
                .iter()
                .filter(|(a, (inc, _))| !self.addrs.incs.is_live(a, *inc))
                .map(|(a, (inc, _))| (a.clone(), *inc))
                .collect();
            for (addr, inc) in stale {
                let r = self.drop_peer(nic, &addr, inc);
                if first.is_ok() {
                    first = r;
                }
            }
        }
        let group = self.group;
        for pg in &mut self.reg.peer_groups {
            if pg.removed.is_some() {
                continue;
            }
            pg.removed = pg.members.iter().enumerate().find_map(|(j, m)| {
                m.nics
                    .iter()
                    .find(|(a, _)| !self.addrs.incs.is_live(a, m.incarnation))
                    .map(|(a, _)| (j, a.clone()))
            });
            if let Some((j, a)) = &pg.removed {
                tracing::debug!(group, member = j, peer = %a, incarnation = %pg.members[*j].incarnation,
                    "peer group refused from now on: a member is no longer live");
            }
        }
        self.publish_peers();
        first
    }

    /// Drops the peer at `addr` (incarnation `inc`) on `nic`: fails its
    /// queued WRs, removes it from the domain and the caches.
    pub(super) fn drop_peer(
        &mut self,
        nic: usize,
        addr: &NetAddr,
        inc: Incarnation,
    ) -> Result<(), EngineError> {
        let Some((_, peer)) = self.nics[nic].peers.remove(addr) else {
            return Ok(());
        };
        tracing::debug!(group = self.group, nic, peer = %addr, incarnation = %inc,
            "dropping a peer whose incarnation is no longer live");
        for slot in self.nics[nic].by_addr_id.iter_mut() {
            if *slot == Some(peer) {
                *slot = None;
            }
        }
        let err = TransportError::PeerRemoved {
            nic: self.nics[nic].name.clone(),
            peer: addr.clone(),
        };
        self.fail_queued_to(nic, peer, &err);
        self.nics[nic].peer_addrs.remove(&peer);
        self.nics[nic].peer_counts.remove(&peer);
        self.counters.peer_dropped(nic, addr);
        self.nics[nic].domain.remove_peer(peer).map_err(|e| {
            tracing::warn!(group = self.group, nic, peer = %addr, error = %e, "backend cannot remove the peer");
            EngineError::Control {
                group: self.group,
                nic,
                op: "remove_peer",
                source: Box::new(e),
            }
        })
    }

    /// Fails the WRs to `peer` on `nic` that wait for send-queue room.
    fn fail_queued_to(&mut self, nic: usize, peer: PeerId, err: &TransportError) {
        for fresh in [true, false] {
            let ring = std::mem::take(self.nics[nic].ring(fresh));
            let mut keep = VecDeque::with_capacity(ring.len());
            let mut failed = Vec::new();
            for op in ring {
                if op.peer == peer {
                    failed.push(op);
                } else {
                    keep.push_back(op);
                }
            }
            *self.nics[nic].ring(fresh) = keep;
            for op in failed {
                self.unposted_failed(nic, op, err.clone());
            }
        }
    }

    /// Admits incarnation `inc` at `addr` for a destination resolved on
    /// `nic`: a removed or replaced incarnation is refused with
    /// [`TransportError::PeerRemoved`]; a newer one than the live one is
    /// refused as unproven unless the live one ended, and then replaces it
    /// (dropped on this group at once, on the others at their next
    /// [`WorkerCore::sync_incarnations`]).
    pub(super) fn admit(
        &mut self,
        nic: usize,
        addr: &NetAddr,
        inc: Incarnation,
    ) -> Result<(), Refusal> {
        if let Err(why) = self.addrs.incs.admit(addr, inc) {
            let name = self
                .nics
                .get(nic)
                .map(|n| n.name.clone())
                .unwrap_or_default();
            let removed = TransportError::PeerRemoved {
                nic: name,
                peer: addr.clone(),
            };
            return Err(match why {
                Refused::Removed => {
                    tracing::debug!(group = self.group, nic, peer = %addr,
                        incarnation = %inc, "refused: this incarnation was removed");
                    removed.into()
                }
                Refused::Replaced(live) => {
                    tracing::debug!(group = self.group, nic, peer = %addr,
                        incarnation = %inc, live = %live, "refused: a newer incarnation answers there");
                    removed.into()
                }
                Refused::Unproven(live) => {
                    tracing::debug!(group = self.group, nic, peer = %addr, incarnation = %inc,
                        live = %live, "refused: a newer incarnation than the live one, unconfirmed");
                    Refusal::Unproven { named: inc, live }
                }
            });
        }
        self.sync_incarnations();
        Ok(())
    }

    /// A WR on `nic` failed with `e`: if the transport reports its peer
    /// unreachable, the incarnation resolved at that address on `nic` is
    /// recorded as possibly ended (a newer incarnation named there may
    /// replace it, see [`Incarnations::unreachable`](crate::incarnation::Incarnations::unreachable)).
    pub(super) fn note_unreachable(&mut self, nic: usize, e: &TransportError) {
        if let TransportError::PeerUnreachable { peer, .. } = e {
            if let Some((inc, _)) = self.nics.get(nic).and_then(|n| n.peers.get(peer)) {
                self.addrs.incs.unreachable(peer, *inc);
            }
        }
    }

    /// Publishes each NIC's number of resolved peers for `stats()`.
    pub(super) fn publish_peers(&self) {
        for (i, n) in self.nics.iter().enumerate() {
            self.counters.set_peers(i, n.peers.len());
        }
    }
}
