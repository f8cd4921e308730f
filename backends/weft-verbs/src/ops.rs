//! The seam: exactly the verbs calls the backend makes.
//!
//! Everything above this module (connection manager, QP state handling, WR
//! chaining, receive replenishment, completion demux, error mapping) talks to
//! a NIC only through [`VerbsLib`] and [`VerbsOps`]. Two implementations
//! exist: the real libibverbs ([`crate::ffi`]) and, behind the `sim` cargo
//! feature, a simulated RC device (`crate::sim`).
//!
//! Types here mirror `struct ibv_*` fields one to one, in host byte order;
//! the FFI layer converts (immediates are big-endian on the wire).

use std::fmt;
use weft_transport::TransportError;

/// A failed verbs call: which call and its errno (or verbs status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsError {
    /// The verbs call, e.g. `ibv_modify_qp`.
    pub op: &'static str,
    /// Positive errno (or provider status).
    pub code: i32,
    /// Extra context (which QP, which transition).
    pub detail: String,
}

impl VerbsError {
    /// A new error for `op` with errno `code`.
    pub fn new(op: &'static str, code: i32, detail: impl Into<String>) -> Self {
        Self {
            op,
            code,
            detail: detail.into(),
        }
    }

    /// Converts to the contract's error type, naming the NIC.
    pub fn into_transport(self, nic: &str) -> TransportError {
        let errno = std::io::Error::from_raw_os_error(self.code);
        TransportError::Provider {
            nic: nic.to_string(),
            op: self.op,
            code: i64::from(self.code),
            message: if self.detail.is_empty() {
                errno.to_string()
            } else {
                format!("{errno}: {}", self.detail)
            },
        }
    }
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed (errno {}) {}",
            self.op, self.code, self.detail
        )
    }
}

/// A partially posted chain: WRs before `bad_index` were posted, the one at
/// `bad_index` (the verbs `bad_wr`) and all after it were not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostFailure {
    /// Index of the first WR that was not posted.
    pub bad_index: usize,
    /// Why.
    pub error: VerbsError,
}

macro_rules! handle {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u64);
    };
}
handle!(
    /// A protection domain (`struct ibv_pd *`).
    Pd
);
handle!(
    /// A completion queue (`struct ibv_cq *`).
    Cq
);
handle!(
    /// A shared receive queue (`struct ibv_srq *`).
    Srq
);
handle!(
    /// A queue pair (`struct ibv_qp *`).
    Qp
);
handle!(
    /// A memory registration (`struct ibv_mr *`).
    Mr
);
handle!(
    /// An address handle (`struct ibv_ah *`).
    Ah
);

/// A 128-bit GID (`union ibv_gid`), network byte order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Whether every byte is zero (an unused GID table entry).
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|b| *b == 0)
    }

    /// Whether this is an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`), the
    /// form RoCE v2 GIDs of IPv4 interfaces take.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10].iter().all(|b| *b == 0) && self.0[10] == 0xff && self.0[11] == 0xff
    }

    /// The IPv4-mapped GID `::ffff:a.b.c.d` of IPv4 address `ip`.
    pub fn ipv4_mapped(ip: [u8; 4]) -> Self {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&ip);
        Gid(g)
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks_exact(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

/// `enum ibv_gid_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GidType {
    /// InfiniBand GID.
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable).
    RoceV2,
}

/// One GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// The GID.
    pub gid: Gid,
    /// Its type, when the library or sysfs can tell.
    pub gid_type: Option<GidType>,
}

/// `IBV_LINK_LAYER_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// Unspecified (treated as InfiniBand).
    Unspecified,
    /// InfiniBand: LID routing, GRH optional.
    InfiniBand,
    /// Ethernet (RoCE): GRH mandatory.
    Ethernet,
}

/// `enum ibv_mtu` as a byte count.
pub fn mtu_bytes(mtu: u32) -> Option<u32> {
    match mtu {
        1 => Some(256),
        2 => Some(512),
        3 => Some(1024),
        4 => Some(2048),
        5 => Some(4096),
        _ => None,
    }
}

/// The parts of `struct ibv_port_attr` the backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `enum ibv_port_state` (4 = `IBV_PORT_ACTIVE`).
    pub state: u32,
    /// `enum ibv_mtu` of the active MTU (1..=5).
    pub active_mtu: u32,
    /// Number of GID table entries.
    pub gid_tbl_len: u32,
    /// Largest message size.
    pub max_msg_sz: u32,
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// `active_width` (IB encoding).
    pub active_width: u8,
    /// `active_speed` (IB encoding).
    pub active_speed: u8,
}

/// `IBV_PORT_ACTIVE`.
pub const PORT_ACTIVE: u32 = 4;

/// Bytes of the GRH area in front of every UD receive's payload
/// (`sizeof(struct ibv_grh)`).
pub const GRH_LEN: usize = 40;

/// Where an IPv6-format GRH holds the source GID (`struct ibv_grh.sgid`).
pub const GRH_SGID: std::ops::Range<usize> = 8..24;

/// `IBV_ACCESS_*` flags.
pub mod access {
    /// `IBV_ACCESS_LOCAL_WRITE`.
    pub const LOCAL_WRITE: u32 = 1;
    /// `IBV_ACCESS_REMOTE_WRITE`.
    pub const REMOTE_WRITE: u32 = 1 << 1;
    /// `IBV_ACCESS_REMOTE_READ`.
    pub const REMOTE_READ: u32 = 1 << 2;
    /// `IBV_ACCESS_RELAXED_ORDERING` (first optional access flag).
    pub const RELAXED_ORDERING: u32 = 1 << 20;
}

/// A device as listed by `ibv_get_device_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel device name, e.g. `mlx5_0`.
    pub name: String,
    /// NUMA node from sysfs, when known.
    pub numa_node: Option<u32>,
}

/// `enum ibv_qp_type` (the two the backend uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    /// Reliable connected.
    Rc,
    /// Unreliable datagram.
    Ud,
}

/// `struct ibv_qp_init_attr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInit {
    /// RC or UD.
    pub qp_type: QpType,
    /// CQ for send completions.
    pub send_cq: Cq,
    /// CQ for receive completions.
    pub recv_cq: Cq,
    /// Shared receive queue, if receives come from one.
    pub srq: Option<Srq>,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// Scatter/gather entries per WR.
    pub max_sge: u32,
}

/// What `ibv_create_qp` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCreated {
    /// The QP.
    pub qp: Qp,
    /// Its number.
    pub qpn: u32,
    /// Actual send queue depth (at least the requested one).
    pub max_send_wr: u32,
    /// Actual receive queue depth.
    pub max_recv_wr: u32,
}

/// `struct ibv_ah_attr` (with its GRH).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AhAttr {
    /// Destination LID (IB).
    pub dlid: u16,
    /// Whether a GRH is used (always on RoCE).
    pub is_global: bool,
    /// Destination GID.
    pub dgid: Gid,
    /// Local GID index.
    pub sgid_index: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
    /// GRH traffic class.
    pub traffic_class: u8,
    /// Service level.
    pub sl: u8,
    /// Local port.
    pub port: u8,
}

/// One QP state transition, with exactly the attributes verbs requires
/// for it (the attribute mask follows from the variant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModifyQp {
    /// RESET→INIT.
    Init {
        /// Port number.
        port: u8,
        /// P_Key index.
        pkey_index: u16,
        /// RC: remote access flags; UD: ignored.
        access: u32,
        /// UD: Q_Key.
        qkey: Option<u32>,
    },
    /// INIT→RTR of an RC QP.
    RtrRc {
        /// `enum ibv_mtu`.
        path_mtu: u32,
        /// Remote QPN.
        dest_qpn: u32,
        /// Remote's starting PSN.
        rq_psn: u32,
        /// Path to the remote.
        ah: AhAttr,
        /// Responder RDMA read/atomic resources.
        max_dest_rd_atomic: u8,
        /// RNR NAK timer code.
        min_rnr_timer: u8,
    },
    /// INIT→RTR of a UD QP.
    RtrUd,
    /// RTR→RTS.
    Rts {
        /// Our starting PSN.
        sq_psn: u32,
        /// Local ACK timeout exponent (RC).
        timeout: u8,
        /// Transport retries (RC).
        retry_cnt: u8,
        /// RNR retries (RC, 7 = infinite).
        rnr_retry: u8,
        /// Initiator RDMA read/atomic depth (RC).
        max_rd_atomic: u8,
        /// Whether this is an RC QP (UD takes only the PSN).
        rc: bool,
    },
    /// Any state→ERR (flushes outstanding WRs).
    Err,
    /// Any state→RESET.
    Reset,
}

/// `enum ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QpState {
    /// RESET.
    Reset,
    /// INIT.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Error: everything is flushed.
    Err,
}

/// `struct ibv_sge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Address.
    pub addr: u64,
    /// Length (verbs lengths are 32-bit).
    pub length: u32,
    /// Local key.
    pub lkey: u32,
}

/// What a send WR does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// `IBV_WR_SEND`.
    Send,
    /// `IBV_WR_RDMA_WRITE`.
    Write {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// `IBV_WR_RDMA_WRITE_WITH_IMM` (immediate in host order here).
    WriteImm {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate.
        imm: u32,
    },
    /// `IBV_WR_SEND` on a UD QP.
    UdSend {
        /// Address handle of the destination.
        ah: Ah,
        /// Destination QPN.
        remote_qpn: u32,
        /// Destination Q_Key.
        remote_qkey: u32,
    },
}

/// `struct ibv_send_wr` (one SGE at most).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Comes back in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local buffer; `None` for zero-length.
    pub sge: Option<Sge>,
    /// `IBV_SEND_SIGNALED`.
    pub signaled: bool,
}

/// `struct ibv_recv_wr` (one SGE at most).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Comes back in the completion.
    pub wr_id: u64,
    /// Buffer; `None` for the zero-byte receives WRITE_WITH_IMM consumes.
    pub sge: Option<Sge>,
}

/// `enum ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum WcStatus {
    Success,
    LocLenErr,
    LocQpOpErr,
    LocProtErr,
    WrFlushErr,
    LocAccessErr,
    RemInvReqErr,
    RemAccessErr,
    RemOpErr,
    RetryExcErr,
    RnrRetryExcErr,
    FatalErr,
    GeneralErr,
    /// Any other status code.
    Other(u32),
}

impl WcStatus {
    /// From the raw `enum ibv_wc_status` value.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => Self::Success,
            1 => Self::LocLenErr,
            2 => Self::LocQpOpErr,
            4 => Self::LocProtErr,
            5 => Self::WrFlushErr,
            8 => Self::LocAccessErr,
            9 => Self::RemInvReqErr,
            10 => Self::RemAccessErr,
            11 => Self::RemOpErr,
            12 => Self::RetryExcErr,
            13 => Self::RnrRetryExcErr,
            19 => Self::FatalErr,
            21 => Self::GeneralErr,
            o => Self::Other(o),
        }
    }

    /// The raw value.
    pub fn raw(self) -> u32 {
        match self {
            Self::Success => 0,
            Self::LocLenErr => 1,
            Self::LocQpOpErr => 2,
            Self::LocProtErr => 4,
            Self::WrFlushErr => 5,
            Self::LocAccessErr => 8,
            Self::RemInvReqErr => 9,
            Self::RemAccessErr => 10,
            Self::RemOpErr => 11,
            Self::RetryExcErr => 12,
            Self::RnrRetryExcErr => 13,
            Self::FatalErr => 19,
            Self::GeneralErr => 21,
            Self::Other(o) => o,
        }
    }
}

/// `enum ibv_wc_opcode` (the ones the backend sees).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND finished.
    Send,
    /// An RDMA WRITE (with or without immediate) finished.
    RdmaWrite,
    /// A SEND arrived.
    Recv,
    /// A WRITE_WITH_IMM arrived.
    RecvRdmaWithImm,
    /// Anything else (or unknown in an error completion).
    Other(u32),
}

/// `struct ibv_wc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    /// The WR's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed (valid only for successful completions).
    pub opcode: WcOpcode,
    /// Vendor syndrome.
    pub vendor_err: u32,
    /// Bytes received.
    pub byte_len: u32,
    /// Immediate (host order), if the completion carries one.
    pub imm: Option<u32>,
    /// Local QPN.
    pub qp_num: u32,
    /// Source QPN (UD receives).
    pub src_qp: u32,
    /// Source LID (UD receives on InfiniBand).
    pub slid: u16,
    /// A 40-byte GRH area precedes a UD receive's payload and holds its
    /// source (`IBV_WC_GRH`).
    pub grh: bool,
}

/// Device discovery and opening (`ibv_get_device_list`, `ibv_open_device`).
pub trait VerbsLib: Send + Sync {
    /// The device context type.
    type Ops: VerbsOps + 'static;

    /// Lists devices. `LibraryUnavailable` when libibverbs cannot be loaded,
    /// an empty list when it loads but finds no devices.
    fn devices(&self) -> Result<Vec<DeviceInfo>, TransportError>;

    /// Opens the device at index `nic` of [`VerbsLib::devices`].
    fn open(&self, nic: usize) -> Result<Self::Ops, TransportError>;
}

/// One opened device (`struct ibv_context`) and every verbs call the backend
/// makes on it.
pub trait VerbsOps: Send {
    /// The device name.
    fn name(&self) -> &str;
    /// `ibv_query_port`.
    fn query_port(&mut self, port: u8) -> Result<PortAttr, VerbsError>;
    /// `ibv_query_gid_ex` (type from the library or sysfs).
    fn query_gid(&mut self, port: u8, index: u32) -> Result<GidEntry, VerbsError>;
    /// `ibv_alloc_pd`.
    fn alloc_pd(&mut self) -> Result<Pd, VerbsError>;
    /// `ibv_dealloc_pd`.
    fn dealloc_pd(&mut self, pd: Pd) -> Result<(), VerbsError>;
    /// `ibv_reg_mr` (`ibv_reg_mr_iova2` when optional access flags are set).
    /// Returns `(mr, lkey, rkey)`.
    fn reg_mr(
        &mut self,
        pd: Pd,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError>;
    /// `ibv_reg_dmabuf_mr`. Returns `(mr, lkey, rkey)`.
    fn reg_dmabuf_mr(
        &mut self,
        pd: Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError>;
    /// `ibv_dereg_mr`.
    fn dereg_mr(&mut self, mr: Mr) -> Result<(), VerbsError>;
    /// `ibv_create_cq` with at least `cqe` entries.
    fn create_cq(&mut self, cqe: u32) -> Result<Cq, VerbsError>;
    /// `ibv_destroy_cq`.
    fn destroy_cq(&mut self, cq: Cq) -> Result<(), VerbsError>;
    /// `ibv_create_srq`.
    fn create_srq(&mut self, pd: Pd, max_wr: u32) -> Result<Srq, VerbsError>;
    /// `ibv_destroy_srq`.
    fn destroy_srq(&mut self, srq: Srq) -> Result<(), VerbsError>;
    /// `ibv_create_qp`.
    fn create_qp(&mut self, pd: Pd, init: &QpInit) -> Result<QpCreated, VerbsError>;
    /// `ibv_modify_qp`.
    fn modify_qp(&mut self, qp: Qp, change: &ModifyQp) -> Result<(), VerbsError>;
    /// `ibv_destroy_qp`.
    fn destroy_qp(&mut self, qp: Qp) -> Result<(), VerbsError>;
    /// `ibv_post_send` of `wrs` linked into one chain (one doorbell).
    fn post_send(&mut self, qp: Qp, wrs: &[SendWr]) -> Result<(), PostFailure>;
    /// `ibv_post_recv` of a chain.
    fn post_recv(&mut self, qp: Qp, wrs: &[RecvWr]) -> Result<(), PostFailure>;
    /// `ibv_post_srq_recv` of a chain.
    fn post_srq_recv(&mut self, srq: Srq, wrs: &[RecvWr]) -> Result<(), PostFailure>;
    /// `ibv_poll_cq` for up to `max` completions, appended to `out`.
    fn poll_cq(&mut self, cq: Cq, max: usize, out: &mut Vec<Wc>) -> Result<usize, VerbsError>;
    /// `ibv_create_ah`.
    fn create_ah(&mut self, pd: Pd, attr: &AhAttr) -> Result<Ah, VerbsError>;
    /// `ibv_destroy_ah`.
    fn destroy_ah(&mut self, ah: Ah) -> Result<(), VerbsError>;
    /// Monotonic time in nanoseconds (the simulator's logical clock there).
    fn now_ns(&self) -> u64;
    /// A seed for PSNs and handshake nonces.
    fn entropy(&mut self) -> u64;
    /// Whether GPU memory can be registered with plain `ibv_reg_mr`
    /// (a peer-memory client such as `nvidia_peermem` is loaded).
    fn peer_memory(&self) -> bool;
}
