//! The verbs [`Domain`]: connection manager, QP state handling, WR chaining,
//! receive replenishment, completion demux and error mapping, all on top of
//! the [`VerbsOps`] seam.

use crate::ops::*;
use crate::wire::{Handshake, QpPair, VerbsAddr, HANDSHAKE_LEN};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, VecDeque};
use std::ptr::NonNull;
use weft_transport::{
    Access, Capabilities, Completion, Device, Domain, LocalMr, LocalSlice, MemRegion, MrKey,
    NetAddr, NicInfo, PeerId, PostError, RemoteAccessReason, Rkey, TransportError, WrId, WriteWr,
};

/// Q_Key of every weft UD (handshake) QP.
pub const WEFT_QKEY: u32 = 0x7765_6674;
/// Bytes of GRH in front of every UD receive.
const GRH: usize = 40;
/// Size of one UD buffer slot (GRH + handshake, rounded up).
const UD_SLOT: usize = 256;
/// Largest length one verbs WR can carry (`uint32_t length`, and the RC
/// message limit): 2^31 - 1.
pub const MAX_VERBS_WR_LEN: u64 = (1 << 31) - 1;

/// How GPU memory is turned into a dma-buf for `ibv_reg_dmabuf_mr`.
pub trait DmaBufExporter: Send + Sync {
    /// Returns `(fd, offset)` of a dma-buf covering `[addr, addr+len)` on
    /// `device` (for CUDA: `cuMemGetHandleForAddressRange`). The backend
    /// does not close the fd.
    fn export(&self, addr: u64, len: u64, device: Device) -> Result<(i32, u64), TransportError>;
}

/// Tunables of a verbs domain. `Default` is right for ConnectX.
#[derive(Clone)]
pub struct VerbsConfig {
    /// Port number (1-based).
    pub port: u8,
    /// GID index; `None` = pick automatically (RoCE v2 IPv4-mapped first,
    /// then any RoCE v2, then the IB GID). The provider reads
    /// `WEFT_VERBS_GID_INDEX` into this.
    pub gid_index: Option<u32>,
    /// User SEND + WRITE operations accepted but not completed.
    pub max_inflight: usize,
    /// Send queue depth of each RC QP.
    pub sq_depth: u32,
    /// Hardware send WRs outstanding across all QPs of the domain (sizes the
    /// send CQ).
    pub hw_send_budget: u32,
    /// Receive buffers the user may post (SEND/RECV SRQ depth).
    pub recv_pool: u32,
    /// Zero-byte receives kept posted for WRITE_WITH_IMM (imm SRQ depth).
    pub imm_pool: u32,
    /// WRs linked per `ibv_post_send` (doorbell).
    pub chain_len: usize,
    /// Most WRs accepted by one `post_writes` call.
    pub max_batch: usize,
    /// Override of the largest bytes per WR (default: the port's
    /// `max_msg_sz`, at most 2^31-1). Longer WRITEs are split.
    pub max_wr_len: Option<u64>,
    /// Time before a handshake is retransmitted.
    pub handshake_timeout_ns: u64,
    /// Handshake transmissions before the peer is declared unreachable.
    pub handshake_tries: u32,
    /// RC local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// RC transport retries.
    pub retry_cnt: u8,
    /// RC RNR retries (7 would be infinite; the contract wants a bound).
    pub rnr_retry: u8,
    /// RNR NAK timer code advertised by our responders.
    pub min_rnr_timer: u8,
    /// Service level.
    pub sl: u8,
    /// GRH traffic class (RoCE DSCP << 2).
    pub traffic_class: u8,
    /// Turns GPU pointers into dma-bufs; without it GPU memory needs a
    /// peer-memory client (`nvidia_peermem`).
    pub dmabuf: Option<std::sync::Arc<dyn DmaBufExporter>>,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        Self {
            port: 1,
            gid_index: None,
            max_inflight: 1024,
            sq_depth: 256,
            hw_send_budget: 2048,
            recv_pool: 1024,
            imm_pool: 1024,
            chain_len: 4,
            max_batch: 256,
            max_wr_len: None,
            handshake_timeout_ns: 50_000_000,
            handshake_tries: 40,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 6,
            min_rnr_timer: 12,
            sl: 0,
            traffic_class: 0,
            dmabuf: None,
        }
    }
}

impl std::fmt::Debug for VerbsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsConfig")
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("max_inflight", &self.max_inflight)
            .field("chain_len", &self.chain_len)
            .field("max_wr_len", &self.max_wr_len)
            .finish_non_exhaustive()
    }
}

/// Heap memory the NIC reads and writes (UD handshake slots), accessed only
/// through raw pointers.
struct DmaBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl DmaBuf {
    fn new(len: usize) -> Self {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let raw = Box::into_raw(b) as *mut u8;
        Self {
            ptr: NonNull::new(raw).unwrap_or(NonNull::dangling()),
            len,
        }
    }
    fn addr(&self, off: usize) -> u64 {
        self.ptr.as_ptr() as u64 + off as u64
    }
    fn write(&mut self, off: usize, data: &[u8]) {
        if off.checked_add(data.len()).is_some_and(|e| e <= self.len) {
            // SAFETY: in bounds of our own allocation; the slot is not posted
            // to the NIC while we fill it.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(off), data.len())
            }
        }
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Vec::new();
        }
        let mut v = vec![0u8; len];
        // SAFETY: in bounds; the NIC finished writing the slot (its receive
        // completion was polled) and it is not reposted until after this.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len) };
        v
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: allocated by `Box<[u8]>` of exactly this length in `new`;
        // the domain destroys every QP using it before dropping it.
        drop(unsafe { Box::from_raw(slice) });
    }
}

// SAFETY: DmaBuf owns its allocation exclusively; the pointer is never shared
// outside the domain that owns it.
unsafe impl Send for DmaBuf {}

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Send,
    Write,
}

struct Op {
    gen: u32,
    lane: Lane,
    wr: WrId,
    peer: PeerId,
    src_addr: u64,
    lkey: u32,
    len: u64,
    remote_addr: u64,
    rkey: u32,
    imm: Option<u32>,
    /// Bytes handed to the NIC so far.
    next_off: u64,
    /// Bytes whose WRs completed successfully (a prefix: RC is in order).
    ok_bytes: u64,
    /// Whether the last WR (the one carrying the imm) was posted.
    posted_all: bool,
    /// Posted WRs whose completions are outstanding.
    inflight: u32,
    /// QPN the op's WRs are on.
    qpn: u32,
    error: Option<TransportError>,
    /// Acceptance order (keeps requeued ops in post order).
    seq: u64,
}

struct QpEnd {
    qp: Qp,
    qpn: u32,
    psn: u32,
    room: u32,
    outstanding: u32,
}

struct Conn {
    send: QpEnd,
    write: QpEnd,
    remote: Option<QpPair>,
    remote_ready: bool,
    rts: bool,
    tries: u32,
    next_retx: u64,
}

impl Conn {
    fn pair(&self) -> QpPair {
        QpPair {
            send_qpn: self.send.qpn,
            write_qpn: self.write.qpn,
            send_psn: self.send.psn,
            write_psn: self.write.psn,
        }
    }
    fn connected(&self) -> bool {
        self.rts && self.remote_ready
    }
}

struct Peer {
    addr: NetAddr,
    va: VerbsAddr,
    ah: Option<Ah>,
    conn: Option<Conn>,
    /// Old connections whose WRs are still completing.
    draining: Vec<Conn>,
    unreachable: Option<String>,
    send_q: VecDeque<u32>,
    write_q: VecDeque<u32>,
}

struct MrEntry {
    mr: Mr,
    lkey: u32,
    addr: u64,
    len: u64,
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
    /// Connections established.
    pub connects: u64,
    /// Connections torn down after an error or a peer reconnect.
    pub resets: u64,
    /// `post_send` calls that posted only part of their chain.
    pub partial_posts: u64,
    /// Operations moved to a new connection after a flush.
    pub requeued_ops: u64,
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
    ud_qp: Qp,
    ud: DmaBuf,
    ud_mr: Mr,
    ud_lkey: u32,
    ud_send_free: Vec<u32>,
    hw_outstanding: u32,
    mrs: BTreeMap<u64, MrEntry>,
    next_mr: u64,
    peers: Vec<Peer>,
    by_addr: BTreeMap<NetAddr, PeerId>,
    qpn_peer: BTreeMap<u32, PeerId>,
    op_slab: Vec<Option<Op>>,
    op_free: Vec<u32>,
    op_gen: u32,
    next_seq: u64,
    recv_slab: Vec<Option<(u32, WrId, u64)>>,
    recv_free: Vec<u32>,
    recvs_posted: u32,
    inflight: usize,
    imm_missing: u32,
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
            ud_qp,
            ud,
            ud_mr,
            ud_lkey,
            ud_send_free: (ud_slots..ud_slots + ud_send_slots).rev().collect(),
            hw_outstanding: 0,
            mrs: BTreeMap::new(),
            next_mr: 1,
            peers: Vec::new(),
            by_addr: BTreeMap::new(),
            qpn_peer: BTreeMap::new(),
            op_slab: Vec::new(),
            op_free: Vec::new(),
            op_gen: 0,
            next_seq: 0,
            recv_slab: Vec::new(),
            recv_free: Vec::new(),
            recvs_posted: 0,
            inflight: 0,
            imm_missing: cfg.imm_pool,
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

    fn post_ud_recv(&mut self, slot: u32) -> Result<(), TransportError> {
        let off = slot as usize * UD_SLOT;
        let wr = RecvWr {
            wr_id: wr_id(KIND_UD, 0, slot),
            sge: Some(Sge {
                addr: self.ud.addr(off),
                length: UD_SLOT as u32,
                lkey: self.ud_lkey,
            }),
        };
        self.ops
            .post_recv(self.ud_qp, &[wr])
            .map_err(|f| f.error.into_transport(&self.nic))
    }

    fn replenish_imm(&mut self) -> Result<(), TransportError> {
        let mut chain = Vec::new();
        while self.imm_missing > 0 {
            chain.clear();
            let n = self.imm_missing.min(32);
            for _ in 0..n {
                chain.push(RecvWr {
                    wr_id: wr_id(KIND_IMM, 0, 0),
                    sge: None,
                });
            }
            match self.ops.post_srq_recv(self.imm_srq, &chain) {
                Ok(()) => self.imm_missing -= n,
                Err(f) => {
                    self.imm_missing -= f.bad_index as u32;
                    return Err(f.error.into_transport(&self.nic));
                }
            }
        }
        Ok(())
    }

    fn peer_err(&self, pid: PeerId, reason: impl Into<String>) -> TransportError {
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

    fn alloc_op(&mut self, mut op: Op) -> u32 {
        self.op_gen = self.op_gen.wrapping_add(1) & 0x1fff_ffff;
        op.gen = self.op_gen;
        if let Some(s) = self.op_free.pop() {
            self.op_slab[s as usize] = Some(op);
            s
        } else {
            self.op_slab.push(Some(op));
            (self.op_slab.len() - 1) as u32
        }
    }

    fn op_mut(&mut self, slot: u32) -> Option<&mut Op> {
        self.op_slab.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// Emits the op's completion and frees it if it is finished.
    fn maybe_finish(&mut self, slot: u32) {
        let done = match self.op_slab.get(slot as usize).and_then(Option::as_ref) {
            Some(op) => {
                op.inflight == 0 && (op.error.is_some() || (op.posted_all && op.ok_bytes == op.len))
            }
            None => false,
        };
        if !done {
            return;
        }
        let Some(op) = self.op_slab[slot as usize].take() else {
            return;
        };
        self.op_free.push(slot);
        self.inflight = self.inflight.saturating_sub(1);
        if let Some(p) = self.peers.get_mut(op.peer.0 as usize) {
            let q = match op.lane {
                Lane::Send => &mut p.send_q,
                Lane::Write => &mut p.write_q,
            };
            q.retain(|s| *s != slot);
        }
        let result = match op.error {
            Some(e) => Err(e),
            None => Ok(()),
        };
        self.out_q.push_back(match op.lane {
            Lane::Send => Completion::Send { wr: op.wr, result },
            Lane::Write => Completion::Write { wr: op.wr, result },
        });
    }

    fn fail_op(&mut self, slot: u32, err: TransportError) {
        if let Some(op) = self.op_mut(slot) {
            if op.error.is_none() {
                op.error = Some(err);
            }
            let (peer, lane) = (op.peer, op.lane);
            if let Some(p) = self.peers.get_mut(peer.0 as usize) {
                match lane {
                    Lane::Send => p.send_q.retain(|s| *s != slot),
                    Lane::Write => p.write_q.retain(|s| *s != slot),
                }
            }
        }
        self.maybe_finish(slot);
    }

    fn resolve_local(&self, s: &LocalSlice) -> Result<u32, TransportError> {
        let m = self
            .mrs
            .get(&s.mr.0)
            .ok_or_else(|| TransportError::LocalAccess {
                nic: self.nic.clone(),
                what: format!("unknown or deregistered key {:?}", s.mr),
            })?;
        let end = s.addr.checked_add(s.len);
        let mend = m.addr.checked_add(m.len);
        match (end, mend) {
            (Some(e), Some(me)) if s.addr >= m.addr && e <= me => Ok(m.lkey),
            _ => Err(TransportError::LocalAccess {
                nic: self.nic.clone(),
                what: format!(
                    "[{:#x}, +{}) outside registration {:?} [{:#x}, +{})",
                    s.addr, s.len, s.mr, m.addr, m.len
                ),
            }),
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
        if self.inflight >= self.caps.max_inflight {
            return Err(TransportError::QueueFull {
                nic: self.nic.clone(),
            });
        }
        Ok(())
    }

    // ---------------------------------------------------------------------
    // Connections

    fn create_conn(&mut self, pid: PeerId) -> Result<(), TransportError> {
        let mut ends = Vec::with_capacity(2);
        for srq in [self.recv_srq, self.imm_srq] {
            let c = self
                .ops
                .create_qp(
                    self.pd,
                    &QpInit {
                        qp_type: QpType::Rc,
                        send_cq: self.send_cq,
                        recv_cq: self.recv_cq,
                        srq: Some(srq),
                        max_send_wr: self.cfg.sq_depth,
                        max_recv_wr: 0,
                        max_sge: 1,
                    },
                )
                .map_err(|e| self.verr(e))?;
            let init = ModifyQp::Init {
                port: self.cfg.port,
                pkey_index: 0,
                access: access::LOCAL_WRITE | access::REMOTE_WRITE,
                qkey: None,
            };
            if let Err(e) = self.ops.modify_qp(c.qp, &init) {
                let _ = self.ops.destroy_qp(c.qp);
                return Err(self.verr(e));
            }
            self.qpn_peer.insert(c.qpn, pid);
            ends.push(QpEnd {
                qp: c.qp,
                qpn: c.qpn,
                psn: self.rng.gen::<u32>() & 0xff_ffff,
                room: c.max_send_wr.min(self.cfg.sq_depth),
                outstanding: 0,
            });
        }
        let write = ends.pop().expect("two QPs created");
        let send = ends.pop().expect("two QPs created");
        let now = self.ops.now_ns();
        if let Some(p) = self.peers.get_mut(pid.0 as usize) {
            p.conn = Some(Conn {
                send,
                write,
                remote: None,
                remote_ready: false,
                rts: false,
                tries: 0,
                next_retx: now,
            });
        }
        tracing::debug!(nic = %self.nic, peer = pid.0, "connecting");
        Ok(())
    }

    fn ensure_conn(&mut self, pid: PeerId) {
        let needs = self
            .peers
            .get(pid.0 as usize)
            .is_some_and(|p| p.conn.is_none() && p.unreachable.is_none());
        if needs {
            if let Err(e) = self.create_conn(pid) {
                tracing::warn!(nic = %self.nic, peer = pid.0, error = %e, "cannot create QPs");
                self.mark_unreachable(pid, format!("cannot create QPs: {e}"));
                return;
            }
            self.send_handshake(pid);
        }
    }

    fn send_handshake(&mut self, pid: PeerId) {
        let now = self.ops.now_ns();
        let timeout = self.cfg.handshake_timeout_ns;
        let from = VerbsAddr::decode(&self.info.addr.0).expect("own address is valid");
        let mtu = self.port_attr.active_mtu as u8;
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        let Some(c) = p.conn.as_mut() else { return };
        c.tries += 1;
        c.next_retx = now.saturating_add(timeout);
        let remote = c.remote.unwrap_or_default();
        let msg = Handshake {
            from,
            qps: c.pair(),
            peer_send_qpn: remote.send_qpn,
            peer_write_qpn: remote.write_qpn,
            ready: c.rts,
            ack: c.remote_ready,
            mtu,
        };
        let va = p.va;
        let ah = match p.ah {
            Some(a) => a,
            None => {
                let attr = self.ah_attr(&va);
                match self.ops.create_ah(self.pd, &attr) {
                    Ok(a) => {
                        self.peers[pid.0 as usize].ah = Some(a);
                        a
                    }
                    Err(e) => {
                        tracing::warn!(nic = %self.nic, error = %e, "create_ah failed");
                        return;
                    }
                }
            }
        };
        let Some(slot) = self.ud_send_free.pop() else {
            tracing::debug!(nic = %self.nic, "no UD send slot; handshake waits for retransmit");
            return;
        };
        let bytes = msg.encode();
        let off = slot as usize * UD_SLOT;
        self.ud.write(off, &bytes);
        let wr = SendWr {
            wr_id: wr_id(KIND_UD, 0, slot) | UD_SEND_BIT,
            op: SendOp::UdSend {
                ah,
                remote_qpn: va.ud_qpn,
                remote_qkey: WEFT_QKEY,
            },
            sge: Some(Sge {
                addr: self.ud.addr(off),
                length: HANDSHAKE_LEN as u32,
                lkey: self.ud_lkey,
            }),
            signaled: true,
        };
        match self.ops.post_send(self.ud_qp, &[wr]) {
            Ok(()) => self.stats.handshakes_sent += 1,
            Err(f) => {
                self.ud_send_free.push(slot);
                tracing::warn!(nic = %self.nic, error = %f.error, "UD post_send failed");
            }
        }
    }

    fn ah_attr(&self, va: &VerbsAddr) -> AhAttr {
        let global = self.port_attr.link_layer == LinkLayer::Ethernet || va.lid == 0;
        AhAttr {
            dlid: va.lid,
            is_global: global,
            dgid: va.gid,
            sgid_index: self.gid_index as u8,
            hop_limit: if global { 64 } else { 0 },
            traffic_class: self.cfg.traffic_class,
            sl: self.cfg.sl,
            port: self.cfg.port,
        }
    }

    fn on_handshake(&mut self, bytes: &[u8]) {
        let msg = match Handshake::decode(bytes) {
            Ok(m) => m,
            Err(why) => {
                self.stats.handshakes_malformed += 1;
                tracing::debug!(nic = %self.nic, why, "malformed handshake dropped");
                return;
            }
        };
        self.stats.handshakes_received += 1;
        let addr = msg.from.encode();
        let pid = match self.add_peer(&addr) {
            Ok(p) => p,
            Err(_) => return,
        };
        if self.peers[pid.0 as usize].unreachable.is_some() {
            tracing::debug!(nic = %self.nic, peer = %addr_str(&addr), "handshake from a peer declared unreachable ignored");
            return;
        }
        // A peer that now presents different QPs replaced its connection.
        let stale = self.peers[pid.0 as usize]
            .conn
            .as_ref()
            .and_then(|c| c.remote)
            .is_some_and(|r| r != msg.qps);
        if stale {
            tracing::info!(nic = %self.nic, peer = %addr_str(&addr), "peer re-established the connection");
            self.retire_conn(pid, None);
        }
        if self.peers[pid.0 as usize].conn.is_none() {
            if let Err(e) = self.create_conn(pid) {
                tracing::warn!(nic = %self.nic, error = %e, "cannot create QPs for incoming handshake");
                return;
            }
        }
        let needs_rts = self.peers[pid.0 as usize]
            .conn
            .as_ref()
            .is_some_and(|c| !c.rts);
        if needs_rts {
            if let Err(e) = self.bring_up(pid, &msg) {
                tracing::warn!(nic = %self.nic, error = %e, "QP bring-up failed");
                self.mark_unreachable(pid, format!("QP bring-up failed: {e}"));
                return;
            }
        }
        let (matches, was_connected) = {
            let c = self.peers[pid.0 as usize]
                .conn
                .as_ref()
                .expect("created above");
            (
                msg.peer_send_qpn == c.send.qpn && msg.peer_write_qpn == c.write.qpn,
                c.connected(),
            )
        };
        let c = self.peers[pid.0 as usize]
            .conn
            .as_mut()
            .expect("created above");
        if msg.ready && matches {
            c.remote_ready = true;
        }
        let now_connected = c.connected();
        if !msg.ack || !matches {
            self.send_handshake(pid);
        }
        if now_connected && !was_connected {
            self.stats.connects += 1;
            tracing::debug!(nic = %self.nic, peer = pid.0, "connected");
            self.pump(pid);
        }
    }

    fn bring_up(&mut self, pid: PeerId, msg: &Handshake) -> Result<(), TransportError> {
        let mtu = u32::from(msg.mtu)
            .clamp(1, 5)
            .min(self.port_attr.active_mtu);
        let va = msg.from;
        let ah = self.ah_attr(&va);
        let (sq, wq, spsn, wpsn) = {
            let c = self.peers[pid.0 as usize]
                .conn
                .as_ref()
                .expect("caller ensured");
            (c.send.qp, c.write.qp, c.send.psn, c.write.psn)
        };
        for (qp, dest, rq_psn, sq_psn) in [
            (sq, msg.qps.send_qpn, msg.qps.send_psn, spsn),
            (wq, msg.qps.write_qpn, msg.qps.write_psn, wpsn),
        ] {
            self.ops
                .modify_qp(
                    qp,
                    &ModifyQp::RtrRc {
                        path_mtu: mtu,
                        dest_qpn: dest,
                        rq_psn,
                        ah,
                        max_dest_rd_atomic: 1,
                        min_rnr_timer: self.cfg.min_rnr_timer,
                    },
                )
                .map_err(|e| self.verr(e))?;
            self.ops
                .modify_qp(
                    qp,
                    &ModifyQp::Rts {
                        sq_psn,
                        timeout: self.cfg.timeout,
                        retry_cnt: self.cfg.retry_cnt,
                        rnr_retry: self.cfg.rnr_retry,
                        max_rd_atomic: 1,
                        rc: true,
                    },
                )
                .map_err(|e| self.verr(e))?;
        }
        let c = self.peers[pid.0 as usize]
            .conn
            .as_mut()
            .expect("caller ensured");
        c.remote = Some(msg.qps);
        c.rts = true;
        Ok(())
    }

    /// Takes the current connection out of service. `errored`: QPN of the QP
    /// that hit a requester error (it is in ERR and flushes); the sibling
    /// (and both QPs when `None`) drain what is in flight. Unposted work
    /// stays queued for the next connection.
    fn retire_conn(&mut self, pid: PeerId, errored: Option<u32>) {
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        let Some(c) = p.conn.take() else { return };
        self.stats.resets += 1;
        // Ops partially posted on the old connection continue from where
        // their acknowledged bytes end (set when their flushes arrive); ops
        // in the queue with nothing posted simply move over.
        p.draining.push(c);
        let has_work = !p.send_q.is_empty() || !p.write_q.is_empty();
        self.reap_draining(pid);
        // After an error, reconnect at once even without work, so the peer
        // learns about our new QPs before it uses the dead ones.
        if has_work || errored.is_some() {
            self.ensure_conn(pid);
        }
    }

    fn reap_draining(&mut self, pid: PeerId) {
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        let mut keep = Vec::new();
        let mut gone = Vec::new();
        for c in p.draining.drain(..) {
            if c.send.outstanding == 0 && c.write.outstanding == 0 {
                gone.push(c);
            } else {
                keep.push(c);
            }
        }
        p.draining = keep;
        for c in gone {
            for end in [c.send, c.write] {
                self.qpn_peer.remove(&end.qpn);
                if let Err(e) = self.ops.destroy_qp(end.qp) {
                    tracing::warn!(nic = %self.nic, error = %e, "destroy_qp failed");
                }
            }
        }
    }

    fn mark_unreachable(&mut self, pid: PeerId, reason: String) {
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        if p.unreachable.is_some() {
            return;
        }
        tracing::warn!(nic = %self.nic, peer = %addr_str(&p.addr), reason = %reason, "peer unreachable");
        p.unreachable = Some(reason.clone());
        if let Some(c) = p.conn.take() {
            p.draining.push(c);
        }
        // Move every QP of the peer to ERR so in-flight work flushes.
        let qps: Vec<Qp> = p
            .draining
            .iter()
            .flat_map(|c| [c.send.qp, c.write.qp])
            .collect();
        let queued: Vec<u32> = p.send_q.drain(..).chain(p.write_q.drain(..)).collect();
        for qp in qps {
            let _ = self.ops.modify_qp(qp, &ModifyQp::Err);
        }
        let err = self.peer_err(pid, reason);
        for slot in queued {
            self.fail_op(slot, err.clone());
        }
        // Ops with WRs in flight fail as their flushes arrive.
        self.reap_draining(pid);
    }

    fn timers(&mut self) {
        let now = self.ops.now_ns();
        for i in 0..self.peers.len() {
            let pid = PeerId(i as u32);
            let due = self.peers[i]
                .conn
                .as_ref()
                .filter(|c| !c.connected() && now >= c.next_retx)
                .map(|c| c.tries);
            if let Some(tries) = due {
                let has_work =
                    !self.peers[i].send_q.is_empty() || !self.peers[i].write_q.is_empty();
                if tries >= self.cfg.handshake_tries && !has_work {
                    // Passive side with nothing to send: stop retransmitting
                    // but keep the QPs, so a slow peer can still finish.
                    if let Some(c) = self.peers[i].conn.as_mut() {
                        c.next_retx = u64::MAX;
                    }
                } else if tries >= self.cfg.handshake_tries {
                    self.mark_unreachable(pid, format!("no handshake answer after {tries} tries"));
                } else {
                    self.send_handshake(pid);
                }
            }
        }
    }

    // ---------------------------------------------------------------------
    // Posting

    /// Posts as many queued WRs of `pid` as the send queues, the domain's
    /// hardware budget and the chain length allow.
    fn pump(&mut self, pid: PeerId) {
        for lane in [Lane::Send, Lane::Write] {
            while self.pump_lane(pid, lane) {}
        }
    }

    /// One doorbell's worth. Returns whether another round may post more.
    fn pump_lane(&mut self, pid: PeerId, lane: Lane) -> bool {
        let Some(p) = self.peers.get(pid.0 as usize) else {
            return false;
        };
        let Some(c) = p.conn.as_ref().filter(|c| c.connected()) else {
            return false;
        };
        let (qp, qpn, room) = match lane {
            Lane::Send => (c.send.qp, c.send.qpn, c.send.room),
            Lane::Write => (c.write.qp, c.write.qpn, c.write.room),
        };
        let budget = self.cfg.hw_send_budget.saturating_sub(self.hw_outstanding);
        let max = (room.min(budget) as usize).min(self.cfg.chain_len);
        if max == 0 {
            return false;
        }
        let queue = match lane {
            Lane::Send => &p.send_q,
            Lane::Write => &p.write_q,
        };
        // Plan: (slot, offset, len, last) per WR, without mutating ops.
        let mut plan: Vec<(u32, u64, u64, bool)> = Vec::with_capacity(max);
        for &slot in queue.iter() {
            let Some(op) = self.op_slab.get(slot as usize).and_then(Option::as_ref) else {
                continue;
            };
            if op.error.is_some() {
                continue;
            }
            if op.inflight > 0 && op.qpn != qpn {
                // Still completing on a retired connection: wait, keeping
                // the lane in order.
                break;
            }
            let mut off = op.next_off;
            loop {
                if plan.len() >= max {
                    break;
                }
                let rest = op.len - off;
                let n = rest.min(self.max_wr_len);
                let last = off + n == op.len;
                plan.push((slot, off, n, last));
                off += n;
                if last {
                    break;
                }
            }
            if plan.len() >= max {
                break;
            }
        }
        if plan.is_empty() {
            return false;
        }
        let wrs: Vec<SendWr> = plan
            .iter()
            .filter_map(|&(slot, off, n, last)| {
                let op = self.op_slab.get(slot as usize)?.as_ref()?;
                let sge = (n > 0).then(|| Sge {
                    addr: op.src_addr + off,
                    length: n as u32,
                    lkey: op.lkey,
                });
                let sop = match (op.lane, op.imm, last) {
                    (Lane::Send, _, _) => SendOp::Send,
                    (Lane::Write, Some(imm), true) => SendOp::WriteImm {
                        remote_addr: op.remote_addr + off,
                        rkey: op.rkey,
                        imm,
                    },
                    (Lane::Write, _, _) => SendOp::Write {
                        remote_addr: op.remote_addr + off,
                        rkey: op.rkey,
                    },
                };
                Some(SendWr {
                    wr_id: wr_id(KIND_OP, op.gen, slot),
                    op: sop,
                    sge,
                    signaled: true,
                })
            })
            .collect();
        let (posted, failure) = match self.ops.post_send(qp, &wrs) {
            Ok(()) => (wrs.len(), None),
            Err(f) => (f.bad_index.min(wrs.len()), Some(f.error)),
        };
        // Commit the posted prefix.
        for &(slot, off, n, last) in &plan[..posted] {
            if let Some(op) = self.op_mut(slot) {
                op.next_off = off + n;
                op.inflight += 1;
                op.qpn = qpn;
                if last {
                    op.posted_all = true;
                }
            }
            if last {
                let p = &mut self.peers[pid.0 as usize];
                let q = match lane {
                    Lane::Send => &mut p.send_q,
                    Lane::Write => &mut p.write_q,
                };
                q.retain(|s| *s != slot);
            }
        }
        self.hw_outstanding += posted as u32;
        if let Some(c) = self.peers[pid.0 as usize].conn.as_mut() {
            let end = match lane {
                Lane::Send => &mut c.send,
                Lane::Write => &mut c.write,
            };
            end.room -= posted as u32;
            end.outstanding += posted as u32;
        }
        match failure {
            None => posted == max,
            Some(e) => {
                self.stats.partial_posts += 1;
                tracing::debug!(nic = %self.nic, posted, total = wrs.len(), error = %e, "partial post_send");
                if e.code == 12 || e.code == 11 {
                    // ENOMEM/EAGAIN: the send queue is full; the rest stays
                    // queued and is posted after completions free room.
                    posted > 0
                } else {
                    // The QP refused work: take the connection out of service
                    // and rebuild it; the unposted WRs stay queued.
                    let err = self.verr(e);
                    tracing::warn!(nic = %self.nic, error = %err, "post_send rejected; resetting connection");
                    self.retire_conn(pid, None);
                    false
                }
            }
        }
    }

    fn enqueue(&mut self, mut op: Op) -> u32 {
        self.next_seq += 1;
        op.seq = self.next_seq;
        let pid = op.peer;
        let lane = op.lane;
        let slot = self.alloc_op(op);
        self.inflight += 1;
        let p = &mut self.peers[pid.0 as usize];
        match lane {
            Lane::Send => p.send_q.push_back(slot),
            Lane::Write => p.write_q.push_back(slot),
        }
        slot
    }

    fn make_write(&self, wr: &WriteWr) -> Result<Result<Op, TransportError>, TransportError> {
        self.check_peer(wr.peer)?;
        let lkey = if wr.src.len > 0 {
            self.resolve_local(&wr.src)?
        } else {
            0
        };
        let Some(remote_addr) = wr.dst.addr() else {
            return Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: "remote address overflows".into(),
            });
        };
        if remote_addr.checked_add(wr.src.len).is_none() {
            return Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: "remote range overflows".into(),
            });
        }
        let Ok(rkey) = u32::try_from(wr.dst.rkey.0) else {
            // Not a verbs rkey: no NIC can accept it. Fail like the target
            // would, as a completion.
            return Ok(Err(TransportError::RemoteAccess {
                nic: self.nic.clone(),
                peer: self.peers[wr.peer.0 as usize].addr.clone(),
                rkey: wr.dst.rkey.0,
                addr: remote_addr,
                len: wr.src.len,
                reason: RemoteAccessReason::UnknownKey,
            }));
        };
        Ok(Ok(Op {
            gen: 0,
            lane: Lane::Write,
            wr: wr.wr,
            peer: wr.peer,
            src_addr: wr.src.addr,
            lkey,
            len: wr.src.len,
            remote_addr,
            rkey,
            imm: wr.imm,
            next_off: 0,
            ok_bytes: 0,
            posted_all: false,
            inflight: 0,
            qpn: 0,
            error: None,
            seq: 0,
        }))
    }

    fn kick(&mut self, pid: PeerId) {
        if self.is_connected(pid) {
            self.pump(pid);
        } else if let Some(c) = self
            .peers
            .get_mut(pid.0 as usize)
            .and_then(|p| p.conn.as_mut())
            .filter(|c| c.next_retx == u64::MAX)
        {
            // An idle half-open connection got work: resume the handshake.
            c.tries = 0;
            self.send_handshake(pid);
        } else {
            self.ensure_conn(pid);
        }
    }

    // ---------------------------------------------------------------------
    // Completions

    fn map_status(&self, op: &Op, status: WcStatus, vendor: u32) -> TransportError {
        let peer = self
            .peers
            .get(op.peer.0 as usize)
            .map(|p| p.addr.clone())
            .unwrap_or_default_addr();
        let nic = self.nic.clone();
        match status {
            WcStatus::RetryExcErr => TransportError::PeerUnreachable {
                nic,
                peer,
                reason: "transport retry counter exceeded (IBV_WC_RETRY_EXC_ERR)".into(),
            },
            WcStatus::RnrRetryExcErr => TransportError::ReceiverNotReady { nic, peer },
            WcStatus::RemAccessErr => TransportError::RemoteAccess {
                nic,
                peer,
                rkey: u64::from(op.rkey),
                addr: op.remote_addr,
                len: op.len,
                // Verbs does not say which check failed; an rkey the target
                // does not know and an out-of-range access both land here.
                reason: RemoteAccessReason::Unspecified,
            },
            WcStatus::RemInvReqErr if op.lane == Lane::Send => TransportError::MessageTooLong {
                nic,
                peer,
                len: op.len,
                capacity: 0,
            },
            WcStatus::LocProtErr | WcStatus::LocAccessErr | WcStatus::LocLenErr => {
                TransportError::LocalAccess {
                    nic,
                    what: format!("{:?} on {:?} (vendor syndrome {vendor:#x})", status, op.wr),
                }
            }
            s => TransportError::Provider {
                nic,
                op: "ibv_poll_cq",
                code: i64::from(s.raw()),
                message: format!("work completion status {s:?} for {:?}", op.wr),
            },
        }
    }

    fn on_send_wc(&mut self, wc: Wc) {
        let id = wc.wr_id;
        if wr_kind(id) == KIND_UD {
            let slot = wr_slot(id);
            self.ud_send_free.push(slot);
            return;
        }
        self.hw_outstanding = self.hw_outstanding.saturating_sub(1);
        let pid = self.qpn_peer.get(&wc.qp_num).copied();
        // Return the send-queue slot to whichever connection owns the QP.
        let mut on_current = false;
        if let Some(p) = pid.and_then(|p| self.peers.get_mut(p.0 as usize)) {
            for c in p.conn.iter_mut().chain(p.draining.iter_mut()) {
                for end in [&mut c.send, &mut c.write] {
                    if end.qpn == wc.qp_num {
                        end.room += 1;
                        end.outstanding = end.outstanding.saturating_sub(1);
                    }
                }
            }
            on_current = p
                .conn
                .as_ref()
                .is_some_and(|c| c.send.qpn == wc.qp_num || c.write.qpn == wc.qp_num);
        }
        let slot = wr_slot(id);
        let gen = wr_gen(id);
        let Some(op) = self
            .op_slab
            .get(slot as usize)
            .and_then(Option::as_ref)
            .filter(|o| o.gen == gen)
        else {
            return;
        };
        let piece_len = {
            // Pieces complete in order: this one starts at ok_bytes.
            let rest = op.len - op.ok_bytes.min(op.len);
            rest.min(self.max_wr_len)
        };
        match wc.status {
            WcStatus::Success => {
                if let Some(op) = self.op_mut(slot) {
                    op.inflight = op.inflight.saturating_sub(1);
                    op.ok_bytes += piece_len;
                }
                self.maybe_finish(slot);
            }
            WcStatus::WrFlushErr => {
                if on_current {
                    // Our QP is in ERR without an error completion of ours
                    // (a local catastrophic error, or the QP was moved
                    // there): rebuild the connection.
                    if let Some(p) = pid {
                        tracing::info!(nic = %self.nic, qpn = wc.qp_num, "flush on a live connection; rebuilding");
                        self.retire_conn(p, Some(wc.qp_num));
                    }
                }
                let unreachable = pid
                    .and_then(|p| self.peers.get(p.0 as usize))
                    .and_then(|p| p.unreachable.clone());
                let Some(op) = self.op_mut(slot) else { return };
                op.inflight = op.inflight.saturating_sub(1);
                let opid = op.peer;
                if let Some(r) = unreachable {
                    let e = self.peer_err(opid, r);
                    self.fail_op(slot, e);
                } else if op.error.is_none() {
                    // A flushed WR was not executed (it sat behind the WR
                    // that failed, or its QP was moved to ERR): resend the
                    // rest of the op on the next connection.
                    op.next_off = op.ok_bytes;
                    op.posted_all = false;
                    if op.inflight == 0 {
                        let lane = op.lane;
                        self.stats.requeued_ops += 1;
                        let p = &mut self.peers[opid.0 as usize];
                        let q = match lane {
                            Lane::Send => &mut p.send_q,
                            Lane::Write => &mut p.write_q,
                        };
                        if !q.contains(&slot) {
                            // Keep post order: insert before the first op
                            // that was accepted after this one.
                            let seq = self.op_slab[slot as usize].as_ref().map_or(0, |o| o.seq);
                            let slab = &self.op_slab;
                            let pos = q
                                .iter()
                                .position(|s| {
                                    slab.get(*s as usize)
                                        .and_then(Option::as_ref)
                                        .is_some_and(|o| o.seq > seq)
                                })
                                .unwrap_or(q.len());
                            q.insert(pos, slot);
                        }
                    }
                    self.maybe_finish(slot);
                } else {
                    self.maybe_finish(slot);
                }
            }
            WcStatus::RetryExcErr if !on_current => {
                // A retired connection whose peer QP is gone: the WR was not
                // acknowledged; resend the rest on the current connection.
                let Some(op) = self.op_mut(slot) else { return };
                op.inflight = op.inflight.saturating_sub(1);
                if op.error.is_none() {
                    op.next_off = op.ok_bytes;
                    op.posted_all = false;
                }
                let (opid, lane, seq) = (op.peer, op.lane, op.seq);
                if op.inflight == 0 && op.error.is_none() {
                    self.stats.requeued_ops += 1;
                    let slab = &self.op_slab;
                    let p = &mut self.peers[opid.0 as usize];
                    let q = match lane {
                        Lane::Send => &mut p.send_q,
                        Lane::Write => &mut p.write_q,
                    };
                    if !q.contains(&slot) {
                        let pos = q
                            .iter()
                            .position(|s| {
                                slab.get(*s as usize)
                                    .and_then(Option::as_ref)
                                    .is_some_and(|o| o.seq > seq)
                            })
                            .unwrap_or(q.len());
                        q.insert(pos, slot);
                    }
                }
                self.maybe_finish(slot);
            }
            status => {
                let err = self.map_status(op, status, wc.vendor_err);
                let opid = op.peer;
                tracing::debug!(nic = %self.nic, wr = ?op.wr, status = ?status, "error completion");
                if let Some(op) = self.op_mut(slot) {
                    op.inflight = op.inflight.saturating_sub(1);
                }
                self.fail_op(slot, err.clone());
                if on_current {
                    match (status, err) {
                        (WcStatus::RetryExcErr, TransportError::PeerUnreachable { reason, .. }) => {
                            self.mark_unreachable(opid, reason)
                        }
                        // The QP is in ERR now: rebuild the connection; WRs
                        // behind this one flush and are resent.
                        _ => self.retire_conn(opid, Some(wc.qp_num)),
                    }
                }
            }
        }
        if let Some(p) = pid {
            self.reap_draining(p);
        }
    }

    fn on_recv_wc(&mut self, wc: Wc) {
        let id = wc.wr_id;
        match wr_kind(id) {
            KIND_UD => {
                let slot = wr_slot(id);
                if wc.status == WcStatus::Success {
                    let len = (wc.byte_len as usize).saturating_sub(GRH);
                    let bytes = self
                        .ud
                        .read(slot as usize * UD_SLOT + GRH, len.min(UD_SLOT - GRH));
                    self.on_handshake(&bytes);
                }
                if let Err(e) = self.post_ud_recv(slot) {
                    tracing::warn!(nic = %self.nic, error = %e, "cannot repost UD receive");
                }
            }
            KIND_IMM => {
                self.imm_missing += 1;
                if wc.status == WcStatus::Success {
                    if let Some(imm) = wc.imm {
                        self.out_q.push_back(Completion::Imm { imm });
                    }
                } else {
                    self.on_responder_error(wc);
                }
            }
            KIND_RECV => {
                let slot = wr_slot(id);
                let gen = wr_gen(id);
                let Some(&Some((g, user, cap))) = self.recv_slab.get(slot as usize) else {
                    return;
                };
                if g != gen {
                    return;
                }
                self.recv_slab[slot as usize] = None;
                self.recv_free.push(slot);
                self.recvs_posted = self.recvs_posted.saturating_sub(1);
                let result = match wc.status {
                    WcStatus::Success => Ok(u64::from(wc.byte_len)),
                    WcStatus::LocLenErr => Err(TransportError::MessageTooLong {
                        nic: self.nic.clone(),
                        peer: self.peer_of_qpn(wc.qp_num),
                        len: u64::from(wc.byte_len),
                        capacity: cap,
                    }),
                    s => Err(TransportError::Provider {
                        nic: self.nic.clone(),
                        op: "ibv_poll_cq",
                        code: i64::from(s.raw()),
                        message: format!("receive completion status {s:?}"),
                    }),
                };
                let failed = result.is_err();
                self.out_q.push_back(Completion::Recv { wr: user, result });
                if failed {
                    self.on_responder_error(wc);
                }
            }
            _ => {}
        }
    }

    fn peer_of_qpn(&self, qpn: u32) -> NetAddr {
        self.qpn_peer
            .get(&qpn)
            .and_then(|p| self.peers.get(p.0 as usize))
            .map(|p| p.addr.clone())
            .unwrap_or_default_addr()
    }

    /// A receive-side error moved one of a peer's QPs to ERR: rebuild.
    fn on_responder_error(&mut self, wc: Wc) {
        if let Some(pid) = self.qpn_peer.get(&wc.qp_num).copied() {
            let current = self.peers[pid.0 as usize]
                .conn
                .as_ref()
                .is_some_and(|c| c.send.qpn == wc.qp_num || c.write.qpn == wc.qp_num);
            if current {
                tracing::info!(nic = %self.nic, qpn = wc.qp_num, status = ?wc.status, "responder QP error; rebuilding connection");
                self.retire_conn(pid, Some(wc.qp_num));
            }
        }
    }

    fn poll_inner(&mut self) -> Result<(), TransportError> {
        if let Some(d) = &self.dead {
            return Err(d.clone());
        }
        for cq in [self.send_cq, self.recv_cq] {
            loop {
                let mut buf = std::mem::take(&mut self.wc_buf);
                buf.clear();
                let r = self.ops.poll_cq(cq, 64, &mut buf);
                let n = match r {
                    Ok(n) => n,
                    Err(e) => {
                        let err = if e.code == 75 {
                            TransportError::NicDown {
                                nic: format!("{} (CQ overrun)", self.nic),
                            }
                        } else {
                            self.verr(e)
                        };
                        self.dead = Some(err.clone());
                        self.wc_buf = buf;
                        return Err(err);
                    }
                };
                for wc in buf.drain(..) {
                    if cq == self.send_cq {
                        self.on_send_wc(wc);
                    } else {
                        self.on_recv_wc(wc);
                    }
                }
                self.wc_buf = buf;
                if n < 64 {
                    break;
                }
            }
        }
        if let Err(e) = self.replenish_imm() {
            tracing::warn!(nic = %self.nic, error = %e, "cannot replenish WRITE_WITH_IMM receives");
        }
        self.timers();
        for i in 0..self.peers.len() {
            let pid = PeerId(i as u32);
            let p = &self.peers[i];
            let work = !p.send_q.is_empty() || !p.write_q.is_empty();
            if work {
                self.kick(pid);
            }
            self.reap_draining(pid);
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

fn link_gbps(width: u8, speed: u8) -> Option<f64> {
    let lanes = match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => return None,
    };
    let per_lane = match speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0625,
        32 => 25.78125,
        64 => 53.125,
        128 => 106.25,
        _ => return None,
    };
    Some(lanes * per_lane)
}

/// Picks the GID: the configured index (validated), or the best one by type:
/// on Ethernet an IPv4-mapped RoCE v2 GID, else any RoCE v2 GID; on IB the
/// first non-zero IB GID. Never silently index 0: when nothing fits it fails.
fn select_gid<O: VerbsOps>(
    ops: &mut O,
    cfg: &VerbsConfig,
    port: &PortAttr,
    nic: &str,
) -> Result<(u32, Gid), TransportError> {
    if let Some(i) = cfg.gid_index {
        let e = ops
            .query_gid(cfg.port, i)
            .map_err(|e| e.into_transport(nic))?;
        if e.gid.is_zero() {
            return Err(TransportError::InvalidArgument {
                nic: nic.to_string(),
                what: format!("configured GID index {i} is empty"),
            });
        }
        return Ok((i, e.gid));
    }
    let n = port.gid_tbl_len.min(256);
    let mut entries = Vec::new();
    for i in 0..n {
        if let Ok(e) = ops.query_gid(cfg.port, i) {
            if !e.gid.is_zero() {
                entries.push((i, e));
            }
        }
    }
    let pick = if port.link_layer == LinkLayer::Ethernet {
        entries
            .iter()
            .find(|(_, e)| e.gid_type == Some(GidType::RoceV2) && e.gid.is_ipv4_mapped())
            .or_else(|| {
                entries
                    .iter()
                    .find(|(_, e)| e.gid_type == Some(GidType::RoceV2))
            })
    } else {
        entries
            .iter()
            .find(|(_, e)| matches!(e.gid_type, Some(GidType::Ib) | None))
    };
    match pick {
        Some((i, e)) => Ok((*i, e.gid)),
        None => Err(TransportError::NoDevice {
            what: format!(
                "usable GID on {nic} ({} entries, link layer {:?}); set WEFT_VERBS_GID_INDEX",
                entries.len(),
                port.link_layer
            ),
        }),
    }
}

impl<O: VerbsOps> Domain for VerbsDomain<O> {
    fn info(&self) -> &NicInfo {
        &self.info
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn register(&mut self, region: &MemRegion, acc: Access) -> Result<LocalMr, TransportError> {
        let mut flags = access::LOCAL_WRITE | access::RELAXED_ORDERING;
        if acc == Access::RemoteWrite {
            flags |= access::REMOTE_WRITE;
        }
        let addr = region.addr();
        let len = region.len() as u64;
        let res = match region.device() {
            Device::Host => self.ops.reg_mr(self.pd, addr, len, flags),
            dev @ Device::Cuda(_) => match self.cfg.dmabuf.clone() {
                Some(exp) => {
                    let (fd, off) = exp.export(addr, len, dev)?;
                    match self.ops.reg_dmabuf_mr(self.pd, off, len, addr, fd, flags) {
                        Ok(r) => Ok(r),
                        Err(e) if self.ops.peer_memory() => {
                            tracing::debug!(nic = %self.nic, error = %e, "dma-buf registration failed; using peer memory");
                            self.ops.reg_mr(self.pd, addr, len, flags)
                        }
                        Err(e) => Err(e),
                    }
                }
                None if self.ops.peer_memory() => self.ops.reg_mr(self.pd, addr, len, flags),
                None => {
                    return Err(TransportError::Unsupported {
                        nic: self.nic.clone(),
                        what: format!(
                            "{dev} memory: no dma-buf exporter configured and no peer-memory client"
                        ),
                    })
                }
            },
        };
        let (mr, lkey, rkey) = res.map_err(|e| {
            if e.code == 95 {
                TransportError::Unsupported {
                    nic: self.nic.clone(),
                    what: format!("registering {} memory: {e}", region.device()),
                }
            } else {
                self.verr(e)
            }
        })?;
        let key = self.next_mr;
        self.next_mr += 1;
        self.mrs.insert(
            key,
            MrEntry {
                mr,
                lkey,
                addr,
                len,
            },
        );
        Ok(LocalMr {
            key: MrKey(key),
            rkey: Rkey(u64::from(rkey)),
            addr,
            len,
            device: region.device(),
        })
    }

    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError> {
        let e = self
            .mrs
            .remove(&mr.0)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: format!("unknown registration {mr:?}"),
            })?;
        self.ops.dereg_mr(e.mr).map_err(|e| self.verr(e))
    }

    fn add_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        if let Some(p) = self.by_addr.get(addr) {
            return Ok(*p);
        }
        let va = VerbsAddr::decode(&addr.0).map_err(|why| TransportError::InvalidArgument {
            nic: self.nic.clone(),
            what: format!("address {addr}: {why}"),
        })?;
        let pid = PeerId(u32::try_from(self.peers.len()).map_err(|_| {
            TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: "too many peers".into(),
            }
        })?);
        self.peers.push(Peer {
            addr: addr.clone(),
            va,
            ah: None,
            conn: None,
            draining: Vec::new(),
            unreachable: None,
            send_q: VecDeque::new(),
            write_q: VecDeque::new(),
        });
        self.by_addr.insert(addr.clone(), pid);
        Ok(pid)
    }

    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError> {
        self.check_room()?;
        self.check_peer(peer)?;
        if src.len > self.caps.max_send_len {
            return Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: format!(
                    "SEND of {} bytes exceeds {} bytes",
                    src.len, self.caps.max_send_len
                ),
            });
        }
        let lkey = if src.len > 0 {
            self.resolve_local(&src)?
        } else {
            0
        };
        self.enqueue(Op {
            gen: 0,
            lane: Lane::Send,
            wr,
            peer,
            src_addr: src.addr,
            lkey,
            len: src.len,
            remote_addr: 0,
            rkey: 0,
            imm: None,
            next_off: 0,
            ok_bytes: 0,
            posted_all: false,
            inflight: 0,
            qpn: 0,
            error: None,
            seq: 0,
        });
        self.kick(peer);
        Ok(())
    }

    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        if let Some(d) = &self.dead {
            return Err(d.clone());
        }
        if self.recvs_posted >= self.cfg.recv_pool {
            return Err(TransportError::QueueFull {
                nic: self.nic.clone(),
            });
        }
        let lkey = if buf.len > 0 {
            self.resolve_local(&buf)?
        } else {
            0
        };
        let length = u32::try_from(buf.len)
            .unwrap_or(u32::MAX)
            .min(MAX_VERBS_WR_LEN as u32);
        self.op_gen = self.op_gen.wrapping_add(1) & 0x1fff_ffff;
        let gen = self.op_gen;
        let slot = match self.recv_free.pop() {
            Some(s) => s,
            None => {
                self.recv_slab.push(None);
                (self.recv_slab.len() - 1) as u32
            }
        };
        let rwr = RecvWr {
            wr_id: wr_id(KIND_RECV, gen, slot),
            sge: (buf.len > 0).then_some(Sge {
                addr: buf.addr,
                length,
                lkey,
            }),
        };
        match self.ops.post_srq_recv(self.recv_srq, &[rwr]) {
            Ok(()) => {
                self.recv_slab[slot as usize] = Some((gen, wr, u64::from(length)));
                self.recvs_posted += 1;
                Ok(())
            }
            Err(f) => {
                self.recv_free.push(slot);
                Err(self.verr(f.error))
            }
        }
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        let mut touched: Vec<PeerId> = Vec::new();
        let mut accepted = 0;
        let mut error = None;
        for w in wrs.iter().take(self.caps.max_batch) {
            if let Err(e) = self.check_room() {
                if e.is_retryable() {
                    break;
                }
                error = Some(e);
                break;
            }
            match self.make_write(w) {
                Err(e) => {
                    error = Some(e);
                    break;
                }
                Ok(Err(completion_error)) => {
                    self.inflight += 1;
                    let slot = self.alloc_op(Op {
                        gen: 0,
                        lane: Lane::Write,
                        wr: w.wr,
                        peer: w.peer,
                        src_addr: 0,
                        lkey: 0,
                        len: w.src.len,
                        remote_addr: 0,
                        rkey: 0,
                        imm: None,
                        next_off: 0,
                        ok_bytes: 0,
                        posted_all: false,
                        inflight: 0,
                        qpn: 0,
                        error: None,
                        seq: 0,
                    });
                    self.fail_op(slot, completion_error);
                }
                Ok(Ok(op)) => {
                    let pid = op.peer;
                    self.enqueue(op);
                    if !touched.contains(&pid) {
                        touched.push(pid);
                    }
                }
            }
            accepted += 1;
        }
        for pid in touched {
            self.kick(pid);
        }
        match error {
            Some(error) => Err(PostError {
                posted: accepted,
                error,
            }),
            None => Ok(accepted),
        }
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
        let _ = self.ops.destroy_qp(self.ud_qp);
        let _ = self.ops.destroy_srq(self.recv_srq);
        let _ = self.ops.destroy_srq(self.imm_srq);
        let _ = self.ops.destroy_cq(self.send_cq);
        let _ = self.ops.destroy_cq(self.recv_cq);
        let _ = self.ops.dereg_mr(self.ud_mr);
        for (_, m) in std::mem::take(&mut self.mrs) {
            let _ = self.ops.dereg_mr(m.mr);
        }
        let _ = self.ops.dealloc_pd(self.pd);
    }
}
