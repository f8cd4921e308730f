//! The verbs [`Domain`]: connection manager, QP state handling, WR chaining,
//! receive replenishment, completion demux and error mapping, all on top of
//! the [`VerbsOps`] seam.
//!
//! One module per piece of state the domain owns: `config` (tunables),
//! `memory` (registrations, `MrTable`), `connection` (peers, their two RC
//! QPs and the UD handshake channel `Ud`), `posting` (the `OpTable`, lane
//! queues, WR chains and doorbells), `recv` (receive buffers, `Receives`)
//! and `completions` (CQ polling and completion translation); `port` picks
//! the GID and `dma_buf` holds the only unsafe code (the UD slot buffer).
//! This module keeps the device objects, the constructor and the
//! [`Domain`] impl, which only delegates.

mod completions;
mod config;
mod connection;
#[allow(unsafe_code)]
mod dma_buf;
mod memory;
mod passive;
mod port;
mod posting;
mod recv;
pub(crate) mod ud_source;

pub use config::{DmaBufExporter, VerbsConfig, MAX_VERBS_WR_LEN, WEFT_QKEY};

use crate::ops::*;
use crate::wire::VerbsAddr;
use connection::{Conn, Peer, Ud};
use dma_buf::DmaBuf;
use memory::MrTable;
use port::{link_gbps, select_gid};
use posting::OpTable;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use recv::Receives;
use std::collections::{BTreeMap, VecDeque};
use weft_transport::{
    Access, Capabilities, Completion, Domain, LocalMr, LocalSlice, MemRegion, MrKey, NetAddr,
    NicInfo, PeerId, PostError, TransportError, WrId, WriteWr,
};

/// Bytes of GRH in front of every UD receive.
const GRH: usize = GRH_LEN;
/// Size of one UD buffer slot (GRH + handshake, rounded up).
const UD_SLOT: usize = 256;

// wr_id layout: top 2 bits kind, then generation (30 bits), slot (32 bits).
const KIND_OP: u64 = 0;
const KIND_RECV: u64 = 1;
const KIND_IMM: u64 = 2;
const KIND_UD: u64 = 3;
const UD_SEND_BIT: u64 = 1 << 61;

fn wr_id(kind: u64, gen: u32, slot: u32) -> u64 {
    kind << 62 | (u64::from(gen) & 0x1fff_ffff) << 32 | u64::from(slot)
}
fn wr_kind(id: u64) -> u64 {
    id >> 62
}
fn wr_gen(id: u64) -> u32 {
    ((id >> 32) & 0x1fff_ffff) as u32
}
fn wr_slot(id: u64) -> u32 {
    id as u32
}

/// Counters the domain keeps (for tests and diagnostics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DomainStats {
    /// Handshake datagrams sent.
    pub handshakes_sent: u64,
    /// Handshake datagrams received and parsed.
    pub handshakes_received: u64,
    /// Datagrams that did not parse.
    pub handshakes_malformed: u64,
    /// Handshakes dropped because the address they claim is not the one
    /// the device reports they came from (see `ud_source`).
    pub handshakes_spoofed: u64,
    /// Connections established.
    pub connects: u64,
    /// Connections torn down after an error or a peer reconnect.
    pub resets: u64,
    /// `post_send` calls that posted only part of their chain.
    pub partial_posts: u64,
    /// Operations moved to a new connection after a flush.
    pub requeued_ops: u64,
    /// Peers removed with `Domain::remove_peer`.
    pub peers_removed: u64,
    /// Handshakes from new addresses refused because
    /// [`VerbsConfig::max_half_open`] passive peers were half-open, none of
    /// them spent.
    pub handshakes_refused: u64,
    /// Half-open passive peers evicted: to make room for a new one, or
    /// because their QPs could not be made or brought up.
    pub half_open_evicted: u64,
}

/// One verbs NIC (port) as a weft [`Domain`].
pub struct VerbsDomain<O: VerbsOps> {
    ops: O,
    cfg: VerbsConfig,
    nic: String,
    info: NicInfo,
    caps: Capabilities,
    port_attr: PortAttr,
    gid_index: u32,
    max_wr_len: u64,
    pd: Pd,
    send_cq: Cq,
    recv_cq: Cq,
    send_cq_depth: u32,
    recv_cq_depth: u32,
    recv_srq: Srq,
    imm_srq: Srq,
    ud: Ud,
    hw_outstanding: u32,
    mrs: MrTable,
    peers: Vec<Peer>,
    by_addr: BTreeMap<NetAddr, PeerId>,
    /// Peers created by handshakes from unknown addresses (`passive`).
    passive: passive::Passive,
    qpn_peer: BTreeMap<u32, PeerId>,
    op_table: OpTable,
    /// Generation of the last op or user receive (in their wr_ids).
    op_gen: u32,
    recvs: Receives,
    out_q: VecDeque<Completion>,
    rng: ChaCha8Rng,
    stats: DomainStats,
    dead: Option<TransportError>,
    wc_buf: Vec<Wc>,
}

fn addr_str(a: &NetAddr) -> String {
    a.to_string()
}

impl<O: VerbsOps> VerbsDomain<O> {
    /// Opens a domain on an opened device: picks the GID, creates the PD,
    /// CQs, SRQs and the UD handshake QP.
    pub fn open(
        mut ops: O,
        cfg: VerbsConfig,
        numa_node: Option<u32>,
    ) -> Result<Self, TransportError> {
        let nic = format!("{}:{}", ops.name(), cfg.port);
        let nic2 = nic.clone();
        let e = |err: VerbsError| err.into_transport(&nic2);
        let port_attr = ops.query_port(cfg.port).map_err(e)?;
        if port_attr.state != PORT_ACTIVE {
            return Err(TransportError::NoDevice {
                what: format!("active verbs port ({nic} is in state {})", port_attr.state),
            });
        }
        let (gid_index, gid) = select_gid(&mut ops, &cfg, &port_attr, &nic)?;
        let max_wr_len = cfg
            .max_wr_len
            .unwrap_or(u64::from(port_attr.max_msg_sz))
            .clamp(1, MAX_VERBS_WR_LEN);
        if cfg.chain_len == 0 || cfg.sq_depth == 0 || cfg.max_batch == 0 {
            return Err(TransportError::InvalidArgument {
                nic,
                what: "chain_len, sq_depth and max_batch must be positive".into(),
            });
        }
        let ud_slots: u32 = 64;
        let ud_send_slots: u32 = 32;
        let send_cq_depth = cfg.hw_send_budget.saturating_add(ud_send_slots);
        let recv_cq_depth = cfg
            .recv_pool
            .saturating_add(cfg.imm_pool)
            .saturating_add(ud_slots);
        let pd = ops.alloc_pd().map_err(e)?;
        let send_cq = ops.create_cq(send_cq_depth).map_err(e)?;
        let recv_cq = ops.create_cq(recv_cq_depth).map_err(e)?;
        let recv_srq = ops.create_srq(pd, cfg.recv_pool).map_err(e)?;
        let imm_srq = ops.create_srq(pd, cfg.imm_pool).map_err(e)?;
        let ud = DmaBuf::new(UD_SLOT * (ud_slots + ud_send_slots) as usize);
        let (ud_mr, ud_lkey, _) = ops
            .reg_mr(pd, ud.addr(0), ud.len as u64, access::LOCAL_WRITE)
            .map_err(e)?;
        let created = ops
            .create_qp(
                pd,
                &QpInit {
                    qp_type: QpType::Ud,
                    send_cq,
                    recv_cq,
                    srq: None,
                    max_send_wr: ud_send_slots,
                    max_recv_wr: ud_slots,
                    max_sge: 1,
                },
            )
            .map_err(e)?;
        let ud_qp = created.qp;
        for change in [
            ModifyQp::Init {
                port: cfg.port,
                pkey_index: 0,
                access: 0,
                qkey: Some(WEFT_QKEY),
            },
            ModifyQp::RtrUd,
            ModifyQp::Rts {
                sq_psn: 0,
                timeout: 0,
                retry_cnt: 0,
                rnr_retry: 0,
                max_rd_atomic: 0,
                rc: false,
            },
        ] {
            ops.modify_qp(ud_qp, &change).map_err(e)?;
        }
        let va = VerbsAddr {
            gid,
            lid: port_attr.lid,
            ud_qpn: created.qpn,
        };
        let seed = ops.entropy();
        let info = NicInfo {
            name: nic.clone(),
            addr: va.encode(),
            numa_node,
            link_gbps: link_gbps(port_attr.active_width, port_attr.active_speed),
        };
        let caps = Capabilities {
            // RC QPs: the NIC moves data without the host.
            software_progress: false,
            max_write_len: u64::MAX,
            max_send_len: max_wr_len,
            max_inflight: cfg.max_inflight,
            max_recvs: cfg.recv_pool as usize,
            max_batch: cfg.max_batch,
            ordered: true,
            device_memory: ops.peer_memory() || cfg.dmabuf.is_some(),
        };
        tracing::info!(nic = %nic, gid = %gid, gid_index, lid = port_attr.lid, mtu = port_attr.active_mtu, "verbs domain open");
        let mut d = Self {
            ops,
            nic,
            info,
            caps,
            port_attr,
            gid_index,
            max_wr_len,
            pd,
            send_cq,
            recv_cq,
            send_cq_depth,
            recv_cq_depth,
            recv_srq,
            imm_srq,
            ud: Ud {
                qp: ud_qp,
                buf: ud,
                mr: ud_mr,
                lkey: ud_lkey,
                send_free: (ud_slots..ud_slots + ud_send_slots).rev().collect(),
            },
            hw_outstanding: 0,
            mrs: MrTable {
                by_key: BTreeMap::new(),
                next: 1,
            },
            peers: Vec::new(),
            by_addr: BTreeMap::new(),
            passive: passive::Passive::default(),
            qpn_peer: BTreeMap::new(),
            op_table: OpTable {
                slab: Vec::new(),
                free: Vec::new(),
                next_seq: 0,
                inflight: 0,
            },
            op_gen: 0,
            recvs: Receives {
                slab: Vec::new(),
                free: Vec::new(),
                posted: 0,
                imm_missing: cfg.imm_pool,
            },
            out_q: VecDeque::new(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            stats: DomainStats::default(),
            dead: None,
            wc_buf: Vec::with_capacity(64),
            cfg,
        };
        for slot in 0..ud_slots {
            d.post_ud_recv(slot)?;
        }
        d.replenish_imm()?;
        Ok(d)
    }

    /// The device behind the seam (the simulator's device in tests).
    pub fn ops(&self) -> &O {
        &self.ops
    }

    /// Domain counters.
    pub fn stats(&self) -> &DomainStats {
        &self.stats
    }

    /// RC QPs the domain holds (two per connection, current or draining):
    /// after every peer is removed and its flushes are polled, 0.
    pub fn live_qps(&self) -> usize {
        self.peers
            .iter()
            .map(|p| 2 * (usize::from(p.conn.is_some()) + p.draining.len()))
            .sum()
    }

    /// The GID index in use.
    pub fn gid_index(&self) -> u32 {
        self.gid_index
    }

    /// The largest bytes one WR carries (longer WRITEs are split).
    pub fn max_wr_len(&self) -> u64 {
        self.max_wr_len
    }

    /// `(send CQ depth, receive CQ depth)`.
    pub fn cq_depths(&self) -> (u32, u32) {
        (self.send_cq_depth, self.recv_cq_depth)
    }

    /// The port's active MTU in bytes.
    pub fn mtu(&self) -> u32 {
        mtu_bytes(self.port_attr.active_mtu).unwrap_or(1024)
    }

    /// Whether the connection to `peer` is established.
    pub fn is_connected(&self, peer: PeerId) -> bool {
        self.peers
            .get(peer.0 as usize)
            .and_then(|p| p.conn.as_ref())
            .is_some_and(Conn::connected)
    }

    fn verr(&self, e: VerbsError) -> TransportError {
        e.into_transport(&self.nic)
    }

    fn peer_err(&self, pid: PeerId, reason: impl Into<String>) -> TransportError {
        if let Some(p) = self.peers.get(pid.0 as usize).filter(|p| p.removed) {
            return TransportError::PeerRemoved {
                nic: self.nic.clone(),
                peer: p.addr.clone(),
            };
        }
        TransportError::PeerUnreachable {
            nic: self.nic.clone(),
            peer: self
                .peers
                .get(pid.0 as usize)
                .map(|p| p.addr.clone())
                .unwrap_or_default_addr(),
            reason: reason.into(),
        }
    }

    fn check_peer(&self, peer: PeerId) -> Result<(), TransportError> {
        match self.peers.get(peer.0 as usize) {
            None => Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: format!("unknown peer handle {}", peer.0),
            }),
            Some(p) => match &p.unreachable {
                Some(r) => Err(self.peer_err(peer, r.clone())),
                None => Ok(()),
            },
        }
    }

    fn check_room(&self) -> Result<(), TransportError> {
        if let Some(d) = &self.dead {
            return Err(d.clone());
        }
        if self.op_table.inflight >= self.caps.max_inflight {
            return Err(TransportError::QueueFull {
                nic: self.nic.clone(),
            });
        }
        Ok(())
    }
}

trait DefaultAddr {
    fn unwrap_or_default_addr(self) -> NetAddr;
}
impl DefaultAddr for Option<NetAddr> {
    fn unwrap_or_default_addr(self) -> NetAddr {
        self.unwrap_or(NetAddr(Vec::new()))
    }
}

impl<O: VerbsOps> Domain for VerbsDomain<O> {
    fn info(&self) -> &NicInfo {
        &self.info
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn data_path(&self) -> weft_transport::DataPath {
        use weft_transport::{DeviceMemoryPath, DirectKind};
        // dma-buf is tried first when configured (peer memory is its
        // fallback), as `register` does.
        let dm = if self.cfg.dmabuf.is_some() {
            DeviceMemoryPath::Direct(DirectKind::DmaBuf)
        } else if self.ops.peer_memory() {
            DeviceMemoryPath::Direct(DirectKind::PeerMemory)
        } else {
            DeviceMemoryPath::Unsupported
        };
        weft_transport::DataPath::from_capabilities("verbs", &self.nic, &self.caps)
            .with_device_memory(dm)
    }

    fn register(&mut self, region: &MemRegion, acc: Access) -> Result<LocalMr, TransportError> {
        self.register_region(region, acc)
    }

    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError> {
        self.deregister_key(mr)
    }

    fn add_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        let pid = self.peer_for(addr)?;
        // The user knows this id now: a passive peer is never evicted.
        self.passive.list.remove(pid);
        Ok(pid)
    }

    fn remove_peer(&mut self, peer: PeerId) -> Result<(), TransportError> {
        self.forget_peer(peer);
        Ok(())
    }

    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError> {
        self.accept_send(wr, peer, src)
    }

    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        self.accept_recv(wr, buf)
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        self.accept_writes(wrs)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        let r = self.poll_inner();
        let n = self.out_q.len();
        out.extend(self.out_q.drain(..));
        r.map(|()| n)
    }
}

impl<O: VerbsOps> Drop for VerbsDomain<O> {
    fn drop(&mut self) {
        for p in std::mem::take(&mut self.peers) {
            for c in p.conn.into_iter().chain(p.draining) {
                let _ = self.ops.destroy_qp(c.send.qp);
                let _ = self.ops.destroy_qp(c.write.qp);
            }
            if let Some(ah) = p.ah {
                let _ = self.ops.destroy_ah(ah);
            }
        }
        let _ = self.ops.destroy_qp(self.ud.qp);
        let _ = self.ops.destroy_srq(self.recv_srq);
        let _ = self.ops.destroy_srq(self.imm_srq);
        let _ = self.ops.destroy_cq(self.send_cq);
        let _ = self.ops.destroy_cq(self.recv_cq);
        let _ = self.ops.dereg_mr(self.ud.mr);
        for (_, m) in std::mem::take(&mut self.mrs.by_key) {
            let _ = self.ops.dereg_mr(m.mr);
        }
        let _ = self.ops.dealloc_pd(self.pd);
    }
}
