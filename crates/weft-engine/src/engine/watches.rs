//! Rounds that wait on named peers: `expect_imm_count_from` records which
//! peers a round's immediates come from, and `remove_peer` fails the rounds
//! still waiting on a removed peer, so a receiver learns that its writer is
//! gone instead of waiting for immediates that will never come.

use super::TransferEngine;
use crate::error::EngineError;
use crate::imm::{ImmDone, RoundWatch};
use crate::ondone::OnDone;
use crate::request::GroupAddress;
use parking_lot::Mutex;
use std::sync::{Arc, Weak};
use weft_transport::{Imm, NetAddr};

/// One watched round: its value, the NIC addresses of the peers it waits
/// on, and (weakly) the round itself, which ends the watch when it ends.
struct Watch {
    imm: Imm,
    peers: Vec<GroupAddress>,
    round: Weak<RoundWatch>,
}

/// The engine's watched rounds. Entries of rounds that ended are dropped
/// whenever one is added or looked up, so the list holds at most the
/// rounds armed at one time (one per immediate value).
#[derive(Default)]
pub(crate) struct Watches(Mutex<Vec<Watch>>);

impl Watches {
    /// Watches a round on `imm` waiting on `peers`.
    fn add(&self, imm: Imm, peers: &[GroupAddress]) -> Arc<RoundWatch> {
        let round = Arc::new(RoundWatch);
        let mut w = self.0.lock();
        w.retain(|x| x.round.strong_count() > 0);
        w.push(Watch {
            imm,
            peers: peers.to_vec(),
            round: Arc::downgrade(&round),
        });
        round
    }

    /// Takes the live watches naming any NIC address of `peer` (with its
    /// incarnation).
    fn take_for(&self, peer: &GroupAddress) -> Vec<(Imm, Arc<RoundWatch>)> {
        let names = |g: &GroupAddress| {
            g.incarnation == peer.incarnation && g.nics.iter().any(|a| peer.nics.contains(a))
        };
        let mut out = Vec::new();
        self.0.lock().retain(|x| match x.round.upgrade() {
            None => false,
            Some(r) if x.peers.iter().any(names) => {
                out.push((x.imm, r));
                false
            }
            Some(_) => true,
        });
        out
    }
}

impl TransferEngine {
    /// [`expect_imm_count_with`](Self::expect_imm_count_with) for a round
    /// whose immediates come from the peers `from`: if one of them is
    /// removed ([`remove_peer`](Self::remove_peer)) before the round fires,
    /// the round fails with [`EngineError::PeerGone`] naming it (the
    /// arrivals counted so far stay pending, see
    /// [`imm_pending`](Self::imm_pending)). A peer already removed when
    /// the round is armed fails it at once.
    ///
    /// The engine learns that a peer is gone only from `remove_peer`: a
    /// receiver of one-sided writes sends nothing to its writers, so no
    /// transport error reaches it. Applications call `remove_peer` when
    /// they learn of a death: a heartbeat that stopped (as KvCache does),
    /// a rendezvous record whose lease expired, a process supervisor.
    pub fn expect_imm_count_from(
        &self,
        imm: Imm,
        count: u64,
        from: &[GroupAddress],
        on_done: OnDone,
    ) -> Result<(), EngineError> {
        if let Some(gone) = from.iter().find(|p| self.removed(p)) {
            let err = self.peer_gone(imm, gone);
            if let Some((cb, r)) = on_done.resolve_inline(Err(err)) {
                self.dispatch(crate::core::Event::Done(cb, r));
            }
            return Ok(());
        }
        let watch = self.inner.watches.add(imm, from);
        let d = ImmDone::watched(on_done, &self.inner.imm_waits, watch);
        self.arm_round(imm, count, d)
    }

    /// Whether `peer` (any of its NIC addresses, with its incarnation) was
    /// removed.
    fn removed(&self, peer: &GroupAddress) -> bool {
        peer.nics
            .iter()
            .any(|a| self.inner.addrs.incs.is_removed(a, peer.incarnation))
    }

    fn peer_gone(&self, imm: Imm, peer: &GroupAddress) -> EngineError {
        EngineError::PeerGone {
            imm,
            peer: peer.nics.first().cloned().unwrap_or(NetAddr(Vec::new())),
            incarnation: peer.incarnation,
        }
    }

    /// Fails the rounds still waiting on `peer` (called by `remove_peer`).
    pub(super) fn fail_rounds_from(&self, peer: &GroupAddress) {
        for (imm, watch) in self.inner.watches.take_for(peer) {
            if let Some(d) = self.inner.imms.disarm_if(imm, |d| d.is(&watch)) {
                self.finish_imm(d, Err(self.peer_gone(imm, peer)));
            }
        }
    }
}
