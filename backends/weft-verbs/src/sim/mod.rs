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

mod device;
#[allow(unsafe_code)]
mod exec;
mod fabric;

pub use device::SimDevice;

use crate::ops::*;
use fabric::{Fabric, Node};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use weft_transport::TransportError;

/// Size of the GRH in front of every UD receive.
pub use crate::ops::GRH_LEN;

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
        let node = f.nodes.len();
        let gid = Gid::ipv4_mapped([10, 0, ((node >> 8) & 0xff) as u8, (node & 0xff) as u8]);
        f.nodes.push(Node {
            name: name.to_string(),
            alive: true,
            lid: u16::try_from(node + 1).unwrap_or(u16::MAX),
            gid,
            stats: SimStats::default(),
            fail_post_at: None,
            drop_ud_to: 0,
            last_ud_qpn: None,
            reuse_ud_qpn: None,
        });
        SimLib {
            fabric: self.clone(),
            nodes: vec![node],
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

    /// Brings killed devices back at the same addresses, as a process
    /// restarted on the same host and given its predecessor's GID, LID and
    /// UD QPN would be: every object of the old incarnation on them (QPs,
    /// CQs, SRQs, MRs, PDs, address handles) is destroyed, so nothing
    /// aimed at the old one can land; the next UD QP created on each gets
    /// the old UD QPN. Returns a library listing the devices in order.
    /// Fails on an unknown or still alive device (nothing is changed).
    /// Drop the old incarnation's domains first: a handle it still holds
    /// cannot be told apart from the revived device's QP of the same QPN.
    pub fn revive(&self, names: &[&str]) -> Result<SimLib, String> {
        let mut f = self.lock();
        let mut nodes = Vec::with_capacity(names.len());
        for name in names {
            let i = Self::node_idx(&f, name).ok_or_else(|| format!("no device {name}"))?;
            if f.nodes[i].alive {
                return Err(format!("device {name} is alive"));
            }
            nodes.push(i);
        }
        for &i in &nodes {
            f.qps.retain(|_, q| q.node != i);
            f.cqs.retain(|_, c| c.node != i);
            f.srqs.retain(|_, q| q.node != i);
            f.mrs.retain(|_, m| m.node != i);
            f.pds.retain(|_, n| *n != i);
            f.ahs.retain(|_, (n, _)| *n != i);
            let n = &mut f.nodes[i];
            n.alive = true;
            n.fail_post_at = None;
            n.drop_ud_to = 0;
            n.reuse_ud_qpn = n.last_ud_qpn;
        }
        drop(f);
        Ok(SimLib {
            fabric: self.clone(),
            nodes,
        })
    }

    /// Counters of a device.
    pub fn stats(&self, name: &str) -> SimStats {
        let f = self.lock();
        Self::node_idx(&f, name)
            .map(|i| f.nodes[i].stats.clone())
            .unwrap_or_default()
    }

    /// RC QPs of device `name` that exist (created, not destroyed).
    pub fn rc_qps(&self, name: &str) -> usize {
        let f = self.lock();
        Self::node_idx(&f, name).map_or(0, |i| {
            f.qps
                .values()
                .filter(|q| q.node == i && q.ty == QpType::Rc)
                .count()
        })
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

    fn open(&self, nic: usize) -> Result<SimDevice, TransportError> {
        let node = *self
            .nodes
            .get(nic)
            .ok_or_else(|| TransportError::NoDevice {
                what: format!("simulated verbs (index {nic})"),
            })?;
        let name = self.fabric.lock().nodes[node].name.clone();
        Ok(SimDevice {
            fabric: self.fabric.clone(),
            node,
            name,
        })
    }
}
