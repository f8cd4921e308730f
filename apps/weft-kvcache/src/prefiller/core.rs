//! The prefiller's clock-free state machine: the decoders it serves and
//! their liveness, and every request from its arrival until none of its
//! writes can land any more. Steps `0..layers` are the layers' paged writes,
//! step `layers` the tail (when the request's source writes it).

use crate::layout::layer_pages;
use crate::liveness::{Beat, PeerClock};
use crate::wire::{Failure, KvRequest, Msg};
use crate::{HeadMap, Heartbeat, KvError, KvLayout, PeerLoss, Refusal};
use std::collections::BTreeMap;
use std::time::Instant;
use weft::{GroupAddress, MrDesc, Pages};

/// A request, named by its decoder and the decoder's id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskKey {
    /// The decoder.
    pub decoder: GroupAddress,
    /// Its request id.
    pub id: u64,
}

/// A request waiting for the application to accept it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    /// Which request.
    pub key: TaskKey,
    /// Pages of the prompt (per head).
    pub pages: u32,
    /// Heads to send (this rank's `src` → the decoder's `dst`).
    pub heads: Vec<HeadMap>,
    /// Whether this prefiller writes the tail.
    pub tail: bool,
    /// The decoder's application data.
    pub meta: Vec<u8>,
}

/// One write to post.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// A layer's paged write.
    Layer {
        /// Layer.
        layer: u32,
        /// Page bytes.
        page_len: u64,
        /// Source pages in this prefiller's KV region.
        src: Pages,
        /// Destination region.
        dst: MrDesc,
        /// Destination pages.
        dst_pages: Pages,
        /// Immediate.
        imm: u32,
    },
    /// The tail.
    Tail {
        /// Bytes.
        len: u64,
        /// Offset in this prefiller's tail region.
        src_off: u64,
        /// Destination region.
        dst: MrDesc,
        /// Offset in it.
        dst_off: u64,
        /// Immediate.
        imm: u32,
    },
}

/// What the driver must do.
#[derive(Debug, Clone)]
pub enum PreAction {
    /// SEND `msg` to `to`.
    Send {
        /// Destination.
        to: GroupAddress,
        /// Message.
        msg: Msg,
    },
    /// Tell the application about a new request.
    Incoming(Incoming),
    /// Post step `step` of `key`; report it with [`PrefillerCore::on_posted`].
    Post {
        /// Request.
        key: TaskKey,
        /// Step.
        step: u32,
        /// The write.
        write: Write,
    },
    /// The request ended (none of its writes can land any more).
    Finish {
        /// Request.
        key: TaskKey,
        /// Outcome.
        result: Result<(), KvError>,
    },
    /// Decoder `peer` is dead: remove it from the engine
    /// (`TransferEngine::remove_peer`), so that its connection state is
    /// freed and nothing reaches that incarnation any more. Writes to it
    /// still posted resolve as the engine's peer removal says.
    Forget {
        /// The dead decoder.
        peer: GroupAddress,
    },
}

#[derive(Debug, Clone)]
enum Stop {
    Cancelled,
    Failed(Failure),
    DecoderDead(PeerLoss),
    ShutDown,
}

#[derive(Debug)]
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
pub struct PrefillerCore {
    layout: KvLayout,
    hb: Heartbeat,
    decoders: BTreeMap<GroupAddress, PeerClock>,
    tasks: BTreeMap<TaskKey, Task>,
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
            decoders: BTreeMap::new(),
            tasks: BTreeMap::new(),
            max_pending: crate::KvConfig::default().max_pending_requests,
            max_decoders: crate::KvConfig::default().max_decoders,
            closing: false,
        })
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
            .filter(|(a, c)| {
                c.died()
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
            .filter_map(|(a, c)| Some((c.died()?, a)))
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

    fn refuse(&self, req: &KvRequest) -> Option<Refusal> {
        let (me, d) = (&self.layout, &req.layout);
        if d.layers != me.layers || d.page_len != me.page_len {
            return Some(Refusal::LayoutMismatch {
                what: format!(
                    "decoder {} layers of {} B pages, prefiller {} of {} B",
                    d.layers, d.page_len, me.layers, me.page_len
                ),
            });
        }
        if req.tail_slot.is_some() && d.tail_len != me.tail_len {
            return Some(Refusal::LayoutMismatch {
                what: format!("tail {} B vs {} B", d.tail_len, me.tail_len),
            });
        }
        for hm in &req.heads {
            if hm.src >= me.kv_heads {
                return Some(Refusal::HeadOutOfRange {
                    head: hm.src,
                    heads: me.kv_heads,
                    side: "prefill".into(),
                });
            }
            if hm.dst >= d.kv_heads {
                return Some(Refusal::HeadOutOfRange {
                    head: hm.dst,
                    heads: d.kv_heads,
                    side: "decode".into(),
                });
            }
        }
        // Each decoder head at most once (the decoder checks its own routes
        // the same way). Without this, a short request repeating one head
        // map thousands of times would make the per-layer index lists
        // (heads x pages) as long as a whole cache.
        let mut dsts: Vec<u32> = req.heads.iter().map(|hm| hm.dst).collect();
        dsts.sort_unstable();
        if let Some(w) = dsts.windows(2).find(|w| w[0] == w[1]) {
            return Some(Refusal::DuplicateHead { head: w[0] });
        }
        if req.pages.is_empty() || req.heads.is_empty() {
            return Some(Refusal::BadPages {
                what: "no pages or no heads".into(),
            });
        }
        if let Some(p) = req.pages.iter().find(|&&p| p >= d.num_pages) {
            return Some(Refusal::BadPages {
                what: format!("page {p} of {}", d.num_pages),
            });
        }
        if req.tail_slot.is_some_and(|s| s >= d.tail_slots) {
            return Some(Refusal::BadPages {
                what: "tail slot out of range".into(),
            });
        }
        None
    }

    /// A message arrived from `from`.
    pub fn on_msg(&mut self, from: &GroupAddress, msg: Msg, now: Instant) -> Vec<PreAction> {
        match self.decoders.get_mut(from) {
            Some(c) if c.dead().is_some() => return Vec::new(),
            Some(c) => c.heard(now),
            None => {
                // Anyone who can send to this engine can name any address:
                // a bounded number of decoders, dead ones with nothing left
                // making room first.
                if !self.room_for_decoder() {
                    tracing::warn!(decoder = ?from, max = self.max_decoders, "prefiller: message from a new decoder dropped: too many decoders");
                    return Vec::new();
                }
                self.decoders.insert(from.clone(), PeerClock::new(now));
            }
        }
        let key = |id| TaskKey {
            decoder: from.clone(),
            id,
        };
        match msg {
            Msg::Hello | Msg::Heartbeat => Vec::new(),
            Msg::Request(req) => {
                let k = key(req.id);
                let refusal = if self.closing {
                    Some(Refusal::ShuttingDown)
                } else if self.tasks.contains_key(&k) {
                    Some(Refusal::Duplicate)
                } else if self.tasks.len() >= self.max_pending {
                    Some(Refusal::Busy {
                        max: self.max_pending as u64,
                    })
                } else {
                    self.refuse(&req)
                };
                if let Some(r) = refusal {
                    tracing::warn!(id = req.id, "prefiller: refused: {r}");
                    return vec![self.send(
                        from,
                        Msg::Failed {
                            id: req.id,
                            failure: Failure::Refused(r),
                        },
                        now,
                    )];
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
            Msg::Cancel { id } => {
                let k = key(id);
                match self.tasks.get_mut(&k) {
                    Some(t) => {
                        if t.stop.is_none() {
                            t.stop = Some(Stop::Cancelled);
                        }
                        self.settle(&k, now)
                    }
                    // Unknown or finished: nothing of it can land any more.
                    None => vec![self.send(from, Msg::CancelAck { id }, now)],
                }
            }
            other => {
                tracing::warn!(?from, "prefiller: unexpected message {other:?}");
                Vec::new()
            }
        }
    }

    fn send(&mut self, to: &GroupAddress, msg: Msg, now: Instant) -> PreAction {
        if let Some(c) = self.decoders.get_mut(to) {
            c.sent(now);
        }
        PreAction::Send {
            to: to.clone(),
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
            now,
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
                let Some((src, dst_pages)) = layer_pages(
                    l,
                    &t.req.layout,
                    step,
                    &t.req.heads,
                    src_pages,
                    &t.req.pages,
                ) else {
                    t.stop = Some(Stop::Failed(Failure::Write {
                        step: step_name(l.layers, step),
                        error: "page set out of range".into(),
                    }));
                    break;
                };
                Write::Layer {
                    layer: step,
                    page_len: l.page_len,
                    src,
                    dst: t.req.kv.clone(),
                    dst_pages,
                    imm: t.req.imm,
                }
            } else {
                let slot = t.req.tail_slot.unwrap_or(0);
                Write::Tail {
                    len: l.tail_len,
                    src_off: l.tail_offset(*tail_slot).unwrap_or(0),
                    dst: t.req.tail.clone(),
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
            if let Some(c) = self.decoders.get_mut(&key.decoder) {
                c.heard(now);
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
        self.settle(key, now)
    }

    /// Ends `key` if nothing of it is in flight and it is complete or stopping.
    fn settle(&mut self, key: &TaskKey, now: Instant) -> Vec<PreAction> {
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
            out.extend(self.settle(&k, now));
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
            .is_some_and(|c| c.kill(loss.clone(), now));
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
        let clock = self
            .decoders
            .entry(addr.clone())
            .or_insert_with(|| PeerClock::new(now));
        if clock.kill(loss.clone(), now) {
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
        for (addr, c) in self.decoders.iter_mut() {
            match c.tick(now, &self.hb) {
                Beat::Idle => {}
                Beat::Send => out.push(PreAction::Send {
                    to: addr.clone(),
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
