//! Peer lifecycle: `TransferEngine::remove_peer` on one group.
//!
//! Removing a peer (all NIC addresses of its group address):
//! * its addresses join `removed` for good: a later destination naming one
//!   (a descriptor of the old incarnation) fails with
//!   [`TransportError::PeerRemoved`] instead of reaching whatever process
//!   now answers at that address; a restarted peer is reached at its new
//!   address;
//! * its WRs still waiting for send-queue room fail with `PeerRemoved`
//!   (never posted);
//! * the domains forget it ([`weft_transport::Domain::remove_peer`]), which
//!   fails (or lets complete) what is already posted and frees its
//!   connection state; the core's own caches (address → peer, interned
//!   address → peer) drop it;
//! * peer groups with it as a member are refused from then on
//!   ([`EngineError::PeerRemoved`]).

use super::nic::Op;
use super::WorkerCore;
use crate::error::EngineError;
use std::collections::VecDeque;
use weft_transport::{NetAddr, PeerId, TransportError};

impl WorkerCore {
    /// Removes the peers at `addrs` (see the module docs). Idempotent.
    pub(super) fn remove_peers(&mut self, addrs: &[NetAddr]) -> Result<(), EngineError> {
        let mut first = Ok(());
        for addr in addrs {
            self.removed.insert(addr.clone());
        }
        for nic in 0..self.nics.len() {
            for addr in addrs {
                let Some(peer) = self.nics[nic].peers.remove(addr) else {
                    continue;
                };
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
                if let Err(e) = self.nics[nic].domain.remove_peer(peer) {
                    tracing::warn!(group = self.group, nic, peer = %addr, error = %e, "backend cannot remove the peer");
                    if first.is_ok() {
                        first = Err(EngineError::Control {
                            group: self.group,
                            nic,
                            op: "remove_peer",
                            source: Box::new(e),
                        });
                    }
                }
                self.nics[nic].peer_addrs.remove(&peer);
            }
        }
        for pg in &mut self.reg.peer_groups {
            if pg.removed.is_some() {
                continue;
            }
            pg.removed = pg.members.iter().enumerate().find_map(|(j, m)| {
                m.iter()
                    .find(|(a, _)| addrs.contains(a))
                    .map(|(a, _)| (j, a.clone()))
            });
        }
        self.publish_peers();
        first
    }

    /// Fails the WRs to `peer` on `nic` that wait for send-queue room.
    fn fail_queued_to(&mut self, nic: usize, peer: PeerId, err: &TransportError) {
        for fresh in [true, false] {
            let ring = std::mem::take(self.ring(nic, fresh));
            let mut keep = VecDeque::with_capacity(ring.len());
            let mut failed = Vec::new();
            for op in ring {
                let to = match op {
                    Op::Write(w) => w.peer,
                    Op::Send { peer, .. } => peer,
                };
                if to == peer {
                    failed.push(op);
                } else {
                    keep.push_back(op);
                }
            }
            *self.ring(nic, fresh) = keep;
            for op in failed {
                self.unposted_failed(nic, op, err.clone());
            }
        }
    }

    /// Refuses addresses removed with `TransferEngine::remove_peer`.
    pub(super) fn check_not_removed(
        &self,
        nic: usize,
        addr: &NetAddr,
    ) -> Result<(), TransportError> {
        if self.removed.contains(addr) {
            return Err(TransportError::PeerRemoved {
                nic: self
                    .nics
                    .get(nic)
                    .map(|n| n.name.clone())
                    .unwrap_or_default(),
                peer: addr.clone(),
            });
        }
        Ok(())
    }

    /// Publishes each NIC's number of resolved peers for `stats()`.
    pub(super) fn publish_peers(&self) {
        for (i, n) in self.nics.iter().enumerate() {
            self.counters.set_peers(i, n.peers.len());
        }
    }
}
