//! The ABI mirrors: hand-written `#[repr(C)]` copies of the parts of
//! rdma-core's `<infiniband/verbs.h>` the backend uses, and the numeric
//! constants it takes from there.
//!
//! Public (but hidden) only so that `tests/layout.rs` can compare every
//! size, alignment, field offset and constant here with what the C compiler
//! computes from the installed header. Field names are verbs.h's. Each
//! struct says how much of its C counterpart it mirrors:
//!
//! - *whole*: every C field, same size and alignment;
//! - *head*: the leading fields of a struct the library allocates and
//!   weft only reads through a pointer (same offsets, size at most C's);
//! - *out buffer*: every C field, and at least C's size, since the
//!   library writes into it.
//!
//! Arrays named `_…` stand for C fields weft never touches; their size is
//! covered by the struct's size check.

use std::ffi::{c_int, c_void};
use std::ops::Range;

/// `struct ibv_sge` (whole).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSge {
    /// Start of the local buffer.
    pub addr: u64,
    /// Its length in bytes.
    pub length: u32,
    /// Local key of its registration.
    pub lkey: u32,
}

/// `struct ibv_send_wr` (whole). The `wr` union is kept as bytes and
/// written at the offsets [`WR_RDMA_REMOTE_ADDR`] .. [`WR_UD_REMOTE_QKEY`];
/// `_pad` and `_tail` stand for the rest of the `qp_type` union and the
/// `bind_mw` / `tso` union.
#[repr(C)]
pub struct IbvSendWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// Next WR of the chain, or NULL.
    pub next: *mut IbvSendWr,
    /// Scatter/gather list.
    pub sg_list: *mut IbvSge,
    /// Entries in `sg_list`.
    pub num_sge: c_int,
    /// `enum ibv_wr_opcode`.
    pub opcode: u32,
    /// `IBV_SEND_*` flags.
    pub send_flags: u32,
    /// Immediate, network byte order.
    pub imm_data: u32,
    /// The `wr` union (rdma / atomic / ud).
    pub wr: [u8; 32],
    /// The `qp_type` union (`xrc.remote_srqn`).
    pub qp_type: u32,
    /// Padding after `qp_type`.
    pub _pad: u32,
    /// The `bind_mw` / `tso` union.
    pub _tail: [u64; 6],
}

/// `wr.rdma.remote_addr` within [`IbvSendWr::wr`].
pub const WR_RDMA_REMOTE_ADDR: Range<usize> = 0..8;
/// `wr.rdma.rkey` within [`IbvSendWr::wr`].
pub const WR_RDMA_RKEY: Range<usize> = 8..12;
/// `wr.ud.ah` within [`IbvSendWr::wr`].
pub const WR_UD_AH: Range<usize> = 0..8;
/// `wr.ud.remote_qpn` within [`IbvSendWr::wr`].
pub const WR_UD_REMOTE_QPN: Range<usize> = 8..12;
/// `wr.ud.remote_qkey` within [`IbvSendWr::wr`].
pub const WR_UD_REMOTE_QKEY: Range<usize> = 12..16;

/// `struct ibv_recv_wr` (whole).
#[repr(C)]
pub struct IbvRecvWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// Next WR of the chain, or NULL.
    pub next: *mut IbvRecvWr,
    /// Scatter/gather list.
    pub sg_list: *mut IbvSge,
    /// Entries in `sg_list`.
    pub num_sge: c_int,
}

/// `struct ibv_wc` (whole: `poll_cq` fills an array of them).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvWc {
    /// The WR's id.
    pub wr_id: u64,
    /// `enum ibv_wc_status`.
    pub status: u32,
    /// `enum ibv_wc_opcode`.
    pub opcode: u32,
    /// Vendor syndrome.
    pub vendor_err: u32,
    /// Bytes received.
    pub byte_len: u32,
    /// Immediate, network byte order (union with `invalidated_rkey`).
    pub imm_data: u32,
    /// Local QPN.
    pub qp_num: u32,
    /// Source QPN (UD).
    pub src_qp: u32,
    /// `IBV_WC_*` flags.
    pub wc_flags: u32,
    /// P_Key index (GSI QPs).
    pub pkey_index: u16,
    /// Source LID.
    pub slid: u16,
    /// Service level.
    pub sl: u8,
    /// Destination LID path bits.
    pub dlid_path_bits: u8,
}

/// `context->ops.poll_cq` (what the inline `ibv_poll_cq` calls).
pub type PollCqFn = unsafe extern "C" fn(*mut IbvCq, c_int, *mut IbvWc) -> c_int;
/// `context->ops.post_send` (what the inline `ibv_post_send` calls).
pub type PostSendFn =
    unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
/// `context->ops.post_recv` (what the inline `ibv_post_recv` calls).
pub type PostRecvFn =
    unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;
/// `context->ops.post_srq_recv` (what the inline `ibv_post_srq_recv` calls).
pub type PostSrqRecvFn =
    unsafe extern "C" fn(*mut IbvSrq, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;

/// `struct ibv_context_ops` (whole: 32 pointers, four of them named).
#[repr(C)]
pub struct IbvContextOps {
    /// `_compat_query_device` .. `_compat_create_cq`.
    pub _before_poll: [*mut c_void; 11],
    /// `poll_cq`.
    pub poll_cq: Option<PollCqFn>,
    /// `req_notify_cq` .. `_compat_destroy_srq`.
    pub _before_srq: [*mut c_void; 8],
    /// `post_srq_recv`.
    pub post_srq_recv: Option<PostSrqRecvFn>,
    /// `_compat_create_qp` .. `_compat_destroy_qp`.
    pub _before_send: [*mut c_void; 4],
    /// `post_send`.
    pub post_send: Option<PostSendFn>,
    /// `post_recv`.
    pub post_recv: Option<PostRecvFn>,
    /// `_compat_create_ah` .. `_compat_async_event`.
    pub _rest: [*mut c_void; 5],
}

/// `struct ibv_context` (head: device pointer, then the ops table).
#[repr(C)]
pub struct IbvContext {
    /// `struct ibv_device *`.
    pub device: *mut c_void,
    /// The provider's entry points.
    pub ops: IbvContextOps,
}

/// `struct ibv_qp` (head, through `qp_num`).
#[repr(C)]
pub struct IbvQp {
    /// Owning context.
    pub context: *mut IbvContext,
    /// User context pointer.
    pub qp_context: *mut c_void,
    /// `struct ibv_pd *`.
    pub pd: *mut c_void,
    /// `struct ibv_cq *` for sends.
    pub send_cq: *mut c_void,
    /// `struct ibv_cq *` for receives.
    pub recv_cq: *mut c_void,
    /// `struct ibv_srq *`, or NULL.
    pub srq: *mut c_void,
    /// Kernel handle.
    pub handle: u32,
    /// QP number.
    pub qp_num: u32,
}

/// `struct ibv_cq` (head: the context pointer).
#[repr(C)]
pub struct IbvCq {
    /// Owning context.
    pub context: *mut IbvContext,
}

/// `struct ibv_srq` (head: the context pointer).
#[repr(C)]
pub struct IbvSrq {
    /// Owning context.
    pub context: *mut IbvContext,
}

/// `struct ibv_mr` (whole).
#[repr(C)]
pub struct IbvMr {
    /// Owning context.
    pub context: *mut IbvContext,
    /// `struct ibv_pd *`.
    pub pd: *mut c_void,
    /// Start of the region.
    pub addr: *mut c_void,
    /// Its length.
    pub length: usize,
    /// Kernel handle.
    pub handle: u32,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// `struct ibv_qp_cap` (whole).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send WR.
    pub max_send_sge: u32,
    /// SGEs per receive WR.
    pub max_recv_sge: u32,
    /// Inline data bytes.
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr` (whole).
#[repr(C)]
pub struct IbvQpInitAttr {
    /// User context pointer.
    pub qp_context: *mut c_void,
    /// `struct ibv_cq *` for sends.
    pub send_cq: *mut c_void,
    /// `struct ibv_cq *` for receives.
    pub recv_cq: *mut c_void,
    /// `struct ibv_srq *`, or NULL.
    pub srq: *mut c_void,
    /// Requested (and, on return, actual) capabilities.
    pub cap: IbvQpCap,
    /// `enum ibv_qp_type`.
    pub qp_type: u32,
    /// Whether every send WR is signaled.
    pub sq_sig_all: c_int,
}

/// `struct ibv_srq_init_attr` (whole; its `attr` member,
/// `struct ibv_srq_attr`, flattened).
#[repr(C)]
pub struct IbvSrqInitAttr {
    /// User context pointer.
    pub srq_context: *mut c_void,
    /// `attr.max_wr`.
    pub max_wr: u32,
    /// `attr.max_sge`.
    pub max_sge: u32,
    /// `attr.srq_limit`.
    pub srq_limit: u32,
}

/// `struct ibv_global_route` (whole). `union ibv_gid` holds two `__be64`,
/// hence the 8-byte alignment.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    /// Destination GID (`union ibv_gid`).
    pub dgid: [u8; 16],
    /// Flow label.
    pub flow_label: u32,
    /// Local GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr` (whole).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvAhAttr {
    /// Global route (used when `is_global`).
    pub grh: IbvGlobalRoute,
    /// Destination LID.
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate.
    pub static_rate: u8,
    /// Whether `grh` is used.
    pub is_global: u8,
    /// Local port.
    pub port_num: u8,
}

/// `struct ibv_qp_attr` (whole).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpAttr {
    /// `enum ibv_qp_state`.
    pub qp_state: u32,
    /// `enum ibv_qp_state`.
    pub cur_qp_state: u32,
    /// `enum ibv_mtu`.
    pub path_mtu: u32,
    /// `enum ibv_mig_state`.
    pub path_mig_state: u32,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Remote QPN.
    pub dest_qp_num: u32,
    /// `IBV_ACCESS_*` flags.
    pub qp_access_flags: u32,
    /// Capabilities.
    pub cap: IbvQpCap,
    /// Primary path.
    pub ah_attr: IbvAhAttr,
    /// Alternate path.
    pub alt_ah_attr: IbvAhAttr,
    /// P_Key index.
    pub pkey_index: u16,
    /// Alternate P_Key index.
    pub alt_pkey_index: u16,
    /// SQD async event wanted.
    pub en_sqd_async_notify: u8,
    /// SQ draining (query only).
    pub sq_draining: u8,
    /// Initiator RDMA read/atomic depth.
    pub max_rd_atomic: u8,
    /// Responder RDMA read/atomic resources.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Port.
    pub port_num: u8,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries.
    pub rnr_retry: u8,
    /// Alternate port.
    pub alt_port_num: u8,
    /// Alternate timeout.
    pub alt_timeout: u8,
    /// Rate limit (kbps).
    pub rate_limit: u32,
}

/// `struct ibv_port_attr` (out buffer of the exported `ibv_query_port`,
/// which fills at most this much).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvPortAttr {
    /// `enum ibv_port_state`.
    pub state: u32,
    /// `enum ibv_mtu`.
    pub max_mtu: u32,
    /// `enum ibv_mtu`.
    pub active_mtu: u32,
    /// GID table entries.
    pub gid_tbl_len: c_int,
    /// Capability flags.
    pub port_cap_flags: u32,
    /// Largest message size.
    pub max_msg_sz: u32,
    /// Bad P_Key counter.
    pub bad_pkey_cntr: u32,
    /// Q_Key violation counter.
    pub qkey_viol_cntr: u32,
    /// P_Key table entries.
    pub pkey_tbl_len: u16,
    /// Local LID.
    pub lid: u16,
    /// Subnet manager LID.
    pub sm_lid: u16,
    /// LID mask control.
    pub lmc: u8,
    /// Virtual lanes.
    pub max_vl_num: u8,
    /// Subnet manager SL.
    pub sm_sl: u8,
    /// Subnet timeout.
    pub subnet_timeout: u8,
    /// Init type reply.
    pub init_type_reply: u8,
    /// Active width (IB encoding).
    pub active_width: u8,
    /// Active speed (IB encoding).
    pub active_speed: u8,
    /// Physical state.
    pub phys_state: u8,
    /// `IBV_LINK_LAYER_*`.
    pub link_layer: u8,
    /// `IBV_QPF_*` flags.
    pub flags: u8,
    /// More capability flags.
    pub port_cap_flags2: u16,
}

/// `struct ibv_gid_entry` (whole; `ibv_query_gid_ex` is told its size).
/// `union ibv_gid` holds two `__be64`, hence the 8-byte alignment.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct IbvGidEntry {
    /// The GID (`union ibv_gid`).
    pub gid: [u8; 16],
    /// Its index.
    pub gid_index: u32,
    /// Its port.
    pub port_num: u32,
    /// `enum ibv_gid_type`.
    pub gid_type: u32,
    /// Network device index.
    pub ndev_ifindex: u32,
}

/// `IBV_QP_STATE` (`enum ibv_qp_attr_mask`).
pub const QP_STATE: c_int = 1;
/// `IBV_QP_ACCESS_FLAGS`.
pub const QP_ACCESS_FLAGS: c_int = 1 << 3;
/// `IBV_QP_PKEY_INDEX`.
pub const QP_PKEY_INDEX: c_int = 1 << 4;
/// `IBV_QP_PORT`.
pub const QP_PORT: c_int = 1 << 5;
/// `IBV_QP_QKEY`.
pub const QP_QKEY: c_int = 1 << 6;
/// `IBV_QP_AV`.
pub const QP_AV: c_int = 1 << 7;
/// `IBV_QP_PATH_MTU`.
pub const QP_PATH_MTU: c_int = 1 << 8;
/// `IBV_QP_TIMEOUT`.
pub const QP_TIMEOUT: c_int = 1 << 9;
/// `IBV_QP_RETRY_CNT`.
pub const QP_RETRY_CNT: c_int = 1 << 10;
/// `IBV_QP_RNR_RETRY`.
pub const QP_RNR_RETRY: c_int = 1 << 11;
/// `IBV_QP_RQ_PSN`.
pub const QP_RQ_PSN: c_int = 1 << 12;
/// `IBV_QP_MAX_QP_RD_ATOMIC`.
pub const QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
/// `IBV_QP_MIN_RNR_TIMER`.
pub const QP_MIN_RNR_TIMER: c_int = 1 << 15;
/// `IBV_QP_SQ_PSN`.
pub const QP_SQ_PSN: c_int = 1 << 16;
/// `IBV_QP_MAX_DEST_RD_ATOMIC`.
pub const QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
/// `IBV_QP_DEST_QPN`.
pub const QP_DEST_QPN: c_int = 1 << 20;
/// `IBV_QPS_RESET` (`enum ibv_qp_state`).
pub const QPS_RESET: u32 = 0;
/// `IBV_QPS_INIT`.
pub const QPS_INIT: u32 = 1;
/// `IBV_QPS_RTR`.
pub const QPS_RTR: u32 = 2;
/// `IBV_QPS_RTS`.
pub const QPS_RTS: u32 = 3;
/// `IBV_QPS_ERR`.
pub const QPS_ERR: u32 = 6;
/// `IBV_QPT_RC` (`enum ibv_qp_type`).
pub const QPT_RC: u32 = 2;
/// `IBV_QPT_UD`.
pub const QPT_UD: u32 = 4;
/// `IBV_WR_RDMA_WRITE` (`enum ibv_wr_opcode`).
pub const WR_RDMA_WRITE: u32 = 0;
/// `IBV_WR_RDMA_WRITE_WITH_IMM`.
pub const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
/// `IBV_WR_SEND`.
pub const WR_SEND: u32 = 2;
/// `IBV_SEND_SIGNALED` (`enum ibv_send_flags`).
pub const SEND_SIGNALED: u32 = 1 << 1;
/// `IBV_WC_SEND` (`enum ibv_wc_opcode`).
pub const WC_SEND: u32 = 0;
/// `IBV_WC_RDMA_WRITE`.
pub const WC_RDMA_WRITE: u32 = 1;
/// `IBV_WC_RECV`.
pub const WC_RECV: u32 = 1 << 7;
/// `IBV_WC_RECV_RDMA_WITH_IMM`.
pub const WC_RECV_RDMA_WITH_IMM: u32 = (1 << 7) + 1;
/// `IBV_WC_GRH` (`enum ibv_wc_flags`).
pub const WC_GRH: u32 = 1 << 0;
/// `IBV_WC_WITH_IMM`.
pub const WC_WITH_IMM: u32 = 1 << 1;
/// `IBV_ACCESS_OPTIONAL_RANGE`: the access flags a provider may ignore.
pub const ACCESS_OPTIONAL_RANGE: u32 = 0x3ff0_0000;
/// `IBV_LINK_LAYER_INFINIBAND`.
pub const LINK_LAYER_INFINIBAND: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET`.
pub const LINK_LAYER_ETHERNET: u8 = 2;
/// `IBV_GID_TYPE_IB` (`enum ibv_gid_type`).
pub const GID_TYPE_IB: u32 = 0;
/// `IBV_GID_TYPE_ROCE_V1`.
pub const GID_TYPE_ROCE_V1: u32 = 1;
/// `IBV_GID_TYPE_ROCE_V2`.
pub const GID_TYPE_ROCE_V2: u32 = 2;
