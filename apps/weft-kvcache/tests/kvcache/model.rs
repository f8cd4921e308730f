//! The KvCache protocol checked in every order (stateright, breadth-first):
//! two decoders and two prefillers — the real [`DecoderCore`]s and
//! [`PrefillerCore`]s, stepped by a model of the network and the engines —
//! with a network that delivers any frame or write in flight in any order,
//! duplicates or replays frames, and carries frames a third party forged.
//!
//! The scenario: decoder 0 asks for one prompt from both prefillers
//! (prefiller 0: head 0 and the tail; prefiller 1: head 1), then, once that
//! ended, frees its lease and asks prefiller 0 alone for a second prompt
//! on a fresh lease (the same page and immediate come back); decoder 1 asks
//! prefiller 1 for one prompt. Two layers, one page each. Each decoder may
//! cancel each request at any time. The prefiller applications accept at
//! once and report layers one at a time.
//!
//! Invariants, in every state:
//! - a write lands only on pages the decoder's pool holds for that
//!   request's lease, while that request has not ended at the decoder (so
//!   never after its cancel was confirmed or its lease freed), and only
//!   for a request the decoder made;
//! - a request completes only once every write of every source landed, and
//!   fails only through a prefiller it was sent to;
//! - each request ends exactly once on each side;
//! - nothing is ever sent to an address that merely shares a NIC with a
//!   real process (the engine would drop the real one for it);
//! - every state in which nothing can happen any more has every request
//!   of every live process ended (liveness at quiescence).
//!
//! What the model shortens: a write's landing, its completion at the
//! prefiller and the decoder's immediate callback are one step; writes
//! that fail (a peer dead or removed) report at once, in one order; the
//! handshakes are done before the first step (the forged `Hello`s still
//! race the rest); time is not modelled (a peer's death is found by an
//! explicit step, which heartbeats would take).
//!
//! Bounds: each run below says what it adds to the scenario (decoder 1's
//! request, one duplicate or replay, one forged frame, one crash or false
//! suspicion); a run prints its bounds with its state count and time.
//! `manual::probe` (ignored) runs other bounds from the environment: `DUPS`,
//! `FORGED`, `DEATHS` (counts), `SECOND`, `CANCELS`, `OTHER` (0 or 1).

use crate::sans_io::{addr, counts, desc};
use stateright::{Checker, Model, Property};
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};
use weft::GroupAddress;
use weft_kvcache::wire::Failure;
use weft_kvcache::{
    Auth, DecAction, DecoderCore, HeadMap, HeadOrder, Heartbeat, KvError, KvLayout, KvRequest, Msg,
    PageLease, PeerLoss, PreAction, PrefillerCore, PrefillerId, Refusal, Route, Source, Write,
};

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    kv_heads: 2,
    page_len: 64,
    tail_len: 8,
    num_pages: 2,
    tail_slots: 1,
    order: HeadOrder::HeadsBeforePages,
};

const HB: Heartbeat = Heartbeat {
    interval: Duration::from_secs(10),
    timeout: Duration::from_secs(100),
};

const DECODERS: usize = 2;
const PREFILLERS: usize = 2;

fn dec_addr(d: usize) -> GroupAddress {
    addr(100 + d as u8)
}

fn pre_addr(p: usize) -> GroupAddress {
    addr(1 + p as u8)
}

/// A process, as a network destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Node {
    Dec(usize),
    Pre(usize),
}

/// Something in flight.
#[derive(Debug, Clone)]
enum Item {
    /// A SEND.
    Frame {
        to: Node,
        from: GroupAddress,
        auth: Auth,
        msg: Box<Msg>,
    },
    /// A write.
    Write(W),
}

/// A write of prefiller `p`'s request `(d, id)`, step `step`: `imms`
/// immediates `imm` at decoder `d`, onto its pages `pages`.
#[derive(Debug, Clone)]
struct W {
    p: usize,
    d: usize,
    id: u64,
    step: u32,
    imm: u32,
    imms: u64,
    pages: Vec<u32>,
}

/// A request as its decoder's application sees it.
#[derive(Debug, Clone)]
struct ReqInfo {
    lease: u64,
    /// (prefiller, steps it writes)
    sources: Vec<(usize, u32)>,
    done: bool,
    cancelled: bool,
}

#[derive(Debug, Clone)]
struct Dec {
    core: DecoderCore,
    alive: bool,
    /// Requests begun so far.
    begun: u8,
    lease: Option<PageLease>,
    reqs: BTreeMap<u64, ReqInfo>,
    /// The engine's immediate counters: arrivals since the value was last
    /// freed, and the round armed on it.
    counts: BTreeMap<u32, u64>,
    armed: BTreeMap<u32, (u64, u64)>,
    /// Immediates freed (the engine hands out the last freed first).
    freed_imms: Vec<u32>,
    next_imm: u32,
    /// Prefillers this decoder's engine removed.
    removed: BTreeSet<usize>,
    /// Prefillers found dead (by the model's detector).
    gave_up: BTreeSet<usize>,
}

#[derive(Debug, Clone)]
struct Pre {
    core: PrefillerCore,
    alive: bool,
    /// Accepted requests not ended: (decoder, id) → (steps ready, steps).
    tasks: BTreeMap<(usize, u64), (u32, u32)>,
    ended: BTreeSet<(usize, u64)>,
    removed: BTreeSet<usize>,
    gave_up: BTreeSet<usize>,
    /// What its frames to each decoder carry (for a prefiller that lies).
    auth_to: BTreeMap<usize, Auth>,
}

/// Bounds of one run.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    /// Frames delivered and kept in flight (duplicates, later replays).
    dups: u8,
    /// Forged frames injected.
    forged: u8,
    /// Crashes and false suspicions.
    deaths: u8,
    /// Whether decoder 0 makes its second request.
    second: bool,
    /// Whether decoder 0 cancels its first request.
    cancels: bool,
    /// Whether decoder 1 makes its request (else it only knows prefiller
    /// 1, and strangers can name it).
    other: bool,
}

#[derive(Debug, Clone)]
struct Sys {
    decs: Vec<Dec>,
    pres: Vec<Pre>,
    /// In flight, sorted by fingerprint (a canonical multiset).
    net: Vec<(u64, Item)>,
    left: Bounds,
    /// (decoder, request, prefiller, step) writes that landed.
    landed: BTreeSet<(usize, u64, usize, u32)>,
    violation: Option<String>,
    /// The clock of every step (the cores are clock-free; time is not
    /// modelled).
    t: Instant,
    /// Scenario marks, for the `sometimes` properties.
    seen: BTreeSet<&'static str>,
    fp: u64,
}

impl Hash for Sys {
    fn hash<H: Hasher>(&self, h: &mut H) {
        h.write_u64(self.fp);
    }
}

impl PartialEq for Sys {
    fn eq(&self, o: &Self) -> bool {
        self.fp == o.fp
    }
}

/// A 64-bit fingerprint of what `Debug` prints (two multiply-rotate lanes
/// over 8-byte words, folded with splitmix64's finaliser): fast at the
/// test profile's opt-level, and, at a few hundred thousand states, a
/// collision (which would merge two states) is a ~1e-9 chance.
fn fingerprint(x: &impl std::fmt::Debug) -> u64 {
    use std::fmt::Write as _;
    thread_local! {
        static BUF: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    }
    BUF.with(|b| {
        let mut b = b.borrow_mut();
        b.clear();
        let _ = write!(b, "{x:?}");
        let bytes = b.as_bytes();
        let (mut h1, mut h2) = (0x243f_6a88_85a3_08d3u64, 0x1319_8a2e_0370_7344u64);
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let w = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
            h1 = (h1 ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
            h2 = (h2 ^ w.rotate_left(17)).wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (h2 >> 31);
        }
        for &c in words.remainder() {
            h1 = (h1 ^ u64::from(c)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
        let mix = |mut z: u64| {
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        mix(h1 ^ bytes.len() as u64) ^ mix(h2).rotate_left(32)
    })
}

#[derive(Debug, Clone, PartialEq)]
enum Act {
    Deliver(usize),
    DeliverKeep(usize),
    Begin(usize),
    Cancel(usize, u64),
    Ready(usize, usize, u64),
    Crash(Node),
    /// Decoder `d` finds prefiller `p` dead (a crash found, or suspicion).
    DecGivesUp(usize, usize),
    /// Prefiller `p` finds decoder `d` dead.
    PreGivesUp(usize, usize),
}

struct KvModel {
    bounds: Bounds,
    t0: Instant,
}

fn node_of(a: &GroupAddress) -> Option<Node> {
    (0..DECODERS)
        .find(|&d| *a == dec_addr(d))
        .map(Node::Dec)
        .or_else(|| (0..PREFILLERS).find(|&p| *a == pre_addr(p)).map(Node::Pre))
}

/// A real process sharing a NIC with `a` but not its incarnation.
fn shadows(a: &GroupAddress) -> bool {
    let real = (0..DECODERS)
        .map(dec_addr)
        .chain((0..PREFILLERS).map(pre_addr));
    real.into_iter()
        .any(|r| r != *a && r.nics.iter().any(|n| a.nics.contains(n)))
}

/// The prefiller behind decoder `d`'s `PrefillerId(i)`: decoder 0 added
/// prefillers 0 and 1, decoder 1 only prefiller 1.
fn pre_of(d: usize, i: PrefillerId) -> usize {
    if d == 0 {
        i.0 as usize
    } else {
        1
    }
}

/// Whether decoder `d` added prefiller `p`.
fn knows(d: usize, p: usize) -> bool {
    d == 0 || p == 1
}

impl KvModel {
    /// Whether decoder `d` takes part (decoder 1 only when it asks).
    fn active(&self, d: usize) -> bool {
        d == 0 || self.bounds.other
    }
}

fn loss() -> PeerLoss {
    PeerLoss::Left {
        store: "model".into(),
    }
}

impl Sys {
    fn push(&mut self, item: Item) {
        let f = fingerprint(&item);
        let at = self.net.partition_point(|(g, _)| *g < f);
        self.net.insert(at, (f, item));
    }

    fn bad(&mut self, what: String) {
        if self.violation.is_none() {
            self.violation = Some(what);
        }
    }

    fn seal(&mut self) {
        self.fp = 0;
        self.fp = fingerprint(self);
    }

    /// Runs decoder `d`'s actions.
    fn dec_actions(&mut self, d: usize, acts: Vec<DecAction>) {
        for a in acts {
            match a {
                DecAction::Send { to, auth, msg } => match node_of(&to) {
                    Some(node @ Node::Pre(_)) => self.push(Item::Frame {
                        to: node,
                        from: dec_addr(d),
                        auth,
                        msg: Box::new(msg),
                    }),
                    _ if shadows(&to) => self.bad(format!("decoder {d} sent to {to:?}")),
                    _ => {}
                },
                DecAction::Finish { id, imm, result } => {
                    let dec = &mut self.decs[d];
                    let Some(r) = dec.reqs.get_mut(&id) else {
                        self.bad(format!("decoder {d} ended unknown request {id}"));
                        continue;
                    };
                    if r.done {
                        self.bad(format!("decoder {d} ended request {id} twice"));
                        continue;
                    }
                    r.done = true;
                    let sources = r.sources.clone();
                    // a request fails only through a peer it was sent to
                    let blamed = match &result {
                        Err(
                            KvError::Refused { peer, .. }
                            | KvError::TransferFailed { peer, .. }
                            | KvError::PrefillerDead { peer, .. },
                        ) => node_of(peer),
                        _ => None,
                    };
                    if let Some(Node::Pre(bp)) = blamed {
                        if !sources.iter().any(|&(p, _)| p == bp) {
                            let what = format!(
                                "decoder {d} request {id} failed by prefiller {bp}, not one of its sources: {result:?}"
                            );
                            self.bad(what);
                        }
                    }
                    if result.is_ok() {
                        let landed = &self.landed;
                        let missing: Vec<_> = sources
                            .iter()
                            .flat_map(|&(p, steps)| (0..steps).map(move |s| (p, s)))
                            .filter(|&(p, s)| !landed.contains(&(d, id, p, s)))
                            .collect();
                        if !missing.is_empty() {
                            let what = format!(
                                "decoder {d} request {id} completed with (prefiller, step) {missing:?} not landed"
                            );
                            self.bad(what);
                        }
                        self.seen.insert("a request completed");
                    }
                    // the driver frees the immediate
                    let dec = &mut self.decs[d];
                    dec.counts.remove(&imm);
                    dec.armed.remove(&imm);
                    dec.freed_imms.push(imm);
                }
                DecAction::Forget { peer } => {
                    if let Some(Node::Pre(p)) = node_of(&peer) {
                        self.decs[d].removed.insert(p);
                        self.fail_writes(|ip, id| ip == p && id == d);
                    }
                }
            }
        }
    }

    /// Runs prefiller `p`'s actions.
    fn pre_actions(&mut self, p: usize, acts: Vec<PreAction>, t: Instant) {
        let mut queue: std::collections::VecDeque<PreAction> = acts.into();
        while let Some(a) = queue.pop_front() {
            match a {
                PreAction::Send { to, auth, msg } => match node_of(&to) {
                    Some(node @ Node::Dec(d)) => {
                        self.pres[p].auth_to.entry(d).or_insert(auth);
                        if matches!(msg, Msg::CancelAck { .. }) {
                            self.seen.insert("a cancel was confirmed");
                        }
                        self.push(Item::Frame {
                            to: node,
                            from: pre_addr(p),
                            auth,
                            msg: Box::new(msg),
                        });
                    }
                    _ if shadows(&to) => self.bad(format!("prefiller {p} sent to {to:?}")),
                    _ => {}
                },
                PreAction::Incoming(inc) => {
                    let src: Vec<u32> = (0..inc.pages).collect();
                    let pre = &mut self.pres[p];
                    match (
                        node_of(&inc.key.decoder),
                        pre.core.accept(&inc.key, &src, 0),
                    ) {
                        (Some(Node::Dec(d)), Ok(())) => {
                            let steps = pre.core.steps(&inc.key).unwrap_or(0);
                            pre.tasks.insert((d, inc.key.id), (0, steps));
                        }
                        (_, r) => self.bad(format!(
                            "prefiller {p} took a request of {:?}: {r:?}",
                            inc.key.decoder
                        )),
                    }
                }
                PreAction::Post { key, step, write } => {
                    let target = match node_of(&key.decoder) {
                        Some(Node::Dec(d)) => Some(d),
                        _ => None,
                    };
                    let ok = target.is_some_and(|d| {
                        self.decs[d].alive
                            && !self.decs[d].removed.contains(&p)
                            && !self.pres[p].removed.contains(&d)
                    });
                    match (target, ok) {
                        (Some(d), true) => {
                            let (imm, imms, pages) = match &write {
                                Write::Layer { dst_pages, imm, .. } => (
                                    *imm,
                                    counts().paged_writes(
                                        LAYOUT.page_len,
                                        dst_pages.indices.len() as u64,
                                    ),
                                    dst_pages
                                        .indices
                                        .iter()
                                        .map(|i| i % LAYOUT.num_pages)
                                        .collect(),
                                ),
                                Write::Tail { imm, .. } => {
                                    (*imm, counts().single_write(LAYOUT.tail_len), Vec::new())
                                }
                            };
                            self.push(Item::Write(W {
                                p,
                                d,
                                id: key.id,
                                step,
                                imm,
                                imms,
                                pages,
                            }));
                        }
                        _ => {
                            let a =
                                self.pres[p]
                                    .core
                                    .on_posted(&key, step, Err("peer gone".into()), t);
                            queue.extend(a);
                        }
                    }
                }
                PreAction::Finish { key, .. } => {
                    let Some(Node::Dec(d)) = node_of(&key.decoder) else {
                        self.bad(format!("prefiller {p} ended a stranger's request"));
                        continue;
                    };
                    let pre = &mut self.pres[p];
                    pre.tasks.remove(&(d, key.id));
                    if !pre.ended.insert((d, key.id)) {
                        self.bad(format!("prefiller {p} ended ({d}, {}) twice", key.id));
                    }
                }
                PreAction::Forget { peer } => {
                    if let Some(Node::Dec(d)) = node_of(&peer) {
                        self.pres[p].removed.insert(d);
                        self.fail_writes(|ip, id| ip == p && id == d);
                    }
                }
            }
        }
    }

    /// Writes in flight from `p` to `d` (where `which(p, d)`) fail: removed,
    /// reported to their prefillers at once.
    fn fail_writes(&mut self, which: impl Fn(usize, usize) -> bool) {
        let mut failed = Vec::new();
        self.net.retain(|(_, it)| match it {
            Item::Write(w) if which(w.p, w.d) => {
                failed.push((w.p, w.d, w.id, w.step));
                false
            }
            _ => true,
        });
        let t = self.t;
        for (p, d, id, step) in failed {
            if self.pres[p].alive {
                let key = weft_kvcache::TaskKey {
                    decoder: dec_addr(d),
                    id,
                };
                let a = self.pres[p]
                    .core
                    .on_posted(&key, step, Err("removed".into()), t);
                self.pre_actions(p, a, t);
            }
        }
    }

    /// Write `w` lands.
    fn land(&mut self, w: &W) {
        let W {
            p,
            d,
            id,
            step,
            imm,
            imms,
            ref pages,
        } = *w;
        let dec = &self.decs[d];
        let wrong = match dec.reqs.get(&id) {
            None => Some(format!("a write for request {id} decoder {d} never made")),
            Some(r) if r.done => Some(format!(
                "prefiller {p} step {step} of decoder {d} request {id} landed after it ended"
            )),
            Some(r) => pages.iter().find_map(|&pg| {
                let holder = dec.core.pool().holder(pg);
                (holder != Some(r.lease)).then(|| {
                    format!(
                        "page {pg} of decoder {d} written for request {id} but held by {holder:?}"
                    )
                })
            }),
        };
        if let Some(w) = wrong {
            self.bad(w);
        }
        self.landed.insert((d, id, p, step));
        let dec = &mut self.decs[d];
        let c = dec.counts.entry(imm).or_insert(0);
        *c += imms;
        let count = *c;
        if let Some(&(rid, want)) = dec.armed.get(&imm) {
            if count >= want {
                dec.armed.remove(&imm);
                let a = dec.core.on_imms(rid, Ok(()));
                self.dec_actions(d, a);
            }
        }
    }
}

impl KvModel {
    fn init(&self) -> Sys {
        let t = self.t0;
        let decs: Vec<Dec> = (0..DECODERS)
            .map(|d| Dec {
                core: DecoderCore::new(dec_addr(d), LAYOUT, vec![desc()], Some(desc()), HB)
                    .unwrap()
                    .with_seed(10 + d as u64),
                alive: true,
                begun: 0,
                lease: None,
                reqs: BTreeMap::new(),
                counts: BTreeMap::new(),
                armed: BTreeMap::new(),
                freed_imms: Vec::new(),
                next_imm: 0,
                removed: BTreeSet::new(),
                gave_up: BTreeSet::new(),
            })
            .collect();
        let pres: Vec<Pre> = (0..PREFILLERS)
            .map(|p| Pre {
                core: PrefillerCore::new(LAYOUT, HB)
                    .unwrap()
                    .with_seed(20 + p as u64),
                alive: true,
                tasks: BTreeMap::new(),
                ended: BTreeSet::new(),
                removed: BTreeSet::new(),
                gave_up: BTreeSet::new(),
                auth_to: BTreeMap::new(),
            })
            .collect();
        let mut s = Sys {
            decs,
            pres,
            net: Vec::new(),
            left: self.bounds,
            landed: BTreeSet::new(),
            violation: None,
            t,
            seen: BTreeSet::new(),
            fp: 0,
        };
        // Decoder 0 knows both prefillers, decoder 1 prefiller 1; the
        // handshakes run to the end here.
        for (d, ps) in [(0usize, vec![0usize, 1]), (1, vec![1])] {
            for p in ps {
                let (_, a) = s.decs[d].core.add_prefiller(pre_addr(p), t);
                s.dec_actions(d, a);
            }
        }
        while !s.net.is_empty() {
            let (_, it) = s.net.remove(0);
            self.deliver(&mut s, it);
        }
        s.seal();
        s
    }

    fn deliver(&self, s: &mut Sys, it: Item) {
        let t = self.t0;
        match it {
            Item::Frame {
                to,
                from,
                auth,
                msg,
            } => match to {
                Node::Dec(d) if s.decs[d].alive => {
                    let a = s.decs[d].core.on_msg(&from, auth, *msg, t);
                    s.dec_actions(d, a);
                }
                Node::Pre(p) if s.pres[p].alive => {
                    let req = match &*msg {
                        Msg::Request(r) => Some(r.id),
                        _ => None,
                    };
                    let a = s.pres[p].core.on_msg(&from, auth, *msg, t);
                    let after_cancel = a.iter().any(|x| {
                        matches!(x, PreAction::Send { msg: Msg::CancelAck { id }, .. } if Some(*id) == req)
                    });
                    if after_cancel {
                        s.seen.insert("a request came after its cancel");
                    }
                    s.pre_actions(p, a, t);
                }
                _ => {}
            },
            Item::Write(w) => {
                s.land(&w);
                if s.pres[w.p].alive {
                    let key = weft_kvcache::TaskKey {
                        decoder: dec_addr(w.d),
                        id: w.id,
                    };
                    let a = s.pres[w.p].core.on_posted(&key, w.step, Ok(()), t);
                    s.pre_actions(w.p, a, t);
                }
            }
        }
    }

    /// Decoder `d`'s next request: its route, or none.
    fn route(&self, s: &Sys, d: usize) -> Option<Route> {
        let dec = &s.decs[d];
        let all_done = dec.reqs.values().all(|r| r.done);
        match (d, dec.begun) {
            (0, 0) => Some(Route {
                sources: vec![
                    Source {
                        prefiller: PrefillerId(0),
                        heads: vec![HeadMap { src: 0, dst: 0 }],
                        tail: true,
                    },
                    Source {
                        prefiller: PrefillerId(1),
                        heads: vec![HeadMap { src: 1, dst: 1 }],
                        tail: false,
                    },
                ],
            }),
            (0, 1) if self.bounds.second && all_done => Some(Route::single(PrefillerId(0), 2)),
            (1, 0) if self.bounds.other => Some(Route::single(PrefillerId(0), 2)),
            _ => None,
        }
    }

    fn begin(&self, s: &mut Sys, d: usize) {
        let t = self.t0;
        let Some(route) = self.route(s, d) else {
            return;
        };
        let dec = &mut s.decs[d];
        dec.begun += 1;
        if let Some(old) = dec.lease.take() {
            let a = dec.core.free(old, t);
            s.dec_actions(d, a);
        }
        let dec = &mut s.decs[d];
        let lease = dec.core.alloc(1).expect("a page");
        let imm = dec.freed_imms.pop().unwrap_or_else(|| {
            dec.next_imm += 1;
            dec.next_imm - 1
        });
        let st = match dec.core.begin(&route, &lease, imm, &counts(), b"", t) {
            Ok(st) => st,
            Err(e) => {
                // a route to a prefiller found dead: the request is refused
                // before it exists
                dec.freed_imms.push(imm);
                dec.lease = Some(lease);
                let _ = e;
                return;
            }
        };
        let sources = route
            .sources
            .iter()
            .map(|src| {
                let p = pre_of(d, src.prefiller);
                (p, LAYOUT.layers + u32::from(src.tail))
            })
            .collect();
        dec.reqs.insert(
            st.id,
            ReqInfo {
                lease: lease.id(),
                sources,
                done: false,
                cancelled: false,
            },
        );
        dec.lease = Some(lease);
        // early arrivals on a reused immediate count
        let early = dec.counts.get(&imm).copied().unwrap_or(0);
        if early >= st.imm_count {
            let a = dec.core.on_imms(st.id, Ok(()));
            s.dec_actions(d, a);
        } else {
            dec.armed.insert(imm, (st.id, st.imm_count));
        }
        s.dec_actions(d, st.actions);
    }

    /// Forged frame `k` (a third party, or a prefiller lying about a
    /// request it does not serve), if it can be made now.
    fn forged(&self, s: &Sys, k: usize) -> Option<Item> {
        let wrong = Auth {
            proof: 1,
            grant: 77,
        };
        let unproven = Auth {
            proof: 0,
            grant: 77,
        };
        let mut newer = dec_addr(0);
        newer.incarnation = weft::Incarnation(1);
        let refused = Failure::Refused(Refusal::ShuttingDown);
        let (to, from, auth, msg) = match k {
            // a newer incarnation of decoder 0, claimed to prefiller 0
            0 => (Node::Pre(0), newer, unproven, Msg::Hello),
            // decoder 0's name, no proof: a cancel, a request
            1 => (Node::Pre(0), dec_addr(0), wrong, Msg::Cancel { id: 1 }),
            2 => {
                let req = KvRequest {
                    id: 7,
                    layout: LAYOUT,
                    kv: vec![desc()],
                    tail: Some(desc()),
                    heads: vec![HeadMap { src: 0, dst: 0 }],
                    pages: vec![1],
                    tail_slot: None,
                    imm: 0,
                    meta: Vec::new(),
                };
                (Node::Pre(0), dec_addr(0), wrong, Msg::Request(req))
            }
            // prefiller 0's name, no proof: a failure, a confirmation
            3 => {
                let msg = Msg::Failed {
                    id: 1,
                    failure: refused,
                };
                (Node::Dec(0), pre_addr(0), wrong, msg)
            }
            4 => (Node::Dec(0), pre_addr(0), wrong, Msg::CancelAck { id: 1 }),
            // prefiller 1, with its real proof, failing decoder 0's second
            // request and confirming its cancel: that request was sent to
            // prefiller 0 only
            5 => {
                let msg = Msg::Failed {
                    id: 2,
                    failure: refused,
                };
                (Node::Dec(0), pre_addr(1), *s.pres[1].auth_to.get(&0)?, msg)
            }
            6 => {
                let auth = *s.pres[1].auth_to.get(&0)?;
                (Node::Dec(0), pre_addr(1), auth, Msg::CancelAck { id: 2 })
            }
            // an unproven hello in decoder 0's own name
            7 => (Node::Pre(0), dec_addr(0), unproven, Msg::Hello),
            _ => return None,
        };
        Some(Item::Frame {
            to,
            from,
            auth,
            msg: Box::new(msg),
        })
    }

    fn settled(&self, s: &Sys) -> bool {
        s.decs.iter().all(|d| !d.alive || d.core.pending() == 0)
            && s.pres.iter().all(|p| !p.alive || p.core.pending() == 0)
    }
}

const FORGERIES: usize = 8;

impl Model for KvModel {
    type State = Sys;
    type Action = Act;

    fn init_states(&self) -> Vec<Sys> {
        let s = self.init();
        if s.left.forged == 0 {
            return vec![s];
        }
        // A forged frame in flight from the start can arrive at any point:
        // one initial state per forgery.
        (0..FORGERIES)
            .filter_map(|k| {
                let mut s = s.clone();
                let it = self.forged(&s, k)?;
                s.left.forged -= 1;
                s.push(it);
                s.seal();
                Some(s)
            })
            .collect()
    }

    fn actions(&self, s: &Sys, out: &mut Vec<Act>) {
        if s.violation.is_some() {
            return;
        }
        let mut last = None;
        for (i, (f, it)) in s.net.iter().enumerate() {
            if last == Some(*f) {
                continue; // the same item again: the same successors
            }
            last = Some(*f);
            out.push(Act::Deliver(i));
            if s.left.dups > 0 && matches!(it, Item::Frame { .. }) {
                out.push(Act::DeliverKeep(i));
            }
        }
        for d in 0..DECODERS {
            let dec = &s.decs[d];
            if !dec.alive {
                continue;
            }
            if self.route(s, d).is_some() {
                out.push(Act::Begin(d));
            }
            // Decoder 0 may cancel its first request (the one with two
            // sources, whose page and immediate come back for the second).
            if self.bounds.cancels && d == 0 {
                if let Some(r) = dec.reqs.get(&1) {
                    if !r.done && !r.cancelled {
                        out.push(Act::Cancel(d, 1));
                    }
                }
            }
        }
        for p in 0..PREFILLERS {
            if !s.pres[p].alive {
                continue;
            }
            for (&(d, id), &(ready, steps)) in &s.pres[p].tasks {
                if ready < steps {
                    out.push(Act::Ready(p, d, id));
                }
            }
        }

        // Crashes and suspicions: bounded. Finding a crashed peer dead:
        // always possible (heartbeats would).
        for d in 0..DECODERS {
            for p in 0..PREFILLERS {
                if !knows(d, p)
                    || !self.active(d)
                    || !s.decs[d].alive
                    || s.decs[d].gave_up.contains(&p)
                {
                    continue;
                }
                // free when the prefiller is gone or stopped talking to this
                // decoder (it gave it up: no more heartbeats)
                if !s.pres[p].alive || s.pres[p].gave_up.contains(&d) || s.left.deaths > 0 {
                    out.push(Act::DecGivesUp(d, p));
                }
            }
        }
        for p in 0..PREFILLERS {
            for d in 0..DECODERS {
                if !knows(d, p)
                    || !self.active(d)
                    || !s.pres[p].alive
                    || s.pres[p].gave_up.contains(&d)
                {
                    continue;
                }
                if !s.decs[d].alive || s.decs[d].gave_up.contains(&p) || s.left.deaths > 0 {
                    out.push(Act::PreGivesUp(p, d));
                }
            }
        }
        if s.left.deaths > 0 {
            for d in 0..DECODERS {
                if s.decs[d].alive && self.active(d) {
                    out.push(Act::Crash(Node::Dec(d)));
                }
            }
            for p in 0..PREFILLERS {
                if s.pres[p].alive {
                    out.push(Act::Crash(Node::Pre(p)));
                }
            }
        }
    }

    fn next_state(&self, last: &Sys, act: Act) -> Option<Sys> {
        let t = self.t0;
        let mut s = last.clone();
        match act {
            Act::Deliver(i) => {
                let (_, it) = s.net.remove(i);
                self.deliver(&mut s, it);
            }
            Act::DeliverKeep(i) => {
                s.left.dups -= 1;
                let it = s.net[i].1.clone();
                s.seen.insert("a frame was delivered twice");
                self.deliver(&mut s, it);
            }
            Act::Begin(d) => self.begin(&mut s, d),
            Act::Cancel(d, id) => {
                if let Some(r) = s.decs[d].reqs.get_mut(&id) {
                    r.cancelled = true;
                }
                let a = s.decs[d].core.cancel(id, t);
                s.dec_actions(d, a);
            }
            Act::Ready(p, d, id) => {
                let key = weft_kvcache::TaskKey {
                    decoder: dec_addr(d),
                    id,
                };
                let task = s.pres[p].tasks.get_mut(&(d, id))?;
                task.0 += 1;
                let ready = u64::from(task.0);
                match s.pres[p].core.ready(&key, ready) {
                    Ok(a) => s.pre_actions(p, a, t),
                    Err(e) => s.bad(format!("prefiller {p}: ready: {e}")),
                }
            }
            Act::Crash(node) => {
                s.left.deaths -= 1;
                match node {
                    Node::Dec(d) => {
                        s.decs[d].alive = false;
                        // writes to a dead process are dropped; they fail
                        // at their prefillers
                        s.fail_writes(|_, id| id == d);
                    }
                    Node::Pre(p) => {
                        s.pres[p].alive = false;
                        // a dead peer's writes are dropped
                        s.net
                            .retain(|(_, it)| !matches!(it, Item::Write(w) if w.p == p));
                    }
                }
            }
            Act::DecGivesUp(d, p) => {
                if s.pres[p].alive && !s.pres[p].gave_up.contains(&d) {
                    s.left.deaths -= 1;
                    s.seen.insert("a live prefiller was given up");
                }
                s.decs[d].gave_up.insert(p);
                let a = s.decs[d].core.prefiller_gone(&pre_addr(p), loss(), t);
                s.dec_actions(d, a);
            }
            Act::PreGivesUp(p, d) => {
                if s.decs[d].alive && !s.decs[d].gave_up.contains(&p) {
                    s.left.deaths -= 1;
                    s.seen.insert("a live decoder was given up");
                }
                s.pres[p].gave_up.insert(d);
                let a = s.pres[p].core.decoder_gone(&dec_addr(d), loss(), t);
                s.pre_actions(p, a, t);
            }
        }
        s.seal();
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no violation", |_, s: &Sys| s.violation.is_none()),
            Property::always("quiescent states are settled", |m: &KvModel, s: &Sys| {
                let mut a = Vec::new();
                m.actions(s, &mut a);
                !a.is_empty() || s.violation.is_some() || m.settled(s)
            }),
            Property::sometimes("a request completes", |_, s: &Sys| {
                s.seen.contains("a request completed")
            }),
            Property::sometimes("a cancel is confirmed", |_, s: &Sys| {
                s.seen.contains("a cancel was confirmed")
            }),
            Property::sometimes("a request comes after its cancel", |_, s: &Sys| {
                s.seen.contains("a request came after its cancel")
            }),
        ]
    }
}

/// Checks one run; returns (states, unique states).
fn check(name: &str, bounds: Bounds) -> (usize, usize) {
    let m = KvModel {
        bounds,
        t0: Instant::now(),
    };
    // one thread per run: the test harness runs the runs side by side
    let started = Instant::now();
    let c = m.checker().spawn_bfs().join();
    let took = started.elapsed();
    println!(
        "model {name}: {bounds:?}: {} states, {} unique, {:.1} s",
        c.state_count(),
        c.unique_state_count(),
        took.as_secs_f64()
    );
    if let Some(p) = c.discoveries().get("no violation") {
        let last = p.last_state();
        panic!(
            "{name}: {:?}\npath:\n{:#?}",
            last.violation,
            p.clone().into_actions()
        );
    }
    if let Some(p) = c.discoveries().get("quiescent states are settled") {
        panic!(
            "{name}: a quiescent state with requests left\npath:\n{:#?}\nlast:\n{:#?}",
            p.clone().into_actions(),
            p.last_state()
        );
    }
    c.assert_properties();
    (c.state_count(), c.unique_state_count())
}

/// Both decoders ask (decoder 1 from prefiller 1, which serves decoder 0
/// too), decoder 0 twice, cancelling its first request at any point.
#[test]
fn every_order_two_decoders_two_prefillers() {
    check(
        "orders",
        Bounds {
            dups: 0,
            forged: 0,
            deaths: 0,
            second: true,
            cancels: true,
            other: true,
        },
    );
}

/// Decoder 0's two requests with a cancel, any one frame delivered twice
/// (at once, or replayed at any later point). Decoder 1 is known to
/// prefiller 1 but asks for nothing.
#[test]
fn every_order_with_a_duplicate_or_replay() {
    check(
        "duplicates",
        Bounds {
            dups: 1,
            forged: 0,
            deaths: 0,
            second: true,
            cancels: true,
            other: false,
        },
    );
}

/// Decoder 0's two requests with a cancel, and one forged frame in flight
/// from the start (each of the forgeries in turn): a newer incarnation of
/// decoder 0, a cancel, a request, a failure and a confirmation in
/// decoder 0's or prefiller 0's name without proof, prefiller 1 failing
/// and confirming a request it never got, an unproven hello.
#[test]
fn every_order_with_a_forged_frame() {
    check(
        "forgery",
        Bounds {
            dups: 0,
            forged: 1,
            deaths: 0,
            second: true,
            cancels: true,
            other: false,
        },
    );
}

/// Decoder 0's two requests with a cancel, and one crash (of decoder 0 or
/// a prefiller) or false suspicion (either side giving the other up while
/// it lives) at any point; the survivors find a crashed peer dead, and a
/// peer that gave them up goes silent, so they find it dead too.
#[test]
fn every_order_with_a_crash_or_a_suspicion() {
    check(
        "deaths",
        Bounds {
            dups: 0,
            forged: 0,
            deaths: 1,
            second: true,
            cancels: true,
            other: false,
        },
    );
}

/// Runs by hand only (`cargo xtask test` skips `manual::`).
mod manual {
    use super::{check, Bounds};

    /// Bounds from the environment (see the module docs).
    #[test]
    #[ignore = "manual: bounds from the environment"]
    fn probe() {
        let v = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|x| x.parse::<u8>().ok())
                .unwrap_or(0)
        };
        check(
            "probe",
            Bounds {
                dups: v("DUPS"),
                forged: v("FORGED"),
                deaths: v("DEATHS"),
                second: v("SECOND") > 0,
                cancels: v("CANCELS") > 0,
                other: v("OTHER") > 0,
            },
        );
    }
}
