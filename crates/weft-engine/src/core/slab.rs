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
    #[inline]
    pub(super) fn get_mut(&mut self, slot: usize) -> Option<&mut Transfer> {
        self.transfers.get_mut(slot)
    }

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

    /// Returns a finished transfer's slot to the free list.
    pub(super) fn release(&mut self, slot: u32) {
        self.free.push(slot);
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
        if let Some(slot) = self.slab.lookup(wr) {
            let t = &mut self.slab[slot as usize];
            t.unposted = t.unposted.saturating_sub(1);
            t.remaining = t.remaining.saturating_sub(1);
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
        let Some(slot) = self.slab.lookup(wr) else {
            return;
        };
        let addr = peer.and_then(|p| self.nics[nic].peer_addrs.get(&p).cloned());
        let t = &mut self.slab[slot as usize];
        t.unposted = t.unposted.saturating_sub(1);
        t.remaining = t.remaining.saturating_sub(1);
        if t.error.is_none() {
            t.error = Some(transport(self.group, nic, t.id, addr, e));
        }
        self.maybe_finish(slot);
    }

    pub(super) fn fail_transfer(&mut self, slot: u32, e: EngineError) {
        if let Some(t) = self.slab.get_mut(slot as usize) {
            if t.error.is_none() {
                t.error = Some(e);
            }
        }
    }

    /// Resolves a transfer whose pieces have all completed.
    pub(super) fn maybe_finish(&mut self, slot: u32) {
        let Some(t) = self.slab.get_mut(slot as usize) else {
            return;
        };
        if !t.live || t.remaining != 0 {
            return;
        }
        // Pieces never planned because planning failed part-way may still
        // sit in `fresh`/`backlog`; they are skipped when reached, and they
        // hold `remaining` up, so we only get here when all are accounted.
        t.live = false;
        let result = match t.error.take() {
            Some(e) => {
                self.counters.transfer_failed(e.kind());
                Err(e)
            }
            None => {
                self.counters.transfer_ok();
                Ok(())
            }
        };
        let on_done = t.on_done.take();
        let send = t.send.take();
        self.slab.release(slot);
        if let Some(res) = send {
            if let Some(s) = res.slot {
                let _ = self.send_pool.free.push(s);
            }
            if let Some((buf, key)) = res.owned {
                let _ = self.nics[0].domain.deregister(key);
                drop(buf);
            }
        }
        match (on_done, result) {
            // Counted in a batch (`flush_counts`).
            (Some(OnDone::Counter(c)), Ok(())) => self.counts.push(c),
            (Some(od), result) => {
                if let Some((cb, r)) = od.resolve_inline(result) {
                    self.events.push(Event::Done(cb, r));
                }
            }
            (None, _) => {}
        }
    }
}
