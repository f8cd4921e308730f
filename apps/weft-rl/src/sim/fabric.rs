//! The fabric-driven simulation: the plan's WRITE streams posted on the
//! `Domain`s of a timing-only, step-mode loopback fabric by a single-
//! threaded deterministic driver (see the parent module for the model).
//!
//! Actors `0..nt` are trainers, `nt..nt + ni` inference ranks; actor `a` is
//! fabric host `a` with `nics` NICs. Every actor has one *proxy lane*: the
//! WRs it has to post wait in `pending` in order, each posted `submit`
//! after the later of its ready time and the previous post. The driver's
//! agenda holds one entry per actor with pending WRs (the time its next WR
//! is posted); the main loop advances the fabric to the earlier of the next
//! agenda entry and the next fabric event, polls the domains the fabric
//! lists as ready, moves the ranks' state machines, and posts.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::time::Duration;

use weft::loopback::{Fabric, FabricConfig, LoopbackDomain, NicModel};
use weft::shard::{plan_single_write, ShardConfig};
use weft::{Access, Completion, Domain, LocalMr, PeerId, RemoteSlice, WrId, WriteWr};

use super::gather::{self, WaveGather};
use super::{ns, SimConfig};
use crate::meta::ModelLayout;
use crate::plan::{Plan, Unit, Xfer};
use crate::RlError;

/// Immediate of the WRITEs into inference memory.
const IMM_WEIGHTS: u32 = 1;
/// Immediate of the inference ranks' acknowledgements.
const IMM_ACK: u32 = 2;
/// Immediate of group `g`'s barrier: `IMM_BARRIER + g`.
const IMM_BARRIER: u32 = 16;

/// What one run produced.
pub(super) struct FabricRun {
    /// Update time (ns).
    pub update_ns: u64,
    /// Unshard, quantise, write, barrier wait (ns) of the last rank done.
    pub parts: [u64; 4],
    /// WRs posted.
    pub wrs: u64,
    /// Fabric events.
    pub events: u64,
}

/// Which registration a WR reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    /// Trainer shards.
    Shards,
    /// Trainer arena (staged units).
    Arena,
    /// Offset 0 of the actor's receive region (zero-length messages).
    Empty,
}

/// One WR waiting on an actor's proxy lane.
#[derive(Debug, Clone, Copy)]
struct Post {
    ready: u64,
    nic: usize,
    src: Src,
    src_off: u64,
    len: u64,
    to: usize,
    dst_off: u64,
    imm: u32,
    /// The arena half of its wave ([`Plan::arena_half`]).
    half: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the barrier of its `pos`-th wave (since `since`).
    Barrier {
        since: u64,
    },
    /// Posting / waiting for the WRITEs of its `pos`-th wave.
    Work,
    /// Trainer: waiting for the acknowledgements. Inference: waiting for
    /// its round.
    Final,
    /// Inference: acknowledging.
    Acking,
    Done,
}

struct Actor {
    doms: Vec<LoopbackDomain>,
    /// Per NIC: shards (trainers) / nothing (inference: the receive
    /// region stands in).
    shards: Vec<LocalMr>,
    /// Per NIC: the arena (trainers: target of barriers and acks, source
    /// of staged units) or the weights (inference).
    recv: Vec<LocalMr>,
    /// Peer handles, `peers[nic][actor]`.
    peers: Vec<Vec<Option<PeerId>>>,
    pending: VecDeque<Post>,
    proxy_free: u64,
    scheduled: bool,
    outstanding: u64,
    /// Outstanding WRs by arena half of their wave.
    by_half: BTreeMap<usize, u64>,
    /// Immediates received, by value.
    imms: BTreeMap<u32, u64>,
    /// Trainers: `(group, wave)` list in execution order.
    waves: Vec<(usize, usize)>,
    pos: usize,
    phase: Phase,
    /// Unshard, quantise, (unused), barrier wait (ns).
    parts: [u64; 4],
    done_at: u64,
    /// Staged units waiting for cross-node gathers.
    staged_wait: Option<StagedWait>,
}

/// A writer's staged units of one wave, waiting for the gathers that
/// cross nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StagedWait {
    gi: usize,
    k: usize,
    /// When its barrier passed.
    from: u64,
    /// When its NVLink gathers are in.
    nvlink_ready: u64,
    /// Cross-node gather WRITEs it needs, counted by their immediate.
    expect: u64,
    imm: u32,
}

struct Driver<'a> {
    m: &'a ModelLayout,
    plan: &'a Plan,
    cfg: SimConfig,
    fabric: Fabric,
    actors: Vec<Actor>,
    nt: usize,
    nics: usize,
    agenda: BinaryHeap<Reverse<(u64, u64, usize)>>,
    seq: u64,
    next_wr: u64,
    /// Per inference rank: immediates its round needs.
    expected: Vec<u64>,
    /// Per (group, wave), computed when its first rank starts it.
    gathers: Vec<Vec<Option<WaveGather>>>,
    /// Per trainer: round-robin NIC of its next single write.
    rr: Vec<usize>,
    shard: ShardConfig,
    /// The arena half of each outstanding WR.
    wr_half: BTreeMap<u64, usize>,
    /// Waves overlap: wave k+1 starts once wave k is posted and wave k-1
    /// completed (two arena halves).
    pipelined: bool,
    /// Per trainer: when its device (unshard, quantise) is free.
    dev_free: Vec<u64>,
}

fn sim_err(what: String, source: Option<weft::TransportError>) -> RlError {
    RlError::Sim { what, source }
}

/// Runs the update once.
pub(super) fn run(m: &ModelLayout, plan: &Plan, cfg: &SimConfig) -> Result<FabricRun, RlError> {
    let mut d = Driver::new(m, plan, cfg)?;
    for a in 0..d.nt {
        d.start_wave(a)?;
    }
    for a in d.nt..d.actors.len() {
        d.progress(a)?;
    }
    d.main_loop()?;
    let (slowest, done) = d.actors[..d.nt]
        .iter()
        .enumerate()
        .map(|(i, a)| (i, a.done_at))
        .fold((0, 0), |b, x| if x.1 > b.1 { x } else { b });
    let mut parts = d.actors.get(slowest).map_or([0; 4], |a| a.parts);
    parts[2] = done.saturating_sub(parts[0] + parts[1] + parts[3]);
    Ok(FabricRun {
        update_ns: done,
        parts,
        wrs: d.next_wr,
        events: d.fabric.stats().events,
    })
}

impl<'a> Driver<'a> {
    fn new(m: &'a ModelLayout, plan: &'a Plan, cfg: &SimConfig) -> Result<Self, RlError> {
        let nics = cfg.nics.max(1) as usize;
        let nt = plan.trainers.len();
        let ni = plan.inference.len();
        let fabric = Fabric::new(FabricConfig {
            nic: NicModel {
                latency: Duration::from_nanos(ns(cfg.latency_us)),
                link_gbps: cfg.nic_gbps,
            },
            jitter: Duration::from_nanos(ns(cfg.jitter_us)),
            ..FabricConfig::timing(cfg.seed)
        });
        fn fail(a: usize, what: &'static str) -> impl FnOnce(weft::TransportError) -> RlError {
            move |e| sim_err(format!("setting up actor {a}: {what}"), Some(e))
        }
        let mut actors = Vec::with_capacity(nt + ni);
        for a in 0..nt + ni {
            let host = fabric.add_host(nics);
            let (mut doms, mut shards, mut recv) = (Vec::new(), Vec::new(), Vec::new());
            for k in 0..nics {
                let mut d = fabric.open(host, k).map_err(fail(a, "open"))?;
                if a < nt {
                    shards.push(
                        d.register_virtual(plan.trainers[a].len, Access::LocalOnly)
                            .map_err(fail(a, "shards"))?,
                    );
                    recv.push(
                        d.register_virtual(2 * plan.arena_len, Access::RemoteWrite)
                            .map_err(fail(a, "arena"))?,
                    );
                } else {
                    let w = d
                        .register_virtual(plan.inference[a - nt].len, Access::RemoteWrite)
                        .map_err(fail(a, "weights"))?;
                    shards.push(w);
                    recv.push(w);
                }
                doms.push(d);
            }
            let waves = if a < nt {
                let r = a as u32;
                plan.groups
                    .iter()
                    .enumerate()
                    .filter(|(_, g)| g.ranks.binary_search(&r).is_ok())
                    .flat_map(|(gi, g)| (0..g.waves.len()).map(move |k| (gi, k)))
                    .collect()
            } else {
                Vec::new()
            };
            actors.push(Actor {
                doms,
                shards,
                recv,
                peers: vec![vec![None; nt + ni]; nics],
                pending: VecDeque::new(),
                proxy_free: 0,
                scheduled: false,
                outstanding: 0,
                by_half: BTreeMap::new(),
                imms: BTreeMap::new(),
                waves,
                pos: 0,
                phase: if a < nt { Phase::Work } else { Phase::Final },
                parts: [0; 4],
                done_at: 0,
                staged_wait: None,
            });
        }
        let shard = ShardConfig::default();
        let mut expected = vec![0u64; ni];
        for u in &plan.units {
            for dst in &u.dests {
                for x in dst.xfers() {
                    expected[dst.inf as usize] += wr_count(x, nics, &shard);
                }
            }
        }
        Ok(Driver {
            m,
            plan,
            cfg: *cfg,
            fabric,
            actors,
            nt,
            nics,
            agenda: BinaryHeap::new(),
            seq: 0,
            next_wr: 0,
            expected,
            gathers: plan
                .groups
                .iter()
                .map(|g| (0..g.waves.len()).map(|_| None).collect())
                .collect(),
            rr: vec![0; nt],
            shard,
            wr_half: BTreeMap::new(),
            pipelined: cfg.pipelined,
            dev_free: vec![0; nt],
        })
    }

    fn now(&self) -> u64 {
        self.fabric.now().as_nanos()
    }

    /// Appends `p` to `a`'s proxy lane and schedules the lane if idle.
    fn queue(&mut self, a: usize, p: Post) {
        self.actors[a].pending.push_back(p);
        self.schedule(a);
    }

    fn schedule(&mut self, a: usize) {
        let act = &mut self.actors[a];
        if act.scheduled {
            return;
        }
        if let Some(p) = act.pending.front() {
            let t = p.ready.max(act.proxy_free) + ns(self.cfg.submit_us);
            act.scheduled = true;
            self.seq += 1;
            self.agenda.push(Reverse((t, self.seq, a)));
        }
    }

    /// Posts `a`'s WRs due now (the agenda entry fired).
    fn post_due(&mut self, a: usize) -> Result<(), RlError> {
        let now = self.now();
        let submit = ns(self.cfg.submit_us);
        self.actors[a].scheduled = false;
        loop {
            let act = &self.actors[a];
            let Some(&p) = act.pending.front() else { break };
            if p.ready.max(act.proxy_free) + submit > now {
                break;
            }
            self.actors[a].pending.pop_front();
            self.post(a, &p)?;
            let act = &mut self.actors[a];
            act.proxy_free = now;
            if submit > 0 {
                break;
            }
        }
        self.schedule(a);
        Ok(())
    }

    fn post(&mut self, a: usize, p: &Post) -> Result<(), RlError> {
        let (nic, to) = (p.nic, p.to);
        let addr = Fabric::nic_addr(weft::loopback::HostId(to as u32), nic);
        let peer = match self.actors[a].peers[nic][to] {
            Some(pe) => pe,
            None => {
                let pe = self.actors[a].doms[nic]
                    .add_peer(&addr)
                    .map_err(|e| sim_err(format!("actor {a}: add_peer {to}"), Some(e)))?;
                self.actors[a].peers[nic][to] = Some(pe);
                pe
            }
        };
        let act = &self.actors[a];
        let mr = match p.src {
            Src::Shards => act.shards[nic],
            Src::Arena | Src::Empty => act.recv[nic],
        };
        let off = if p.src == Src::Empty { 0 } else { p.src_off };
        let src = mr.slice(off, p.len).ok_or_else(|| {
            sim_err(
                format!(
                    "actor {a}: source [{off}, +{}) outside its {:?} region",
                    p.len, p.src
                ),
                None,
            )
        })?;
        let dst_mr = self.actors[to].recv[nic];
        let wr = WriteWr {
            wr: WrId(self.next_wr),
            peer,
            src,
            dst: RemoteSlice {
                base: dst_mr.addr,
                offset: p.dst_off,
                rkey: dst_mr.rkey,
            },
            imm: Some(p.imm),
        };
        self.wr_half.insert(self.next_wr, p.half);
        *self.actors[a].by_half.entry(p.half).or_default() += 1;
        self.next_wr += 1;
        let n = self.actors[a].doms[nic]
            .post_writes(std::slice::from_ref(&wr))
            .map_err(|e| sim_err(format!("actor {a}: post to {to}"), Some(e.error)))?;
        if n != 1 {
            return Err(sim_err(format!("actor {a}: send queue full"), None));
        }
        self.actors[a].outstanding += 1;
        Ok(())
    }

    /// Trainer `a` begins its `pos`-th wave (or waits for the acks).
    fn start_wave(&mut self, a: usize) -> Result<(), RlError> {
        let now = self.now();
        let Some(&(gi, k)) = self.actors[a].waves.get(self.actors[a].pos) else {
            self.actors[a].phase = Phase::Final;
            return self.progress(a);
        };
        let r = a as u32;
        let peers: Vec<usize> = self.plan.groups[gi]
            .ranks
            .iter()
            .filter(|&&p| p != r)
            .map(|&p| p as usize)
            .collect();
        for p in peers {
            self.queue(
                a,
                Post {
                    ready: now,
                    nic: 0,
                    src: Src::Empty,
                    src_off: 0,
                    len: 0,
                    to: p,
                    dst_off: 0,
                    imm: IMM_BARRIER + gi as u32,
                    half: self.plan.arena_half(gi, k),
                },
            );
        }
        self.actors[a].phase = Phase::Barrier { since: now };
        self.progress(a)
    }

    /// Moves `a`'s state machine as far as it goes now.
    fn progress(&mut self, a: usize) -> Result<(), RlError> {
        loop {
            let now = self.now();
            let act = &self.actors[a];
            match act.phase {
                Phase::Barrier { since } => {
                    let (gi, k) = act.waves[act.pos];
                    let n = self.plan.groups[gi].ranks.len() as u64 - 1;
                    let seen = act.imms.get(&(IMM_BARRIER + gi as u32)).copied();
                    if seen.unwrap_or(0) < (k as u64 + 1) * n {
                        return Ok(());
                    }
                    self.actors[a].parts[3] += now - since;
                    self.actors[a].phase = Phase::Work;
                    self.wave_work(a, gi, k)?;
                }
                Phase::Work => {
                    if let Some(w) = act.staged_wait {
                        let seen = act.imms.get(&w.imm).copied();
                        if seen.unwrap_or(0) < w.expect {
                            return Ok(());
                        }
                        self.actors[a].staged_wait = None;
                        self.stage(a, w);
                        self.schedule(a);
                        continue;
                    }
                    let next_half = act
                        .waves
                        .get(act.pos + 1)
                        .map(|&(g, k)| self.plan.arena_half(g, k));
                    let blocked = if self.pipelined {
                        // Posted, and the arena half of the next wave free
                        // (the last wave staged in it completed).
                        !act.pending.is_empty()
                            || next_half.is_some_and(|h| act.by_half.contains_key(&h))
                            || (next_half.is_none() && act.outstanding > 0)
                    } else {
                        !act.pending.is_empty() || act.outstanding > 0
                    };
                    if blocked {
                        return Ok(());
                    }
                    self.actors[a].pos += 1;
                    return self.start_wave(a);
                }
                Phase::Final if a < self.nt => {
                    let acks = act.imms.get(&IMM_ACK).copied().unwrap_or(0);
                    if acks < (self.actors.len() - self.nt) as u64 || act.outstanding > 0 {
                        return Ok(());
                    }
                    self.actors[a].done_at = now;
                    self.actors[a].phase = Phase::Done;
                }
                Phase::Final => {
                    let got = act.imms.get(&IMM_WEIGHTS).copied().unwrap_or(0);
                    if got < self.expected[a - self.nt] {
                        return Ok(());
                    }
                    for t in 0..self.nt {
                        self.queue(
                            a,
                            Post {
                                ready: now,
                                nic: 0,
                                src: Src::Empty,
                                src_off: 0,
                                len: 0,
                                to: t,
                                dst_off: 0,
                                imm: IMM_ACK,
                                half: usize::MAX,
                            },
                        );
                    }
                    self.actors[a].phase = Phase::Acking;
                }
                Phase::Acking => {
                    if !act.pending.is_empty() || act.outstanding > 0 {
                        return Ok(());
                    }
                    self.actors[a].done_at = now;
                    self.actors[a].phase = Phase::Done;
                }
                Phase::Done => return Ok(()),
            }
        }
    }

    /// After the barrier of wave `k` of group `gi`: the gathers it sources
    /// (cross-node ones posted, NVLink ones modelled), its direct WRITEs at
    /// once, and its staged ones after the gathers into it and their
    /// quantisation.
    fn wave_work(&mut self, a: usize, gi: usize, k: usize) -> Result<(), RlError> {
        let now = self.now();
        let r = a as u32;
        if self.gathers[gi][k].is_none() {
            self.gathers[gi][k] = Some(WaveGather::new(self.plan, &self.cfg, gi, k));
        }
        let g = self.gathers[gi][k].as_ref();
        let nvl = g.and_then(|g| g.nvlink_done.get(&r)).copied().unwrap_or(0);
        let gsub = g.and_then(|g| g.submits.get(&r)).copied().unwrap_or(0);
        let expect = g.and_then(|g| g.cross_in.get(&r)).copied().unwrap_or(0);
        let cross = g.and_then(|g| g.cross.get(&r)).cloned().unwrap_or_default();
        let half = self.plan.arena_half(gi, k);
        let imm = gather::imm(self.plan, gi, k);
        // The planned gather transfers are submitted first (host cost), then
        // the cross-node bytes go out on the fabric.
        {
            let act = &mut self.actors[a];
            act.proxy_free = act.proxy_free.max(now) + gsub * ns(self.cfg.submit_us);
        }
        for (w, bytes, chunk) in cross {
            let mut left = bytes;
            while left > 0 {
                let len = left.min(chunk);
                left -= len;
                let nic = self.rr[a] % self.nics;
                self.rr[a] += 1;
                self.actors[a].pending.push_back(Post {
                    ready: now,
                    nic,
                    src: Src::Shards,
                    src_off: 0,
                    len,
                    to: w as usize,
                    dst_off: half as u64 * self.plan.arena_len,
                    imm,
                    half,
                });
            }
        }
        let units = &self.plan.units[self.plan.groups[gi].waves[k].clone()];
        for u in units.iter().filter(|u| u.writer == r && u.arena.is_none()) {
            self.queue_unit(a, u, now, Src::Shards, 0);
        }
        let wait = StagedWait {
            gi,
            k,
            from: now,
            nvlink_ready: now + nvl,
            expect,
            imm,
        };
        if expect > 0 {
            self.actors[a].staged_wait = Some(wait);
        } else {
            self.stage(a, wait);
        }
        self.schedule(a);
        Ok(())
    }

    /// `a`'s gathers of wave `w` are in: quantisation (on its device, in
    /// order) and the staged WRITEs.
    fn stage(&mut self, a: usize, w: StagedWait) {
        let ready = w.nvlink_ready.max(self.now());
        self.actors[a].parts[0] += ready - w.from;
        let units = &self.plan.units[self.plan.groups[w.gi].waves[w.k].clone()];
        // Staged units read the arena half of the wave's parity.
        let base = self.plan.arena_half(w.gi, w.k) as u64 * self.plan.arena_len;
        let q_bs = self.cfg.quant_gbs * 1e9;
        let mut dev = ready.max(self.dev_free[a]);
        let r = a as u32;
        for u in units.iter().filter(|u| u.writer == r && u.arena.is_some()) {
            let bytes = u.src.elems() * self.m.params[u.param].dtype.size();
            let q = ns(self.cfg.kernel_us) + (bytes as f64 / q_bs * 1e9) as u64;
            dev += q;
            self.actors[a].parts[1] += q;
            self.queue_unit(a, u, dev, Src::Arena, base);
        }
        self.dev_free[a] = dev;
    }

    /// Queues every WR of `u`'s destinations, ready at `ready`, their
    /// sources moved by `base`.
    fn queue_unit(&mut self, a: usize, u: &Unit, ready: u64, src: Src, base: u64) {
        let act = &self.actors[a];
        let half = act
            .waves
            .get(act.pos)
            .map_or(0, |&(g, k)| self.plan.arena_half(g, k));
        for d in &u.dests {
            let to = self.nt + d.inf as usize;
            for x in d.xfers() {
                if x.is_single() {
                    let len = x.dst.bytes();
                    let pieces =
                        plan_single_write(len, self.nics, u64::MAX, self.rr[a], &self.shard);
                    self.rr[a] += 1;
                    for p in pieces {
                        self.actors[a].pending.push_back(Post {
                            ready,
                            nic: p.nic,
                            src,
                            src_off: base + x.src.offset + p.offset,
                            len: p.len,
                            to,
                            dst_off: x.dst.offset + p.offset,
                            imm: IMM_WEIGHTS,
                            half,
                        });
                    }
                } else {
                    for i in 0..x.dst.count {
                        self.actors[a].pending.push_back(Post {
                            ready,
                            nic: (i as usize) % self.nics,
                            src,
                            src_off: base + x.src.offset + i * x.src.stride,
                            len: x.dst.page_len,
                            to,
                            dst_off: x.dst.offset + i * x.dst.stride,
                            imm: IMM_WEIGHTS,
                            half,
                        });
                    }
                }
            }
        }
    }

    fn main_loop(&mut self) -> Result<(), RlError> {
        let mut ready = Vec::new();
        let mut cq = Vec::new();
        loop {
            let now = self.now();
            let ta = self.agenda.peek().map(|Reverse((t, _, _))| *t);
            let tf = self.fabric.next_event_at().map(|t| t.as_nanos());
            let target = match (ta, tf) {
                (None, None) => break,
                (Some(a), None) => a,
                (None, Some(f)) => f,
                (Some(a), Some(f)) => a.min(f),
            };
            self.fabric
                .advance(Duration::from_nanos(target.saturating_sub(now)));
            self.fabric.take_ready(&mut ready);
            for (h, nic) in ready.drain(..) {
                let a = h.0 as usize;
                let Some(act) = self.actors.get_mut(a) else {
                    continue;
                };
                cq.clear();
                act.doms[nic]
                    .poll(&mut cq)
                    .map_err(|e| sim_err(format!("actor {a}: poll"), Some(e)))?;
                for c in cq.drain(..) {
                    match c {
                        Completion::Write { wr, result } => {
                            result.map_err(|e| {
                                sim_err(format!("actor {a}: WRITE {} failed", wr.0), Some(e))
                            })?;
                            act.outstanding -= 1;
                            if let Some(w) = self.wr_half.remove(&wr.0) {
                                if let Some(c) = act.by_half.get_mut(&w) {
                                    *c -= 1;
                                    if *c == 0 {
                                        act.by_half.remove(&w);
                                    }
                                }
                            }
                        }
                        Completion::Imm { imm } => *act.imms.entry(imm).or_default() += 1,
                        other => {
                            return Err(sim_err(
                                format!("actor {a}: unexpected completion {other:?}"),
                                None,
                            ))
                        }
                    }
                }
                self.progress(a)?;
            }
            let now = self.now();
            while let Some(&Reverse((t, _, a))) = self.agenda.peek() {
                if t > now {
                    break;
                }
                self.agenda.pop();
                self.post_due(a)?;
                if self.pipelined {
                    self.progress(a)?;
                }
            }
        }
        let stuck: Vec<usize> = (0..self.actors.len())
            .filter(|&a| self.actors[a].phase != Phase::Done)
            .collect();
        if let Some(&a) = stuck.first() {
            return Err(sim_err(
                format!(
                    "stalled at {} ns with {} ranks unfinished (first: actor {a} in {:?}, {} outstanding)",
                    self.now(),
                    stuck.len(),
                    self.actors[a].phase,
                    self.actors[a].outstanding
                ),
                None,
            ));
        }
        Ok(())
    }
}

/// WRs the engine posts for `x` over `nics` NICs (each carries the
/// immediate).
fn wr_count(x: &Xfer, nics: usize, shard: &ShardConfig) -> u64 {
    if x.is_single() {
        plan_single_write(x.dst.bytes(), nics, u64::MAX, 0, shard).len() as u64
    } else {
        x.dst.count
    }
}
