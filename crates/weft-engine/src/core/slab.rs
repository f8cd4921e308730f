//! The transfer slab: one slot per transfer in flight, reused through a
//! free list; a slot's generation (carried in its WR ids) tells a live
//! transfer's completions from a finished one's.

use super::nic::Op;
use super::{transport, Event, WorkerCore};
use crate::error::{EngineError, TransferId};
use crate::ondone::OnDone;
use crate::wrid::{decode, Decoded, GEN_MASK};
use crate::MAX_NICS;
use weft_transport::{MrKey, PeerId, TransportError, WrId};

pub(super) struct SendRes {
    pub(super) slot: Option<u32>,
    pub(super) owned: Option<(Vec<u8>, MrKey)>,
}

pub(super) struct Transfer {
    pub(super) gen: u32,
    pub(super) live: bool,
    pub(super) id: TransferId,
    pub(super) on_done: Option<OnDone>,
    /// Pieces not yet completed (posted or not).
    pub(super) remaining: u64,
    /// Pieces not yet handed to the backend.
    pub(super) unposted: u64,
    /// Posted, not yet completed, per NIC.
    pub(super) posted_on: [u32; MAX_NICS],
    pub(super) error: Option<EngineError>,
    pub(super) send: Option<SendRes>,
    pub(super) probe: crate::probe::TransferProbe,
}

/// What a finished transfer leaves to its group ([`Slab::finish`]).
pub(super) struct Finished {
    /// Its outcome: the first error of any piece.
    pub(super) result: Result<(), EngineError>,
    /// Who to tell.
    pub(super) on_done: Option<OnDone>,
    /// A SEND's send-pool slot or owned buffer, to give back.
    pub(super) send: Option<SendRes>,
}

/// Every transfer slot of a group, live or free.
#[derive(Default)]
pub(super) struct Slab {
    transfers: Vec<Transfer>,
    free: Vec<u32>,
}

impl std::ops::Index<usize> for Slab {
    type Output = Transfer;
    #[inline]
    fn index(&self, slot: usize) -> &Transfer {
        &self.transfers[slot]
    }
}

impl std::ops::IndexMut<usize> for Slab {
    #[inline]
    fn index_mut(&mut self, slot: usize) -> &mut Transfer {
        &mut self.transfers[slot]
    }
}

impl Slab {
    /// Number of slots, live or free.
    pub(super) fn len(&self) -> usize {
        self.transfers.len()
    }

    /// Whether any transfer is still unfinished.
    pub(super) fn live_count(&self) -> usize {
        self.transfers.len() - self.free.len()
    }

    pub(super) fn any_live(&self) -> bool {
        self.transfers.iter().any(|t| t.live)
    }

    /// A slot for a new transfer: `(slot, generation)`.
    #[inline]
    pub(super) fn alloc(&mut self, id: TransferId, on_done: OnDone) -> (u32, u32) {
        if let Some(slot) = self.free.pop() {
            let t = &mut self.transfers[slot as usize];
            t.gen = t.gen.wrapping_add(1) & GEN_MASK as u32;
            t.live = true;
            t.id = id;
            t.on_done = Some(on_done);
            t.remaining = 0;
            t.unposted = 0;
            t.posted_on = [0; MAX_NICS];
            t.error = None;
            t.send = None;
            return (slot, t.gen);
        }
        let slot = self.transfers.len() as u32;
        self.transfers.push(Transfer {
            gen: 0,
            live: true,
            id,
            on_done: Some(on_done),
            remaining: 0,
            unposted: 0,
            posted_on: [0; MAX_NICS],
            error: None,
            send: None,
            probe: crate::probe::TransferProbe::new(),
        });
        (slot, 0)
    }

    /// The transfer's side of `k` of its WRs (id `wr`) accepted by NIC
    /// `nic`; the caller counts them on the NIC and in `pending_pieces`.
    #[inline]
    pub(super) fn posted_run(
        &mut self,
        nic: usize,
        wr: WrId,
        k: usize,
        probes: &crate::probe::Probes,
    ) {
        if let Some(slot) = self.lookup(wr) {
            let t = &mut self.transfers[slot as usize];
            let k32 = u32::try_from(k).unwrap_or(u32::MAX);
            if let Some(p) = t.posted_on.get_mut(nic) {
                *p = p.saturating_add(k32);
            }
            t.unposted = t.unposted.saturating_sub(k as u64);
            t.probe.posted(nic, k32, t.unposted == 0, probes);
        }
    }

    /// Whether the transfer `wr` belongs to has already failed.
    #[inline]
    pub(super) fn failed(&self, wr: WrId) -> bool {
        match decode(wr) {
            Decoded::Transfer { slot, .. } => self
                .transfers
                .get(slot as usize)
                .is_some_and(|t| t.error.is_some()),
            _ => false,
        }
    }

    /// The live transfer slot `wr` belongs to (`None`: finished or unknown).
    #[inline]
    pub(super) fn lookup(&self, wr: WrId) -> Option<u32> {
        match decode(wr) {
            Decoded::Transfer { slot, gen } => {
                let t = self.transfers.get(slot as usize)?;
                (t.live && t.gen == gen).then_some(slot)
            }
            _ => None,
        }
    }

    /// Holds transfer `slot` open while it is planned: one count of
    /// `remaining` and of `unposted`, so pieces posted early can neither
    /// finish it nor count as all posted before every piece is planned.
    pub(super) fn hold(&mut self, slot: u32) {
        let t = &mut self[slot as usize];
        t.remaining += 1;
        t.unposted += 1;
    }

    /// Drops a hold of [`Slab::hold`]. Returns whether every piece was
    /// posted before the hold went (nothing unposted, no error): the
    /// transfer's "all posted" moment is then now.
    pub(super) fn release(&mut self, slot: u32) -> bool {
        let t = &mut self[slot as usize];
        t.remaining -= 1;
        t.unposted -= 1;
        t.unposted == 0 && t.error.is_none()
    }

    /// Records `e` as transfer `slot`'s error unless it already has one
    /// (the first error is the one reported).
    pub(super) fn set_error(&mut self, slot: u32, e: EngineError) {
        if let Some(t) = self.transfers.get_mut(slot as usize) {
            if t.error.is_none() {
                t.error = Some(e);
            }
        }
    }

    /// One piece of the live transfer `wr` belongs to will never reach
    /// the backend: it counts as done, failed with `error(id)` when given
    /// (unless the transfer already failed). Returns the transfer's slot,
    /// `None` for a finished or unknown transfer.
    pub(super) fn piece_resolved(
        &mut self,
        wr: WrId,
        error: Option<impl FnOnce(TransferId) -> EngineError>,
    ) -> Option<u32> {
        let slot = self.lookup(wr)?;
        let t = &mut self.transfers[slot as usize];
        t.unposted = t.unposted.saturating_sub(1);
        t.remaining = t.remaining.saturating_sub(1);
        if let Some(f) = error {
            if t.error.is_none() {
                t.error = Some(f(t.id));
            }
        }
        Some(slot)
    }

    /// Ends transfer `slot` if it is live with no piece left: frees the
    /// slot and returns its result, callback and send resources. `None`
    /// while pieces remain (or for a slot already finished).
    pub(super) fn finish(&mut self, slot: u32) -> Option<Finished> {
        let t = self.transfers.get_mut(slot as usize)?;
        if !t.live || t.remaining != 0 {
            return None;
        }
        // Pieces never planned because planning failed part-way may still
        // sit in `fresh`/`backlog`; they are skipped when reached, and they
        // hold `remaining` up, so we only get here when all are accounted.
        t.live = false;
        let f = Finished {
            result: t.error.take().map_or(Ok(()), Err),
            on_done: t.on_done.take(),
            send: t.send.take(),
        };
        self.free.push(slot);
        Some(f)
    }
}

impl WorkerCore {
    /// One WR (a SEND) of transfer `wr` was accepted by NIC `nic`. Runs of
    /// WRITEs are counted in `post_ring` itself (`Slab::posted_run` once
    /// per run of one transfer).
    pub(super) fn posted(&mut self, nic: usize, wr: WrId) {
        self.nics[nic].inflight += 1;
        self.pending_pieces = self.pending_pieces.saturating_sub(1);
        self.slab.posted_run(nic, wr, 1, &self.probes);
    }

    /// A piece never reached the backend (failed transfer): resolve it.
    pub(super) fn skip_piece(&mut self, wr: WrId) {
        self.pending_pieces = self.pending_pieces.saturating_sub(1);
        let none: Option<fn(TransferId) -> EngineError> = None;
        if let Some(slot) = self.slab.piece_resolved(wr, none) {
            self.maybe_finish(slot);
        }
    }

    pub(super) fn unposted_failed(&mut self, nic: usize, op: Op, e: TransportError) {
        self.post_failed(nic, op.wr, Some(op.peer), e);
    }

    /// The backend rejected a WR at post time.
    pub(super) fn post_failed(
        &mut self,
        nic: usize,
        wr: WrId,
        peer: Option<PeerId>,
        e: TransportError,
    ) {
        self.pending_pieces = self.pending_pieces.saturating_sub(1);
        self.note_unreachable(nic, &e);
        let addr = peer.and_then(|p| self.nics[nic].peer_addrs.get(&p).cloned());
        let group = self.group;
        let error = |id| transport(group, nic, id, addr, e);
        if let Some(slot) = self.slab.piece_resolved(wr, Some(error)) {
            self.maybe_finish(slot);
        }
    }

    pub(super) fn fail_transfer(&mut self, slot: u32, e: EngineError) {
        self.slab.set_error(slot, e);
    }

    /// Resolves a transfer whose pieces have all completed.
    pub(super) fn maybe_finish(&mut self, slot: u32) {
        let Some(f) = self.slab.finish(slot) else {
            return;
        };
        match &f.result {
            Err(e) => self.counters.transfer_failed(e.kind()),
            Ok(()) => self.counters.transfer_ok(),
        }
        if let Some(res) = f.send {
            if let Some(s) = res.slot {
                let _ = self.send_pool.free.push(s);
            }
            if let Some((buf, key)) = res.owned {
                let _ = self.nics[0].domain.deregister(key);
                drop(buf);
            }
        }
        match (f.on_done, f.result) {
            // Counted in a batch (`flush_counts`).
            (Some(OnDone::Counter(c)), Ok(())) => self.out.count_ok(c),
            (Some(od), result) => {
                if let Some((cb, r)) = od.resolve_inline(result) {
                    self.out.push(Event::Done(cb, r));
                }
            }
            (None, _) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wrid::{wr_transfer, KIND_WRITE};

    fn err(id: TransferId, what: &str) -> EngineError {
        EngineError::Transport {
            transfer: id,
            group: 0,
            nic: 0,
            peer: None,
            source: Box::new(TransportError::Failed {
                nic: what.into(),
                wr: None,
                what: what.into(),
            }),
        }
    }

    /// A transfer of `pieces` pieces, none posted yet.
    fn live(s: &mut Slab, id: u64, pieces: u64) -> (u32, WrId) {
        let (slot, gen) = s.alloc(TransferId(id), OnDone::Ignore);
        s[slot as usize].remaining = pieces;
        s[slot as usize].unposted = pieces;
        (slot, wr_transfer(KIND_WRITE, slot, gen))
    }

    #[test]
    fn a_transfer_finishes_when_its_last_piece_is_resolved() {
        let mut s = Slab::default();
        let (slot, wr) = live(&mut s, 7, 2);
        let none: Option<fn(TransferId) -> EngineError> = None;
        assert_eq!(s.piece_resolved(wr, none), Some(slot));
        assert!(s.finish(slot).is_none(), "one piece left");
        assert_eq!(s.piece_resolved(wr, none), Some(slot));
        let f = s.finish(slot).expect("finished");
        assert!(f.result.is_ok());
        assert_eq!(s.live_count(), 0);
        // Finished once: its ids no longer resolve, and it does not finish
        // twice.
        assert!(s.finish(slot).is_none());
        assert_eq!(s.lookup(wr), None);
        assert_eq!(s.piece_resolved(wr, none), None);
    }

    #[test]
    fn the_first_error_is_the_one_reported() {
        let mut s = Slab::default();
        let (slot, wr) = live(&mut s, 3, 3);
        s.piece_resolved(wr, Some(|id| err(id, "first")));
        s.set_error(slot, err(TransferId(3), "second"));
        s.piece_resolved(wr, Some(|id| err(id, "third")));
        s.piece_resolved(wr, None::<fn(TransferId) -> EngineError>);
        let f = s.finish(slot).expect("finished");
        let e = f.result.expect_err("failed");
        assert!(e.to_string().contains("first"), "{e}");
        assert!(matches!(
            e,
            EngineError::Transport {
                transfer: TransferId(3),
                ..
            }
        ));
    }

    #[test]
    fn a_hold_keeps_a_transfer_open_until_released() {
        let none: Option<fn(TransferId) -> EngineError> = None;
        // Its one piece resolved (never posted) while held: still open.
        let mut s = Slab::default();
        let (slot, wr) = live(&mut s, 7, 1);
        s.hold(slot);
        assert_eq!(s.piece_resolved(wr, none), Some(slot));
        assert!(s.finish(slot).is_none(), "the hold keeps it open");
        s.release(slot);
        assert!(s.finish(slot).is_some());
        // Its one piece posted under the hold: all posted when the hold
        // goes, the piece still in flight.
        let (slot, wr) = live(&mut s, 8, 1);
        s.hold(slot);
        s.posted_run(0, wr, 1, &Default::default());
        assert!(s.release(slot), "everything was posted under the hold");
        assert!(s.finish(slot).is_none(), "its piece is in flight");
        // A transfer that failed under its hold does not report all posted.
        let (slot, _) = live(&mut s, 9, 0);
        s.hold(slot);
        s.set_error(slot, err(TransferId(9), "x"));
        assert!(!s.release(slot));
    }

    #[test]
    fn a_reused_slot_gets_a_new_generation() {
        let mut s = Slab::default();
        let (slot, old) = live(&mut s, 1, 1);
        s.piece_resolved(old, None::<fn(TransferId) -> EngineError>);
        assert!(s.finish(slot).is_some());
        let (again, new) = live(&mut s, 2, 1);
        assert_eq!(again, slot, "the free slot is reused");
        assert_ne!(old, new);
        // A late completion id of the finished transfer touches nothing.
        assert_eq!(
            s.piece_resolved(old, None::<fn(TransferId) -> EngineError>),
            None
        );
        assert_eq!(s[slot as usize].remaining, 1);
        assert_eq!(s.lookup(new), Some(slot));
    }
}
