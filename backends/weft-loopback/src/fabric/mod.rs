//! The shared fabric: hosts, NICs, the event queue and all delivery logic.
//!
//! Everything here is driven by simulated time (`u64` nanoseconds). The wall
//! clock appears only in [`Fabric::lock`], the thin realtime driver.

mod handle;

pub use handle::Fabric;

use crate::config::{FabricConfig, NicModel};
use crate::mem::{self, Span};
use crate::rules::{Action, OpKind, Rule};
use crate::trace::{FabricStats, TraceEvent, TraceKind};
use crate::{addr, HostId, SimTime};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use weft_transport::{
    Access, Completion, Device, DeviceCopy, Imm, LocalMr, LocalSlice, MemRegion, MrKey,
    RemoteAccessReason, Rkey, TransportError, WrId, WriteWr,
};

/// (host, NIC) of a simulated NIC.
pub(crate) type Loc = (u32, u32);

/// Rkeys are the local key XOR this salt, so an lkey passed as an rkey (or
/// the reverse) is rejected.
const RKEY_SALT: u64 = 0x1f00_d5ee_d000_0000;

fn dur_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub(crate) fn nic_name(loc: Loc) -> String {
    format!("lo/host{}/nic{}", loc.0, loc.1)
}

fn span_within(base: u64, base_len: u64, a: u64, len: u64) -> bool {
    match (a.checked_add(len), base.checked_add(base_len)) {
        (Some(end), Some(base_end)) => a >= base && end <= base_end,
        _ => false,
    }
}

/// An address-free (hence replayable) description of an error for the trace.
fn trace_error(e: &TransportError) -> String {
    match e {
        TransportError::RemoteAccess { reason, .. } => format!("RemoteAccess: {reason}"),
        TransportError::PeerUnreachable { reason, .. } => format!("PeerUnreachable: {reason}"),
        TransportError::Failed { what, .. } => format!("Failed: {what}"),
        other => {
            let dbg = format!("{other:?}");
            dbg.split([' ', '{', '('])
                .next()
                .unwrap_or_default()
                .to_owned()
        }
    }
}

fn unknown_nic(host: HostId, nic: usize) -> TransportError {
    TransportError::InvalidArgument {
        nic: format!("lo/host{}/nic{nic}", host.0),
        what: "no such loopback host/NIC".into(),
    }
}

// ---------------------------------------------------------------------------
// State

struct RuleState {
    rule: Rule,
    hits: u64,
}

struct HostState {
    nics: Vec<NicState>,
}

#[derive(Debug, Clone, Copy)]
struct Reg {
    addr: u64,
    len: u64,
    device: Device,
    access: Access,
}

#[derive(Debug, Clone, Copy)]
struct PostedRecv {
    wr: WrId,
    key: u64,
    addr: u64,
    len: u64,
}

pub(crate) struct NicState {
    alive: bool,
    open: bool,
    model: NicModel,
    regs: BTreeMap<u64, Reg>,
    recvs: Vec<PostedRecv>,
    rnr_wait: VecDeque<u64>,
    cq: Vec<Completion>,
    inflight: usize,
    tx_free: u64,
    rx_free: u64,
}

impl NicState {
    fn new(model: NicModel) -> Self {
        Self {
            alive: true,
            open: false,
            model,
            regs: BTreeMap::new(),
            recvs: Vec::new(),
            rnr_wait: VecDeque::new(),
            cq: Vec::new(),
            inflight: 0,
            tx_free: 0,
            rx_free: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DropMode {
    Random,
    Once,
}

#[derive(Debug, Clone, Copy)]
enum Body {
    Write {
        src_key: u64,
        src_addr: u64,
        len: u64,
        rkey: u64,
        dst_addr: Option<u64>,
        imm: Option<Imm>,
        chunk: u64,
        nchunks: u32,
        landed: u32,
        max_landed: Option<u32>,
    },
    Send {
        src_key: u64,
        src_addr: u64,
        len: u64,
        waiting: bool,
    },
}

#[derive(Debug)]
enum Phase {
    InFlight,
    Acking(Result<(), TransportError>),
}

#[derive(Debug)]
struct Op {
    wr: WrId,
    src: Loc,
    dst: Loc,
    body: Body,
    phase: Phase,
    drop: DropMode,
}

#[derive(Debug, Clone, Copy)]
enum FailReason {
    Injected(usize),
    Partition,
}

#[derive(Debug, Clone, Copy)]
enum EvKind {
    Chunk { op: u64, idx: u32, attempt: u32 },
    SendArrive { op: u64, attempt: u32 },
    Ack { op: u64 },
    RnrTimeout { op: u64 },
    Fail { op: u64, why: FailReason },
}

#[derive(Debug)]
struct Event {
    time: u64,
    seq: u64,
    kind: EvKind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        (self.time, self.seq) == (o.time, o.seq)
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    /// Reversed, so the `BinaryHeap` pops the earliest (time, seq) first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.time, o.seq).cmp(&(self.time, self.seq))
    }
}

pub(crate) struct State {
    cfg: FabricConfig,
    now: u64,
    seq: u64,
    next_op: u64,
    next_key: u64,
    rng: ChaCha8Rng,
    events: BinaryHeap<Event>,
    hosts: Vec<HostState>,
    ops: BTreeMap<u64, Op>,
    rules: Vec<RuleState>,
    trace: Vec<TraceEvent>,
    stats: FabricStats,
    last_landed: BTreeMap<(Loc, Loc), u64>,
    device_copy: Option<Arc<dyn DeviceCopy>>,
    shuffle_buf: Vec<u32>,
}

impl State {
    fn new(cfg: FabricConfig) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            device_copy: cfg.device_copy.clone(),
            cfg,
            now: 0,
            seq: 0,
            next_op: 0,
            next_key: 1,
            events: BinaryHeap::new(),
            hosts: Vec::new(),
            ops: BTreeMap::new(),
            rules: Vec::new(),
            trace: Vec::new(),
            stats: FabricStats::default(),
            last_landed: BTreeMap::new(),
            shuffle_buf: Vec::new(),
        }
    }

    // --- lookup helpers ---------------------------------------------------

    fn loc(&self, host: HostId, nic: usize) -> Result<Loc, TransportError> {
        let h = self
            .hosts
            .get(host.0 as usize)
            .ok_or_else(|| unknown_nic(host, nic))?;
        if nic >= h.nics.len() {
            return Err(unknown_nic(host, nic));
        }
        let n = u32::try_from(nic).map_err(|_| unknown_nic(host, nic))?;
        Ok((host.0, n))
    }

    pub(crate) fn nic_mut(&mut self, loc: Loc) -> Option<&mut NicState> {
        self.hosts
            .get_mut(loc.0 as usize)?
            .nics
            .get_mut(loc.1 as usize)
    }

    fn nic(&self, loc: Loc) -> Option<&NicState> {
        self.hosts.get(loc.0 as usize)?.nics.get(loc.1 as usize)
    }

    fn model(&self, loc: Loc) -> NicModel {
        self.nic(loc).map_or(self.cfg.nic, |n| n.model)
    }

    /// Whether operations can land on `loc` now.
    fn reachable(&self, loc: Loc) -> bool {
        self.nic(loc).is_some_and(|n| n.alive && n.open)
    }

    pub(crate) fn capabilities(&self, device_memory: bool) -> weft_transport::Capabilities {
        weft_transport::Capabilities {
            // Every call into the fabric, from any host, moves it forward.
            software_progress: false,
            max_write_len: self.cfg.max_write_len,
            max_send_len: self.cfg.max_send_len,
            max_inflight: self.cfg.max_inflight,
            max_recvs: self.cfg.max_recvs,
            max_batch: self.cfg.max_batch.max(1),
            ordered: false,
            device_memory,
        }
    }

    fn record(&mut self, what: TraceKind) {
        if self.cfg.trace {
            self.trace.push(TraceEvent {
                at: SimTime(self.now),
                what,
            });
        }
    }

    fn schedule(&mut self, time: u64, kind: EvKind) {
        let seq = self.seq;
        self.seq += 1;
        self.events.push(Event { time, seq, kind });
    }

    // --- time -------------------------------------------------------------

    fn step(&mut self) -> bool {
        let Some(ev) = self.events.pop() else {
            return false;
        };
        self.now = self.now.max(ev.time);
        self.handle(ev.kind);
        true
    }

    pub(crate) fn process_due(&mut self) {
        while self.events.peek().is_some_and(|e| e.time <= self.now) {
            self.step();
        }
    }

    fn advance_to(&mut self, t: u64) {
        while self.events.peek().is_some_and(|e| e.time <= t) {
            self.step();
        }
        self.now = self.now.max(t);
    }

    /// Serialization time of `bytes` at `gbps`.
    fn ser(bytes: u64, gbps: f64) -> u64 {
        if gbps.is_finite() && gbps > 0.0 {
            // bits / (Gbit/s) = ns. f64 arithmetic is deterministic.
            (bytes as f64 * 8.0 / gbps) as u64
        } else {
            0
        }
    }

    fn one_way(&self, src: Loc, dst: Loc) -> u64 {
        if self.cfg.null {
            return 0;
        }
        let (a, b) = (self.model(src), self.model(dst));
        (dur_ns(a.latency) / 2).saturating_add(dur_ns(b.latency) / 2)
    }

    /// Arrival time of `bytes` sent now from `src` to `dst`, updating the
    /// link-occupancy model.
    fn transit(&mut self, src: Loc, dst: Loc, bytes: u64, extra: u64) -> u64 {
        if self.cfg.null {
            return self.now.saturating_add(extra);
        }
        let now = self.now;
        let lat = self.one_way(src, dst);
        let sm = self.model(src);
        let mut t = now;
        if let Some(s) = self.nic_mut(src) {
            let depart = now.max(s.tx_free);
            s.tx_free = depart.saturating_add(Self::ser(bytes, sm.link_gbps));
            t = s.tx_free;
        }
        t = t.saturating_add(lat).saturating_add(extra);
        if let Some(d) = self.nic_mut(dst) {
            let rx = Self::ser(bytes, d.model.link_gbps);
            let start = t.max(d.rx_free);
            d.rx_free = start.saturating_add(rx);
            t = d.rx_free;
        }
        let jitter = dur_ns(self.cfg.jitter);
        if jitter > 0 {
            t = t.saturating_add(self.rng.gen_range(0..=jitter));
        }
        t
    }

    // --- memory -----------------------------------------------------------

    pub(crate) fn register(
        &mut self,
        loc: Loc,
        region: &MemRegion,
        access: Access,
    ) -> Result<LocalMr, TransportError> {
        let cuda = region.device() != Device::Host;
        let has_dc = self.device_copy.is_some();
        let key = self.next_key;
        let Some(nic) = self.nic_mut(loc).filter(|n| n.alive) else {
            return Err(TransportError::NicDown { nic: nic_name(loc) });
        };
        if cuda && !has_dc {
            return Err(TransportError::Unsupported {
                nic: nic_name(loc),
                what: format!(
                    "registering {} memory needs a DeviceCopy (FabricConfig::device_copy or Fabric::set_device_copy)",
                    region.device()
                ),
            });
        }
        let reg = Reg {
            addr: region.addr(),
            len: region.len() as u64,
            device: region.device(),
            access,
        };
        if reg.addr.checked_add(reg.len).is_none() {
            return Err(TransportError::InvalidArgument {
                nic: nic_name(loc),
                what: "region wraps the address space".into(),
            });
        }
        nic.regs.insert(key, reg);
        self.next_key += 1;
        Ok(LocalMr {
            key: MrKey(key),
            rkey: Rkey(key ^ RKEY_SALT),
            addr: reg.addr,
            len: reg.len,
            device: reg.device,
        })
    }

    pub(crate) fn deregister(&mut self, loc: Loc, key: MrKey) -> Result<(), TransportError> {
        let Some(nic) = self.nic_mut(loc) else {
            return Err(TransportError::NicDown { nic: nic_name(loc) });
        };
        if nic.regs.remove(&key.0).is_none() {
            return Err(TransportError::LocalAccess {
                nic: nic_name(loc),
                what: format!("deregister of unknown key {}", key.0),
            });
        }
        // Posted receive buffers in this registration are flushed.
        let alive = nic.alive;
        let mut i = 0;
        while i < nic.recvs.len() {
            if nic.recvs[i].key == key.0 {
                let r = nic.recvs.remove(i);
                if alive {
                    nic.cq.push(Completion::Recv {
                        wr: r.wr,
                        result: Err(TransportError::LocalAccess {
                            nic: nic_name(loc),
                            what: format!("receive buffer's key {} deregistered", key.0),
                        }),
                    });
                }
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    fn check_local(&self, loc: Loc, key: u64, a: u64, len: u64) -> Result<Device, TransportError> {
        let err = |what: String| TransportError::LocalAccess {
            nic: nic_name(loc),
            what,
        };
        let reg = self
            .nic(loc)
            .and_then(|n| n.regs.get(&key))
            .ok_or_else(|| err(format!("unknown or deregistered key {key}")))?;
        if !span_within(reg.addr, reg.len, a, len) {
            return Err(err(format!(
                "slice [{a:#x}, +{len}) outside registration {key} [{:#x}, +{})",
                reg.addr, reg.len
            )));
        }
        Ok(reg.device)
    }

    fn check_remote(
        &self,
        dst: Loc,
        rkey: u64,
        a: Option<u64>,
        len: u64,
    ) -> Result<Device, RemoteAccessReason> {
        let reg = self
            .nic(dst)
            .and_then(|n| n.regs.get(&(rkey ^ RKEY_SALT)))
            .ok_or(RemoteAccessReason::UnknownKey)?;
        if reg.access != Access::RemoteWrite {
            return Err(RemoteAccessReason::NotWritable);
        }
        match a {
            Some(a) if span_within(reg.addr, reg.len, a, len) => Ok(reg.device),
            _ => Err(RemoteAccessReason::OutOfBounds),
        }
    }

    // --- posting ----------------------------------------------------------

    pub(crate) fn check_alive(&self, loc: Loc) -> Result<(), TransportError> {
        if self.nic(loc).is_some_and(|n| n.alive) {
            Ok(())
        } else {
            Err(TransportError::NicDown { nic: nic_name(loc) })
        }
    }

    pub(crate) fn has_room(&self, loc: Loc) -> bool {
        self.nic(loc)
            .is_some_and(|n| n.inflight < self.cfg.max_inflight)
    }

    fn apply_rules(
        &mut self,
        op: u64,
        kind: OpKind,
        src: Loc,
        dst: Loc,
        imm: Option<Imm>,
    ) -> (Option<usize>, Action) {
        let hit = self.rules.iter_mut().enumerate().find_map(|(i, r)| {
            let open = r.rule.limit.is_none_or(|l| r.hits < l);
            (open && r.rule.matcher.matches(kind, src, Some(dst), imm)).then(|| {
                r.hits += 1;
                (i, r.rule.action)
            })
        });
        match hit {
            Some((i, action)) => {
                self.stats.rule_matches += 1;
                self.record(TraceKind::RuleMatched { op, rule: i });
                (Some(i), action)
            }
            None => (None, Action::Pass),
        }
    }

    /// Applies a rule decision. Returns the extra delay for the payload, or
    /// `None` when the payload must not be scheduled at all.
    fn decide(
        &mut self,
        id: u64,
        src: Loc,
        dst: Loc,
        rule: Option<usize>,
        action: Action,
    ) -> Option<u64> {
        match action {
            Action::Pass => Some(0),
            Action::Delay(d) => Some(dur_ns(d)),
            Action::Drop => {
                if let Some(op) = self.ops.get_mut(&id) {
                    op.drop = DropMode::Once;
                }
                Some(0)
            }
            Action::Fail => {
                let t = self.now.saturating_add(self.one_way(src, dst));
                self.schedule(
                    t,
                    EvKind::Fail {
                        op: id,
                        why: FailReason::Injected(rule.unwrap_or(0)),
                    },
                );
                None
            }
            Action::DropAll => {
                let tries = u64::from(self.cfg.retry_limit) + 1;
                self.stats.drops += tries;
                self.stats.retransmits += tries - 1;
                let t = self
                    .now
                    .saturating_add(self.one_way(src, dst))
                    .saturating_add(dur_ns(self.cfg.retransmit_delay).saturating_mul(tries));
                self.schedule(
                    t,
                    EvKind::Fail {
                        op: id,
                        why: FailReason::Partition,
                    },
                );
                None
            }
            Action::KillDst => {
                self.kill_host(dst.0);
                // Normally the kill failed this op already; if the target
                // named no NIC (nothing to kill), fail it here.
                if self.ops.contains_key(&id) {
                    let e = self.unreachable(src, dst, self.dst_state(dst));
                    self.complete(id, Err(e));
                }
                None
            }
        }
    }

    /// Posts one WRITE (the caller checked `has_room` and the peer).
    pub(crate) fn post_write(
        &mut self,
        src: Loc,
        dst: Loc,
        wr: &WriteWr,
    ) -> Result<(), TransportError> {
        let len = wr.src.len;
        if len > self.cfg.max_write_len {
            return Err(TransportError::InvalidArgument {
                nic: nic_name(src),
                what: format!(
                    "write {:?} of {len} bytes exceeds max_write_len {}",
                    wr.wr, self.cfg.max_write_len
                ),
            });
        }
        self.check_local(src, wr.src.mr.0, wr.src.addr, len)?;
        let id = self.next_op;
        self.next_op += 1;
        let kind = if len == 0 && wr.imm.is_some() {
            OpKind::ImmOnly
        } else {
            OpKind::Write
        };
        let (chunk, nchunks) = self.chunking(len);
        self.stats.writes_posted += 1;
        self.record(TraceKind::Posted {
            op: id,
            kind,
            src,
            dst: self.nic(dst).map(|_| dst),
            len,
            imm: wr.imm,
            chunks: nchunks,
        });
        let (rule, action) = self.apply_rules(id, kind, src, dst, wr.imm);
        if self.cfg.null && action == Action::Pass {
            self.null_write(id, src, dst, wr);
            return Ok(());
        }
        if let Some(n) = self.nic_mut(src) {
            n.inflight += 1;
        }
        self.ops.insert(
            id,
            Op {
                wr: wr.wr,
                src,
                dst,
                body: Body::Write {
                    src_key: wr.src.mr.0,
                    src_addr: wr.src.addr,
                    len,
                    rkey: wr.dst.rkey.0,
                    dst_addr: wr.dst.addr(),
                    imm: wr.imm,
                    chunk,
                    nchunks,
                    landed: 0,
                    max_landed: None,
                },
                phase: Phase::InFlight,
                drop: DropMode::Random,
            },
        );
        let Some(extra) = self.decide(id, src, dst, rule, action) else {
            return Ok(());
        };
        let mut order = std::mem::take(&mut self.shuffle_buf);
        order.clear();
        order.extend(0..nchunks);
        if self.cfg.shuffle_chunks && nchunks > 1 {
            order.shuffle(&mut self.rng);
        }
        for &idx in &order {
            let off = u64::from(idx).saturating_mul(chunk);
            let bytes = chunk.min(len.saturating_sub(off));
            let t = self.transit(src, dst, bytes, extra);
            self.schedule(
                t,
                EvKind::Chunk {
                    op: id,
                    idx,
                    attempt: 0,
                },
            );
        }
        self.shuffle_buf = order;
        Ok(())
    }

    /// Chunk size and count for a WRITE of `len` bytes.
    fn chunking(&mut self, len: u64) -> (u64, u32) {
        let max_chunks = u64::from(self.cfg.max_chunks.max(1));
        if self.cfg.null || max_chunks == 1 || len == 0 {
            return (len.max(1), 1);
        }
        let lo = self.cfg.chunk_min.max(1);
        let hi = self.cfg.chunk_max.max(lo);
        let cs = self.rng.gen_range(lo..=hi).max(len.div_ceil(max_chunks));
        let n = len.div_ceil(cs).max(1);
        (cs, u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Posts one SEND (the caller checked `has_room` and the peer).
    pub(crate) fn post_send(
        &mut self,
        src: Loc,
        dst: Loc,
        wr: WrId,
        s: LocalSlice,
    ) -> Result<(), TransportError> {
        if s.len > self.cfg.max_send_len {
            return Err(TransportError::InvalidArgument {
                nic: nic_name(src),
                what: format!(
                    "send {wr:?} of {} bytes exceeds max_send_len {}",
                    s.len, self.cfg.max_send_len
                ),
            });
        }
        self.check_local(src, s.mr.0, s.addr, s.len)?;
        let id = self.next_op;
        self.next_op += 1;
        if let Some(n) = self.nic_mut(src) {
            n.inflight += 1;
        }
        self.stats.sends_posted += 1;
        self.ops.insert(
            id,
            Op {
                wr,
                src,
                dst,
                body: Body::Send {
                    src_key: s.mr.0,
                    src_addr: s.addr,
                    len: s.len,
                    waiting: false,
                },
                phase: Phase::InFlight,
                drop: DropMode::Random,
            },
        );
        self.record(TraceKind::Posted {
            op: id,
            kind: OpKind::Send,
            src,
            dst: self.nic(dst).map(|_| dst),
            len: s.len,
            imm: None,
            chunks: 1,
        });
        let (rule, action) = self.apply_rules(id, OpKind::Send, src, dst, None);
        if let Some(extra) = self.decide(id, src, dst, rule, action) {
            let t = self.transit(src, dst, s.len, extra);
            self.schedule(t, EvKind::SendArrive { op: id, attempt: 0 });
        }
        Ok(())
    }

    pub(crate) fn post_recv(
        &mut self,
        loc: Loc,
        wr: WrId,
        buf: LocalSlice,
    ) -> Result<(), TransportError> {
        self.check_local(loc, buf.mr.0, buf.addr, buf.len)?;
        let max = self.cfg.max_recvs;
        let Some(nic) = self.nic_mut(loc) else {
            return Err(TransportError::NicDown { nic: nic_name(loc) });
        };
        if nic.recvs.len() >= max {
            return Err(TransportError::QueueFull { nic: nic_name(loc) });
        }
        nic.recvs.push(PostedRecv {
            wr,
            key: buf.mr.0,
            addr: buf.addr,
            len: buf.len,
        });
        self.stats.recvs_posted += 1;
        self.match_waiting(loc);
        Ok(())
    }

    pub(crate) fn drain_cq(
        &mut self,
        loc: Loc,
        out: &mut Vec<Completion>,
    ) -> Result<usize, TransportError> {
        match self.nic_mut(loc) {
            Some(n) if n.alive => {
                let k = n.cq.len();
                // A send-queue slot frees when its completion is polled.
                let sq =
                    n.cq.iter()
                        .filter(|c| matches!(c, Completion::Send { .. } | Completion::Write { .. }))
                        .count();
                n.inflight = n.inflight.saturating_sub(sq);
                out.append(&mut n.cq);
                Ok(k)
            }
            _ => Err(TransportError::NicDown { nic: nic_name(loc) }),
        }
    }

    // --- completion -------------------------------------------------------

    /// Generates the initiator's completion for `id` and forgets the op.
    fn complete(&mut self, id: u64, result: Result<(), TransportError>) {
        let Some(op) = self.ops.remove(&id) else {
            return;
        };
        if result.is_ok() {
            self.stats.completed_ok += 1;
        } else {
            self.stats.completed_err += 1;
        }
        if self.cfg.trace {
            let error = result.as_ref().err().map(trace_error);
            self.record(TraceKind::Completed { op: id, error });
        }
        if let Err(e) = &result {
            tracing::debug!(op = id, wr = op.wr.0, error = %e, "loopback op failed");
        }
        if let Some(n) = self.nic_mut(op.src) {
            if n.alive && n.open {
                n.cq.push(match op.body {
                    Body::Send { .. } => Completion::Send { wr: op.wr, result },
                    Body::Write { .. } => Completion::Write { wr: op.wr, result },
                });
            }
        }
    }

    /// Null-mode fast path for a WRITE no rule touched: the target-side
    /// checks and the immediate happen now, with no event and no op state
    /// (the completion is in the initiator's queue for its next poll).
    fn null_write(&mut self, id: u64, src: Loc, dst: Loc, wr: &WriteWr) {
        let len = wr.src.len;
        let result = if !self.reachable(dst) {
            Err(self.unreachable(src, dst, self.dst_state(dst)))
        } else {
            match self.check_remote(dst, wr.dst.rkey.0, wr.dst.addr(), len) {
                Err(reason) => Err(TransportError::RemoteAccess {
                    nic: nic_name(src),
                    peer: addr::encode(dst.0, dst.1),
                    rkey: wr.dst.rkey.0,
                    addr: wr.dst.addr().unwrap_or(u64::MAX),
                    len,
                    reason,
                }),
                Ok(_) => {
                    self.stats.chunks_delivered += 1;
                    self.stats.bytes_delivered += len;
                    self.record(TraceKind::ChunkLanded {
                        op: id,
                        chunk: 0,
                        offset: 0,
                        len,
                    });
                    if let Some(imm) = wr.imm {
                        if let Some(n) = self.nic_mut(dst) {
                            n.cq.push(Completion::Imm { imm });
                        }
                        self.stats.imms_delivered += 1;
                        self.record(TraceKind::ImmDelivered { op: id, imm });
                    }
                    Ok(())
                }
            }
        };
        if result.is_ok() {
            self.stats.completed_ok += 1;
        } else {
            self.stats.completed_err += 1;
        }
        if self.cfg.trace {
            let error = result.as_ref().err().map(trace_error);
            self.record(TraceKind::Completed { op: id, error });
        }
        if let Some(n) = self.nic_mut(src) {
            n.inflight += 1;
            n.cq.push(Completion::Write { wr: wr.wr, result });
        }
    }

    /// Marks `id` finished with `result`; the initiator learns it one
    /// (ack) latency later.
    fn finish(&mut self, id: u64, result: Result<(), TransportError>) {
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        op.phase = Phase::Acking(result);
        let (src, dst) = (op.src, op.dst);
        let t = self.now.saturating_add(self.one_way(dst, src));
        self.schedule(t, EvKind::Ack { op: id });
    }

    fn unreachable(&self, src: Loc, dst: Loc, why: &str) -> TransportError {
        TransportError::PeerUnreachable {
            nic: nic_name(src),
            peer: addr::encode(dst.0, dst.1),
            reason: why.to_owned(),
        }
    }

    fn dst_state(&self, dst: Loc) -> &'static str {
        match self.nic(dst) {
            None => "no such loopback NIC",
            Some(n) if !n.alive => "peer NIC is dead",
            Some(_) => "peer domain is closed",
        }
    }

    // --- event handling ---------------------------------------------------

    fn handle(&mut self, ev: EvKind) {
        self.stats.events += 1;
        match ev {
            EvKind::Chunk { op, idx, attempt } => self.on_chunk(op, idx, attempt),
            EvKind::SendArrive { op, attempt } => self.on_send(op, attempt),
            EvKind::Ack { op } => {
                let r = match self.ops.get(&op) {
                    Some(Op {
                        phase: Phase::Acking(r),
                        ..
                    }) => r.clone(),
                    _ => return,
                };
                self.complete(op, r);
            }
            EvKind::RnrTimeout { op } => {
                let Some(o) = self.ops.get(&op) else { return };
                let (src, dst) = (o.src, o.dst);
                if !matches!(
                    (&o.phase, o.body),
                    (Phase::InFlight, Body::Send { waiting: true, .. })
                ) {
                    return;
                }
                if let Some(n) = self.nic_mut(dst) {
                    n.rnr_wait.retain(|&w| w != op);
                }
                self.stats.rnr_timeouts += 1;
                let e = TransportError::ReceiverNotReady {
                    nic: nic_name(src),
                    peer: addr::encode(dst.0, dst.1),
                };
                self.finish(op, Err(e));
            }
            EvKind::Fail { op, why } => {
                let Some(o) = self.ops.get(&op) else { return };
                if !matches!(o.phase, Phase::InFlight) {
                    return;
                }
                let (src, dst, wr) = (o.src, o.dst, o.wr);
                let e = match why {
                    FailReason::Injected(rule) => TransportError::Failed {
                        nic: nic_name(src),
                        wr: Some(wr),
                        what: format!("error injected by loopback rule #{rule}"),
                    },
                    FailReason::Partition => self.unreachable(
                        src,
                        dst,
                        &format!(
                            "retry limit ({}) exceeded: every transmission lost",
                            self.cfg.retry_limit
                        ),
                    ),
                };
                self.complete(op, Err(e));
            }
        }
    }

    /// Whether this transmission is lost; if so schedules the retransmission.
    fn lost(&mut self, id: u64, mode: DropMode, chunk: u32, attempt: u32, resend: EvKind) -> bool {
        let lost = match mode {
            DropMode::Once => attempt == 0,
            DropMode::Random => {
                !self.cfg.null
                    && self.cfg.drop_prob > 0.0
                    && attempt < self.cfg.retry_limit
                    && self.rng.gen::<f64>() < self.cfg.drop_prob
            }
        };
        if lost {
            self.stats.drops += 1;
            self.stats.retransmits += 1;
            self.record(TraceKind::Dropped {
                op: id,
                chunk,
                attempt,
            });
            let t = self.now.saturating_add(dur_ns(self.cfg.retransmit_delay));
            self.schedule(t, resend);
        }
        lost
    }

    fn on_chunk(&mut self, id: u64, idx: u32, attempt: u32) {
        let Some(op) = self.ops.get(&id) else { return };
        if !matches!(op.phase, Phase::InFlight) {
            return;
        }
        let (src, dst, mode) = (op.src, op.dst, op.drop);
        let Body::Write {
            src_key,
            src_addr,
            len,
            rkey,
            dst_addr,
            imm,
            chunk,
            nchunks,
            ..
        } = op.body
        else {
            return;
        };
        let resend = EvKind::Chunk {
            op: id,
            idx,
            attempt: attempt.saturating_add(1),
        };
        if self.lost(id, mode, idx, attempt, resend) {
            return;
        }
        if !self.reachable(dst) {
            let e = self.unreachable(src, dst, self.dst_state(dst));
            self.finish(id, Err(e));
            return;
        }
        // All checks at the target, at arrival, against the whole WRITE.
        let src_dev = match self.check_local(src, src_key, src_addr, len) {
            Ok(d) => d,
            Err(e) => return self.finish(id, Err(e)),
        };
        let dst_dev = match self.check_remote(dst, rkey, dst_addr, len) {
            Ok(d) => d,
            Err(reason) => {
                let e = TransportError::RemoteAccess {
                    nic: nic_name(src),
                    peer: addr::encode(dst.0, dst.1),
                    rkey,
                    addr: dst_addr.unwrap_or(u64::MAX),
                    len,
                    reason,
                };
                return self.finish(id, Err(e));
            }
        };
        let off = u64::from(idx).saturating_mul(chunk);
        let bytes = chunk.min(len.saturating_sub(off));
        if !self.cfg.null {
            // Bounds of the whole write were checked above; off + bytes <= len.
            let (Some(d), Some(s)) = (
                dst_addr.and_then(|a| a.checked_add(off)),
                src_addr.checked_add(off),
            ) else {
                let e = TransportError::RemoteAccess {
                    nic: nic_name(src),
                    peer: addr::encode(dst.0, dst.1),
                    rkey,
                    addr: dst_addr.unwrap_or(u64::MAX),
                    len,
                    reason: RemoteAccessReason::OutOfBounds,
                };
                return self.finish(id, Err(e));
            };
            let r = mem::copy(
                Span {
                    addr: d,
                    device: dst_dev,
                },
                Span {
                    addr: s,
                    device: src_dev,
                },
                bytes,
                self.device_copy.as_deref(),
                || nic_name(src),
            );
            if let Err(e) = r {
                return self.finish(id, Err(e));
            }
        }
        self.stats.chunks_delivered += 1;
        self.stats.bytes_delivered += bytes;
        self.record(TraceKind::ChunkLanded {
            op: id,
            chunk: idx,
            offset: off,
            len: bytes,
        });
        let Some(Op {
            body: Body::Write {
                landed, max_landed, ..
            },
            ..
        }) = self.ops.get_mut(&id)
        else {
            return;
        };
        *landed += 1;
        let inverted = max_landed.is_some_and(|m| idx < m);
        *max_landed = Some(max_landed.map_or(idx, |m| m.max(idx)));
        let all = *landed >= nchunks;
        if inverted {
            self.stats.inversions_within += 1;
        }
        if !all {
            return;
        }
        // Whole payload landed: count cross-write inversions, report imm.
        let last = self.last_landed.entry((src, dst)).or_insert(id);
        if id < *last {
            self.stats.inversions_across += 1;
        } else {
            *last = id;
        }
        if let Some(imm) = imm {
            if let Some(n) = self.nic_mut(dst) {
                n.cq.push(Completion::Imm { imm });
            }
            self.stats.imms_delivered += 1;
            self.record(TraceKind::ImmDelivered { op: id, imm });
        }
        self.finish(id, Ok(()));
    }

    fn on_send(&mut self, id: u64, attempt: u32) {
        let Some(op) = self.ops.get(&id) else { return };
        if !matches!(op.phase, Phase::InFlight) {
            return;
        }
        let (src, dst, mode) = (op.src, op.dst, op.drop);
        let resend = EvKind::SendArrive {
            op: id,
            attempt: attempt.saturating_add(1),
        };
        if self.lost(id, mode, 0, attempt, resend) {
            return;
        }
        if !self.reachable(dst) {
            let e = self.unreachable(src, dst, self.dst_state(dst));
            return self.finish(id, Err(e));
        }
        let has_recv = self.nic(dst).is_some_and(|n| !n.recvs.is_empty());
        if has_recv {
            self.deliver_send(id);
            return;
        }
        // Receiver not ready: wait for a buffer, up to the RNR timeout.
        if let Some(Op {
            body: Body::Send { waiting, .. },
            ..
        }) = self.ops.get_mut(&id)
        {
            *waiting = true;
        }
        if let Some(n) = self.nic_mut(dst) {
            n.rnr_wait.push_back(id);
        }
        self.stats.rnr_waits += 1;
        self.record(TraceKind::RnrWait { op: id });
        let t = self.now.saturating_add(dur_ns(self.cfg.rnr_timeout));
        self.schedule(t, EvKind::RnrTimeout { op: id });
    }

    /// Places SEND `id` into a posted buffer at its (reachable) target.
    fn deliver_send(&mut self, id: u64) {
        let Some(op) = self.ops.get(&id) else { return };
        let (src, dst, wr) = (op.src, op.dst, op.wr);
        let Body::Send {
            src_key,
            src_addr,
            len,
            ..
        } = op.body
        else {
            return;
        };
        let src_dev = match self.check_local(src, src_key, src_addr, len) {
            Ok(d) => d,
            Err(e) => return self.finish(id, Err(e)),
        };
        let nrecv = self.nic(dst).map_or(0, |n| n.recvs.len());
        if nrecv == 0 {
            return;
        }
        let i = if self.cfg.random_recv_match && nrecv > 1 {
            self.rng.gen_range(0..nrecv)
        } else {
            0
        };
        let Some(recv) = self.nic(dst).and_then(|n| n.recvs.get(i)).copied() else {
            return;
        };
        if len > recv.len {
            let e = TransportError::MessageTooLong {
                nic: nic_name(src),
                peer: addr::encode(dst.0, dst.1),
                len,
                capacity: recv.len,
            };
            return self.finish(id, Err(e));
        }
        // The buffer's registration is live: deregistration flushes buffers.
        let dst_dev = self
            .nic(dst)
            .and_then(|n| n.regs.get(&recv.key))
            .map(|r| r.device);
        let Some(dst_dev) = dst_dev else {
            let e = TransportError::Failed {
                nic: nic_name(src),
                wr: Some(wr),
                what: "receive buffer registration vanished".into(),
            };
            return self.finish(id, Err(e));
        };
        if !self.cfg.null {
            let r = mem::copy(
                Span {
                    addr: recv.addr,
                    device: dst_dev,
                },
                Span {
                    addr: src_addr,
                    device: src_dev,
                },
                len,
                self.device_copy.as_deref(),
                || nic_name(src),
            );
            if let Err(e) = r {
                return self.finish(id, Err(e));
            }
        }
        if let Some(n) = self.nic_mut(dst).filter(|n| i < n.recvs.len()) {
            n.recvs.remove(i);
            n.cq.push(Completion::Recv {
                wr: recv.wr,
                result: Ok(len),
            });
        }
        self.stats.recvs_matched += 1;
        self.stats.bytes_delivered += len;
        self.record(TraceKind::RecvMatched {
            op: id,
            recv_wr: recv.wr.0,
            len,
        });
        self.finish(id, Ok(()));
    }

    /// Hands newly posted buffers at `loc` to SENDs waiting there.
    fn match_waiting(&mut self, loc: Loc) {
        loop {
            let Some(n) = self.nic_mut(loc) else { return };
            if n.recvs.is_empty() {
                return;
            }
            let Some(id) = n.rnr_wait.pop_front() else {
                return;
            };
            let waiting = matches!(
                self.ops.get(&id),
                Some(Op {
                    phase: Phase::InFlight,
                    body: Body::Send { waiting: true, .. },
                    ..
                })
            );
            if !waiting {
                continue;
            }
            if let Some(Op {
                body: Body::Send { waiting, .. },
                ..
            }) = self.ops.get_mut(&id)
            {
                *waiting = false;
            }
            self.deliver_send(id);
        }
    }

    // --- faults -----------------------------------------------------------

    pub(crate) fn kill_host(&mut self, host: u32) {
        let n = self.hosts.get(host as usize).map_or(0, |h| h.nics.len());
        for nic in 0..n {
            if let Ok(nic) = u32::try_from(nic) {
                self.nic_down((host, nic), true);
            }
        }
    }

    /// A NIC dies (`killed`) or its domain closes.
    pub(crate) fn nic_down(&mut self, loc: Loc, killed: bool) {
        let Some(n) = self.nic_mut(loc) else { return };
        if killed && !n.alive {
            return;
        }
        if killed {
            n.alive = false;
        } else {
            n.open = false;
            n.regs.clear();
        }
        n.recvs.clear();
        n.rnr_wait.clear();
        n.cq.clear();
        n.inflight = 0;
        self.record(TraceKind::NicDown {
            host: loc.0,
            nic: loc.1,
            killed,
        });
        let affected: Vec<(u64, bool)> = self
            .ops
            .iter()
            .filter(|(_, o)| o.src == loc || (o.dst == loc && matches!(o.phase, Phase::InFlight)))
            .map(|(&id, o)| (id, o.src == loc))
            .collect();
        let why = if killed {
            "peer NIC died"
        } else {
            "peer domain closed"
        };
        for (id, own) in affected {
            if own {
                // The initiator is gone: its work vanishes with it.
                self.ops.remove(&id);
                self.record(TraceKind::Completed {
                    op: id,
                    error: Some("canceled: initiator NIC down".into()),
                });
            } else if let Some(src) = self.ops.get(&id).map(|o| o.src) {
                let e = self.unreachable(src, loc, why);
                self.complete(id, Err(e));
            }
        }
    }
}
