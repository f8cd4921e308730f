//! The decoder's clock-free state machine: known prefillers and their
//! liveness, the page pool, and every request from `begin` until no write of
//! it can land any more. Events go in (with `now`), [`DecAction`]s come out;
//! the driver ([`crate::Decoder`]) runs them on the engine, tests step it
//! directly.
//!
//! ## Who may say what
//! Frames are taken only from the prefillers this decoder added, and only
//! when authentic (their [`Auth`] proves the sender holds the address it
//! names; see the crate docs). Until a prefiller's first authentic frame
//! (the answer to this decoder's `Hello`, resent on every heartbeat until
//! then), what this decoder has for it waits in a queue: a request
//! cancelled there is never sent, so it ends at once. Of an authentic
//! prefiller, a `CancelAck` or `Failed` counts only for a request that was
//! sent to it and that it has not ended yet: a prefiller cannot end
//! another's part of a request, and a duplicate or replay ends nothing.
//! A lease is taken only from this decoder's own pool
//! ([`PagePool`]), and a request writes the pages the pool holds for it.

use crate::auth::Keys;
use crate::layout::source_imm_count;
use crate::liveness::{Beat, PeerClock};
use crate::pages::{ForeignLease, PageLease, PagePool};
use crate::wire::{Auth, Failure, KvRequest, Msg};
use crate::{HeadMap, Heartbeat, KvError, KvLayout, PeerLoss, RankSource};
use std::collections::BTreeMap;
use std::time::Instant;
use weft::{GroupAddress, ImmCounts, MrDesc};

/// A prefiller known to a decoder (index into its peer table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PrefillerId(pub u32);

/// One prefiller's part of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The prefiller.
    pub prefiller: PrefillerId,
    /// Its heads → this decoder's heads.
    pub heads: Vec<HeadMap>,
    /// Whether it writes the tail.
    pub tail: bool,
}

/// Where a request's KV comes from: every head of the decoder's cache from
/// exactly one source, the tail from exactly one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The sources.
    pub sources: Vec<Source>,
}

impl Route {
    /// All `kv_heads` heads (identity map) and the tail from one prefiller.
    pub fn single(prefiller: PrefillerId, kv_heads: u32) -> Self {
        Route {
            sources: vec![Source {
                prefiller,
                heads: (0..kv_heads).map(|h| HeadMap { src: h, dst: h }).collect(),
                tail: true,
            }],
        }
    }

    /// A route from a [`TpShape::plan`](crate::TpShape::plan) entry, with
    /// `prefillers[r]` the id of prefill rank `r`.
    pub fn from_plan(plan: &[RankSource], prefillers: &[PrefillerId]) -> Result<Self, KvError> {
        let sources = plan
            .iter()
            .map(|s| {
                let p = prefillers.get(s.prefill_rank as usize).ok_or_else(|| {
                    KvError::InvalidRoute {
                        what: format!("no prefiller for prefill rank {}", s.prefill_rank),
                    }
                })?;
                Ok(Source {
                    prefiller: *p,
                    heads: s.heads.clone(),
                    tail: s.tail,
                })
            })
            .collect::<Result<_, KvError>>()?;
        Ok(Route { sources })
    }
}

/// What the driver must do.
#[derive(Debug, Clone)]
pub enum DecAction {
    /// SEND `msg` to `to`, framed with `auth`.
    Send {
        /// Destination.
        to: GroupAddress,
        /// The frame's proof and grant.
        auth: Auth,
        /// Message.
        msg: Msg,
    },
    /// Request `id` ended: free its immediate, report `result`.
    Finish {
        /// Request id.
        id: u64,
        /// Its immediate.
        imm: u32,
        /// Outcome.
        result: Result<(), KvError>,
    },
    /// Prefiller `peer` is dead: remove it from the engine
    /// (`TransferEngine::remove_peer`), so that its connection state is
    /// freed and nothing reaches that incarnation any more.
    Forget {
        /// The dead prefiller.
        peer: GroupAddress,
    },
}

/// A request [`DecoderCore::begin`] started.
#[derive(Debug)]
pub struct Started {
    /// Request id.
    pub id: u64,
    /// Immediates to expect (arm before running `actions`).
    pub imm_count: u64,
    /// The request messages to send.
    pub actions: Vec<DecAction>,
}

#[derive(Debug, Clone)]
struct Peer {
    addr: GroupAddress,
    clock: PeerClock,
    /// The prefiller's grant to this decoder, from its first authentic
    /// frame: the proof of every frame sent to it.
    theirs: Option<u64>,
    /// Messages waiting for `theirs`.
    queue: Vec<Msg>,
}

#[derive(Debug, Clone)]
struct SourceState {
    peer: usize,
    /// No write of this source can land any more.
    quiet: bool,
}

#[derive(Debug, Clone)]
struct Req {
    lease: u64,
    imm: u32,
    sources: Vec<SourceState>,
    /// `Some(outcome)` once the request is stopping: reported when every
    /// source is quiet.
    stopping: Option<KvError>,
    /// Immediates seen arriving so far (liveness).
    arrived: u64,
}

/// The decoder's state machine.
#[derive(Debug, Clone)]
pub struct DecoderCore {
    me: GroupAddress,
    keys: Keys,
    /// Frames dropped: from strangers, unauthentic, or answers that count
    /// for no request.
    dropped: u64,
    layout: KvLayout,
    kv: Vec<MrDesc>,
    tail: Option<MrDesc>,
    hb: Heartbeat,
    peers: Vec<Peer>,
    by_addr: BTreeMap<GroupAddress, usize>,
    pool: PagePool,
    reqs: BTreeMap<u64, Req>,
    next_id: u64,
}

impl DecoderCore {
    /// A decoder `me` whose registered cache (`layout`) is described by `kv`
    /// (one region for every layer, or one per layer) and `tail` (when the
    /// layout has a tail).
    pub fn new(
        me: GroupAddress,
        layout: KvLayout,
        kv: Vec<MrDesc>,
        tail: Option<MrDesc>,
        hb: Heartbeat,
    ) -> Result<Self, KvError> {
        layout.validate()?;
        if kv.len() != 1 && kv.len() as u64 != u64::from(layout.layers) {
            return Err(KvError::Layout {
                what: format!(
                    "{} KV descriptors for {} layers: one, or one per layer",
                    kv.len(),
                    layout.layers
                ),
            });
        }
        if layout.tail_len > 0 && tail.is_none() {
            return Err(KvError::Layout {
                what: "the layout has a tail but no tail descriptor was given".into(),
            });
        }
        Ok(Self {
            me,
            keys: Keys::random(),
            dropped: 0,
            layout,
            kv,
            tail,
            hb,
            peers: Vec::new(),
            by_addr: BTreeMap::new(),
            pool: PagePool::new(layout.num_pages, layout.tail_slots),
            reqs: BTreeMap::new(),
            next_id: 1,
        })
    }

    /// Derives its grants from a key drawn from `seed` instead of the OS's
    /// randomness (tests and models). Call before adding prefillers.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.keys = Keys::seeded(seed);
        self
    }

    /// Frames dropped so far: from strangers, unauthentic, or answers that
    /// count for no request (duplicates, replays, another prefiller's).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Whether prefiller `p` has proven itself (its first authentic frame
    /// came): until then what is sent to it waits.
    pub fn prefiller_ready(&self, p: PrefillerId) -> bool {
        self.peers
            .get(p.0 as usize)
            .is_some_and(|x| x.theirs.is_some())
    }

    /// This decoder's address.
    pub fn address(&self) -> &GroupAddress {
        &self.me
    }

    /// The cache layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The page pool.
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// Requests not yet finished.
    pub fn pending(&self) -> usize {
        self.reqs.len()
    }

    /// Adds a prefiller (or returns the id it already has) and greets it.
    pub fn add_prefiller(
        &mut self,
        addr: GroupAddress,
        now: Instant,
    ) -> (PrefillerId, Vec<DecAction>) {
        if let Some(&i) = self.by_addr.get(&addr) {
            return (PrefillerId(i as u32), Vec::new());
        }
        let i = self.peers.len();
        self.peers.push(Peer {
            addr: addr.clone(),
            clock: PeerClock::new(now),
            theirs: None,
            queue: Vec::new(),
        });
        self.by_addr.insert(addr, i);
        (PrefillerId(i as u32), vec![self.hello(i, now)])
    }

    /// A `Hello` to `peer` (proof: its grant if known).
    fn hello(&mut self, peer: usize, now: Instant) -> DecAction {
        let grant = self.keys.grant(&self.peers[peer].addr);
        let p = &mut self.peers[peer];
        p.clock.sent(now);
        DecAction::Send {
            to: p.addr.clone(),
            auth: Auth {
                proof: p.theirs.unwrap_or(0),
                grant,
            },
            msg: Msg::Hello,
        }
    }

    /// The address of a prefiller.
    pub fn prefiller_address(&self, p: PrefillerId) -> Option<&GroupAddress> {
        self.peers.get(p.0 as usize).map(|x| &x.addr)
    }

    /// Why a prefiller is dead, if it is.
    pub fn prefiller_dead(&self, p: PrefillerId) -> Option<&PeerLoss> {
        self.peers.get(p.0 as usize).and_then(|x| x.clock.dead())
    }

    /// Takes `pages` pages and a tail slot.
    pub fn alloc(&mut self, pages: u32) -> Result<PageLease, KvError> {
        self.pool.alloc(pages)
    }

    /// Takes exactly `pages` (the serving stack's own block ids) and a tail
    /// slot: [`PagePool::alloc_pages`].
    pub fn alloc_pages(&mut self, pages: &[u32]) -> Result<PageLease, KvError> {
        self.pool.alloc_pages(pages)
    }

    /// Frees a lease: its pages return at once, or — if a request on it is
    /// in flight — that request is cancelled and they return once every
    /// prefiller confirmed. A lease of another decoder is dropped with a
    /// warning, this decoder's leases untouched ([`Self::try_free`] gives
    /// it back).
    pub fn free(&mut self, lease: PageLease, now: Instant) -> Vec<DecAction> {
        self.try_free(lease, now).unwrap_or_else(|e| {
            tracing::warn!("decoder: {e}: not freed here");
            Vec::new()
        })
    }

    /// [`Self::free`], giving a lease of another decoder back.
    pub fn try_free(
        &mut self,
        lease: PageLease,
        now: Instant,
    ) -> Result<Vec<DecAction>, ForeignLease> {
        Ok(match self.pool.free(lease)? {
            Some(id) => self.cancel(id, now),
            None => Vec::new(),
        })
    }

    fn check_route(&self, route: &Route) -> Result<(), KvError> {
        let bad = |what: String| Err(KvError::InvalidRoute { what });
        if route.sources.is_empty() {
            return bad("no source".into());
        }
        let mut seen = vec![false; self.layout.kv_heads as usize];
        let mut tails = 0;
        let mut peers = std::collections::BTreeSet::new();
        for s in &route.sources {
            let Some(peer) = self.peers.get(s.prefiller.0 as usize) else {
                return bad(format!("unknown prefiller {:?}", s.prefiller));
            };
            if let Some(loss) = peer.clock.dead() {
                return Err(KvError::PeerDead {
                    peer: peer.addr.clone(),
                    loss: loss.clone(),
                });
            }
            if !peers.insert(s.prefiller) {
                return bad(format!("prefiller {:?} twice", s.prefiller));
            }
            for hm in &s.heads {
                match seen.get_mut(hm.dst as usize) {
                    Some(x) if !*x => *x = true,
                    Some(_) => return bad(format!("decoder head {} twice", hm.dst)),
                    None => return bad(format!("decoder head {} out of range", hm.dst)),
                }
            }
            tails += usize::from(s.tail);
        }
        if let Some(h) = seen.iter().position(|x| !x) {
            return bad(format!("decoder head {h} has no source"));
        }
        // Without a tail in the layout, the sources' tail flags mean nothing.
        if self.layout.tail_len > 0 && tails != 1 {
            return bad(format!("{tails} tail sources, want 1"));
        }
        Ok(())
    }

    /// Starts a request on `lease` along `route`, with immediate `imm`.
    /// `counts` are the decoder engine's immediate-count parameters.
    pub fn begin(
        &mut self,
        route: &Route,
        lease: &PageLease,
        imm: u32,
        counts: &ImmCounts,
        meta: &[u8],
        now: Instant,
    ) -> Result<Started, KvError> {
        self.check_route(route)?;
        let id = self.next_id;
        // The pages are the pool's record of the lease, never the caller's.
        let (pages, tail_slot) = {
            let (p, t) = self.pool.start(lease, id)?;
            (p.to_vec(), t)
        };
        let imm_count = match self.imm_count(route, &pages, counts) {
            Ok(c) => c,
            Err(e) => {
                self.pool.end(lease.id());
                return Err(e);
            }
        };
        self.next_id += 1;
        let n = pages.len();
        let mut actions = Vec::with_capacity(route.sources.len());
        let mut sources = Vec::with_capacity(route.sources.len());
        for s in &route.sources {
            let peer = s.prefiller.0 as usize;
            sources.push(SourceState { peer, quiet: false });
            let req = KvRequest {
                id,
                layout: self.layout,
                kv: self.kv.clone(),
                tail: self.tail.clone(),
                heads: s.heads.clone(),
                pages: pages.clone(),
                tail_slot: (s.tail && self.layout.tail_len > 0).then_some(tail_slot),
                imm,
                meta: meta.to_vec(),
            };
            actions.extend(self.send(peer, Msg::Request(req), now));
        }
        self.reqs.insert(
            id,
            Req {
                lease: lease.id(),
                imm,
                sources,
                stopping: None,
                arrived: 0,
            },
        );
        tracing::debug!(id, pages = n, imm, imm_count, "decoder: request");
        Ok(Started {
            id,
            imm_count,
            actions,
        })
    }

    /// Immediates a request of `pages` along `route` produces.
    fn imm_count(&self, route: &Route, pages: &[u32], counts: &ImmCounts) -> Result<u64, KvError> {
        let n = u32::try_from(pages.len()).map_err(|_| KvError::Layout {
            what: "too many pages".into(),
        })?;
        let mut imm_count = 0u64;
        for s in &route.sources {
            let heads = u32::try_from(s.heads.len()).unwrap_or(u32::MAX);
            let c = source_imm_count(counts, &self.layout, heads, n, s.tail)?;
            imm_count = imm_count.checked_add(c).ok_or_else(|| KvError::Layout {
                what: "immediate count overflows".into(),
            })?;
        }
        Ok(imm_count)
    }

    /// `msg` to `peer`: a send, or queued until the peer proved itself.
    fn send(&mut self, peer: usize, msg: Msg, now: Instant) -> Option<DecAction> {
        let grant = self.keys.grant(&self.peers[peer].addr);
        let p = &mut self.peers[peer];
        let Some(proof) = p.theirs else {
            p.queue.push(msg);
            return None;
        };
        p.clock.sent(now);
        Some(DecAction::Send {
            to: p.addr.clone(),
            auth: Auth { proof, grant },
            msg,
        })
    }

    /// The immediate count of request `id` was reached (all its bytes are in
    /// place) or its round failed.
    pub fn on_imms(&mut self, id: u64, result: Result<(), weft::EngineError>) -> Vec<DecAction> {
        let Some(r) = self.reqs.remove(&id) else {
            return Vec::new(); // stale: finished already
        };
        self.pool.end(r.lease);
        let result = result.map_err(KvError::engine("immediate count"));
        vec![DecAction::Finish {
            id,
            imm: r.imm,
            result,
        }]
    }

    /// Cancels request `id`: it ends with [`KvError::Cancelled`] once every
    /// live prefiller confirmed (or with `Ok` if all its data lands first).
    pub fn cancel(&mut self, id: u64, now: Instant) -> Vec<DecAction> {
        self.stop(id, KvError::Cancelled { request: id }, now, None)
    }

    /// Ends `id`, whose request messages were never sent (arming its
    /// immediate count failed), with `why`.
    pub fn abort_unsent(&mut self, id: u64, why: KvError) -> Vec<DecAction> {
        let Some(r) = self.reqs.remove(&id) else {
            return Vec::new();
        };
        self.pool.end(r.lease);
        vec![DecAction::Finish {
            id,
            imm: r.imm,
            result: Err(why),
        }]
    }

    /// Stops `id` with outcome `why`: asks every source not yet quiet (except
    /// `skip`) to cancel.
    fn stop(&mut self, id: u64, why: KvError, now: Instant, skip: Option<usize>) -> Vec<DecAction> {
        let mut out = Vec::new();
        let targets: Vec<usize> = match self.reqs.get_mut(&id) {
            Some(r) if r.stopping.is_none() => {
                r.stopping = Some(why);
                r.sources
                    .iter()
                    .filter(|s| !s.quiet && Some(s.peer) != skip)
                    .map(|s| s.peer)
                    .collect()
            }
            _ => return out,
        };
        for peer in targets {
            if self.peers[peer].clock.dead().is_some() {
                continue;
            }
            let q = &mut self.peers[peer].queue;
            let queued = q.len();
            q.retain(|m| !matches!(m, Msg::Request(r) if r.id == id));
            if q.len() < queued {
                // never sent: nothing of it can land
                self.quiet(id, peer);
            } else {
                out.extend(self.send(peer, Msg::Cancel { id }, now));
            }
        }
        out.extend(self.settle(id));
        out
    }

    /// Finishes `id` if it is stopping and every source is quiet.
    fn settle(&mut self, id: u64) -> Vec<DecAction> {
        let done = self
            .reqs
            .get(&id)
            .is_some_and(|r| r.stopping.is_some() && r.sources.iter().all(|s| s.quiet));
        if !done {
            return Vec::new();
        }
        let Some(r) = self.reqs.remove(&id) else {
            return Vec::new();
        };
        self.pool.end(r.lease);
        let why = r.stopping.unwrap_or(KvError::ShutDown);
        vec![DecAction::Finish {
            id,
            imm: r.imm,
            result: Err(why),
        }]
    }

    fn quiet(&mut self, id: u64, peer: usize) {
        if let Some(r) = self.reqs.get_mut(&id) {
            for s in r.sources.iter_mut().filter(|s| s.peer == peer) {
                s.quiet = true;
            }
        }
    }

    /// Whether `peer` is a source of request `id` that has not ended its
    /// part yet.
    fn live_source(&self, id: u64, peer: usize) -> bool {
        self.reqs
            .get(&id)
            .is_some_and(|r| r.sources.iter().any(|s| s.peer == peer && !s.quiet))
    }

    /// A frame arrived claiming to be from `from`, with `auth`.
    pub fn on_msg(
        &mut self,
        from: &GroupAddress,
        auth: Auth,
        msg: Msg,
        now: Instant,
    ) -> Vec<DecAction> {
        let Some(&peer) = self.by_addr.get(from) else {
            self.dropped += 1;
            if crate::auth::loud(self.dropped) {
                tracing::warn!(
                    ?from,
                    dropped = self.dropped,
                    "decoder: message from an unknown peer"
                );
            }
            return Vec::new();
        };
        if self.peers[peer].clock.dead().is_some() {
            return Vec::new(); // declared dead: its requests are settled
        }
        let grant = self.keys.grant(from);
        if auth.proof != grant {
            if matches!(msg, Msg::Hello) {
                // Echo the claimed grant: the real prefiller finds its own.
                self.peers[peer].clock.sent(now);
                return vec![DecAction::Send {
                    to: from.clone(),
                    auth: Auth {
                        proof: auth.grant,
                        grant,
                    },
                    msg: Msg::Hello,
                }];
            }
            tracing::debug!(?from, "decoder: unauthentic frame dropped");
            self.dropped += 1;
            return Vec::new();
        }
        self.peers[peer].clock.heard(now);
        let mut out = Vec::new();
        if self.peers[peer].theirs.is_none() {
            self.peers[peer].theirs = Some(auth.grant);
            let queued = std::mem::take(&mut self.peers[peer].queue);
            if queued.is_empty() {
                // so that the prefiller learns this decoder's grant now
                out.extend(self.send(peer, Msg::Heartbeat, now));
            }
            for m in queued {
                out.extend(self.send(peer, m, now));
            }
        }
        match msg {
            Msg::Heartbeat | Msg::Hello => {}
            Msg::CancelAck { id } => {
                let stopping = self.reqs.get(&id).is_some_and(|r| r.stopping.is_some());
                if stopping && self.live_source(id, peer) {
                    self.quiet(id, peer);
                    out.extend(self.settle(id));
                } else {
                    tracing::debug!(id, "decoder: cancel confirmation for no cancel dropped");
                    self.dropped += 1;
                }
            }
            Msg::Failed { id, failure } => {
                if !self.live_source(id, peer) {
                    tracing::debug!(
                        id,
                        ?from,
                        "decoder: failure of a request not in flight there dropped"
                    );
                    self.dropped += 1;
                    return out;
                }
                self.quiet(id, peer);
                let addr = self.peers[peer].addr.clone();
                let err = match failure {
                    Failure::Refused(refusal) => KvError::Refused {
                        request: id,
                        peer: addr,
                        refusal,
                    },
                    Failure::Write { step, error } => KvError::TransferFailed {
                        request: id,
                        peer: addr,
                        step,
                        error,
                    },
                };
                out.extend(self.stop(id, err, now, Some(peer)));
                out.extend(self.settle(id));
            }
            other => {
                tracing::warn!(?from, "decoder: unexpected message {other:?}");
            }
        }
        out
    }

    /// A SEND to `to` failed: it is dead.
    pub fn on_send_failed(
        &mut self,
        to: &GroupAddress,
        error: String,
        now: Instant,
    ) -> Vec<DecAction> {
        match self.by_addr.get(to) {
            Some(&peer) => self.peer_dead(peer, PeerLoss::SendFailed { error }, now),
            None => Vec::new(),
        }
    }

    /// Prefiller `addr` is gone (`loss` says how, e.g. its rendezvous
    /// record left): its requests fail with [`KvError::PrefillerDead`] and
    /// no new request goes to it. Nothing if unknown or already dead.
    pub fn prefiller_gone(
        &mut self,
        addr: &GroupAddress,
        loss: PeerLoss,
        now: Instant,
    ) -> Vec<DecAction> {
        match self.by_addr.get(addr) {
            Some(&peer) if self.peers[peer].clock.dead().is_none() => {
                self.peer_dead(peer, loss, now)
            }
            _ => Vec::new(),
        }
    }

    fn peer_dead(&mut self, peer: usize, loss: PeerLoss, now: Instant) -> Vec<DecAction> {
        self.peers[peer].clock.kill(loss.clone(), now);
        self.fail_peer(peer, loss, now)
    }

    fn fail_peer(&mut self, peer: usize, loss: PeerLoss, now: Instant) -> Vec<DecAction> {
        let addr = self.peers[peer].addr.clone();
        self.peers[peer].queue.clear();
        tracing::warn!(peer = ?addr, "decoder: prefiller dead: {loss}");
        // A dead peer's pending writes are dropped (weft's peer-death
        // contract): none of its writes can land any more.
        let ids: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.sources.iter().any(|s| s.peer == peer))
            .map(|(&id, _)| id)
            .collect();
        let mut out = Vec::new();
        for id in ids {
            self.quiet(id, peer);
            let err = KvError::PrefillerDead {
                request: id,
                peer: addr.clone(),
                loss: loss.clone(),
            };
            out.extend(self.stop(id, err, now, Some(peer)));
            out.extend(self.settle(id));
        }
        out.push(DecAction::Forget { peer: addr });
        out
    }

    /// Requests in flight and their immediates (for [`Self::progress`]).
    pub fn in_flight(&self) -> Vec<(u64, u32)> {
        self.reqs.iter().map(|(&id, r)| (id, r.imm)).collect()
    }

    /// `arrived` immediates of request `id` have arrived so far. Growth is
    /// a sign of life of its source (when it has only one: the writes of a
    /// busy link may hold its heartbeats back).
    pub fn progress(&mut self, id: u64, arrived: u64, now: Instant) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if arrived > r.arrived {
            r.arrived = arrived;
            if let [s] = &r.sources[..] {
                self.peers[s.peer].clock.heard(now);
            }
        }
    }

    /// Heartbeats due and silent peers declared dead at `now`.
    pub fn tick(&mut self, now: Instant) -> Vec<DecAction> {
        let mut out = Vec::new();
        for peer in 0..self.peers.len() {
            match self.peers[peer].clock.tick(now, &self.hb) {
                Beat::Idle => {}
                // not proven yet: greet it again (a first Hello may have
                // been dropped, e.g. while its older incarnation lived)
                Beat::Send if self.peers[peer].theirs.is_none() => out.push(self.hello(peer, now)),
                Beat::Send => out.extend(self.send(peer, Msg::Heartbeat, now)),
                Beat::Dead(loss) => out.extend(self.fail_peer(peer, loss, now)),
            }
        }
        out
    }

    /// Ends every request with [`KvError::ShutDown`] (the engine is going
    /// away, so nothing can land any more).
    pub fn shutdown(&mut self) -> Vec<DecAction> {
        let reqs = std::mem::take(&mut self.reqs);
        reqs.into_iter()
            .map(|(id, r)| {
                self.pool.end(r.lease);
                DecAction::Finish {
                    id,
                    imm: r.imm,
                    result: Err(KvError::ShutDown),
                }
            })
            .collect()
    }
}
