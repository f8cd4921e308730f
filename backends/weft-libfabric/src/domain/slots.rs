//! Operation slots: what each one is used for (one per TX operation, per
//! bounce buffer, per ACK), the free lists, and how a finished slot turns
//! into the user's completion.

use std::time::Instant;

use weft_transport::{Completion, PeerId, TransportError, WrId};

use super::messages::wire::AckStatus;
use super::LibfabricDomain;

/// What an operation slot is used for.
#[derive(Debug, Clone, Copy)]
pub(super) enum SlotUse {
    Free,
    Write {
        wr: WrId,
        peer: PeerId,
        rkey: u64,
        raddr: u64,
        len: u64,
    },
    /// A SEND: done when the provider has completed it (`sent`) and the
    /// receiver has answered (`ack`), in either order.
    Send {
        wr: WrId,
        peer: PeerId,
        len: u64,
        /// Sequence number in the header (slot index | generation << 32).
        seq: u64,
        /// When the provider completed it.
        sent: Option<Instant>,
        /// The receiver's answer.
        ack: Option<AckStatus>,
    },
    /// Internal bounce buffer `j`, posted as a receive.
    Bounce {
        j: usize,
    },
    /// An ACK to `peer`, in flight.
    Ack {
        peer: PeerId,
    },
    /// Reported failed (dead peer) but not yet returned by the provider:
    /// the slot is reused only once libfabric hands its context back.
    Zombie,
}

/// The slot table: TX slots `0..tx`, then the bounce slots, then the ACK
/// slots from `ack_base`; each slot index is the operation's libfabric
/// context.
pub(super) struct Slots {
    /// What each slot is used for.
    pub(super) table: Vec<SlotUse>,
    /// Free TX slots.
    pub(super) free_tx: Vec<usize>,
    /// Free ACK slots.
    pub(super) free_ack: Vec<usize>,
    /// Number of TX slots (`max_inflight`).
    tx: usize,
    /// First ACK slot (bounce slots lie between `tx` and it).
    pub(super) ack_base: usize,
    /// The staging buffer each TX slot holds (a SEND from device memory),
    /// returned with the slot.
    stage: Vec<Option<u16>>,
    /// Free staging buffers.
    free_stage: Vec<u16>,
}

impl Slots {
    /// `tx` TX slots, `bounces` bounce slots, `acks` ACK slots and
    /// `stages` staging buffers, all free.
    pub(super) fn new(tx: usize, bounces: usize, acks: usize, stages: u16) -> Slots {
        let ack_base = tx + bounces;
        let n = ack_base + acks;
        Slots {
            table: vec![SlotUse::Free; n],
            free_tx: (0..tx).rev().collect(),
            free_ack: (ack_base..n).rev().collect(),
            tx,
            ack_base,
            stage: vec![None; tx],
            free_stage: (0..stages).rev().collect(),
        }
    }

    /// Gives TX slot `i` a free staging buffer, which comes back when the
    /// slot is freed (the provider is done with the operation); `None` when
    /// none is free.
    pub(super) fn take_stage(&mut self, i: usize) -> Option<u16> {
        let st = self.stage.get_mut(i)?;
        if st.is_some() {
            return *st;
        }
        let s = self.free_stage.pop()?;
        *st = Some(s);
        Some(s)
    }

    /// Puts TX or ACK slot `i` back on its free list (bounce slots have none:
    /// they are re-posted), with its staging buffer.
    pub(super) fn free(&mut self, i: usize) {
        if i < self.tx {
            if let Some(s) = self.stage[i].take() {
                self.free_stage.push(s);
            }
            self.free_tx.push(i);
        } else if i >= self.ack_base {
            self.free_ack.push(i);
        }
    }

    /// Whether no TX or ACK slot is in use (no operation of this domain in
    /// flight, none reported failed and still held by the provider).
    pub(super) fn idle(&self) -> bool {
        self.free_tx.len() == self.tx && self.free_ack.len() == self.table.len() - self.ack_base
    }

    /// Returns a reserved, never-issued slot to its free list.
    pub(super) fn unreserve(&mut self, i: usize) {
        let Some(s) = self.table.get_mut(i) else {
            return;
        };
        *s = SlotUse::Free;
        self.free(i);
    }
}

impl SlotUse {
    /// The peer the slot's operation goes to.
    pub(super) fn peer(self) -> Option<PeerId> {
        match self {
            SlotUse::Write { peer, .. } | SlotUse::Send { peer, .. } | SlotUse::Ack { peer } => {
                Some(peer)
            }
            _ => None,
        }
    }
}

impl LibfabricDomain {
    /// Frees slot `i` of a finished operation (counting it done for its
    /// peer) and returns what it was used for.
    pub(super) fn release(&mut self, i: usize) -> SlotUse {
        let Some(s) = self.slots.table.get_mut(i) else {
            return SlotUse::Free;
        };
        let used = std::mem::replace(s, SlotUse::Free);
        match used {
            SlotUse::Free | SlotUse::Bounce { .. } => {}
            SlotUse::Write { peer, .. } | SlotUse::Send { peer, .. } | SlotUse::Ack { peer } => {
                self.slots.free(i);
                if let Some(p) = self.peers.table.get_mut(peer.0 as usize) {
                    p.inflight = p.inflight.saturating_sub(1);
                    p.done = p.done.wrapping_add(1);
                }
            }
            SlotUse::Zombie => self.slots.free(i),
        }
        used
    }

    /// Reports the user's completion of a finished WRITE or SEND (internal
    /// slots report none).
    pub(super) fn complete(
        &mut self,
        slot: SlotUse,
        result: Result<u64, TransportError>,
        out: &mut Vec<Completion>,
    ) {
        match slot {
            SlotUse::Write { wr, .. } => out.push(Completion::Write {
                wr,
                result: result.map(|_| ()),
            }),
            SlotUse::Send { wr, .. } => out.push(Completion::Send {
                wr,
                result: result.map(|_| ()),
            }),
            SlotUse::Free | SlotUse::Zombie | SlotUse::Bounce { .. } | SlotUse::Ack { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Slots;

    /// A staging buffer belongs to one TX slot at a time and comes back
    /// only with that slot; when none is free the caller gets `None`.
    #[test]
    fn staging_buffers_follow_their_slots() {
        let mut s = Slots::new(4, 1, 1, 2);
        let a = s.free_tx.pop().unwrap();
        let b = s.free_tx.pop().unwrap();
        let c = s.free_tx.pop().unwrap();
        let sa = s.take_stage(a).unwrap();
        assert_eq!(s.take_stage(a), Some(sa), "a slot keeps its buffer");
        let sb = s.take_stage(b).unwrap();
        assert_ne!(sa, sb);
        assert_eq!(s.take_stage(c), None, "both buffers are taken");
        s.free(a);
        assert_eq!(
            s.take_stage(c),
            Some(sa),
            "freeing the slot returned its buffer"
        );
        s.free(b);
        s.free(c);
        let d = s.free_tx.pop().unwrap();
        assert!(s.take_stage(d).is_some());
        // ACK slots never hold one.
        let ack = s.free_ack.pop().unwrap();
        assert_eq!(s.take_stage(ack), None);
        s.free(ack);
        assert_eq!(s.free_ack.len(), 1);
    }

    /// Without staging buffers (no hmem) nothing is handed out.
    #[test]
    fn no_staging_without_hmem() {
        let mut s = Slots::new(2, 1, 1, 0);
        let a = s.free_tx.pop().unwrap();
        assert_eq!(s.take_stage(a), None);
    }
}
