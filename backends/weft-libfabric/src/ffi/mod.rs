//! Every libfabric call and every `unsafe` block of this crate lives here,
//! split by what each part owns: the ABI mirrors and constants (this file),
//! loading the library and discovery (`loader`), opened resources
//! (`resources`, with the data path in `resources/post`) and the
//! backend-owned memory the message layer uses (`window`).
//!
//! libfabric is loaded at run time (`libfabric.so.1`, or the path in
//! `WEFT_LIBFABRIC_PATH`) so the workspace builds on any Linux box. Only six
//! symbols are exported functions (`fi_getinfo`, `fi_freeinfo`, `fi_dupinfo`,
//! `fi_fabric`, `fi_strerror`, `fi_version`); everything else in the libfabric
//! API is a `static inline` wrapper that dispatches through the ops tables of
//! the fid structs, which are hand-written below as `#[repr(C)]` mirrors of the
//! 1.17 headers (`rdma/fabric.h`, `fi_domain.h`, `fi_endpoint.h`, `fi_rma.h`,
//! `fi_eq.h`, `fi_cm.h`).
//!
//! ABI rules followed to stay compatible with libfabric 2.x (which kept these
//! layouts append-only and versions its exported symbols):
//! - `fi_info` and its attribute structs are only ever allocated by the
//!   library (`fi_dupinfo(NULL)` for hints, `fi_getinfo` for results); we read
//!   and write only fields that exist in the 1.17 prefix of each struct.
//! - Structs we allocate and hand to the provider to fill
//!   (`fi_cq_err_entry`, `fi_cq_attr`, `fi_av_attr`, `fi_mr_attr`) are
//!   zero-padded with [`PAD`] spare bytes, so a provider of a newer ABI that
//!   reads or writes a field appended later stays inside our allocation.
//! - Every ops-table entry is checked against the table's `size` and for NULL
//!   before it is called (libfabric's `FI_CHECK_OP`).
//! - We request API version 1.17 (or the library's own version, if older), so
//!   the library applies 1.17 semantics to our calls.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::mem::{offset_of, size_of};
use std::ptr;
use std::sync::OnceLock;

use weft_transport::TransportError;

// ---------------------------------------------------------------------------
// Constants (rdma/fabric.h, fi_errno.h, fi_domain.h, fi_eq.h of 1.17)
// ---------------------------------------------------------------------------

pub(crate) const FI_MSG: u64 = 1 << 1;
pub(crate) const FI_RMA: u64 = 1 << 2;
pub(crate) const FI_READ: u64 = 1 << 8;
pub(crate) const FI_WRITE: u64 = 1 << 9;
pub(crate) const FI_RECV: u64 = 1 << 10;
pub(crate) const FI_SEND: u64 = 1 << 11;
pub(crate) const FI_TRANSMIT: u64 = FI_SEND;
pub(crate) const FI_REMOTE_READ: u64 = 1 << 12;
pub(crate) const FI_REMOTE_WRITE: u64 = 1 << 13;
pub(crate) const FI_REMOTE_CQ_DATA: u64 = 1 << 17;
pub(crate) const FI_MORE: u64 = 1 << 18;
pub(crate) const FI_COMPLETION: u64 = 1 << 24;
pub(crate) const FI_DELIVERY_COMPLETE: u64 = 1 << 28;
pub(crate) const FI_HMEM: u64 = 1 << 47;
/// `enum fi_progress`: progress happens only inside the app's calls.
pub(crate) const FI_PROGRESS_MANUAL: i32 = 2;
pub(crate) const FI_CONTEXT: u64 = 1 << 59;
pub(crate) const FI_CONTEXT2: u64 = 1 << 52;

pub(crate) const FI_MR_LOCAL: i32 = 1 << 2;
pub(crate) const FI_MR_VIRT_ADDR: i32 = 1 << 4;
pub(crate) const FI_MR_ALLOCATED: i32 = 1 << 5;
pub(crate) const FI_MR_PROV_KEY: i32 = 1 << 6;
pub(crate) const FI_MR_ENDPOINT: i32 = 1 << 9;
pub(crate) const FI_MR_HMEM: i32 = 1 << 10;
/// The legacy `FI_MR_BASIC` (= LOCAL-less VIRT_ADDR | ALLOCATED | PROV_KEY).
pub(crate) const FI_MR_BASIC: i32 = 1;

const FI_EP_RDM: c_int = 3;
const FI_AV_UNSPEC: c_int = 0;
const FI_AV_TABLE: c_int = 2;
const FI_THREAD_DOMAIN: c_int = 3;
const FI_CQ_FORMAT_DATA: c_int = 3;
const FI_WAIT_NONE: c_int = 0;
const FI_WAIT_FD: c_int = 3;
const FI_GETWAIT: c_int = 5;
const FI_ENABLE: c_int = 6;
const FI_HMEM_CUDA: c_int = 1;
/// `FI_HMEM_DEVICE_ONLY` (`fi_mr_regattr` flag): device memory, not managed.
const FI_HMEM_DEVICE_ONLY: u64 = 1 << 46;
const FI_ADDR_UNSPEC: u64 = u64::MAX;

pub(crate) const FI_EAGAIN: i64 = libc::EAGAIN as i64;
pub(crate) const FI_EAVAIL: i64 = 259;
pub(crate) const FI_ETOOSMALL: i64 = 257;
pub(crate) const FI_ETRUNC: i64 = 265;
pub(crate) const FI_ENODATA: i64 = libc::ENODATA as i64;
pub(crate) const FI_ENOSYS: i64 = libc::ENOSYS as i64;

/// Spare zeroed bytes behind every struct we allocate for the provider.
const PAD: usize = 256;

/// `FI_SOCKADDR`, `FI_SOCKADDR_IN`, `FI_SOCKADDR_IN6`: `struct sockaddr*`.
pub(crate) const SOCKADDR_FORMATS: [u32; 3] = [1, 2, 3];
/// `FI_ADDR_STR` (enum value 9 in 1.17 and 2.x): a NUL-terminated string.
pub(crate) const FI_ADDR_STR: u32 = 9;

const LIBRARY: &str = "libfabric.so.1";

const fn fi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

// ---------------------------------------------------------------------------
// Struct mirrors
// ---------------------------------------------------------------------------

#[repr(C)]
struct FiTxAttr {
    caps: u64,
    mode: u64,
    op_flags: u64,
    msg_order: u64,
    comp_order: u64,
    inject_size: usize,
    size: usize,
    iov_limit: usize,
    rma_iov_limit: usize,
    tclass: u32,
}

#[repr(C)]
struct FiRxAttr {
    caps: u64,
    mode: u64,
    op_flags: u64,
    msg_order: u64,
    comp_order: u64,
    total_buffered_recv: usize,
    size: usize,
    iov_limit: usize,
}

#[repr(C)]
struct FiEpAttr {
    type_: c_int,
    protocol: u32,
    protocol_version: u32,
    max_msg_size: usize,
    msg_prefix_size: usize,
    max_order_raw_size: usize,
    max_order_war_size: usize,
    max_order_waw_size: usize,
    mem_tag_format: u64,
    tx_ctx_cnt: usize,
    rx_ctx_cnt: usize,
    auth_key_size: usize,
    auth_key: *mut u8,
}

#[repr(C)]
struct FiDomainAttr {
    domain: *mut c_void,
    name: *mut c_char,
    threading: c_int,
    control_progress: c_int,
    data_progress: c_int,
    resource_mgmt: c_int,
    av_type: c_int,
    mr_mode: c_int,
    mr_key_size: usize,
    cq_data_size: usize,
    cq_cnt: usize,
    ep_cnt: usize,
    tx_ctx_cnt: usize,
    rx_ctx_cnt: usize,
    max_ep_tx_ctx: usize,
    max_ep_rx_ctx: usize,
    max_ep_stx_ctx: usize,
    max_ep_srx_ctx: usize,
    cntr_cnt: usize,
    mr_iov_limit: usize,
    caps: u64,
    mode: u64,
    auth_key: *mut u8,
    auth_key_size: usize,
    max_err_data: usize,
    mr_cnt: usize,
    tclass: u32,
    // 1.20+ appends max_ep_auth_key, 2.0 max_group_id, ...: never touched.
}

#[repr(C)]
struct FiFabricAttr {
    fabric: *mut c_void,
    name: *mut c_char,
    prov_name: *mut c_char,
    prov_version: u32,
    api_version: u32,
}

#[repr(C)]
struct FiInfo {
    next: *mut FiInfo,
    caps: u64,
    mode: u64,
    addr_format: u32,
    src_addrlen: usize,
    dest_addrlen: usize,
    src_addr: *mut c_void,
    dest_addr: *mut c_void,
    handle: *mut Fid,
    tx_attr: *mut FiTxAttr,
    rx_attr: *mut FiRxAttr,
    ep_attr: *mut FiEpAttr,
    domain_attr: *mut FiDomainAttr,
    fabric_attr: *mut FiFabricAttr,
    nic: *mut FidNic,
}

#[repr(C)]
struct FiPciAttr {
    domain_id: u16,
    bus_id: u8,
    device_id: u8,
    function_id: u8,
}

#[repr(C)]
struct FiBusAttr {
    bus_type: c_int,
    pci: FiPciAttr,
}

#[repr(C)]
struct FiLinkAttr {
    address: *mut c_char,
    mtu: usize,
    speed: usize,
    state: c_int,
    network_type: *mut c_char,
}

#[repr(C)]
struct FidNic {
    fid: Fid,
    device_attr: *mut c_void,
    bus_attr: *mut FiBusAttr,
    link_attr: *mut FiLinkAttr,
    prov_attr: *mut c_void,
}

#[repr(C)]
struct FiOps {
    size: usize,
    close: Option<unsafe extern "C" fn(*mut Fid) -> c_int>,
    bind: Option<unsafe extern "C" fn(*mut Fid, *mut Fid, u64) -> c_int>,
    control: Option<unsafe extern "C" fn(*mut Fid, c_int, *mut c_void) -> c_int>,
}

#[repr(C)]
struct Fid {
    fclass: usize,
    context: *mut c_void,
    ops: *mut FiOps,
}

type DomainOpenFn =
    unsafe extern "C" fn(*mut FidFabric, *mut FiInfo, *mut *mut FidDomain, *mut c_void) -> c_int;

type TrywaitFn = unsafe extern "C" fn(*mut FidFabric, *mut *mut Fid, c_int) -> c_int;

#[repr(C)]
struct FiOpsFabric {
    size: usize,
    domain: Option<DomainOpenFn>,
    passive_ep: Option<unsafe extern "C" fn()>,
    eq_open: Option<unsafe extern "C" fn()>,
    wait_open: Option<unsafe extern "C" fn()>,
    trywait: Option<TrywaitFn>,
}

#[repr(C)]
struct FidFabric {
    fid: Fid,
    ops: *mut FiOpsFabric,
    api_version: u32,
}

#[repr(C)]
struct FiAvAttr {
    type_: c_int,
    rx_ctx_bits: c_int,
    count: usize,
    ep_per_node: usize,
    name: *const c_char,
    map_addr: *mut c_void,
    flags: u64,
}

#[repr(C)]
struct FiCqAttr {
    size: usize,
    flags: u64,
    format: c_int,
    wait_obj: c_int,
    signaling_vector: c_int,
    wait_cond: c_int,
    wait_set: *mut c_void,
}

type AvOpenFn =
    unsafe extern "C" fn(*mut FidDomain, *mut FiAvAttr, *mut *mut FidAv, *mut c_void) -> c_int;
type CqOpenFn =
    unsafe extern "C" fn(*mut FidDomain, *mut FiCqAttr, *mut *mut FidCq, *mut c_void) -> c_int;
type EndpointFn =
    unsafe extern "C" fn(*mut FidDomain, *mut FiInfo, *mut *mut FidEp, *mut c_void) -> c_int;

#[repr(C)]
struct FiOpsDomain {
    size: usize,
    av_open: Option<AvOpenFn>,
    cq_open: Option<CqOpenFn>,
    endpoint: Option<EndpointFn>,
}

#[repr(C)]
struct FiMrAttr {
    mr_iov: *const libc::iovec,
    iov_count: usize,
    access: u64,
    offset: u64,
    requested_key: u64,
    context: *mut c_void,
    auth_key_size: usize,
    auth_key: *mut u8,
    iface: c_int,
    device: u64, // union { uint64_t reserved; int cuda; ... }
}

type MrRegFn = unsafe extern "C" fn(
    *mut Fid,
    *const c_void,
    usize,
    u64,
    u64,
    u64,
    u64,
    *mut *mut FidMr,
    *mut c_void,
) -> c_int;
type MrRegvFn = unsafe extern "C" fn(
    *mut Fid,
    *const libc::iovec,
    usize,
    u64,
    u64,
    u64,
    u64,
    *mut *mut FidMr,
    *mut c_void,
) -> c_int;
type MrRegattrFn = unsafe extern "C" fn(*mut Fid, *const FiMrAttr, u64, *mut *mut FidMr) -> c_int;

#[repr(C)]
struct FiOpsMr {
    size: usize,
    reg: Option<MrRegFn>,
    regv: Option<MrRegvFn>,
    regattr: Option<MrRegattrFn>,
}

#[repr(C)]
struct FidDomain {
    fid: Fid,
    ops: *mut FiOpsDomain,
    mr: *mut FiOpsMr,
}

#[repr(C)]
struct FidMr {
    fid: Fid,
    mem_desc: *mut c_void,
    key: u64,
}

type AvInsertFn =
    unsafe extern "C" fn(*mut FidAv, *const c_void, usize, *mut u64, u64, *mut c_void) -> c_int;

/// `fi_ops_av.remove`: `(av, fi_addr array, count, flags)`.
type AvRemoveFn = unsafe extern "C" fn(*mut FidAv, *mut u64, usize, u64) -> c_int;

#[repr(C)]
struct FiOpsAv {
    size: usize,
    insert: Option<AvInsertFn>,
    /// `insertsvc`, `insertsym`: not used.
    _insertsvc: Option<unsafe extern "C" fn()>,
    _insertsym: Option<unsafe extern "C" fn()>,
    remove: Option<AvRemoveFn>,
}

#[repr(C)]
struct FidAv {
    fid: Fid,
    ops: *mut FiOpsAv,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct FiCqDataEntry {
    op_context: *mut c_void,
    flags: u64,
    len: usize,
    buf: *mut c_void,
    data: u64,
}

#[repr(C)]
struct FiCqErrEntry {
    op_context: *mut c_void,
    flags: u64,
    len: usize,
    buf: *mut c_void,
    data: u64,
    tag: u64,
    olen: usize,
    err: c_int,
    prov_errno: c_int,
    err_data: *mut c_void,
    err_data_size: usize,
    // 1.20 appended src_addr; the PAD below covers it.
}

type CqReadFn = unsafe extern "C" fn(*mut FidCq, *mut c_void, usize) -> isize;
type CqReadFromFn = unsafe extern "C" fn(*mut FidCq, *mut c_void, usize, *mut u64) -> isize;
type CqReadErrFn = unsafe extern "C" fn(*mut FidCq, *mut FiCqErrEntry, u64) -> isize;
type CqSreadFn =
    unsafe extern "C" fn(*mut FidCq, *mut c_void, usize, *const c_void, c_int) -> isize;
type CqSreadFromFn =
    unsafe extern "C" fn(*mut FidCq, *mut c_void, usize, *mut u64, *const c_void, c_int) -> isize;
type CqSignalFn = unsafe extern "C" fn(*mut FidCq) -> c_int;
type CqStrerrorFn =
    unsafe extern "C" fn(*mut FidCq, c_int, *const c_void, *mut c_char, usize) -> *const c_char;

#[repr(C)]
struct FiOpsCq {
    size: usize,
    read: Option<CqReadFn>,
    readfrom: Option<CqReadFromFn>,
    readerr: Option<CqReadErrFn>,
    sread: Option<CqSreadFn>,
    sreadfrom: Option<CqSreadFromFn>,
    signal: Option<CqSignalFn>,
    strerror: Option<CqStrerrorFn>,
}

#[repr(C)]
struct FidCq {
    fid: Fid,
    ops: *mut FiOpsCq,
}

type GetnameFn = unsafe extern "C" fn(*mut Fid, *mut c_void, *mut usize) -> c_int;

#[repr(C)]
struct FiOpsCm {
    size: usize,
    setname: Option<unsafe extern "C" fn(*mut Fid, *mut c_void, usize) -> c_int>,
    getname: Option<GetnameFn>,
}

type RecvFn =
    unsafe extern "C" fn(*mut FidEp, *mut c_void, usize, *mut c_void, u64, *mut c_void) -> isize;
type SendFn =
    unsafe extern "C" fn(*mut FidEp, *const c_void, usize, *mut c_void, u64, *mut c_void) -> isize;
type VecFn = unsafe extern "C" fn(
    *mut FidEp,
    *const libc::iovec,
    *mut *mut c_void,
    usize,
    u64,
    *mut c_void,
) -> isize;
type MsgFn = unsafe extern "C" fn(*mut FidEp, *const c_void, u64) -> isize;

type SendMsgFn = unsafe extern "C" fn(*mut FidEp, *const FiMsg, u64) -> isize;

#[repr(C)]
struct FiOpsMsg {
    size: usize,
    recv: Option<RecvFn>,
    recvv: Option<VecFn>,
    recvmsg: Option<MsgFn>,
    send: Option<SendFn>,
    sendv: Option<VecFn>,
    sendmsg: Option<SendMsgFn>,
}

#[repr(C)]
struct FiMsg {
    msg_iov: *const libc::iovec,
    desc: *mut *mut c_void,
    iov_count: usize,
    addr: u64,
    context: *mut c_void,
    data: u64,
}

type RmaReadFn = unsafe extern "C" fn(
    *mut FidEp,
    *mut c_void,
    usize,
    *mut c_void,
    u64,
    u64,
    u64,
    *mut c_void,
) -> isize;
type RmaReadvFn = unsafe extern "C" fn(
    *mut FidEp,
    *const libc::iovec,
    *mut *mut c_void,
    usize,
    u64,
    u64,
    u64,
    *mut c_void,
) -> isize;
type RmaMsgFn = unsafe extern "C" fn(*mut FidEp, *const FiMsgRma, u64) -> isize;

#[repr(C)]
struct FiOpsRma {
    size: usize,
    read: Option<RmaReadFn>,
    readv: Option<RmaReadvFn>,
    readmsg: Option<RmaMsgFn>,
    write: Option<RmaReadFn>,
    writev: Option<RmaReadvFn>,
    writemsg: Option<RmaMsgFn>,
}

#[repr(C)]
struct FidEp {
    fid: Fid,
    ops: *mut c_void,
    cm: *mut FiOpsCm,
    msg: *mut FiOpsMsg,
    rma: *mut FiOpsRma,
    tagged: *mut c_void,
    atomic: *mut c_void,
    collective: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct FiRmaIov {
    addr: u64,
    len: usize,
    key: u64,
}

#[repr(C)]
struct FiMsgRma {
    msg_iov: *const libc::iovec,
    desc: *mut *mut c_void,
    iov_count: usize,
    addr: u64,
    rma_iov: *const FiRmaIov,
    rma_iov_count: usize,
    context: *mut c_void,
    data: u64,
}

// Layout checks against the 1.17 headers on LP64 (x86_64, aarch64); the
// numbers were produced by compiling offsetof/sizeof against
// /usr/include/rdma of libfabric-dev 1.17.0.
const _: () = {
    assert!(size_of::<Fid>() == 24);
    assert!(size_of::<FiTxAttr>() == 80);
    assert!(size_of::<FiRxAttr>() == 64);
    assert!(size_of::<FiEpAttr>() == 96);
    assert!(offset_of!(FiDomainAttr, mr_mode) == 36);
    assert!(offset_of!(FiDomainAttr, cq_data_size) == 48);
    assert!(offset_of!(FiDomainAttr, tclass) == 184);
    assert!(size_of::<FiDomainAttr>() == 192);
    assert!(size_of::<FiFabricAttr>() == 32);
    assert!(offset_of!(FiInfo, src_addr) == 48);
    assert!(offset_of!(FiInfo, nic) == 112);
    assert!(size_of::<FiInfo>() == 120);
    assert!(size_of::<FiCqDataEntry>() == 40);
    assert!(offset_of!(FiCqErrEntry, err) == 56);
    assert!(size_of::<FiCqErrEntry>() == 80);
    assert!(size_of::<FiMsgRma>() == 64);
    assert!(size_of::<FiRmaIov>() == 24);
    assert!(offset_of!(FidEp, cm) == 32);
    assert!(offset_of!(FidEp, msg) == 40);
    assert!(offset_of!(FidEp, rma) == 48);
    assert!(offset_of!(FidDomain, mr) == 32);
    assert!(offset_of!(FidMr, key) == 32);
    assert!(offset_of!(FiMrAttr, iface) == 64);
    assert!(offset_of!(FiMrAttr, device) == 72);
    assert!(size_of::<FiMrAttr>() == 80);
    assert!(size_of::<FiCqAttr>() == 40);
    assert!(size_of::<FiAvAttr>() == 48);
    assert!(offset_of!(FidNic, link_attr) == 40);
    assert!(offset_of!(FiLinkAttr, speed) == 16);
    assert!(offset_of!(FiBusAttr, pci) == 4);
    assert!(offset_of!(FiOps, control) == 24);
    assert!(offset_of!(FiOpsFabric, domain) == 8);
    assert!(offset_of!(FiOpsFabric, trywait) == 40);
    assert!(offset_of!(FiOpsDomain, endpoint) == 24);
    assert!(offset_of!(FiOpsMr, regattr) == 24);
    assert!(offset_of!(FiOpsAv, insert) == 8);
    assert!(offset_of!(FiOpsAv, remove) == 32);
    assert!(offset_of!(FiOpsCm, getname) == 16);
    assert!(offset_of!(FiOpsMsg, send) == 32);
    assert!(offset_of!(FiOpsMsg, sendmsg) == 48);
    assert!(size_of::<FiMsg>() == 48);
    assert!(offset_of!(FiOpsRma, writemsg) == 48);
    assert!(offset_of!(FiOpsCq, strerror) == 56);
};

mod bell;
mod cuda_fence;
mod key_table;
mod loader;
mod resources;
mod shm_region;
mod signals;
mod window;

pub(crate) use bell::{Bell, Ringer, PREFIX as BELL_PREFIX};
pub(crate) use cuda_fence::CudaFence;
pub(crate) use key_table::{KeyTable, Verdict, PREFIX as KEY_TABLE_PREFIX};
use loader::cstr_owned;
pub(crate) use loader::{getinfo, lib, Hints, Info, Lib};
pub(crate) use resources::{
    is_remote_write, process_alive, CqEntry, CqError, CqRead, Desc, Mr, Resources,
};
pub(crate) use shm_region::{free_dead_owner_lock, LockState};
pub(crate) use signals::keep_signals;
pub use signals::{restored_dispositions, KEPT as KEPT_SIGNALS, SA_RESTORER};
pub(crate) use window::{CtlBuf, MrWindow};
