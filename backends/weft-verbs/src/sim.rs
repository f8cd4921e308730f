//! A simulated RC/UD device behind the verbs seam (cargo feature `sim`).
//!
//! One [`SimFabric`] holds any number of simulated devices ("nodes") in this
//! process. What it models:
//! - QP state machine RESET→INIT→RTR→RTS→ERR; invalid transitions fail with
//!   `EINVAL`, posting to a QP not in RTS fails with `EINVAL`, posting to a QP
//!   in ERR is accepted and flushed (`IBV_WC_WR_FLUSH_ERR`), like mlx5.
//! - RC: strictly in order per QP (a stalled WR blocks those behind it);
//!   SEND consumes a receive from the QP's SRQ or RQ, WRITE_WITH_IMM consumes
//!   one too (zero-byte is fine) and reports the immediate; no receive →
//!   RNR retries (`rnr_retry`, 7 = infinite) then `IBV_WC_RNR_RETRY_EXC_ERR`;
//!   a SEND longer than the receive buffer → `IBV_WC_LOC_LEN_ERR` on the
//!   receiver and `IBV_WC_REM_INV_REQ_ERR` on the sender; rkey/bounds/access
//!   checks → `IBV_WC_REM_ACCESS_ERR` (nothing written); a dead or unconnected
//!   peer → transport retries (`retry_cnt`) then `IBV_WC_RETRY_EXC_ERR`. Any
//!   error completion moves the QP to ERR and flushes the rest.
//! - UD: datagrams up to the MTU, 40-byte GRH in front of the payload, dropped
//!   with a seeded probability, by explicit drop rules, or when no receive is
//!   posted.
//! - CQ overrun: a CQE that does not fit marks the CQ overrun; `poll_cq` then
//!   fails with `EOVERFLOW` forever.
//! - Doorbells: every `post_send` call and its chain length is counted.
//! - Time: a logical clock; each `poll_cq` advances it by
//!   [`SimConfig::tick_ns`] and runs the fabric. No wall clock.
//!
//! Not modeled: GPU memory (registering it is `EOPNOTSUPP`; `reg_dmabuf_mr`
//! too), RDMA READ/atomics, the IB timeout exponent (the sim uses
//! [`SimConfig::ack_timeout_ns`]), packet-level PSN checks, async events.

use crate::ops::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use weft_transport::TransportError;

const EINVAL: i32 = 22;
const ENOMEM: i32 = 12;
const EOVERFLOW: i32 = 75;
const EOPNOTSUPP: i32 = 95;
const ENOENT: i32 = 2;
const EBUSY: i32 = 16;
/// Size of the GRH in front of every UD receive.
pub const GRH_LEN: usize = 40;

/// Knobs of the simulated fabric.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Seed of every random decision.
    pub seed: u64,
    /// Logical time one `poll_cq` call advances the clock by.
    pub tick_ns: u64,
    /// One-way latency of a WR/datagram.
    pub latency_ns: u64,
    /// Time before an unacknowledged RC WR is retried.
    pub ack_timeout_ns: u64,
    /// Time between RNR retries.
    pub rnr_delay_ns: u64,
    /// Probability a UD datagram is dropped.
    pub ud_drop_prob: f64,
    /// `max_msg_sz` reported by the ports.
    pub max_msg_sz: u32,
    /// Active MTU code reported (1..=5).
    pub active_mtu: u32,
    /// Link layer reported.
    pub link_layer: LinkLayer,
    /// Largest CQ / QP depth accepted.
    pub max_depth: u32,
}

impl SimConfig {
    /// Defaults for a seed: 1 µs ticks, 2 µs latency, no UD drops.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            tick_ns: 1_000,
            latency_ns: 2_000,
            ack_timeout_ns: 20_000,
            rnr_delay_ns: 10_000,
            ud_drop_prob: 0.0,
            max_msg_sz: 1 << 30,
            active_mtu: 5,
            link_layer: LinkLayer::Ethernet,
            max_depth: 1 << 16,
        }
    }
}

/// Counters of one simulated device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimStats {
    /// `post_send` calls on RC QPs (doorbells rung).
    pub rc_doorbells: u64,
    /// Number of WRs in each RC `post_send` call that posted at least one
    /// WR, in call order.
    pub rc_chain_lens: Vec<usize>,
    /// `post_send` calls on UD QPs.
    pub ud_doorbells: u64,
    /// UD datagrams sent.
    pub ud_sent: u64,
    /// UD datagrams dropped (random, rule, no receive).
    pub ud_dropped: u64,
    /// RNR NAKs suffered by this device's senders.
    pub rnr_naks: u64,
    /// Transport retries (no ACK) of this device's senders.
    pub retries: u64,
    /// Error completions generated on this device (not flushes).
    pub error_cqes: u64,
    /// Flush completions generated on this device.
    pub flush_cqes: u64,
}

struct SimMr {
    node: usize,
    addr: u64,
    len: u64,
    access: u32,
    lkey: u32,
    rkey: u32,
}

struct SimCq {
    node: usize,
    cap: usize,
    entries: VecDeque<Wc>,
    overrun: bool,
}

struct SimSrq {
    node: usize,
    max_wr: usize,
    queue: VecDeque<RecvWr>,
}

struct InFlight {
    wr: SendWr,
    ready_at: u64,
    retries: u32,
    rnr: u32,
}

struct SimQp {
    node: usize,
    qpn: u32,
    ty: QpType,
    state: QpState,
    send_cq: Cq,
    recv_cq: Cq,
    srq: Option<Srq>,
    max_send_wr: usize,
    max_recv_wr: usize,
    sq: VecDeque<InFlight>,
    rq: VecDeque<RecvWr>,
    dest_qpn: u32,
    dest: Option<AhAttr>,
    qkey: u32,
    retry_cnt: u8,
    rnr_retry: u8,
    remote_access: u32,
    last_ready: u64,
    /// Set when the QP entered ERR; flushes happen in the next step.
    flush_pending: bool,
}

struct Node {
    name: String,
    alive: bool,
    lid: u16,
    gid: Gid,
    stats: SimStats,
    fail_post_at: Option<usize>,
    drop_ud_to: u32,
}

struct Fabric {
    cfg: SimConfig,
    now: u64,
    rng: ChaCha8Rng,
    nodes: Vec<Node>,
    next_id: u64,
    next_key: u32,
    next_qpn: u32,
    mrs: BTreeMap<u64, SimMr>,
    cqs: BTreeMap<u64, SimCq>,
    srqs: BTreeMap<u64, SimSrq>,
    qps: BTreeMap<u32, SimQp>,
    ahs: BTreeMap<u64, (usize, AhAttr)>,
    pds: BTreeMap<u64, usize>,
}

/// A simulated fabric: create devices with [`SimFabric::add_device`].
#[derive(Clone)]
pub struct SimFabric {
    inner: Arc<Mutex<Fabric>>,
}

impl SimFabric {
    /// A new empty fabric.
    pub fn new(cfg: SimConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Self {
            inner: Arc::new(Mutex::new(Fabric {
                cfg,
                now: 0,
                rng,
                nodes: Vec::new(),
                next_id: 1,
                next_key: 0x100,
                next_qpn: 0x40,
                mrs: BTreeMap::new(),
                cqs: BTreeMap::new(),
                srqs: BTreeMap::new(),
                qps: BTreeMap::new(),
                ahs: BTreeMap::new(),
                pds: BTreeMap::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Fabric> {
        // A panic while holding the lock only happens in a failing test; keep
        // going with the state as it is.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a device (one NIC with one port) and returns a library that
    /// lists exactly that device.
    pub fn add_device(&self, name: &str) -> SimLib {
        let mut f = self.lock();
        let idx = f.nodes.len();
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12] = 10;
        gid[14] = ((idx >> 8) & 0xff) as u8;
        gid[15] = (idx & 0xff) as u8;
        f.nodes.push(Node {
            name: name.to_string(),
            alive: true,
            lid: u16::try_from(idx + 1).unwrap_or(u16::MAX),
            gid: Gid(gid),
            stats: SimStats::default(),
            fail_post_at: None,
            drop_ud_to: 0,
        });
        SimLib {
            fabric: self.clone(),
            nodes: vec![idx],
        }
    }

    /// Adds `nics` devices named `{prefix}n{i}` and returns a library that
    /// lists them in order (one host with several NICs).
    pub fn add_host(&self, prefix: &str, nics: usize) -> SimLib {
        let mut nodes = Vec::with_capacity(nics);
        for i in 0..nics {
            nodes.extend(self.add_device(&format!("{prefix}n{i}")).nodes);
        }
        SimLib {
            fabric: self.clone(),
            nodes,
        }
    }

    fn node_idx(f: &Fabric, name: &str) -> Option<usize> {
        f.nodes.iter().position(|n| n.name == name)
    }

    /// Kills a device: it stops answering anything (peers see retry-exceeded,
    /// its own polls keep working but nothing arrives).
    pub fn kill(&self, name: &str) {
        let mut f = self.lock();
        if let Some(i) = Self::node_idx(&f, name) {
            f.nodes[i].alive = false;
        }
    }

    /// Counters of a device.
    pub fn stats(&self, name: &str) -> SimStats {
        let f = self.lock();
        Self::node_idx(&f, name)
            .map(|i| f.nodes[i].stats.clone())
            .unwrap_or_default()
    }

    /// The next RC `post_send` on device `name` fails with `ENOMEM` at chain
    /// index `index` (WRs before it are posted), as a full send queue would.
    pub fn fail_next_post_send(&self, name: &str, index: usize) {
        let mut f = self.lock();
        if let Some(i) = Self::node_idx(&f, name) {
            f.nodes[i].fail_post_at = Some(index);
        }
    }

    /// Drops the next `count` UD datagrams addressed to device `name`.
    pub fn drop_ud_to(&self, name: &str, count: u32) {
        let mut f = self.lock();
        if let Some(i) = Self::node_idx(&f, name) {
            f.nodes[i].drop_ud_to = count;
        }
    }

    /// Sets the UD drop probability.
    pub fn set_ud_drop_prob(&self, p: f64) {
        self.lock().cfg.ud_drop_prob = p;
    }

    /// Moves every QP of device `name` to ERR (as a local catastrophic error
    /// would), flushing their work.
    pub fn error_all_qps(&self, name: &str) {
        let mut f = self.lock();
        if let Some(i) = Self::node_idx(&f, name) {
            for qp in f.qps.values_mut() {
                if qp.node == i && qp.ty == QpType::Rc {
                    qp.state = QpState::Err;
                    qp.flush_pending = true;
                }
            }
        }
    }

    /// The logical clock.
    pub fn now(&self) -> u64 {
        self.lock().now
    }

    /// Advances the clock by one tick and runs the fabric.
    pub fn step(&self) {
        let mut f = self.lock();
        f.now = f.now.saturating_add(f.cfg.tick_ns);
        f.run();
    }
}

/// A library listing a set of simulated devices (implements [`VerbsLib`]).
#[derive(Clone)]
pub struct SimLib {
    fabric: SimFabric,
    nodes: Vec<usize>,
}

impl SimLib {
    /// A library that lists no device (for "no device" tests).
    pub fn empty(fabric: &SimFabric) -> Self {
        Self {
            fabric: fabric.clone(),
            nodes: Vec::new(),
        }
    }

    /// The fabric this library's devices live on.
    pub fn fabric(&self) -> &SimFabric {
        &self.fabric
    }
}

impl VerbsLib for SimLib {
    type Ops = SimDevice;

    fn devices(&self) -> Result<Vec<DeviceInfo>, TransportError> {
        let f = self.fabric.lock();
        Ok(self
            .nodes
            .iter()
            .filter_map(|i| f.nodes.get(*i))
            .map(|n| DeviceInfo {
                name: n.name.clone(),
                numa_node: Some(0),
            })
            .collect())
    }

    fn open(&self, index: usize) -> Result<SimDevice, TransportError> {
        let node = *self
            .nodes
            .get(index)
            .ok_or_else(|| TransportError::NoDevice {
                what: format!("simulated verbs (index {index})"),
            })?;
        let name = self.fabric.lock().nodes[node].name.clone();
        Ok(SimDevice {
            fabric: self.fabric.clone(),
            node,
            name,
        })
    }
}

/// One opened simulated device.
pub struct SimDevice {
    fabric: SimFabric,
    node: usize,
    name: String,
}

fn verr(op: &'static str, code: i32, detail: impl Into<String>) -> VerbsError {
    VerbsError::new(op, code, detail)
}

impl Fabric {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn key(&mut self) -> u32 {
        self.next_key = self.next_key.wrapping_add(0x101);
        self.next_key
    }

    fn push_cqe(&mut self, cq: Cq, wc: Wc) {
        let Some(c) = self.cqs.get_mut(&cq.0) else {
            return;
        };
        if c.overrun {
            return;
        }
        if c.entries.len() >= c.cap {
            c.overrun = true;
            tracing::error!(cq = cq.0, "simulated CQ overrun");
            return;
        }
        let node = c.node;
        c.entries.push_back(wc);
        if let Some(n) = self.nodes.get_mut(node) {
            match wc.status {
                WcStatus::Success => {}
                WcStatus::WrFlushErr => n.stats.flush_cqes += 1,
                _ => n.stats.error_cqes += 1,
            }
        }
    }

    fn local_sge_ok(&self, node: usize, sge: &Option<Sge>, need_write: bool) -> bool {
        let Some(s) = sge else { return true };
        self.mrs.values().any(|m| {
            m.node == node
                && m.lkey == s.lkey
                && (!need_write || m.access & access::LOCAL_WRITE != 0)
                && span(m.addr, m.len, s.addr, u64::from(s.length))
        })
    }

    fn find_node(&self, ah: &AhAttr) -> Option<usize> {
        if ah.is_global {
            self.nodes.iter().position(|n| n.gid == ah.dgid)
        } else {
            self.nodes.iter().position(|n| n.lid == ah.dlid)
        }
    }

    fn set_err(&mut self, qpn: u32) {
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.state = QpState::Err;
            q.flush_pending = true;
        }
    }

    fn flush(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        q.flush_pending = false;
        let sq: Vec<_> = q.sq.drain(..).map(|f| f.wr).collect();
        let rq: Vec<_> = q.rq.drain(..).collect();
        let (scq, rcq) = (q.send_cq, q.recv_cq);
        for wr in sq {
            self.push_cqe(
                scq,
                wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Other(0), qpn),
            );
        }
        for wr in rq {
            self.push_cqe(
                rcq,
                wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Other(0), qpn),
            );
        }
    }

    /// Fails the head WR of `qpn` with `status`, moves the QP to ERR.
    fn fail_head(&mut self, qpn: u32, status: WcStatus) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(head) = q.sq.pop_front() else { return };
        let cq = q.send_cq;
        self.push_cqe(cq, wc(head.wr.wr_id, status, WcOpcode::Other(0), qpn));
        self.set_err(qpn);
    }

    fn take_recv(&mut self, qpn: u32) -> Option<(RecvWr, Cq)> {
        let q = self.qps.get_mut(&qpn)?;
        let cq = q.recv_cq;
        match q.srq {
            Some(s) => self.srqs.get_mut(&s.0)?.queue.pop_front().map(|r| (r, cq)),
            None => q.rq.pop_front().map(|r| (r, cq)),
        }
    }

    fn run(&mut self) {
        let qpns: Vec<u32> = self.qps.keys().copied().collect();
        for qpn in &qpns {
            if self.qps.get(qpn).is_some_and(|q| q.flush_pending) {
                self.flush(*qpn);
            }
        }
        for qpn in qpns {
            while let Some(q) = self.qps.get(&qpn) {
                if q.state != QpState::Rts {
                    break;
                }
                let Some(head) = q.sq.front() else { break };
                if head.ready_at > self.now {
                    break;
                }
                let alive = self.nodes.get(q.node).is_some_and(|n| n.alive);
                if !alive {
                    break;
                }
                match q.ty {
                    QpType::Ud => self.exec_ud(qpn),
                    QpType::Rc => self.exec_rc(qpn),
                }
            }
        }
    }

    fn exec_ud(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(head) = q.sq.pop_front() else { return };
        let (node, scq) = (q.node, q.send_cq);
        let wr = head.wr;
        let mtu = mtu_bytes(self.cfg.active_mtu).unwrap_or(4096);
        if !self.local_sge_ok(node, &wr.sge, false) {
            self.push_cqe(scq, wc(wr.wr_id, WcStatus::LocProtErr, WcOpcode::Send, qpn));
            self.set_err(qpn);
            return;
        }
        let len = wr.sge.map_or(0, |s| s.length);
        if len > mtu {
            self.push_cqe(scq, wc(wr.wr_id, WcStatus::LocLenErr, WcOpcode::Send, qpn));
            self.set_err(qpn);
            return;
        }
        if let SendOp::UdSend {
            ah,
            remote_qpn,
            remote_qkey,
        } = wr.op
        {
            self.nodes[node].stats.ud_sent += 1;
            let dest = self.ahs.get(&ah.0).map(|(_, a)| *a);
            let dnode = dest.and_then(|a| self.find_node(&a));
            let drop_random = self.rng.gen_bool(self.cfg.ud_drop_prob.clamp(0.0, 1.0));
            let mut delivered = false;
            if let Some(d) = dnode {
                let rule_drop = self.nodes[d].drop_ud_to > 0;
                if rule_drop {
                    self.nodes[d].drop_ud_to -= 1;
                }
                let ok = !rule_drop
                    && !drop_random
                    && self.nodes[d].alive
                    && self.qps.get(&remote_qpn).is_some_and(|r| {
                        r.node == d
                            && r.ty == QpType::Ud
                            && matches!(r.state, QpState::Rtr | QpState::Rts)
                            && r.qkey == remote_qkey
                    });
                if ok {
                    if let Some((rwr, rcq)) = self.take_recv(remote_qpn) {
                        let cap = rwr.sge.map_or(0, |s| s.length as usize);
                        if cap >= GRH_LEN + len as usize && self.local_sge_ok(d, &rwr.sge, true) {
                            if let (Some(dst), Some(src)) = (rwr.sge, wr.sge) {
                                let mut grh = [0u8; GRH_LEN];
                                grh[8..24].copy_from_slice(&self.nodes[node].gid.0);
                                grh[24..40].copy_from_slice(&self.nodes[d].gid.0);
                                // SAFETY: both SGEs were checked against live
                                // registrations of their nodes, whose owners
                                // promised (MemRegion::new / internal buffers)
                                // the memory stays valid while registered.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        grh.as_ptr(),
                                        dst.addr as usize as *mut u8,
                                        GRH_LEN,
                                    );
                                    std::ptr::copy(
                                        src.addr as usize as *const u8,
                                        (dst.addr as usize as *mut u8).add(GRH_LEN),
                                        len as usize,
                                    );
                                }
                            }
                            let mut w =
                                wc(rwr.wr_id, WcStatus::Success, WcOpcode::Recv, remote_qpn);
                            w.byte_len = GRH_LEN as u32 + len;
                            w.src_qp = qpn;
                            self.push_cqe(rcq, w);
                            delivered = true;
                        } else {
                            let w = wc(rwr.wr_id, WcStatus::LocLenErr, WcOpcode::Recv, remote_qpn);
                            self.push_cqe(rcq, w);
                        }
                    }
                }
            }
            if !delivered {
                self.nodes[node].stats.ud_dropped += 1;
            }
        }
        if wr.signaled {
            self.push_cqe(scq, wc(wr.wr_id, WcStatus::Success, WcOpcode::Send, qpn));
        }
    }

    fn exec_rc(&mut self, qpn: u32) {
        let now = self.now;
        let (ack_timeout, rnr_delay) = (self.cfg.ack_timeout_ns, self.cfg.rnr_delay_ns);
        let Some(q) = self.qps.get(&qpn) else { return };
        let Some(head) = q.sq.front() else { return };
        let wr = head.wr;
        let node = q.node;
        let scq = q.send_cq;
        let retry_cnt = q.retry_cnt;
        let rnr_retry = q.rnr_retry;
        // Local protection check.
        if !self.local_sge_ok(node, &wr.sge, false) {
            self.fail_head(qpn, WcStatus::LocProtErr);
            return;
        }
        // Find the responder: right node, alive, connected back to us.
        let dnode = q.dest.and_then(|a| self.find_node(&a));
        let dest_qpn = q.dest_qpn;
        let responder_ok = dnode.is_some_and(|d| {
            self.nodes[d].alive
                && self.qps.get(&dest_qpn).is_some_and(|r| {
                    r.node == d
                        && r.ty == QpType::Rc
                        && matches!(r.state, QpState::Rtr | QpState::Rts)
                        && r.dest_qpn == qpn
                })
        });
        if !responder_ok {
            self.nodes[node].stats.retries += 1;
            let q = self.qps.get_mut(&qpn).expect("checked above");
            let h = q.sq.front_mut().expect("checked above");
            if h.retries >= u32::from(retry_cnt) {
                self.fail_head(qpn, WcStatus::RetryExcErr);
            } else {
                h.retries += 1;
                h.ready_at = now.saturating_add(ack_timeout);
            }
            return;
        }
        let Some(d) = dnode else { return };
        let len = wr.sge.map_or(0u64, |s| u64::from(s.length));
        let (remote_write, needs_recv, imm) = match wr.op {
            SendOp::Send => (None, true, None),
            SendOp::Write { remote_addr, rkey } => (Some((remote_addr, rkey)), false, None),
            SendOp::WriteImm {
                remote_addr,
                rkey,
                imm,
            } => (Some((remote_addr, rkey)), true, Some(imm)),
            SendOp::UdSend { .. } => {
                self.fail_head(qpn, WcStatus::LocQpOpErr);
                return;
            }
        };
        let remote_access = self.qps.get(&dest_qpn).map_or(0, |r| r.remote_access);
        if let Some((raddr, rkey)) = remote_write {
            let ok = remote_access & access::REMOTE_WRITE != 0
                && (len == 0
                    || self.mrs.values().any(|m| {
                        m.node == d
                            && m.rkey == rkey
                            && m.access & access::REMOTE_WRITE != 0
                            && span(m.addr, m.len, raddr, len)
                    }));
            if !ok {
                self.fail_head(qpn, WcStatus::RemAccessErr);
                return;
            }
        }
        let mut recv = None;
        if needs_recv {
            match self.take_recv(dest_qpn) {
                Some(r) => recv = Some(r),
                None => {
                    self.nodes[node].stats.rnr_naks += 1;
                    let q = self.qps.get_mut(&qpn).expect("checked above");
                    let h = q.sq.front_mut().expect("checked above");
                    if rnr_retry != 7 && h.rnr >= u32::from(rnr_retry) {
                        self.fail_head(qpn, WcStatus::RnrRetryExcErr);
                    } else {
                        h.rnr += 1;
                        h.ready_at = now.saturating_add(rnr_delay);
                    }
                    return;
                }
            }
        }
        // Move the bytes.
        match (wr.op, &recv) {
            (SendOp::Send, Some((rwr, rcq))) => {
                let cap = rwr.sge.map_or(0, |s| u64::from(s.length));
                if len > cap || !self.local_sge_ok(d, &rwr.sge, true) {
                    let st = if len > cap {
                        WcStatus::LocLenErr
                    } else {
                        WcStatus::LocProtErr
                    };
                    self.push_cqe(*rcq, wc(rwr.wr_id, st, WcOpcode::Recv, dest_qpn));
                    self.set_err(dest_qpn);
                    self.fail_head(qpn, WcStatus::RemInvReqErr);
                    return;
                }
                if let (Some(src), Some(dst)) = (wr.sge, rwr.sge) {
                    // SAFETY: both SGEs were bounds-checked against live
                    // registrations (see exec_ud).
                    unsafe {
                        std::ptr::copy(
                            src.addr as usize as *const u8,
                            dst.addr as usize as *mut u8,
                            len as usize,
                        )
                    };
                }
                let mut w = wc(rwr.wr_id, WcStatus::Success, WcOpcode::Recv, dest_qpn);
                w.byte_len = len as u32;
                w.src_qp = qpn;
                self.push_cqe(*rcq, w);
            }
            (SendOp::Write { remote_addr, .. } | SendOp::WriteImm { remote_addr, .. }, _) => {
                if let Some(src) = wr.sge {
                    // SAFETY: source checked against a local registration and
                    // the target range against a remote-writable one.
                    unsafe {
                        std::ptr::copy(
                            src.addr as usize as *const u8,
                            remote_addr as usize as *mut u8,
                            len as usize,
                        )
                    };
                }
                if let (Some(imm), Some((rwr, rcq))) = (imm, &recv) {
                    let mut w = wc(
                        rwr.wr_id,
                        WcStatus::Success,
                        WcOpcode::RecvRdmaWithImm,
                        dest_qpn,
                    );
                    w.byte_len = len as u32;
                    w.imm = Some(imm);
                    w.src_qp = qpn;
                    self.push_cqe(*rcq, w);
                }
            }
            _ => {}
        }
        let q = self.qps.get_mut(&qpn).expect("checked above");
        q.sq.pop_front();
        if wr.signaled {
            let op = match wr.op {
                SendOp::Send | SendOp::UdSend { .. } => WcOpcode::Send,
                _ => WcOpcode::RdmaWrite,
            };
            self.push_cqe(scq, wc(wr.wr_id, WcStatus::Success, op, qpn));
        }
    }
}

fn span(base: u64, base_len: u64, addr: u64, len: u64) -> bool {
    match (addr.checked_add(len), base.checked_add(base_len)) {
        (Some(end), Some(bend)) => addr >= base && end <= bend,
        _ => false,
    }
}

fn wc(wr_id: u64, status: WcStatus, opcode: WcOpcode, qpn: u32) -> Wc {
    Wc {
        wr_id,
        status,
        opcode,
        vendor_err: 0,
        byte_len: 0,
        imm: None,
        qp_num: qpn,
        src_qp: 0,
    }
}

impl SimDevice {
    fn f(&self) -> MutexGuard<'_, Fabric> {
        self.fabric.lock()
    }

    /// The fabric this device lives on.
    pub fn fabric(&self) -> &SimFabric {
        &self.fabric
    }
}

impl VerbsOps for SimDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn query_port(&mut self, port: u8) -> Result<PortAttr, VerbsError> {
        if port != 1 {
            return Err(verr("ibv_query_port", EINVAL, format!("port {port}")));
        }
        let f = self.f();
        let n = &f.nodes[self.node];
        Ok(PortAttr {
            state: if n.alive { PORT_ACTIVE } else { 1 },
            active_mtu: f.cfg.active_mtu,
            gid_tbl_len: 4,
            max_msg_sz: f.cfg.max_msg_sz,
            lid: if f.cfg.link_layer == LinkLayer::Ethernet {
                0
            } else {
                n.lid
            },
            link_layer: f.cfg.link_layer,
            active_width: 2,
            active_speed: 32,
        })
    }

    fn query_gid(&mut self, port: u8, index: u32) -> Result<GidEntry, VerbsError> {
        if port != 1 {
            return Err(verr("ibv_query_gid_ex", EINVAL, format!("port {port}")));
        }
        let f = self.f();
        let n = &f.nodes[self.node];
        let ib = f.cfg.link_layer != LinkLayer::Ethernet;
        // Table: 0 link-local (IB / RoCE v1), 1 link-local RoCE v2,
        // 2 IPv4-mapped RoCE v1, 3 IPv4-mapped RoCE v2 (the one to pick).
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[8..].copy_from_slice(&n.gid.0[8..]);
        let e = |gid, t| {
            Ok(GidEntry {
                gid,
                gid_type: Some(t),
            })
        };
        match (ib, index) {
            (true, 0) => e(n.gid, GidType::Ib),
            (true, _) => Err(verr("ibv_query_gid_ex", ENOENT, "")),
            (false, 0) => e(Gid(ll), GidType::RoceV1),
            (false, 1) => e(Gid(ll), GidType::RoceV2),
            (false, 2) => e(n.gid, GidType::RoceV1),
            (false, 3) => e(n.gid, GidType::RoceV2),
            _ => Err(verr("ibv_query_gid_ex", ENOENT, "")),
        }
    }

    fn alloc_pd(&mut self) -> Result<Pd, VerbsError> {
        let mut f = self.f();
        let id = f.id();
        f.pds.insert(id, self.node);
        Ok(Pd(id))
    }

    fn dealloc_pd(&mut self, pd: Pd) -> Result<(), VerbsError> {
        let mut f = self.f();
        f.pds
            .remove(&pd.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_dealloc_pd", EINVAL, ""))
    }

    fn reg_mr(
        &mut self,
        pd: Pd,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        let mut f = self.f();
        if f.pds.get(&pd.0) != Some(&self.node) {
            return Err(verr("ibv_reg_mr", EINVAL, "bad pd"));
        }
        if addr.checked_add(len).is_none() {
            return Err(verr("ibv_reg_mr", EINVAL, "range overflows"));
        }
        let id = f.id();
        let lkey = f.key();
        let rkey = f.key();
        f.mrs.insert(
            id,
            SimMr {
                node: self.node,
                addr,
                len,
                access,
                lkey,
                rkey,
            },
        );
        Ok((Mr(id), lkey, rkey))
    }

    fn reg_dmabuf_mr(
        &mut self,
        _pd: Pd,
        _offset: u64,
        _len: u64,
        _iova: u64,
        _fd: i32,
        _access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        Err(verr(
            "ibv_reg_dmabuf_mr",
            EOPNOTSUPP,
            "the simulated device has no GPU memory",
        ))
    }

    fn dereg_mr(&mut self, mr: Mr) -> Result<(), VerbsError> {
        self.f()
            .mrs
            .remove(&mr.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_dereg_mr", EINVAL, "unknown mr"))
    }

    fn create_cq(&mut self, cqe: u32) -> Result<Cq, VerbsError> {
        let mut f = self.f();
        if cqe == 0 || cqe > f.cfg.max_depth {
            return Err(verr("ibv_create_cq", EINVAL, format!("cqe {cqe}")));
        }
        let id = f.id();
        f.cqs.insert(
            id,
            SimCq {
                node: self.node,
                cap: cqe as usize,
                entries: VecDeque::new(),
                overrun: false,
            },
        );
        Ok(Cq(id))
    }

    fn destroy_cq(&mut self, cq: Cq) -> Result<(), VerbsError> {
        let mut f = self.f();
        if f.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
            return Err(verr("ibv_destroy_cq", EBUSY, "QPs still attached"));
        }
        f.cqs
            .remove(&cq.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_destroy_cq", EINVAL, ""))
    }

    fn create_srq(&mut self, pd: Pd, max_wr: u32) -> Result<Srq, VerbsError> {
        let mut f = self.f();
        if f.pds.get(&pd.0) != Some(&self.node) || max_wr == 0 || max_wr > f.cfg.max_depth {
            return Err(verr("ibv_create_srq", EINVAL, ""));
        }
        let id = f.id();
        f.srqs.insert(
            id,
            SimSrq {
                node: self.node,
                max_wr: max_wr as usize,
                queue: VecDeque::new(),
            },
        );
        Ok(Srq(id))
    }

    fn destroy_srq(&mut self, srq: Srq) -> Result<(), VerbsError> {
        let mut f = self.f();
        if f.qps.values().any(|q| q.srq == Some(srq)) {
            return Err(verr("ibv_destroy_srq", EBUSY, ""));
        }
        f.srqs
            .remove(&srq.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_destroy_srq", EINVAL, ""))
    }

    fn create_qp(&mut self, pd: Pd, init: &QpInit) -> Result<QpCreated, VerbsError> {
        let mut f = self.f();
        let node = self.node;
        let ok = f.pds.get(&pd.0) == Some(&node)
            && f.cqs.get(&init.send_cq.0).is_some_and(|c| c.node == node)
            && f.cqs.get(&init.recv_cq.0).is_some_and(|c| c.node == node)
            && init
                .srq
                .is_none_or(|s| f.srqs.get(&s.0).is_some_and(|s| s.node == node))
            && init.max_send_wr > 0
            && init.max_send_wr <= f.cfg.max_depth
            && init.max_recv_wr <= f.cfg.max_depth
            && !(init.qp_type == QpType::Ud && init.srq.is_some());
        if !ok {
            return Err(verr("ibv_create_qp", EINVAL, format!("{init:?}")));
        }
        f.next_qpn += 1;
        let qpn = f.next_qpn;
        f.qps.insert(
            qpn,
            SimQp {
                node,
                qpn,
                ty: init.qp_type,
                state: QpState::Reset,
                send_cq: init.send_cq,
                recv_cq: init.recv_cq,
                srq: init.srq,
                max_send_wr: init.max_send_wr as usize,
                max_recv_wr: init.max_recv_wr as usize,
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                dest_qpn: 0,
                dest: None,
                qkey: 0,
                retry_cnt: 0,
                rnr_retry: 0,
                remote_access: 0,
                last_ready: 0,
                flush_pending: false,
            },
        );
        Ok(QpCreated {
            qp: Qp(u64::from(qpn)),
            qpn,
            max_send_wr: init.max_send_wr,
            max_recv_wr: init.max_recv_wr,
        })
    }

    fn modify_qp(&mut self, qp: Qp, change: &ModifyQp) -> Result<(), VerbsError> {
        let mut f = self.f();
        let node = self.node;
        let qpn = u32::try_from(qp.0).unwrap_or(0);
        let Some(q) = f.qps.get_mut(&qpn).filter(|q| q.node == node) else {
            return Err(verr("ibv_modify_qp", EINVAL, "unknown qp"));
        };
        let bad = |q: &SimQp| {
            verr(
                "ibv_modify_qp",
                EINVAL,
                format!("qp {:#x}: {:?} -> {change:?} not allowed", q.qpn, q.state),
            )
        };
        match *change {
            ModifyQp::Init {
                port, access, qkey, ..
            } => {
                if q.state != QpState::Reset || port != 1 {
                    return Err(bad(q));
                }
                if q.ty == QpType::Ud {
                    q.qkey = qkey.ok_or_else(|| bad(q))?;
                }
                q.remote_access = access;
                q.state = QpState::Init;
            }
            ModifyQp::RtrRc { dest_qpn, ah, .. } => {
                if q.state != QpState::Init || q.ty != QpType::Rc {
                    return Err(bad(q));
                }
                q.dest_qpn = dest_qpn;
                q.dest = Some(ah);
                q.state = QpState::Rtr;
            }
            ModifyQp::RtrUd => {
                if q.state != QpState::Init || q.ty != QpType::Ud {
                    return Err(bad(q));
                }
                q.state = QpState::Rtr;
            }
            ModifyQp::Rts {
                retry_cnt,
                rnr_retry,
                rc,
                ..
            } => {
                if q.state != QpState::Rtr || rc != (q.ty == QpType::Rc) {
                    return Err(bad(q));
                }
                q.retry_cnt = retry_cnt;
                q.rnr_retry = rnr_retry;
                q.state = QpState::Rts;
            }
            ModifyQp::Err => {
                q.state = QpState::Err;
                q.flush_pending = true;
            }
            ModifyQp::Reset => {
                q.state = QpState::Reset;
                q.sq.clear();
                q.rq.clear();
                q.flush_pending = false;
            }
        }
        Ok(())
    }

    fn destroy_qp(&mut self, qp: Qp) -> Result<(), VerbsError> {
        let mut f = self.f();
        let qpn = u32::try_from(qp.0).unwrap_or(0);
        match f.qps.get(&qpn) {
            Some(q) if q.node == self.node => {
                f.qps.remove(&qpn);
                Ok(())
            }
            _ => Err(verr("ibv_destroy_qp", EINVAL, "unknown qp")),
        }
    }

    fn post_send(&mut self, qp: Qp, wrs: &[SendWr]) -> Result<(), PostFailure> {
        let mut f = self.f();
        let node = self.node;
        let now = f.now;
        let latency = f.cfg.latency_ns;
        let qpn = u32::try_from(qp.0).unwrap_or(0);
        let fail = |i, code, d: &str| PostFailure {
            bad_index: i,
            error: verr("ibv_post_send", code, d),
        };
        let Some(q) = f.qps.get(&qpn).filter(|q| q.node == node) else {
            return Err(fail(0, EINVAL, "unknown qp"));
        };
        let ty = q.ty;
        if !matches!(q.state, QpState::Rts | QpState::Err) {
            return Err(fail(0, EINVAL, "qp not in RTS"));
        }
        let injected = if ty == QpType::Rc {
            f.nodes[node].fail_post_at.take()
        } else {
            None
        };
        let q = f.qps.get_mut(&qpn).expect("checked above");
        let mut posted = 0;
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            if injected == Some(i) || q.sq.len() >= q.max_send_wr {
                result = Err(fail(i, ENOMEM, "send queue full"));
                break;
            }
            let valid = match (ty, wr.op) {
                (QpType::Ud, SendOp::UdSend { .. }) => true,
                (QpType::Rc, SendOp::UdSend { .. }) | (QpType::Ud, _) => false,
                _ => true,
            };
            if !valid {
                result = Err(fail(i, EINVAL, "opcode not valid for QP type"));
                break;
            }
            let ready_at = now.saturating_add(latency).max(q.last_ready);
            q.last_ready = ready_at;
            q.sq.push_back(InFlight {
                wr: *wr,
                ready_at,
                retries: 0,
                rnr: 0,
            });
            posted += 1;
        }
        if q.state == QpState::Err {
            q.flush_pending = true;
        }
        let stats = &mut f.nodes[node].stats;
        match ty {
            QpType::Rc => {
                stats.rc_doorbells += 1;
                if posted > 0 {
                    stats.rc_chain_lens.push(posted);
                }
            }
            QpType::Ud => stats.ud_doorbells += 1,
        }
        result
    }

    fn post_recv(&mut self, qp: Qp, wrs: &[RecvWr]) -> Result<(), PostFailure> {
        let mut f = self.f();
        let node = self.node;
        let qpn = u32::try_from(qp.0).unwrap_or(0);
        let fail = |i, code, d: &str| PostFailure {
            bad_index: i,
            error: verr("ibv_post_recv", code, d),
        };
        let Some(q) = f.qps.get_mut(&qpn).filter(|q| q.node == node) else {
            return Err(fail(0, EINVAL, "unknown qp"));
        };
        if q.srq.is_some() || q.state == QpState::Reset {
            return Err(fail(0, EINVAL, "qp has an SRQ or is in RESET"));
        }
        for (i, wr) in wrs.iter().enumerate() {
            if q.rq.len() >= q.max_recv_wr {
                return Err(fail(i, ENOMEM, "receive queue full"));
            }
            q.rq.push_back(*wr);
        }
        if q.state == QpState::Err {
            q.flush_pending = true;
        }
        Ok(())
    }

    fn post_srq_recv(&mut self, srq: Srq, wrs: &[RecvWr]) -> Result<(), PostFailure> {
        let mut f = self.f();
        let node = self.node;
        let fail = |i, code, d: &str| PostFailure {
            bad_index: i,
            error: verr("ibv_post_srq_recv", code, d),
        };
        let Some(s) = f.srqs.get_mut(&srq.0).filter(|s| s.node == node) else {
            return Err(fail(0, EINVAL, "unknown srq"));
        };
        for (i, wr) in wrs.iter().enumerate() {
            if s.queue.len() >= s.max_wr {
                return Err(fail(i, ENOMEM, "srq full"));
            }
            s.queue.push_back(*wr);
        }
        Ok(())
    }

    fn poll_cq(&mut self, cq: Cq, max: usize, out: &mut Vec<Wc>) -> Result<usize, VerbsError> {
        let mut f = self.f();
        f.now = f.now.saturating_add(f.cfg.tick_ns);
        f.run();
        let node = self.node;
        let Some(c) = f.cqs.get_mut(&cq.0).filter(|c| c.node == node) else {
            return Err(verr("ibv_poll_cq", EINVAL, "unknown cq"));
        };
        if c.overrun {
            return Err(verr("ibv_poll_cq", EOVERFLOW, "CQ overrun"));
        }
        let n = max.min(c.entries.len());
        out.extend(c.entries.drain(..n));
        Ok(n)
    }

    fn create_ah(&mut self, pd: Pd, attr: &AhAttr) -> Result<Ah, VerbsError> {
        let mut f = self.f();
        if f.pds.get(&pd.0) != Some(&self.node) {
            return Err(verr("ibv_create_ah", EINVAL, "bad pd"));
        }
        if f.cfg.link_layer == LinkLayer::Ethernet && !attr.is_global {
            return Err(verr("ibv_create_ah", EINVAL, "RoCE needs a GRH"));
        }
        let id = f.id();
        f.ahs.insert(id, (self.node, *attr));
        Ok(Ah(id))
    }

    fn destroy_ah(&mut self, ah: Ah) -> Result<(), VerbsError> {
        self.f()
            .ahs
            .remove(&ah.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_destroy_ah", EINVAL, ""))
    }

    fn now_ns(&self) -> u64 {
        self.f().now
    }

    fn entropy(&mut self) -> u64 {
        self.f().rng.gen()
    }

    fn peer_memory(&self) -> bool {
        false
    }
}
