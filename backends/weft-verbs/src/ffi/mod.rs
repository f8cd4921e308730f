//! The real libibverbs behind the seam, loaded at run time (`libibverbs.so.1`
//! via `libloading`), so the crate builds without rdma-core installed.
//!
//! All FFI of the crate lives here, split by what each part owns: the ABI
//! mirrors, constants and return-code checks (this file), loading the
//! library and listing devices (`loader`), and one opened device with its
//! objects (`device`). Struct layouts are hand-written
//! `#[repr(C)]` copies of rdma-core 44's `<infiniband/verbs.h>` for the parts
//! used (sizes checked by tests against the values the C compiler gives).
//! `ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv` and `ibv_poll_cq`
//! are `static inline` in verbs.h and dispatch through `context->ops`; this
//! module does the same through `IbvContext::ops`. Every call's return
//! value goes through `check` / `check_ptr`.

#![allow(unsafe_code)]

use crate::ops::*;
use libloading::Library;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};
use weft_transport::TransportError;

/// The library file loaded.
pub const LIBIBVERBS: &str = "libibverbs.so.1";

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct IbvSge {
    addr: u64,
    length: u32,
    lkey: u32,
}

/// `struct ibv_send_wr` (128 bytes). The `wr` union is laid out as words:
/// rdma = { remote_addr @0, rkey @8 }, ud = { ah @0, remote_qpn @8,
/// remote_qkey @12 }.
#[repr(C)]
pub(crate) struct IbvSendWr {
    wr_id: u64,
    next: *mut IbvSendWr,
    sg_list: *mut IbvSge,
    num_sge: c_int,
    opcode: u32,
    send_flags: u32,
    imm_data: u32,
    wr: [u8; 32],
    qp_type: u32,
    _pad: u32,
    tail: [u64; 6],
}

#[repr(C)]
pub(crate) struct IbvRecvWr {
    wr_id: u64,
    next: *mut IbvRecvWr,
    sg_list: *mut IbvSge,
    num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct IbvWc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    vendor_err: u32,
    byte_len: u32,
    imm_data: u32,
    qp_num: u32,
    src_qp: u32,
    wc_flags: u32,
    pkey_index: u16,
    slid: u16,
    sl: u8,
    dlid_path_bits: u8,
}

type PollCqFn = unsafe extern "C" fn(*mut IbvCq, c_int, *mut IbvWc) -> c_int;
type PostSendFn = unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
type PostRecvFn = unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;
type PostSrqRecvFn =
    unsafe extern "C" fn(*mut IbvSrq, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;

/// `struct ibv_context_ops` of rdma-core 44 (32 pointers).
#[repr(C)]
pub(crate) struct IbvContextOps {
    _before_poll: [*mut c_void; 11],
    poll_cq: Option<PollCqFn>,
    _before_srq: [*mut c_void; 8],
    post_srq_recv: Option<PostSrqRecvFn>,
    _before_send: [*mut c_void; 4],
    post_send: Option<PostSendFn>,
    post_recv: Option<PostRecvFn>,
    _rest: [*mut c_void; 5],
}

/// The head of `struct ibv_context` (device pointer, then the ops table).
#[repr(C)]
pub(crate) struct IbvContext {
    device: *mut c_void,
    ops: IbvContextOps,
}

/// The head of `struct ibv_qp`.
#[repr(C)]
pub(crate) struct IbvQp {
    context: *mut IbvContext,
    qp_context: *mut c_void,
    pd: *mut c_void,
    send_cq: *mut c_void,
    recv_cq: *mut c_void,
    srq: *mut c_void,
    handle: u32,
    qp_num: u32,
}

/// The head of `struct ibv_cq`.
#[repr(C)]
pub(crate) struct IbvCq {
    context: *mut IbvContext,
}

/// The head of `struct ibv_srq`.
#[repr(C)]
pub(crate) struct IbvSrq {
    context: *mut IbvContext,
}

#[repr(C)]
pub(crate) struct IbvMr {
    context: *mut IbvContext,
    pd: *mut c_void,
    addr: *mut c_void,
    length: usize,
    handle: u32,
    lkey: u32,
    rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct IbvQpCap {
    max_send_wr: u32,
    max_recv_wr: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline_data: u32,
}

#[repr(C)]
pub(crate) struct IbvQpInitAttr {
    qp_context: *mut c_void,
    send_cq: *mut c_void,
    recv_cq: *mut c_void,
    srq: *mut c_void,
    cap: IbvQpCap,
    qp_type: u32,
    sq_sig_all: c_int,
}

#[repr(C)]
pub(crate) struct IbvSrqInitAttr {
    srq_context: *mut c_void,
    max_wr: u32,
    max_sge: u32,
    srq_limit: u32,
}

// `union ibv_gid` contains two `__be64`: 8-byte alignment.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub(crate) struct IbvGlobalRoute {
    dgid: [u8; 16],
    flow_label: u32,
    sgid_index: u8,
    hop_limit: u8,
    traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct IbvAhAttr {
    grh: IbvGlobalRoute,
    dlid: u16,
    sl: u8,
    src_path_bits: u8,
    static_rate: u8,
    is_global: u8,
    port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct IbvQpAttr {
    qp_state: u32,
    cur_qp_state: u32,
    path_mtu: u32,
    path_mig_state: u32,
    qkey: u32,
    rq_psn: u32,
    sq_psn: u32,
    dest_qp_num: u32,
    qp_access_flags: u32,
    cap: IbvQpCap,
    ah_attr: IbvAhAttr,
    alt_ah_attr: IbvAhAttr,
    pkey_index: u16,
    alt_pkey_index: u16,
    en_sqd_async_notify: u8,
    sq_draining: u8,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    port_num: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    alt_port_num: u8,
    alt_timeout: u8,
    rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct IbvPortAttr {
    state: u32,
    max_mtu: u32,
    active_mtu: u32,
    gid_tbl_len: c_int,
    port_cap_flags: u32,
    max_msg_sz: u32,
    bad_pkey_cntr: u32,
    qkey_viol_cntr: u32,
    pkey_tbl_len: u16,
    lid: u16,
    sm_lid: u16,
    lmc: u8,
    max_vl_num: u8,
    sm_sl: u8,
    subnet_timeout: u8,
    init_type_reply: u8,
    active_width: u8,
    active_speed: u8,
    phys_state: u8,
    link_layer: u8,
    flags: u8,
    port_cap_flags2: u16,
}

// `union ibv_gid` contains two `__be64`: 8-byte alignment.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub(crate) struct IbvGidEntry {
    gid: [u8; 16],
    gid_index: u32,
    port_num: u32,
    gid_type: u32,
    ndev_ifindex: u32,
}

// Attribute masks and enums (verbs.h).
const QP_STATE: c_int = 1;
const QP_ACCESS_FLAGS: c_int = 1 << 3;
const QP_PKEY_INDEX: c_int = 1 << 4;
const QP_PORT: c_int = 1 << 5;
const QP_QKEY: c_int = 1 << 6;
const QP_AV: c_int = 1 << 7;
const QP_PATH_MTU: c_int = 1 << 8;
const QP_TIMEOUT: c_int = 1 << 9;
const QP_RETRY_CNT: c_int = 1 << 10;
const QP_RNR_RETRY: c_int = 1 << 11;
const QP_RQ_PSN: c_int = 1 << 12;
const QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
const QP_MIN_RNR_TIMER: c_int = 1 << 15;
const QP_SQ_PSN: c_int = 1 << 16;
const QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
const QP_DEST_QPN: c_int = 1 << 20;
const QPS_RESET: u32 = 0;
const QPS_INIT: u32 = 1;
const QPS_RTR: u32 = 2;
const QPS_RTS: u32 = 3;
const QPS_ERR: u32 = 6;
const QPT_RC: u32 = 2;
const QPT_UD: u32 = 4;
const WR_RDMA_WRITE: u32 = 0;
const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
const WR_SEND: u32 = 2;
const SEND_SIGNALED: u32 = 1 << 1;
const WC_GRH: u32 = 1 << 0;
const WC_WITH_IMM: u32 = 1 << 1;
const ACCESS_OPTIONAL_RANGE: u32 = 0x3ff0_0000;

/// Turns a verbs `int` return into a result: 0 is success, a positive value
/// is an errno (rdma-core's convention for most calls), a negative one
/// means "see errno".
pub(crate) fn check(op: &'static str, rc: c_int, detail: &str) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::new(op, rc, detail)),
        _ => Err(VerbsError::new(op, last_errno(), detail)),
    }
}

/// A pointer-returning call: NULL means failure with errno.
pub(crate) fn check_ptr<T>(
    op: &'static str,
    p: *mut T,
    detail: &str,
) -> Result<*mut T, VerbsError> {
    if p.is_null() {
        Err(VerbsError::new(op, last_errno(), detail))
    } else {
        Ok(p)
    }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(5)
        .max(1)
}

mod device;
mod loader;

pub use device::IbvDevice;
pub use loader::IbvLib;
use loader::{sysfs_gid_type, Api};

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Sizes and offsets as gcc computes them for rdma-core 44's verbs.h on
    /// x86_64 / aarch64 (LP64).
    #[test]
    fn layouts_match_verbs_h() {
        assert_eq!(size_of::<IbvSge>(), 16);
        assert_eq!(size_of::<IbvSendWr>(), 128);
        assert_eq!(offset_of!(IbvSendWr, imm_data), 36);
        assert_eq!(offset_of!(IbvSendWr, wr), 40);
        assert_eq!(offset_of!(IbvSendWr, qp_type), 72);
        assert_eq!(size_of::<IbvRecvWr>(), 32);
        assert_eq!(size_of::<IbvWc>(), 48);
        assert_eq!(offset_of!(IbvWc, imm_data), 24);
        assert_eq!(offset_of!(IbvWc, wc_flags), 36);
        assert_eq!(size_of::<IbvContextOps>(), 32 * 8);
        assert_eq!(
            offset_of!(IbvContext, ops) + offset_of!(IbvContextOps, poll_cq),
            8 + 11 * 8
        );
        assert_eq!(
            offset_of!(IbvContext, ops) + offset_of!(IbvContextOps, post_srq_recv),
            8 + 20 * 8
        );
        assert_eq!(
            offset_of!(IbvContext, ops) + offset_of!(IbvContextOps, post_send),
            8 + 25 * 8
        );
        assert_eq!(
            offset_of!(IbvContext, ops) + offset_of!(IbvContextOps, post_recv),
            8 + 26 * 8
        );
        assert_eq!(offset_of!(IbvQp, qp_num), 52);
        assert_eq!(offset_of!(IbvMr, lkey), 36);
        assert_eq!(offset_of!(IbvMr, rkey), 40);
        assert_eq!(size_of::<IbvQpInitAttr>(), 64);
        assert_eq!(size_of::<IbvSrqInitAttr>(), 24);
        assert_eq!(size_of::<IbvGlobalRoute>(), 24);
        assert_eq!(size_of::<IbvAhAttr>(), 32);
        assert_eq!(size_of::<IbvQpAttr>(), 144);
        assert_eq!(offset_of!(IbvQpAttr, ah_attr), 56);
        assert_eq!(offset_of!(IbvQpAttr, pkey_index), 120);
        assert_eq!(offset_of!(IbvQpAttr, timeout), 130);
        assert_eq!(offset_of!(IbvQpAttr, rate_limit), 136);
        assert_eq!(size_of::<IbvPortAttr>(), 52);
        assert_eq!(offset_of!(IbvPortAttr, lid), 34);
        assert_eq!(offset_of!(IbvPortAttr, link_layer), 46);
        assert_eq!(size_of::<IbvGidEntry>(), 32);
    }

    #[test]
    fn check_maps_return_codes() {
        assert!(check("x", 0, "").is_ok());
        assert_eq!(check("x", 12, "").unwrap_err().code, 12);
        assert!(check("x", -1, "").unwrap_err().code > 0);
        assert!(check_ptr::<u8>("x", std::ptr::null_mut(), "").is_err());
    }
}
