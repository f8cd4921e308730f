//! One NIC of the group: its domain, its two rings of WRs waiting for
//! send-queue room (`fresh`: the request being taken; `backlog`: older
//! requests), its peers, and the posting and completion polling that move
//! WRs through it.

use super::lifecycle::Refusal;
use super::{transport, Event, WorkerCore};
use crate::error::EngineError;
use crate::mem::NotCopied;
use crate::stats::PeerCounters;
use crate::wrid::{decode, is_send, Decoded};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use weft_transport::{
    Capabilities, Completion, Domain, Incarnation, LocalSlice, NetAddr, PeerId, PostError,
    RemoteSlice, Rkey, TransportError, WrId, WriteWr,
};

/// A work request waiting for send-queue room: a WRITE, or a SEND (its WR
/// id's kind is `KIND_SEND`, see [`is_send`]; `peer` and `src` are the
/// SEND's, `dst` and `imm` are unused). One type for both, so the rings'
/// WRITEs are handed to the backend in place (`post_writes` takes a slice
/// of the ring), never copied into a separate batch.
pub(super) type Op = WriteWr;

/// The ring entry of a SEND.
#[inline]
pub(super) fn send_op(wr: WrId, peer: PeerId, src: LocalSlice) -> Op {
    WriteWr {
        wr,
        peer,
        src,
        dst: RemoteSlice {
            base: 0,
            offset: 0,
            rkey: Rkey(0),
        },
        imm: None,
    }
}

/// One NIC of the group: its domain, rings, peers and counters.
pub(super) struct Nic {
    pub(super) domain: Box<dyn Domain>,
    pub(super) caps: Capabilities,
    pub(super) name: String,
    pub(super) inflight: usize,
    /// WRs of the request being taken right now (priority 1).
    pub(super) fresh: VecDeque<Op>,
    /// WRs of older requests waiting for room (priority 2).
    pub(super) backlog: VecDeque<Op>,
    /// Resolved peers: the incarnation each was resolved for (at most one
    /// per address: a newer one replaces it, see `lifecycle`) and its id.
    pub(super) peers: BTreeMap<NetAddr, (Incarnation, PeerId)>,
    pub(super) peer_addrs: BTreeMap<PeerId, NetAddr>,
    /// What was posted to each resolved peer (shared with `stats()`).
    pub(super) peer_counts: BTreeMap<PeerId, Arc<PeerCounters>>,
    /// `peers` by [`AddrBook`](crate::request::AddrBook) id (filled on
    /// first use).
    pub(super) by_addr_id: Vec<Option<PeerId>>,
    pub(super) dead: Option<TransportError>,
    pub(super) recvs_posted: usize,
}

impl Nic {
    /// A NIC around its freshly opened domain.
    pub(super) fn new(domain: Box<dyn Domain>) -> Self {
        let caps = domain.capabilities().clone();
        let name = domain.info().name.clone();
        Nic {
            domain,
            caps,
            name,
            inflight: 0,
            fresh: VecDeque::new(),
            backlog: VecDeque::new(),
            peers: BTreeMap::new(),
            peer_addrs: BTreeMap::new(),
            peer_counts: BTreeMap::new(),
            by_addr_id: Vec::new(),
            dead: None,
            recvs_posted: 0,
        }
    }

    /// The peer at `addr` resolved for incarnation `inc`, added to the
    /// domain on first use; `None` when another incarnation holds the
    /// address (the caller drops it first).
    pub(super) fn resolve(
        &mut self,
        addr: &NetAddr,
        inc: Incarnation,
    ) -> Result<Option<PeerId>, TransportError> {
        if let Some((i, p)) = self.peers.get(addr) {
            return Ok((*i == inc).then_some(*p));
        }
        let p = self.domain.add_peer(addr)?;
        self.peers.insert(addr.clone(), (inc, p));
        self.peer_addrs.insert(p, addr.clone());
        Ok(Some(p))
    }

    /// The WRs of the request being taken (`fresh`) or the backlog.
    pub(super) fn ring(&mut self, fresh: bool) -> &mut VecDeque<Op> {
        if fresh {
            &mut self.fresh
        } else {
            &mut self.backlog
        }
    }

    /// Moves the WRs left in the fresh ring to the end of the backlog.
    pub(super) fn stage_fresh(&mut self) {
        if self.fresh.is_empty() {
            return;
        }
        if self.backlog.is_empty() {
            // Common case: no copy, the rings trade buffers.
            std::mem::swap(&mut self.fresh, &mut self.backlog);
        } else {
            self.backlog.append(&mut self.fresh);
        }
        // Empty: start the next request's WRs at the buffer's start, so
        // growing it never moves a wrapped ring.
        self.fresh.clear();
    }
}

impl WorkerCore {
    /// The peer at `addr` (incarnation `inc`) on NIC `nic`, added on
    /// first use. Removed and replaced incarnations are refused
    /// ([`TransportError::PeerRemoved`]); a newer one replaces the old
    /// only once the old one ended, and is refused as unproven before (see
    /// `lifecycle`).
    pub(super) fn resolve(
        &mut self,
        nic: usize,
        addr: &NetAddr,
        inc: Incarnation,
    ) -> Result<PeerId, Refusal> {
        if nic >= self.nics.len() {
            return Err(TransportError::InvalidArgument {
                nic: String::new(),
                what: format!("no NIC {nic}"),
            }
            .into());
        }
        self.admit(nic, addr, inc)?;
        let p = match self.resolve_on(nic, addr, inc)? {
            Some(p) => p,
            None => {
                // Another incarnation still holds the address here (one
                // that became stale after the sync above): drop it first.
                if let Some((old, _)) = self.nics[nic].peers.get(addr).copied() {
                    // Logged by `drop_peer`; the new peer is added anyway.
                    let _ = self.drop_peer(nic, addr, old);
                }
                self.resolve_on(nic, addr, inc)?
                    .ok_or_else(|| TransportError::PeerRemoved {
                        nic: self.nics[nic].name.clone(),
                        peer: addr.clone(),
                    })?
            }
        };
        Ok(p)
    }

    fn resolve_on(
        &mut self,
        nic: usize,
        addr: &NetAddr,
        inc: Incarnation,
    ) -> Result<Option<PeerId>, TransportError> {
        let n = self
            .nics
            .get_mut(nic)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: String::new(),
                what: format!("no NIC {nic}"),
            })?;
        let known = n.peers.len();
        let p = n.resolve(addr, inc)?;
        if n.peers.len() != known {
            if let Some(id) = p {
                n.peer_counts
                    .insert(id, self.counters.peer_added(nic, addr));
            }
            self.counters.set_peers(nic, self.nics[nic].peers.len());
        }
        Ok(p)
    }

    /// Posts what the fresh rings hold while there is room; the rest stays
    /// there, in order, ahead of pieces planned later.
    pub(super) fn post_fresh(&mut self) {
        for i in 0..self.nics.len() {
            if !self.nics[i].fresh.is_empty() {
                self.post_ring(i, true);
            }
        }
    }

    /// Posts more WRs of pending requests as room frees (priority 2).
    pub(crate) fn post_backlog(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.nics.len() {
            if !self.nics[i].backlog.is_empty() {
                any |= self.post_ring(i, false);
            }
        }
        any
    }

    /// Posts from one ring of one NIC while there is room. Returns whether
    /// anything was posted or resolved.
    ///
    /// WRITEs go to the backend straight from the ring (a slice of its
    /// front, no copy) and leave it once accepted; what the backend does
    /// not take stays at the front, in order.
    pub(super) fn post_ring(&mut self, nic: usize, fresh: bool) -> bool {
        let mut progressed = false;
        loop {
            if let Some(e) = self.nics[nic].dead.clone() {
                // Everything queued on a dead NIC fails.
                while let Some(op) = self.nics[nic].ring(fresh).pop_front() {
                    self.unposted_failed(nic, op, e.clone());
                }
                return true;
            }
            let n = &self.nics[nic];
            let room = n.caps.max_inflight.saturating_sub(n.inflight);
            if room == 0 {
                return progressed;
            }
            let max = room.min(n.caps.max_batch);
            // Skip (and resolve) pieces of transfers that already failed.
            let Some(front) = self.nics[nic].ring(fresh).front().copied() else {
                return progressed;
            };
            if self.slab.failed(front.wr) {
                self.nics[nic].ring(fresh).pop_front();
                self.skip_piece(front.wr);
                progressed = true;
                continue;
            }
            if is_send(front.wr) {
                self.nics[nic].ring(fresh).pop_front();
                match self.nics[nic]
                    .domain
                    .post_send(front.wr, front.peer, front.src)
                {
                    Ok(()) => {
                        self.posted(nic, front.wr);
                        self.counters.posted(nic, 1, front.src.len);
                        if let Some(c) = self.nics[nic].peer_counts.get(&front.peer) {
                            c.posted(1, front.src.len);
                        }
                        progressed = true;
                    }
                    Err(e) if e.is_retryable() => {
                        self.nics[nic].ring(fresh).push_front(front);
                        return progressed;
                    }
                    Err(e) => {
                        self.post_failed(nic, front.wr, Some(front.peer), e);
                        progressed = true;
                    }
                }
                continue;
            }
            // A run of WRITEs from the front: at most `max`, within the
            // ring's first contiguous slice, up to the first SEND or WR of
            // a failed transfer (those are handled by the next lap). The
            // pieces of one transfer share its WR id and sit next to each
            // other, so the checks run once per transfer, and nothing here
            // changes whether a transfer failed until the post returns.
            let n = &mut self.nics[nic];
            let ring = if fresh { &n.fresh } else { &n.backlog };
            let head = ring.as_slices().0;
            let lim = head.len().min(max);
            let mut k = 1;
            let mut cur = front.wr;
            while k < lim {
                let w = head[k].wr;
                if w != cur {
                    if is_send(w) || self.slab.failed(w) {
                        break;
                    }
                    cur = w;
                }
                k += 1;
            }
            let batch = &head[..k];
            let (accepted, err) = match n.domain.post_writes(batch) {
                Ok(a) => (a.min(k), None),
                Err(PostError { posted, error }) => (posted.min(k), Some(error)),
            };
            let mut bytes = 0u64;
            // One slab update per run of WRs of one transfer, one peer
            // counter update per run of WRs to one peer.
            let mut run: Option<(WrId, usize)> = None;
            let mut to: Option<(PeerId, u64, u64)> = None;
            for w in &batch[..accepted] {
                bytes = bytes.wrapping_add(w.src.len);
                match &mut to {
                    Some((p, k, b)) if *p == w.peer => {
                        *k += 1;
                        *b = b.wrapping_add(w.src.len);
                    }
                    _ => {
                        if let Some((p, k, b)) = to.replace((w.peer, 1, w.src.len)) {
                            if let Some(c) = n.peer_counts.get(&p) {
                                c.posted(k, b);
                            }
                        }
                    }
                }
                match &mut run {
                    Some((id, c)) if *id == w.wr => *c += 1,
                    _ => {
                        if let Some((id, c)) = run.replace((w.wr, 1)) {
                            self.slab.posted_run(nic, id, c, &self.probes);
                        }
                    }
                }
            }
            if let Some((id, c)) = run {
                self.slab.posted_run(nic, id, c, &self.probes);
            }
            if let Some((p, k, b)) = to {
                if let Some(c) = n.peer_counts.get(&p) {
                    c.posted(k, b);
                }
            }
            let rejected = match &err {
                Some(e) if !e.is_retryable() => batch.get(accepted).copied(),
                _ => None,
            };
            let stop = match &err {
                None => accepted < k,
                Some(e) => e.is_retryable(),
            };
            n.inflight += accepted;
            self.pending_pieces = self.pending_pieces.saturating_sub(accepted);
            self.counters.posted(nic, accepted as u64, bytes);
            progressed |= accepted > 0;
            // The accepted WRs (and a rejected one) leave the ring.
            let taken = accepted + usize::from(rejected.is_some());
            let ring = self.nics[nic].ring(fresh);
            if taken == ring.len() {
                ring.clear();
            } else if taken > 0 {
                ring.drain(..taken);
            }
            if let (Some(w), Some(e)) = (rejected, err) {
                let fatal = matches!(e, TransportError::NicDown { .. });
                self.post_failed(nic, w.wr, Some(w.peer), e.clone());
                progressed = true;
                if fatal {
                    // Resolve what is already posted on this NIC too:
                    // `poll` skips dead NICs, so nothing else would.
                    tracing::error!(group = self.group, nic, error = %e, "NIC down on post");
                    self.nic_died(nic, e);
                }
            }
            if stop {
                return progressed;
            }
        }
    }

    /// Polls every domain's completion queue (priority 3). Returns how many
    /// completions were handled.
    pub(crate) fn poll(&mut self) -> usize {
        let mut handled = 0;
        for nic in 0..self.nics.len() {
            if self.nics[nic].dead.is_some() {
                continue;
            }
            let mut comps = std::mem::take(&mut self.comps);
            comps.clear();
            let r = self.nics[nic].domain.poll(&mut comps);
            handled += comps.len();
            // Successful WRITE/SEND completions of one transfer that follow
            // each other (the pages of a paged write, the pieces of a large
            // one) are counted once per run: one slab lookup and one finish
            // check instead of one per WR. Anything else ends the run first,
            // so completions are still handled in the order they came.
            let mut run: Option<(WrId, usize)> = None;
            for c in comps.drain(..) {
                match c {
                    Completion::Write { wr, result: Ok(()) }
                    | Completion::Send { wr, result: Ok(()) } => match &mut run {
                        Some((id, k)) if *id == wr => *k += 1,
                        _ => {
                            if let Some((id, k)) = run.replace((wr, 1)) {
                                self.completed_run(nic, id, k);
                            }
                        }
                    },
                    other => {
                        if let Some((id, k)) = run.take() {
                            self.completed_run(nic, id, k);
                        }
                        self.on_completion(nic, other);
                    }
                }
            }
            if let Some((id, k)) = run {
                self.completed_run(nic, id, k);
            }
            self.flush_counts();
            self.comps = comps;
            if let Err(e) = r {
                tracing::error!(group = self.group, nic, error = %e, "domain failed");
                self.nic_died(nic, e);
                handled += 1;
            }
        }
        handled
    }

    /// `k` WRITE/SEND completions of transfer `wr` on NIC `nic` (their
    /// errors, if any, already recorded): they leave the NIC's and the
    /// transfer's counts, and the transfer finishes if they were its last.
    fn completed_run(&mut self, nic: usize, wr: WrId, k: usize) {
        let n = &mut self.nics[nic];
        let left = n.inflight.saturating_sub(k);
        self.counters.completed(nic, (n.inflight - left) as u64);
        n.inflight = left;
        let Some(slot) = self.slab.lookup(wr) else {
            tracing::warn!(group = self.group, nic, ?wr, k, "completion for unknown WR");
            return;
        };
        let t = &mut self.slab[slot as usize];
        if t.remaining < k as u64 {
            tracing::warn!(
                group = self.group,
                nic,
                ?wr,
                k,
                remaining = t.remaining,
                "more completions than the transfer has WRs left"
            );
        }
        t.posted_on[nic] = t.posted_on[nic].saturating_sub(u32::try_from(k).unwrap_or(u32::MAX));
        t.remaining = t.remaining.saturating_sub(k as u64);
        self.maybe_finish(slot);
    }

    // Copies a completed receive buffer out (`RecvPool::copy_out`).
    #[allow(unsafe_code)]
    pub(super) fn on_completion(&mut self, nic: usize, c: Completion) {
        match c {
            Completion::Write { wr, result } | Completion::Send { wr, result } => {
                if let Err(e) = result {
                    self.note_unreachable(nic, &e);
                    // Recorded before the count, which may finish the transfer.
                    if let Some(slot) = self.slab.lookup(wr) {
                        let group = self.group;
                        let t = &mut self.slab[slot as usize];
                        if t.error.is_none() {
                            let peer = peer_of(&e);
                            t.error = Some(transport(group, nic, t.id, peer, e));
                        }
                    }
                }
                self.completed_run(nic, wr, 1);
            }
            Completion::Recv { wr, result, from } => {
                let Decoded::Recv { pool, idx } = decode(wr) else {
                    tracing::warn!(
                        group = self.group,
                        nic,
                        ?wr,
                        "receive completion for unknown WR"
                    );
                    return;
                };
                let n = &mut self.nics[nic];
                n.recvs_posted = n.recvs_posted.saturating_sub(1);
                // A freed receive slot: post a waiting buffer.
                if let Some(next) = self
                    .reg
                    .pools
                    .values_mut()
                    .find_map(|p| p.waiting.pop_front().map(|i| (p.pool.id, i)))
                {
                    self.repost(next.0, next.1);
                }
                let Some(ps) = self.reg.pools.get(&pool) else {
                    return;
                };
                let pool_ref = Arc::clone(&ps.pool);
                let group = self.group;
                let result = result.map_err(|e| EngineError::Control {
                    group,
                    nic,
                    op: "receive",
                    source: Box::new(e),
                });
                if matches!(
                    result.as_ref().err().and_then(EngineError::transport),
                    Some(TransportError::Canceled { .. })
                ) {
                    // Flushed at close: not an event.
                    return;
                }
                let own = self.incarnation;
                let mut sender = None;
                let result = match result {
                    // SAFETY: buffer `idx` just completed and is re-posted
                    // only below, after its bytes were copied out.
                    Ok(n) => match unsafe { pool_ref.copy_out(idx, n, own) } {
                        Ok((msg, incarnation)) => {
                            sender = from.map(|nic| crate::MessageSender { nic, incarnation });
                            Ok(msg)
                        }
                        Err(NotCopied::Rejected(why)) => {
                            // Not for this engine: dropped and counted, the
                            // buffer serves the next SEND at once.
                            self.frame_dropped(n, &why);
                            self.repost(pool, idx);
                            return;
                        }
                        Err(NotCopied::OutOfRange) => Err(EngineError::InvalidArgument {
                            what: format!("receive of {n} bytes into buffer {idx}"),
                        }),
                    },
                    Err(e) => Err(e),
                };
                // The bytes are out: the buffer serves the next SEND at once,
                // whatever the user's callback does, unless the pool's
                // copied-out messages are at their bound (see `RecvPool`).
                if result.is_ok() && pool_ref.took_out() {
                    self.hold_recv(pool, idx);
                } else {
                    self.repost(pool, idx);
                }
                self.out.push(Event::Recv {
                    pool: pool_ref,
                    result,
                    from: sender,
                });
            }
            Completion::Imm { imm } => {
                if let Some(c) = self.imms.arrive(imm).and_then(|d| d.resolve(Ok(()))) {
                    self.out.push(c.into());
                }
            }
        }
    }

    /// Counts and logs a received frame of `n` bytes that was dropped:
    /// a warning for the 1st, 2nd, 4th, ... one of its kind (stale or
    /// malformed), the others at debug level.
    fn frame_dropped(&self, n: u64, why: &crate::frame::Rejected) {
        let stale = why.is_stale();
        let count = self.counters.recv_dropped(stale);
        let kind = if stale { "stale" } else { "malformed" };
        if count.is_power_of_two() {
            tracing::warn!(group = self.group, len = n, %why, kind, count,
                "dropped a received SEND (warned at the 1st, 2nd, 4th, ... one of its kind)");
        } else {
            tracing::debug!(group = self.group, len = n, %why, kind, count, "dropped a received SEND");
        }
    }

    pub(super) fn nic_died(&mut self, nic: usize, e: TransportError) {
        self.nics[nic].dead = Some(e.clone());
        let failed = std::mem::take(&mut self.nics[nic].inflight);
        self.counters.completed(nic, failed as u64);
        // Fail every posted piece on that NIC.
        for slot in 0..self.slab.len() {
            let t = &mut self.slab[slot];
            if !t.live || t.posted_on[nic] == 0 {
                continue;
            }
            let k = u64::from(t.posted_on[nic]);
            t.posted_on[nic] = 0;
            t.remaining = t.remaining.saturating_sub(k);
            if t.error.is_none() {
                t.error = Some(EngineError::NicDown {
                    group: self.group,
                    nic,
                    source: Box::new(e.clone()),
                });
            }
            self.maybe_finish(slot as u32);
        }
        // And everything still queued on it.
        self.post_ring(nic, false);
    }
}

fn peer_of(e: &TransportError) -> Option<NetAddr> {
    match e {
        TransportError::PeerUnreachable { peer, .. }
        | TransportError::RemoteAccess { peer, .. }
        | TransportError::ReceiverNotReady { peer, .. }
        | TransportError::MessageTooLong { peer, .. } => Some(peer.clone()),
        _ => None,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use weft_loopback::{Fabric, FabricConfig};
    use weft_transport::MrKey;

    fn op(wr: u64) -> Op {
        let src = LocalSlice {
            mr: MrKey(0),
            addr: 0,
            len: 0,
        };
        send_op(WrId(wr), PeerId(0), src)
    }

    fn ids(r: &VecDeque<Op>) -> Vec<u64> {
        r.iter().map(|o| o.wr.0).collect()
    }

    #[test]
    fn staging_moves_fresh_wrs_behind_the_backlog_and_resolving_adds_a_peer_once() {
        let fabric = Fabric::new(FabricConfig::default());
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let mut n = Nic::new(Box::new(fabric.open(a, 0).unwrap()));
        let other = fabric.open(b, 0).unwrap();
        // Into an empty backlog: the rings trade buffers.
        n.ring(true).extend([op(1), op(2)]);
        n.stage_fresh();
        assert_eq!((ids(&n.fresh), ids(&n.backlog)), (vec![], vec![1, 2]));
        // Behind what waits already, oldest first.
        n.ring(true).push_back(op(3));
        n.stage_fresh();
        assert_eq!((ids(&n.fresh), ids(&n.backlog)), (vec![], vec![1, 2, 3]));
        n.stage_fresh();
        assert_eq!(ids(&n.backlog), [1, 2, 3], "nothing fresh: unchanged");
        // A peer resolves once per address; another incarnation is refused
        // until the first is dropped.
        let addr = other.local_addr().clone();
        let (i1, i2) = (Incarnation(1), Incarnation(2));
        let p = n.resolve(&addr, i1).unwrap().expect("resolved");
        assert_eq!(n.resolve(&addr, i1).unwrap(), Some(p));
        assert_eq!(n.peer_addrs.get(&p), Some(&addr));
        assert_eq!(n.resolve(&addr, i2).unwrap(), None);
    }
}
