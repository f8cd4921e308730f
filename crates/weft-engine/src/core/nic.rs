//! One NIC of the group: its domain, its two rings of WRs waiting for
//! send-queue room (`fresh`: the request being taken; `backlog`: older
//! requests), its peers, and the posting and completion polling that move
//! WRs through it.

use super::{transport, Event, WorkerCore};
use crate::error::EngineError;
use crate::wrid::{decode, Decoded};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use weft_transport::{
    Capabilities, Completion, Domain, Incarnation, LocalSlice, NetAddr, PeerId, PostError,
    TransportError, WrId, WriteWr,
};

/// A work request waiting for send-queue room.
#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    Write(WriteWr),
    Send {
        wr: WrId,
        peer: PeerId,
        src: LocalSlice,
    },
}

impl Op {
    /// The WR id the op is posted under.
    #[inline]
    pub(super) fn wr(&self) -> WrId {
        match self {
            Op::Write(w) => w.wr,
            Op::Send { wr, .. } => *wr,
        }
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
}

impl WorkerCore {
    /// The peer at `addr` (incarnation `inc`) on NIC `nic`, added on
    /// first use. Removed and replaced incarnations are refused
    /// ([`TransportError::PeerRemoved`]); a newer one replaces the old (see
    /// `lifecycle`).
    pub(super) fn resolve(
        &mut self,
        nic: usize,
        addr: &NetAddr,
        inc: Incarnation,
    ) -> Result<PeerId, TransportError> {
        if nic >= self.nics.len() {
            return Err(TransportError::InvalidArgument {
                nic: String::new(),
                what: format!("no NIC {nic}"),
            });
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

    pub(super) fn ring(&mut self, nic: usize, fresh: bool) -> &mut VecDeque<Op> {
        let n = &mut self.nics[nic];
        if fresh {
            &mut n.fresh
        } else {
            &mut n.backlog
        }
    }

    /// Posts from one ring of one NIC while there is room. Returns whether
    /// anything was posted or resolved.
    pub(super) fn post_ring(&mut self, nic: usize, fresh: bool) -> bool {
        let mut progressed = false;
        loop {
            if let Some(e) = self.nics[nic].dead.clone() {
                // Everything queued on a dead NIC fails.
                while let Some(op) = self.ring(nic, fresh).pop_front() {
                    self.unposted_failed(nic, op, e.clone());
                }
                return true;
            }
            let n = &self.nics[nic];
            let room = n.caps.max_inflight.saturating_sub(n.inflight);
            if room == 0 {
                return progressed;
            }
            // Skip (and resolve) pieces of transfers that already failed.
            let Some(front) = self.ring(nic, fresh).front().copied() else {
                return progressed;
            };
            if self.slab.failed(front.wr()) {
                self.ring(nic, fresh).pop_front();
                self.skip_piece(front.wr());
                progressed = true;
                continue;
            }
            match front {
                Op::Send { wr, peer, src } => {
                    self.ring(nic, fresh).pop_front();
                    match self.nics[nic].domain.post_send(wr, peer, src) {
                        Ok(()) => {
                            self.posted(nic, wr);
                            self.counters.posted(nic, 1, src.len);
                            progressed = true;
                        }
                        Err(e) if e.is_retryable() => {
                            self.ring(nic, fresh).push_front(front);
                            return progressed;
                        }
                        Err(e) => {
                            self.post_failed(nic, wr, Some(peer), e);
                            progressed = true;
                        }
                    }
                }
                Op::Write(_) => {
                    let max = room.min(self.nics[nic].caps.max_batch);
                    self.scratch.clear();
                    // Whether the transfer of the previous WR failed: the
                    // pieces of one transfer share its WR id and sit next to
                    // each other, and nothing in this loop changes whether a
                    // transfer failed (a skipped piece can finish its
                    // transfer only once no other piece of it is queued).
                    let mut last: Option<(WrId, bool)> = None;
                    while self.scratch.len() < max {
                        // Taken off the ring whether it is posted or
                        // skipped: one ring access and one copy of the WR.
                        let ring = self.ring(nic, fresh);
                        let w = match ring.front() {
                            Some(Op::Write(w)) => *w,
                            _ => break,
                        };
                        ring.pop_front();
                        let failed = match last {
                            Some((id, f)) if id == w.wr => f,
                            _ => {
                                let f = self.slab.failed(w.wr);
                                last = Some((w.wr, f));
                                f
                            }
                        };
                        if failed {
                            self.skip_piece(w.wr);
                            continue;
                        }
                        self.scratch.push(w);
                    }
                    if self.scratch.is_empty() {
                        continue;
                    }
                    let batch = std::mem::take(&mut self.scratch);
                    let (accepted, err) = match self.nics[nic].domain.post_writes(&batch) {
                        Ok(k) => (k.min(batch.len()), None),
                        Err(PostError { posted, error }) => (posted.min(batch.len()), Some(error)),
                    };
                    let mut bytes = 0u64;
                    // One slab update per run of WRs of one transfer.
                    let mut run: Option<(WrId, usize)> = None;
                    for w in &batch[..accepted] {
                        bytes = bytes.wrapping_add(w.src.len);
                        match &mut run {
                            Some((id, k)) if *id == w.wr => *k += 1,
                            _ => {
                                if let Some((id, k)) = run.replace((w.wr, 1)) {
                                    self.posted_n(nic, id, k);
                                }
                            }
                        }
                    }
                    if let Some((id, k)) = run {
                        self.posted_n(nic, id, k);
                    }
                    self.counters.posted(nic, accepted as u64, bytes);
                    progressed |= accepted > 0;
                    let mut rest = accepted;
                    let mut stop = accepted < batch.len() && err.is_none();
                    let mut died = None;
                    if let Some(e) = err {
                        if e.is_retryable() {
                            stop = true;
                        } else if let Some(w) = batch.get(accepted) {
                            let fatal = matches!(e, TransportError::NicDown { .. });
                            self.post_failed(nic, w.wr, Some(w.peer), e.clone());
                            rest += 1;
                            progressed = true;
                            if fatal {
                                died = Some(e);
                            }
                        }
                    }
                    // Put back what was not taken, in order, at the front.
                    for w in batch[rest.min(batch.len())..].iter().rev() {
                        self.ring(nic, fresh).push_front(Op::Write(*w));
                    }
                    self.scratch = batch;
                    if let Some(e) = died {
                        // Resolve what is already posted on this NIC too:
                        // `poll` skips dead NICs, so nothing else would.
                        tracing::error!(group = self.group, nic, error = %e, "NIC down on post");
                        self.nic_died(nic, e);
                    }
                    if stop {
                        return progressed;
                    }
                }
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
            for c in comps.drain(..) {
                self.on_completion(nic, c);
            }
            self.comps = comps;
            if let Err(e) = r {
                tracing::error!(group = self.group, nic, error = %e, "domain failed");
                self.nic_died(nic, e);
                handled += 1;
            }
        }
        handled
    }

    // Copies a completed receive buffer out (`RecvPool::copy_out`).
    #[allow(unsafe_code)]
    pub(super) fn on_completion(&mut self, nic: usize, c: Completion) {
        match c {
            Completion::Write { wr, result } | Completion::Send { wr, result } => {
                self.nics[nic].inflight = self.nics[nic].inflight.saturating_sub(1);
                let Some(slot) = self.slab.lookup(wr) else {
                    tracing::warn!(group = self.group, nic, ?wr, "completion for unknown WR");
                    return;
                };
                let group = self.group;
                let t = &mut self.slab[slot as usize];
                t.posted_on[nic] = t.posted_on[nic].saturating_sub(1);
                t.remaining = t.remaining.saturating_sub(1);
                if let Err(e) = result {
                    if t.error.is_none() {
                        let peer = peer_of(&e);
                        t.error = Some(transport(group, nic, t.id, peer, e));
                    }
                }
                self.maybe_finish(slot);
            }
            Completion::Recv { wr, result } => {
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
                let result = result.and_then(|n| {
                    // SAFETY: buffer `idx` just completed and is re-posted
                    // only below, after its bytes were copied out.
                    unsafe { pool_ref.copy_out(idx, n) }.ok_or_else(|| {
                        EngineError::InvalidArgument {
                            what: format!("receive of {n} bytes into buffer {idx}"),
                        }
                    })
                });
                // The bytes are out: the buffer serves the next SEND at once,
                // whatever the user's callback does (see `RecvPool`).
                self.repost(pool, idx);
                self.events.push(Event::Recv {
                    pool: pool_ref,
                    result,
                });
            }
            Completion::Imm { imm } => {
                if let Some(e) = self.imms.arrive(imm).and_then(|d| d.resolve(Ok(()))) {
                    self.events.push(e);
                }
            }
        }
    }

    pub(super) fn nic_died(&mut self, nic: usize, e: TransportError) {
        self.nics[nic].dead = Some(e.clone());
        self.nics[nic].inflight = 0;
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
