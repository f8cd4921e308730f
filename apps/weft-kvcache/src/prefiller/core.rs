//! The prefiller's clock-free state machine: the decoders it serves and
//! their liveness, and every request from its arrival until none of its
//! writes can land any more. Steps `0..layers` are the layers' paged writes,
//! step `layers` the tail (when the request's source writes it).
//!
//! ## Who may say what
//! A frame is taken only from the decoder it names, proven by its
//! [`Auth`] (see the crate docs): an unauthentic `Hello` gets at most a
//! `Hello` back, to the address it names, and only if no other incarnation
//! is alive at that address's NICs (a stranger's claim to be a decoder's
//! next incarnation is not believed while the decoder lives: a send to
//! the newer incarnation would make the engine drop the live one); any
//! other unauthentic frame is dropped. A request is keyed by its decoder
//! and the decoder's id, so a decoder can only ever cancel its own.
//!
//! Per decoder, the ids it used are remembered in a window
//! ([`ID_WINDOW`](crate::ID_WINDOW) ids above a floor that follows the contiguous ones):
//! - a `Cancel` before its `Request` is confirmed at once and remembered;
//!   the `Request`, when it comes, is answered `CancelAck` again and never
//!   served (the decoder may have reused its pages already);
//! - a `Request` whose id is being served or was served is a duplicate or
//!   a replay: dropped, unanswered (a `Failed` for it would end the one
//!   being served at the decoder while its writes go on);
//! - a `Request` at or below the floor (the window overflowed past it) is
//!   refused [`Refusal::Stale`], never served;
//! - the window goes with the decoder's entry (ten heartbeat timeouts
//!   after its death); a dead decoder's later frames are ignored until
//!   then, and after that whatever they ask fails at the engine, which
//!   never writes to a removed incarnation.
//!
//! Every request taken ends exactly once ([`PreAction::Finish`]), and the
//! decoder is told (`CancelAck` or `Failed`) unless it is dead.

pub use super::actions::{Incoming, PreAction, TaskKey, Write};

use super::checks::refusal;
use super::ids::{Dec, IdState, Ids, Seen};
use crate::auth::Keys;
use crate::layout::layer_pages;
use crate::liveness::{Beat, PeerClock};
use crate::regions::layer_region;
use crate::wire::{Auth, Failure, KvRequest, Msg};
use crate::{Heartbeat, KvError, KvLayout, PeerLoss, Refusal};
use std::collections::BTreeMap;
use std::time::Instant;
use weft::GroupAddress;

/// Unauthentic `Hello`s answered per heartbeat tick at most: a stranger
/// cannot make the prefiller send more than this on its behalf.
const HELLO_REPLIES_PER_TICK: u32 = 64;

#[derive(Debug, Clone)]
enum Stop {
    Cancelled,
    Failed(Failure),
    DecoderDead(PeerLoss),
    ShutDown,
}

#[derive(Debug, Clone)]
struct Task {
    req: KvRequest,
    /// `Some` once accepted: source pages and tail slot.
    src: Option<(Vec<u32>, u32)>,
    steps: u32,
    ready: u32,
    posted: u32,
    in_flight: u32,
    stop: Option<Stop>,
}

/// The prefiller's state machine.
#[derive(Debug, Clone)]
pub struct PrefillerCore {
    layout: KvLayout,
    hb: Heartbeat,
    keys: Keys,
    decoders: BTreeMap<GroupAddress, Dec>,
    tasks: BTreeMap<TaskKey, Task>,
    /// Unauthentic `Hello`s still answered before the next tick.
    hello_budget: u32,
    /// Frames dropped: unauthentic, duplicate or replayed.
    dropped: u64,
    /// Most requests held at once (`KvConfig::max_pending_requests`).
    max_pending: usize,
    /// Most decoders known at once, dead ones kept included
    /// (`KvConfig::max_decoders`).
    max_decoders: usize,
    closing: bool,
}

/// Heartbeat timeouts a dead decoder is kept for after its death (and while
/// it has requests left), so that its late messages are ignored; after
/// that they reach a new entry,
/// and the engine, which never writes to a removed incarnation again,
/// fails whatever they ask.
const DEAD_KEPT: u32 = 10;

fn step_name(layers: u32, step: u32) -> String {
    if step < layers {
        format!("layer {step}")
    } else {
        "tail".into()
    }
}

impl PrefillerCore {
    /// A prefiller whose source cache has `layout`.
    pub fn new(layout: KvLayout, hb: Heartbeat) -> Result<Self, KvError> {
        layout.validate()?;
        Ok(Self {
            layout,
            hb,
            keys: Keys::random(),
            decoders: BTreeMap::new(),
            tasks: BTreeMap::new(),
            hello_budget: HELLO_REPLIES_PER_TICK,
            dropped: 0,
            max_pending: crate::KvConfig::default().max_pending_requests,
            max_decoders: crate::KvConfig::default().max_decoders,
            closing: false,
        })
    }

    /// Derives its grants from a key drawn from `seed` instead of the OS's
    /// randomness (tests and models). Call before any message.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.keys = Keys::seeded(seed);
        self
    }

    /// Frames dropped so far: unauthentic, from a decoder's claimed other
    /// incarnation, from one decoder too many, duplicates and replays.
    /// (Dropped frames are logged at warn only at the 1st, 2nd, 4th, ...
    /// drop: a flood cannot flood the log.)
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Holds at most `max` requests at once (at least 1); more are refused
    /// with [`Refusal::Busy`]. Default 4096.
    pub fn with_max_pending(mut self, max: usize) -> Self {
        self.max_pending = max.max(1);
        self
    }

    /// Knows at most `max` decoders at once (at least 1), dead ones still
    /// kept included; a message from one more is dropped. Default 4096.
    pub fn with_max_decoders(mut self, max: usize) -> Self {
        self.max_decoders = max.max(1);
        self
    }

    /// Decoders known now (live, and dead ones still kept).
    pub fn decoders(&self) -> usize {
        self.decoders.len()
    }

    /// Whether decoder `d` has requests held.
    fn has_tasks(&self, d: &GroupAddress) -> bool {
        self.tasks
            .range(
                TaskKey {
                    decoder: d.clone(),
                    id: 0,
                }..,
            )
            .next()
            .is_some_and(|(k, _)| &k.decoder == d)
    }

    /// Forgets dead decoders with no request left that died at least
    /// `keep` before `now`.
    fn prune_dead(&mut self, now: Instant, keep: std::time::Duration) {
        let gone: Vec<GroupAddress> = self
            .decoders
            .iter()
            .filter(|(a, d)| {
                d.clock
                    .died()
                    .is_some_and(|d| now.saturating_duration_since(d) >= keep)
                    && !self.has_tasks(a)
            })
            .map(|(a, _)| a.clone())
            .collect();
        for a in &gone {
            self.decoders.remove(a);
        }
    }

    /// Forgets the dead decoder with no request left that died first, to
    /// make room for a new one; whether there was one.
    fn forget_one_dead(&mut self) -> bool {
        let oldest = self
            .decoders
            .iter()
            .filter_map(|(a, d)| Some((d.clock.died()?, a)))
            .filter(|(_, a)| !self.has_tasks(a))
            .min_by_key(|(d, _)| *d)
            .map(|(_, a)| a.clone());
        match oldest {
            Some(a) => {
                self.decoders.remove(&a);
                true
            }
            None => false,
        }
    }

    /// The source cache layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Requests not yet finished.
    pub fn pending(&self) -> usize {
        self.tasks.len()
    }

    /// Steps of `key` (layers, plus the tail), if known.
    pub fn steps(&self, key: &TaskKey) -> Option<u32> {
        self.tasks.get(key).map(|t| t.steps)
    }

    /// A frame arrived claiming to be from `from`, with `auth`.
    pub fn on_msg(
        &mut self,
        from: &GroupAddress,
        auth: Auth,
        msg: Msg,
        now: Instant,
    ) -> Vec<PreAction> {
        let grant = self.keys.grant(from);
        if auth.proof != grant {
            return self.unauthentic(from, auth, grant, msg);
        }
        match self.decoders.get_mut(from) {
            Some(d) if d.clock.dead().is_some() => return Vec::new(),
            Some(d) => d.clock.heard(now),
            None => {
                if let Some(live) = self.other_incarnation(from) {
                    self.dropped += 1;
                    if crate::auth::loud(self.dropped) {
                        tracing::warn!(decoder = ?from, ?live, dropped = self.dropped, "prefiller: frame of another incarnation of a live decoder dropped");
                    }
                    return Vec::new();
                }
                // Anyone who holds an address can speak from it: a
                // bounded number of decoders, dead ones with nothing left
                // making room first.
                if !self.room_for_decoder() {
                    self.dropped += 1;
                    if crate::auth::loud(self.dropped) {
                        tracing::warn!(decoder = ?from, max = self.max_decoders, dropped = self.dropped, "prefiller: message from a new decoder dropped: too many decoders");
                    }
                    return Vec::new();
                }
                self.decoders.insert(
                    from.clone(),
                    Dec {
                        clock: PeerClock::new(now),
                        theirs: auth.grant,
                        ids: Ids::default(),
                    },
                );
            }
        }
        match msg {
            Msg::Hello | Msg::Heartbeat => Vec::new(),
            Msg::Request(req) => self.on_request(from, req, now),
            Msg::Cancel { id } => self.on_cancel(from, id, now),
            other => {
                tracing::warn!(?from, "prefiller: unexpected message {other:?}");
                Vec::new()
            }
        }
    }

    /// A frame whose proof is not this prefiller's grant for its sender:
    /// a `Hello` is answered (echoing the claimed grant, so that the real
    /// holder of `from` can prove itself), the rest dropped.
    fn unauthentic(
        &mut self,
        from: &GroupAddress,
        auth: Auth,
        grant: u64,
        msg: Msg,
    ) -> Vec<PreAction> {
        if !matches!(msg, Msg::Hello) {
            tracing::debug!(?from, "prefiller: unauthentic frame dropped");
            self.dropped += 1;
            return Vec::new();
        }
        if self
            .decoders
            .get(from)
            .is_some_and(|d| d.clock.dead().is_some())
        {
            return Vec::new();
        }
        if let Some(live) = self.other_incarnation(from) {
            self.dropped += 1;
            if crate::auth::loud(self.dropped) {
                tracing::warn!(claimed = ?from, ?live, dropped = self.dropped, "prefiller: hello naming another incarnation of a live decoder dropped");
            }
            return Vec::new();
        }
        if self.hello_budget == 0 {
            self.dropped += 1;
            return Vec::new();
        }
        self.hello_budget -= 1;
        vec![PreAction::Send {
            to: from.clone(),
            auth: Auth {
                proof: auth.grant,
                grant,
            },
            msg: Msg::Hello,
        }]
    }

    /// A live decoder of another incarnation at one of `addr`'s NICs.
    fn other_incarnation(&self, addr: &GroupAddress) -> Option<GroupAddress> {
        self.decoders
            .iter()
            .find(|(a, d)| {
                a.incarnation != addr.incarnation
                    && d.clock.dead().is_none()
                    && a.nics.iter().any(|n| addr.nics.contains(n))
            })
            .map(|(a, _)| a.clone())
    }

    fn on_request(&mut self, from: &GroupAddress, req: KvRequest, now: Instant) -> Vec<PreAction> {
        let id = req.id;
        let k = TaskKey {
            decoder: from.clone(),
            id,
        };
        if self.tasks.contains_key(&k) {
            tracing::debug!(id, "prefiller: duplicate request dropped");
            self.dropped += 1;
            return Vec::new();
        }
        let Some(d) = self.decoders.get_mut(from) else {
            return Vec::new();
        };
        match d.ids.state(id) {
            IdState::Seen(Seen::Taken) => {
                tracing::debug!(id, "prefiller: replayed request dropped");
                self.dropped += 1;
                return Vec::new();
            }
            IdState::Seen(Seen::Cancelled) => {
                // Its cancel came first and was confirmed: never served.
                d.ids.mark(id, Seen::Taken);
                tracing::debug!(id, "prefiller: request after its cancel");
                return vec![self.send(from, Msg::CancelAck { id }, Some(now))];
            }
            IdState::Old(floor) => {
                let r = Refusal::Stale { id, floor };
                tracing::warn!(id, "prefiller: refused: {r}");
                let failure = Failure::Refused(r);
                return vec![self.send(from, Msg::Failed { id, failure }, Some(now))];
            }
            IdState::New => d.ids.mark(id, Seen::Taken),
        }
        let refusal = if self.closing {
            Some(Refusal::ShuttingDown)
        } else if self.tasks.len() >= self.max_pending {
            Some(Refusal::Busy {
                max: self.max_pending as u64,
            })
        } else {
            refusal(&self.layout, &req, from.incarnation)
        };
        if let Some(r) = refusal {
            tracing::warn!(id, "prefiller: refused: {r}");
            let failure = Failure::Refused(r);
            return vec![self.send(from, Msg::Failed { id, failure }, Some(now))];
        }
        let inc = Incoming {
            key: k.clone(),
            pages: u32::try_from(req.pages.len()).unwrap_or(u32::MAX),
            heads: req.heads.clone(),
            tail: req.tail_slot.is_some(),
            meta: req.meta.clone(),
        };
        let steps = self.layout.layers + u32::from(req.tail_slot.is_some());
        self.tasks.insert(
            k,
            Task {
                req,
                src: None,
                steps,
                ready: 0,
                posted: 0,
                in_flight: 0,
                stop: None,
            },
        );
        vec![PreAction::Incoming(inc)]
    }

    fn on_cancel(&mut self, from: &GroupAddress, id: u64, now: Instant) -> Vec<PreAction> {
        let k = TaskKey {
            decoder: from.clone(),
            id,
        };
        if let Some(t) = self.tasks.get_mut(&k) {
            if t.stop.is_none() {
                t.stop = Some(Stop::Cancelled);
            }
            return self.settle(&k, Some(now));
        }
        if let Some(d) = self.decoders.get_mut(from) {
            if let IdState::New = d.ids.state(id) {
                // Before its request: remembered, so that the request is
                // never served; nothing of it can land, so confirm now.
                d.ids.mark(id, Seen::Cancelled);
            }
        }
        // Unknown, finished or cancelled before: nothing of it can land.
        vec![self.send(from, Msg::CancelAck { id }, Some(now))]
    }

    fn send(&mut self, to: &GroupAddress, msg: Msg, now: Option<Instant>) -> PreAction {
        let grant = self.keys.grant(to);
        let proof = match self.decoders.get_mut(to) {
            Some(d) => {
                if let Some(now) = now {
                    d.clock.sent(now);
                }
                d.theirs
            }
            None => 0,
        };
        PreAction::Send {
            to: to.clone(),
            auth: Auth { proof, grant },
            msg,
        }
    }

    /// The application accepts `key`, whose KV is in its cache's pages
    /// `src_pages` (prompt order) and whose tail is in `tail_slot`.
    pub fn accept(
        &mut self,
        key: &TaskKey,
        src_pages: &[u32],
        tail_slot: u32,
    ) -> Result<(), KvError> {
        let not_incoming = || KvError::NotIncoming {
            request: key.id,
            peer: key.decoder.clone(),
        };
        let t = self.tasks.get_mut(key).ok_or_else(not_incoming)?;
        if t.src.is_some() || t.stop.is_some() {
            return Err(not_incoming());
        }
        let bad = |what: String| KvError::InvalidSourcePages {
            request: key.id,
            what,
        };
        if src_pages.len() != t.req.pages.len() {
            return Err(bad(format!(
                "{} source pages for {} destination pages",
                src_pages.len(),
                t.req.pages.len()
            )));
        }
        if let Some(p) = src_pages.iter().find(|&&p| p >= self.layout.num_pages) {
            return Err(bad(format!("source page {p} of {}", self.layout.num_pages)));
        }
        if t.req.tail_slot.is_some() && self.layout.tail_offset(tail_slot).is_none() {
            return Err(bad(format!("source tail slot {tail_slot}")));
        }
        t.src = Some((src_pages.to_vec(), tail_slot));
        Ok(())
    }

    /// The application refuses `key`.
    pub fn reject(&mut self, key: &TaskKey, reason: String, now: Instant) -> Vec<PreAction> {
        match self.tasks.get(key) {
            Some(t) if t.src.is_none() && t.stop.is_none() => {}
            _ => return Vec::new(),
        }
        self.tasks.remove(key);
        let failure = Failure::Refused(Refusal::Rejected { reason });
        vec![self.send(
            &key.decoder,
            Msg::Failed {
                id: key.id,
                failure,
            },
            Some(now),
        )]
    }

    /// Steps `0..ready` of `key` are computed (a layer-done call, or the
    /// watcher word's new value): posts those not yet posted. A finished
    /// request is ignored (a late watcher update).
    pub fn ready(&mut self, key: &TaskKey, ready: u64) -> Result<Vec<PreAction>, KvError> {
        let Some(t) = self.tasks.get_mut(key) else {
            return Ok(Vec::new());
        };
        if ready > u64::from(t.steps) {
            return Err(KvError::StepOutOfRange {
                request: key.id,
                step: ready,
                steps: u64::from(t.steps),
            });
        }
        t.ready = t.ready.max(ready as u32);
        let mut out = Vec::new();
        if t.stop.is_some() {
            return Ok(out);
        }
        let Some((src_pages, tail_slot)) = &t.src else {
            return Err(KvError::NotIncoming {
                request: key.id,
                peer: key.decoder.clone(),
            });
        };
        let l = &self.layout;
        while t.posted < t.ready {
            let step = t.posted;
            let write = if step < l.layers {
                let Some(((dst, dst_pages), src)) = layer_pages(
                    l,
                    &t.req.layout,
                    step,
                    &t.req.heads,
                    src_pages,
                    &t.req.pages,
                )
                .and_then(|(src, d)| Some((layer_region(&t.req.kv, step, d)?, src))) else {
                    // The request's checks make this unreachable; should
                    // it happen, the request still ends, answered.
                    t.stop = Some(Stop::Failed(Failure::Refused(Refusal::BadPages {
                        what: format!("{} has no page set", step_name(l.layers, step)),
                    })));
                    break;
                };
                Write::Layer {
                    layer: step,
                    page_len: l.page_len,
                    src,
                    dst,
                    dst_pages,
                    imm: t.req.imm,
                }
            } else {
                let slot = t.req.tail_slot.unwrap_or(0);
                let Some(dst) = t.req.tail.clone() else {
                    // The request's checks make this unreachable too.
                    t.stop = Some(Stop::Failed(Failure::Refused(Refusal::BadPages {
                        what: "no tail region".into(),
                    })));
                    break;
                };
                Write::Tail {
                    len: l.tail_len,
                    src_off: l.tail_offset(*tail_slot).unwrap_or(0),
                    dst,
                    dst_off: t.req.layout.tail_offset(slot).unwrap_or(0),
                    imm: t.req.imm,
                }
            };
            t.posted += 1;
            t.in_flight += 1;
            out.push(PreAction::Post {
                key: key.clone(),
                step,
                write,
            });
        }
        let stopped = t.stop.is_some();
        if stopped {
            out.extend(self.settle(key, None));
        }
        Ok(out)
    }

    /// A posted step completed (`Ok`: delivered).
    pub fn on_posted(
        &mut self,
        key: &TaskKey,
        step: u32,
        result: Result<(), String>,
        now: Instant,
    ) -> Vec<PreAction> {
        let layers = self.layout.layers;
        let Some(t) = self.tasks.get_mut(key) else {
            return Vec::new();
        };
        t.in_flight = t.in_flight.saturating_sub(1);
        if result.is_ok() {
            // delivered: the decoder is alive (its heartbeats may wait
            // behind these writes on a busy link)
            if let Some(d) = self.decoders.get_mut(&key.decoder) {
                d.clock.heard(now);
            }
        }
        if let Err(error) = result {
            tracing::warn!(id = key.id, step, "prefiller: write failed: {error}");
            if t.stop.is_none() || matches!(t.stop, Some(Stop::Cancelled)) {
                t.stop = Some(Stop::Failed(Failure::Write {
                    step: step_name(layers, step),
                    error,
                }));
            }
        }
        self.settle(key, Some(now))
    }

    /// Ends `key` if nothing of it is in flight and it is complete or stopping.
    fn settle(&mut self, key: &TaskKey, now: Option<Instant>) -> Vec<PreAction> {
        let Some(t) = self.tasks.get(key) else {
            return Vec::new();
        };
        let complete = t.stop.is_none() && t.posted == t.steps;
        if t.in_flight > 0 || !(complete || t.stop.is_some()) {
            return Vec::new();
        }
        let Some(t) = self.tasks.remove(key) else {
            return Vec::new();
        };
        let (id, peer) = (key.id, key.decoder.clone());
        let mut out = Vec::new();
        let result = match t.stop {
            None => Ok(()),
            Some(Stop::Cancelled) => {
                out.push(self.send(&peer, Msg::CancelAck { id }, now));
                Err(KvError::Cancelled { request: id })
            }
            Some(Stop::Failed(f)) => {
                let err = match &f {
                    Failure::Refused(r) => KvError::Refused {
                        request: id,
                        peer: peer.clone(),
                        refusal: r.clone(),
                    },
                    Failure::Write { step, error } => KvError::TransferFailed {
                        request: id,
                        peer: peer.clone(),
                        step: step.clone(),
                        error: error.clone(),
                    },
                };
                out.push(self.send(&peer, Msg::Failed { id, failure: f }, now));
                Err(err)
            }
            Some(Stop::DecoderDead(loss)) => Err(KvError::DecoderDead {
                request: id,
                peer,
                loss,
            }),
            Some(Stop::ShutDown) => {
                let f = Failure::Refused(Refusal::ShuttingDown);
                out.push(self.send(&peer, Msg::Failed { id, failure: f }, now));
                Err(KvError::ShutDown)
            }
        };
        out.push(PreAction::Finish {
            key: key.clone(),
            result,
        });
        out
    }

    fn stop_where(
        &mut self,
        now: Instant,
        pick: impl Fn(&TaskKey) -> bool,
        why: impl Fn() -> Stop,
    ) -> Vec<PreAction> {
        let keys: Vec<TaskKey> = self.tasks.keys().filter(|k| pick(k)).cloned().collect();
        let mut out = Vec::new();
        for k in keys {
            if let Some(t) = self.tasks.get_mut(&k) {
                if t.stop.is_none() || matches!(t.stop, Some(Stop::Cancelled)) {
                    t.stop = Some(why());
                }
            }
            out.extend(self.settle(&k, Some(now)));
        }
        out
    }

    /// A SEND to decoder `to` failed: it is dead.
    pub fn on_send_failed(
        &mut self,
        to: &GroupAddress,
        error: String,
        now: Instant,
    ) -> Vec<PreAction> {
        let loss = PeerLoss::SendFailed { error };
        let killed = self
            .decoders
            .get_mut(to)
            .is_some_and(|d| d.clock.kill(loss.clone(), now));
        if killed {
            self.decoder_dead(to.clone(), loss, now)
        } else {
            Vec::new()
        }
    }

    /// Decoder `addr` is gone (`loss` says how, e.g. its rendezvous record
    /// left): its requests stop ([`KvError::DecoderDead`]), nothing more is
    /// written to it and its later messages are ignored (for ten heartbeat
    /// timeouts, and while it has requests left; see
    /// [`KvConfig::max_decoders`](crate::KvConfig)).
    pub fn decoder_gone(
        &mut self,
        addr: &GroupAddress,
        loss: PeerLoss,
        now: Instant,
    ) -> Vec<PreAction> {
        if !self.decoders.contains_key(addr) && !self.room_for_decoder() {
            // Never heard from, and no room to remember it: nothing of it
            // to stop, and its messages, if any come, meet the bound.
            return Vec::new();
        }
        let d = self.decoders.entry(addr.clone()).or_insert_with(|| Dec {
            clock: PeerClock::new(now),
            theirs: 0,
            ids: Ids::default(),
        });
        if d.clock.kill(loss.clone(), now) {
            self.decoder_dead(addr.clone(), loss, now)
        } else {
            Vec::new()
        }
    }

    /// Whether one more decoder may be remembered: under
    /// `max_decoders`, or a dead one with nothing left was forgotten to
    /// make room.
    fn room_for_decoder(&mut self) -> bool {
        self.decoders.len() < self.max_decoders || self.forget_one_dead()
    }

    fn decoder_dead(&mut self, d: GroupAddress, loss: PeerLoss, now: Instant) -> Vec<PreAction> {
        tracing::warn!(decoder = ?d, "prefiller: decoder dead: {loss}");
        let mut out = self.stop_where(now, |k| k.decoder == d, || Stop::DecoderDead(loss.clone()));
        out.push(PreAction::Forget { peer: d });
        out
    }

    /// Heartbeats due and silent decoders declared dead at `now`.
    pub fn tick(&mut self, now: Instant) -> Vec<PreAction> {
        let mut out = Vec::new();
        let mut dead = Vec::new();
        self.hello_budget = HELLO_REPLIES_PER_TICK;
        for (addr, d) in self.decoders.iter_mut() {
            match d.clock.tick(now, &self.hb) {
                Beat::Idle => {}
                Beat::Send => out.push(PreAction::Send {
                    to: addr.clone(),
                    auth: Auth {
                        proof: d.theirs,
                        grant: self.keys.grant(addr),
                    },
                    msg: Msg::Heartbeat,
                }),
                Beat::Dead(loss) => dead.push((addr.clone(), loss)),
            }
        }
        for (addr, loss) in dead {
            out.extend(self.decoder_dead(addr, loss, now));
        }
        // A dead decoder is kept (its late messages ignored) while it has
        // requests left and for `DEAD_KEPT` heartbeat timeouts after its
        // death.
        self.prune_dead(now, self.hb.timeout.saturating_mul(DEAD_KEPT));
        out
    }

    /// Refuses new requests and stops every request (they end once their
    /// posted writes completed; decoders are told).
    pub fn shutdown(&mut self, now: Instant) -> Vec<PreAction> {
        self.closing = true;
        self.stop_where(now, |_| true, || Stop::ShutDown)
    }
}
