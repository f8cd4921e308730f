//! Every libfabric call and every `unsafe` block of this crate lives here.
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

// ---------------------------------------------------------------------------
// Library loading
// ---------------------------------------------------------------------------

type GetinfoFn = unsafe extern "C" fn(
    u32,
    *const c_char,
    *const c_char,
    u64,
    *const FiInfo,
    *mut *mut FiInfo,
) -> c_int;
type FreeinfoFn = unsafe extern "C" fn(*mut FiInfo);
type DupinfoFn = unsafe extern "C" fn(*const FiInfo) -> *mut FiInfo;
type FabricFn = unsafe extern "C" fn(*mut FiFabricAttr, *mut *mut FidFabric, *mut c_void) -> c_int;
type StrerrorFn = unsafe extern "C" fn(c_int) -> *const c_char;
type VersionFn = unsafe extern "C" fn() -> u32;

/// The loaded library and its exported entry points.
pub(crate) struct Lib {
    _lib: libloading::Library,
    getinfo: GetinfoFn,
    freeinfo: FreeinfoFn,
    dupinfo: DupinfoFn,
    fabric: FabricFn,
    strerror: StrerrorFn,
    /// `fi_version()` of the loaded library.
    pub(crate) version: u32,
    /// The API version we request (1.17, or the library's if older).
    pub(crate) api: u32,
}

static LIB: OnceLock<Result<Lib, TransportError>> = OnceLock::new();

/// Loads libfabric once per process.
pub(crate) fn lib() -> Result<&'static Lib, TransportError> {
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Lib, TransportError> {
    let path = std::env::var("WEFT_LIBFABRIC_PATH").unwrap_or_else(|_| LIBRARY.to_string());
    let unavailable = |reason: String| TransportError::LibraryUnavailable {
        library: path.clone(),
        reason,
    };
    // SAFETY: loading libfabric runs its ELF constructors, which only set up
    // internal state (no requirements on the caller).
    let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| {
        unavailable(format!(
            "{e}; install libfabric (Debian/Ubuntu: apt-get install libfabric1) or set \
             WEFT_LIBFABRIC_PATH"
        ))
    })?;
    macro_rules! sym {
        ($name:literal, $ty:ty) => {{
            // SAFETY: the symbol is a libfabric exported function whose C
            // signature is exactly `$ty` (see rdma/fabric.h).
            let s = unsafe { lib.get::<$ty>(concat!($name, "\0").as_bytes()) }
                .map_err(|e| unavailable(format!("missing symbol {}: {e}", $name)))?;
            *s
        }};
    }
    let getinfo = sym!("fi_getinfo", GetinfoFn);
    let freeinfo = sym!("fi_freeinfo", FreeinfoFn);
    let dupinfo = sym!("fi_dupinfo", DupinfoFn);
    let fabric = sym!("fi_fabric", FabricFn);
    let strerror = sym!("fi_strerror", StrerrorFn);
    let version_fn = sym!("fi_version", VersionFn);
    // SAFETY: fi_version takes no arguments and only returns a constant.
    let version = unsafe { version_fn() };
    if version < fi_version(1, 5) {
        return Err(unavailable(format!(
            "libfabric {}.{} is too old (need >= 1.5)",
            version >> 16,
            version & 0xffff
        )));
    }
    let api = version.min(fi_version(1, 17));
    Ok(Lib {
        _lib: lib,
        getinfo,
        freeinfo,
        dupinfo,
        fabric,
        strerror,
        version,
        api,
    })
}

impl Lib {
    /// `fi_strerror(code)` for a positive or negative libfabric code.
    pub(crate) fn strerror(&self, code: i64) -> String {
        let c = c_int::try_from(code.unsigned_abs()).unwrap_or(c_int::MAX);
        // SAFETY: fi_strerror accepts any int and returns a pointer to a static
        // NUL-terminated string (or NULL, handled).
        let p = unsafe { (self.strerror)(c) };
        if p.is_null() {
            return format!("libfabric error {code}");
        }
        // SAFETY: non-NULL result of fi_strerror is a valid C string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// The one helper that turns a libfabric return code into an error.
    pub(crate) fn error(&self, nic: &str, op: &'static str, code: i64) -> TransportError {
        TransportError::Provider {
            nic: nic.to_string(),
            op,
            code,
            message: self.strerror(code),
        }
    }
}

// ---------------------------------------------------------------------------
// Discovery
// ---------------------------------------------------------------------------

/// What we ask fi_getinfo for.
pub(crate) struct Hints<'a> {
    pub(crate) provider: &'a str,
    pub(crate) hmem: bool,
    pub(crate) delivery_complete: bool,
}

/// One fi_info (our own fi_dupinfo copy) plus the facts we read from it.
pub(crate) struct Info {
    ptr: *mut FiInfo,
    pub(crate) prov_name: String,
    pub(crate) fabric_name: String,
    pub(crate) domain_name: String,
    pub(crate) caps: u64,
    pub(crate) mode: u64,
    pub(crate) mr_mode: i32,
    pub(crate) mr_key_size: usize,
    /// `fi_domain_attr::data_progress` (`FI_PROGRESS_*`).
    pub(crate) data_progress: i32,
    pub(crate) cq_data_size: usize,
    pub(crate) tx_size: usize,
    pub(crate) rx_size: usize,
    pub(crate) tx_op_flags: u64,
    /// `fi_tx_attr::iov_limit`: source pieces per SEND.
    pub(crate) tx_iov_limit: usize,
    pub(crate) max_msg_size: usize,
    pub(crate) src_addr: Vec<u8>,
    /// `fi_info::addr_format` (FI_SOCKADDR_IN = 2, FI_ADDR_STR = 9, ...).
    pub(crate) addr_format: u32,
    pub(crate) link_bps: Option<u64>,
    pub(crate) pci: Option<(u16, u8, u8, u8)>,
}

// SAFETY: the fi_info copy is plain heap data owned exclusively by this
// value; libfabric keeps no reference to it and we never mutate it after
// construction, so it may move to and be read from any thread.
unsafe impl Send for Info {}
// SAFETY: see above: shared access is read-only.
unsafe impl Sync for Info {}

impl Drop for Info {
    fn drop(&mut self) {
        if let Ok(lib) = lib() {
            // SAFETY: `ptr` came from fi_dupinfo and is freed exactly once.
            unsafe { (lib.freeinfo)(self.ptr) };
        }
    }
}

fn cstr_owned(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric strings in fi_info are NUL-terminated or NULL.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn strdup(s: &str) -> Result<*mut c_char, TransportError> {
    let c = CString::new(s).map_err(|_| TransportError::InvalidArgument {
        nic: "libfabric".into(),
        what: format!("provider name {s:?} contains NUL"),
    })?;
    // SAFETY: `c` is a valid C string; strdup returns malloc'ed memory that
    // fi_freeinfo later frees with free().
    let p = unsafe { libc::strdup(c.as_ptr()) };
    if p.is_null() {
        return Err(TransportError::InvalidArgument {
            nic: "libfabric".into(),
            what: "out of memory".into(),
        });
    }
    Ok(p)
}

/// Runs fi_getinfo and returns one entry per result, in provider order.
pub(crate) fn getinfo(lib: &Lib, h: &Hints<'_>) -> Result<Vec<Info>, TransportError> {
    // SAFETY: fi_dupinfo(NULL) is fi_allocinfo(): a zeroed fi_info with all
    // attribute structs allocated by the library (so their size matches the
    // library's ABI).
    let hints = unsafe { (lib.dupinfo)(ptr::null()) };
    if hints.is_null() {
        return Err(lib.error("libfabric", "fi_allocinfo", -(libc::ENOMEM as i64)));
    }
    struct Guard<'l>(&'l Lib, *mut FiInfo);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            // SAFETY: the pointer came from fi_dupinfo/fi_getinfo and is freed once.
            unsafe { (self.0.freeinfo)(self.1) };
        }
    }
    let hints_guard = Guard(lib, hints);
    let prov = strdup(h.provider)?;
    // SAFETY: `hints` and its attribute pointers were allocated by
    // fi_allocinfo and are non-NULL; we write only 1.17-prefix fields.
    unsafe {
        let hi = &mut *hints;
        hi.caps = FI_MSG | FI_RMA | if h.hmem { FI_HMEM } else { 0 };
        hi.mode = FI_CONTEXT | FI_CONTEXT2;
        (*hi.ep_attr).type_ = FI_EP_RDM;
        let da = &mut *hi.domain_attr;
        da.threading = FI_THREAD_DOMAIN;
        da.mr_mode = FI_MR_LOCAL
            | FI_MR_VIRT_ADDR
            | FI_MR_ALLOCATED
            | FI_MR_PROV_KEY
            | FI_MR_ENDPOINT
            | if h.hmem { FI_MR_HMEM } else { 0 };
        da.cq_data_size = 4;
        if h.delivery_complete {
            (*hi.tx_attr).op_flags = FI_DELIVERY_COMPLETE;
        }
        (*hi.fabric_attr).prov_name = prov;
    }
    let mut out: *mut FiInfo = ptr::null_mut();
    // SAFETY: valid hints, out-pointer to a local; node/service NULL.
    let rc = unsafe { (lib.getinfo)(lib.api, ptr::null(), ptr::null(), 0, hints, &mut out) };
    drop(hints_guard);
    if rc == -(FI_ENODATA as c_int) {
        return Ok(Vec::new());
    }
    if rc != 0 {
        return Err(lib.error("libfabric", "fi_getinfo", i64::from(rc)));
    }
    let list_guard = Guard(lib, out);
    let mut infos = Vec::new();
    let mut cur = out;
    while !cur.is_null() {
        // SAFETY: `cur` is an element of the list fi_getinfo returned; we
        // duplicate it (fi_dupinfo copies one element, next = NULL).
        let dup = unsafe { (lib.dupinfo)(cur) };
        if dup.is_null() {
            return Err(lib.error("libfabric", "fi_dupinfo", -(libc::ENOMEM as i64)));
        }
        infos.push(Info::from_ptr(dup));
        // SAFETY: list traversal over valid elements.
        cur = unsafe { (*cur).next };
    }
    drop(list_guard);
    Ok(infos)
}

impl Info {
    fn from_ptr(ptr: *mut FiInfo) -> Info {
        // SAFETY: `ptr` is a valid fi_info from fi_dupinfo; attribute
        // pointers are either NULL (checked) or valid library allocations.
        unsafe {
            let i = &*ptr;
            let fa = i.fabric_attr.as_ref();
            let da = i.domain_attr.as_ref();
            let tx = i.tx_attr.as_ref();
            let rx = i.rx_attr.as_ref();
            let ep = i.ep_attr.as_ref();
            let src_addr = if i.src_addr.is_null() || i.src_addrlen == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(i.src_addr as *const u8, i.src_addrlen).to_vec()
            };
            let nic = i.nic.as_ref();
            let link_bps = nic
                .and_then(|n| n.link_attr.as_ref())
                .map(|l| l.speed as u64)
                .filter(|s| *s > 0);
            let pci = nic
                .and_then(|n| n.bus_attr.as_ref())
                .filter(|b| b.bus_type == 1)
                .map(|b| {
                    (
                        b.pci.domain_id,
                        b.pci.bus_id,
                        b.pci.device_id,
                        b.pci.function_id,
                    )
                });
            Info {
                ptr,
                prov_name: fa.map(|f| cstr_owned(f.prov_name)).unwrap_or_default(),
                fabric_name: fa.map(|f| cstr_owned(f.name)).unwrap_or_default(),
                domain_name: da.map(|d| cstr_owned(d.name)).unwrap_or_default(),
                caps: i.caps,
                mode: i.mode,
                mr_mode: da.map(|d| d.mr_mode).unwrap_or(0),
                mr_key_size: da.map(|d| d.mr_key_size).unwrap_or(0),
                data_progress: da.map(|d| d.data_progress).unwrap_or(0),
                cq_data_size: da.map(|d| d.cq_data_size).unwrap_or(0),
                tx_size: tx.map(|t| t.size).unwrap_or(0),
                rx_size: rx.map(|r| r.size).unwrap_or(0),
                tx_op_flags: tx.map(|t| t.op_flags).unwrap_or(0),
                tx_iov_limit: tx.map(|t| t.iov_limit).unwrap_or(0),
                max_msg_size: ep.map(|e| e.max_msg_size).unwrap_or(0),
                src_addr,
                addr_format: i.addr_format,
                link_bps,
                pci,
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Opened resources
// ---------------------------------------------------------------------------

/// An opaque local memory descriptor (`fi_mr_desc`), possibly NULL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Desc(*mut c_void);

// SAFETY: a descriptor is an opaque token owned by the provider; we only pass
// it back into calls on the same domain, which is driven by one thread at a
// time (`&mut self`).
unsafe impl Send for Desc {}

impl Desc {
    /// No descriptor.
    pub(crate) fn null() -> Desc {
        Desc(ptr::null_mut())
    }
}

/// One registration.
pub(crate) struct Mr {
    ptr: *mut FidMr,
    /// `fi_mr_desc(mr)`.
    pub(crate) desc: Desc,
    /// `fi_mr_key(mr)`.
    pub(crate) key: u64,
}

// SAFETY: an open registration handle; it is used (closed) only through the
// owning `Resources`, which one thread drives at a time.
unsafe impl Send for Mr {}

/// A libfabric CQ entry, decoded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CqEntry {
    /// Slot index of our operation, if the entry carries our context.
    pub(crate) slot: Option<usize>,
    pub(crate) flags: u64,
    pub(crate) len: usize,
    pub(crate) data: u64,
}

/// A libfabric CQ error entry, decoded.
#[derive(Debug, Clone)]
pub(crate) struct CqError {
    pub(crate) slot: Option<usize>,
    pub(crate) flags: u64,
    pub(crate) err: i64,
    pub(crate) prov_errno: i64,
    pub(crate) olen: usize,
    /// fi_strerror(err) and fi_cq_strerror(prov_errno) text.
    pub(crate) message: String,
}

/// What [`Resources::cq_read`] found.
pub(crate) enum CqRead {
    /// This many entries were written to the front of the buffer.
    Entries(usize),
    /// Nothing to report.
    Empty,
    /// An error entry is pending: call [`Resources::cq_readerr`].
    ErrorAvailable,
}

/// Per-operation context and work-request template. `ctx` (the
/// `fi_context2` libfabric may use as scratch space) comes first so the
/// context pointer identifies the slot.
#[repr(C)]
struct OpSlot {
    ctx: [*mut c_void; 8],
    /// Up to two source parts: SENDs carry a backend header and the payload.
    iov: [libc::iovec; 2],
    desc: [*mut c_void; 2],
    rma_iov: FiRmaIov,
    msg: FiMsgRma,
}

/// Fabric, domain, endpoint, AV, CQ, registrations and the operation slots
/// of one NIC.
pub(crate) struct Resources {
    lib: &'static Lib,
    nic: String,
    fabric: *mut FidFabric,
    domain: *mut FidDomain,
    ep: *mut FidEp,
    /// Further endpoints (index `k` is endpoint `k + 1`; `null` once
    /// closed), each with an AV of its own holding its one peer, bound to
    /// the main CQ: the per-peer transmit endpoints of providers whose
    /// completions of one endpoint wait for each other
    /// (`domain::peer_eps`).
    tx_eps: Vec<(*mut FidEp, *mut FidAv)>,
    av: *mut FidAv,
    cq: *mut FidCq,
    /// The CQ's wait fd (`FI_WAIT_FD`), when it was opened with one.
    wait_fd: Option<c_int>,
    mr_endpoint: bool,
    delivery_complete: bool,
    mrs: Vec<*mut FidMr>,
    slots: Box<[OpSlot]>,
    cq_buf: Vec<FiCqDataEntry>,
}

// SAFETY: the domain is opened with FI_THREAD_DOMAIN: libfabric requires that
// one thread at a time uses it, which `&mut self` on every entry point
// guarantees. None of the handles is tied to the thread that created it.
unsafe impl Send for Resources {}

fn check_op<T>(table: *const T, size_of_table: usize, off: usize) -> bool {
    if table.is_null() {
        return false;
    }
    // SAFETY: every libfabric ops table starts with `size_t size`.
    let size = unsafe { *(table as *const usize) };
    let _ = size_of_table;
    size > off
}

macro_rules! op {
    ($this:expr, $table:expr, $ty:ty, $field:ident, $name:literal) => {{
        let t: *const $ty = $table;
        if !check_op(t, size_of::<$ty>(), offset_of!($ty, $field)) {
            None
        } else {
            // SAFETY: `t` is a non-NULL ops table of the provider whose size
            // covers `$field` (checked above).
            unsafe { (*t).$field }
        }
        .ok_or_else(|| $this.error($name, -FI_ENOSYS))
    }};
}

impl Resources {
    /// Opens fabric, domain, CQ, AV and an enabled endpoint for `info`.
    /// With `wait_fd` the CQ is opened with an `FI_WAIT_FD` wait object if
    /// the provider accepts one ([`Resources::wait_fd`]), else without.
    pub(crate) fn open(
        lib: &'static Lib,
        nic: &str,
        info: &Info,
        slots: usize,
        wait_fd: bool,
    ) -> Result<Resources, TransportError> {
        let mut r = Resources {
            lib,
            nic: nic.to_string(),
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            ep: ptr::null_mut(),
            tx_eps: Vec::new(),
            av: ptr::null_mut(),
            cq: ptr::null_mut(),
            wait_fd: None,
            mr_endpoint: info.mr_mode & FI_MR_ENDPOINT != 0,
            delivery_complete: info.tx_op_flags & FI_DELIVERY_COMPLETE != 0,
            mrs: Vec::new(),
            slots: (0..slots)
                .map(|_| OpSlot {
                    ctx: [ptr::null_mut(); 8],
                    iov: [libc::iovec {
                        iov_base: ptr::null_mut(),
                        iov_len: 0,
                    }; 2],
                    desc: [ptr::null_mut(); 2],
                    rma_iov: FiRmaIov {
                        addr: 0,
                        len: 0,
                        key: 0,
                    },
                    msg: FiMsgRma {
                        msg_iov: ptr::null(),
                        desc: ptr::null_mut(),
                        iov_count: 1,
                        addr: 0,
                        rma_iov: ptr::null(),
                        rma_iov_count: 1,
                        context: ptr::null_mut(),
                        data: 0,
                    },
                })
                .collect(),
            cq_buf: vec![
                FiCqDataEntry {
                    op_context: ptr::null_mut(),
                    flags: 0,
                    len: 0,
                    buf: ptr::null_mut(),
                    data: 0,
                };
                64
            ],
        };
        // Pre-fill the templates: every pointer inside a slot points into the
        // same slot, whose heap address never changes (boxed slice).
        for s in r.slots.iter_mut() {
            let base: *mut OpSlot = s;
            s.msg.msg_iov = s.iov.as_ptr();
            s.msg.desc = s.desc.as_mut_ptr();
            s.msg.rma_iov = &s.rma_iov;
            s.msg.context = base.cast();
        }
        let fi = info.ptr;
        // SAFETY: `fi` is our valid fi_info; fabric_attr is non-NULL for
        // every fi_getinfo result.
        let rc = unsafe { (lib.fabric)((*fi).fabric_attr, &mut r.fabric, ptr::null_mut()) };
        r.check("fi_fabric", i64::from(rc))?;
        // SAFETY: r.fabric was just opened successfully.
        let fops = unsafe { (*r.fabric).ops };
        let open_domain = op!(r, fops, FiOpsFabric, domain, "fi_domain")?;
        // SAFETY: valid fabric and info; out-pointer into `r`.
        let rc = unsafe { open_domain(r.fabric, fi, &mut r.domain, ptr::null_mut()) };
        r.check("fi_domain", i64::from(rc))?;
        // SAFETY: r.domain was just opened successfully.
        let dops = unsafe { (*r.domain).ops };

        let cq_open = op!(r, dops, FiOpsDomain, cq_open, "fi_cq_open")?;
        let open_cq = |r: &mut Resources, wait_obj: c_int| {
            let mut cq_attr = Padded::new(FiCqAttr {
                size: 0,
                flags: 0,
                format: FI_CQ_FORMAT_DATA,
                wait_obj,
                signaling_vector: 0,
                wait_cond: 0,
                wait_set: ptr::null_mut(),
            });
            // SAFETY: valid domain, attribute struct padded for newer ABIs.
            let rc = unsafe { cq_open(r.domain, cq_attr.as_mut(), &mut r.cq, ptr::null_mut()) };
            if rc != 0 {
                r.cq = ptr::null_mut();
            }
            rc
        };
        let mut opened = false;
        if wait_fd {
            let rc = open_cq(&mut r, FI_WAIT_FD);
            if rc == 0 {
                opened = true;
                r.wait_fd = r.cq_getwait();
                if r.wait_fd.is_none() {
                    tracing::debug!(nic, "CQ opened with FI_WAIT_FD but FI_GETWAIT failed");
                }
            } else {
                tracing::debug!(
                    nic,
                    rc,
                    "provider refuses a CQ with FI_WAIT_FD; polling only"
                );
            }
        }
        if !opened {
            let rc = open_cq(&mut r, FI_WAIT_NONE);
            r.check("fi_cq_open", i64::from(rc))?;
        }

        r.av = r.open_av(info)?;

        let endpoint = op!(r, dops, FiOpsDomain, endpoint, "fi_endpoint")?;
        // SAFETY: valid domain and info.
        let rc = unsafe { endpoint(r.domain, fi, &mut r.ep, ptr::null_mut()) };
        r.check("fi_endpoint", i64::from(rc))?;

        let ep_fid = r.ep.cast::<Fid>();
        // SAFETY: the AV and CQ fids are valid open objects.
        let (av_fid, cq_fid) = (r.av.cast::<Fid>(), r.cq.cast::<Fid>());
        r.fid_bind(ep_fid, av_fid, 0, "fi_ep_bind(av)")?;
        r.fid_bind(ep_fid, cq_fid, FI_TRANSMIT | FI_RECV, "fi_ep_bind(cq)")?;
        r.fid_control(ep_fid, FI_ENABLE, "fi_enable")?;
        Ok(r)
    }

    /// Opens an address vector of the type `info` asks for (a table when
    /// it does not say).
    fn open_av(&self, info: &Info) -> Result<*mut FidAv, TransportError> {
        // SAFETY: domain_attr is non-NULL for fi_getinfo results.
        let av_type = match unsafe { (*(*info.ptr).domain_attr).av_type } {
            FI_AV_UNSPEC => FI_AV_TABLE,
            t => t,
        };
        let mut av_attr = Padded::new(FiAvAttr {
            type_: av_type,
            rx_ctx_bits: 0,
            count: 0,
            ep_per_node: 0,
            name: ptr::null(),
            map_addr: ptr::null_mut(),
            flags: 0,
        });
        // SAFETY: the domain is open.
        let dops = unsafe { (*self.domain).ops };
        let av_open = op!(self, dops, FiOpsDomain, av_open, "fi_av_open")?;
        let mut av: *mut FidAv = ptr::null_mut();
        // SAFETY: valid domain, padded attribute struct.
        let rc = unsafe { av_open(self.domain, av_attr.as_mut(), &mut av, ptr::null_mut()) };
        self.check("fi_av_open", i64::from(rc))?;
        Ok(av)
    }

    fn error(&self, op: &'static str, code: i64) -> TransportError {
        self.lib.error(&self.nic, op, code)
    }

    fn check(&self, op: &'static str, rc: i64) -> Result<(), TransportError> {
        if rc < 0 {
            Err(self.error(op, rc))
        } else {
            Ok(())
        }
    }

    fn fid_ops(&self, fid: *mut Fid) -> *const FiOps {
        // SAFETY: `fid` is one of our open objects; every fid starts with
        // `struct fid` whose `ops` is valid while the object is open.
        unsafe { (*fid).ops }
    }

    fn fid_bind(
        &self,
        fid: *mut Fid,
        bfid: *mut Fid,
        flags: u64,
        name: &'static str,
    ) -> Result<(), TransportError> {
        let bind = op!(self, self.fid_ops(fid), FiOps, bind, "fi_bind")?;
        // SAFETY: both fids are open objects of this domain.
        let rc = unsafe { bind(fid, bfid, flags) };
        self.check(name, i64::from(rc))
    }

    fn fid_control(
        &self,
        fid: *mut Fid,
        cmd: c_int,
        name: &'static str,
    ) -> Result<(), TransportError> {
        let control = op!(self, self.fid_ops(fid), FiOps, control, "fi_control")?;
        // SAFETY: open object; FI_ENABLE takes a NULL argument.
        let rc = unsafe { control(fid, cmd, ptr::null_mut()) };
        self.check(name, i64::from(rc))
    }

    fn close(fid: *mut Fid) -> c_int {
        if fid.is_null() {
            return 0;
        }
        // SAFETY: `fid` is an open object closed exactly once (callers null
        // their copy afterwards).
        unsafe {
            let ops = (*fid).ops;
            if !check_op(ops, size_of::<FiOps>(), offset_of!(FiOps, close)) {
                return -(FI_ENOSYS as c_int);
            }
            match (*ops).close {
                Some(close) => close(fid),
                None => -(FI_ENOSYS as c_int),
            }
        }
    }

    /// The endpoint's address (`fi_getname`).
    pub(crate) fn getname(&self) -> Result<Vec<u8>, TransportError> {
        // SAFETY: the endpoint is open; `cm` is its CM ops table.
        let cm = unsafe { (*self.ep).cm };
        let getname = op!(self, cm, FiOpsCm, getname, "fi_getname")?;
        let mut buf = vec![0u8; 256];
        for _ in 0..2 {
            let mut len = buf.len();
            // SAFETY: buffer of `len` bytes; the provider writes at most `len`
            // and reports the needed size on FI_ETOOSMALL.
            let rc = unsafe { getname(self.ep.cast(), buf.as_mut_ptr().cast(), &mut len) };
            if rc == -(FI_ETOOSMALL as c_int) && len > buf.len() && len <= 1 << 16 {
                buf.resize(len, 0);
                continue;
            }
            self.check("fi_getname", i64::from(rc))?;
            buf.truncate(len.min(buf.len()));
            return Ok(buf);
        }
        Err(self.error("fi_getname", -FI_ETOOSMALL))
    }

    /// `fi_av_remove` of one address (no operation to it may still be
    /// inside the provider: the caller checks).
    pub(crate) fn av_remove(&mut self, fi_addr: u64) -> Result<(), TransportError> {
        // SAFETY: the AV is open.
        let ops = unsafe { (*self.av).ops };
        let remove = op!(self, ops, FiOpsAv, remove, "fi_av_remove")?;
        let mut a = fi_addr;
        // SAFETY: valid AV, one address in a local.
        let rc = unsafe { remove(self.av, &mut a, 1, 0) };
        if rc < 0 {
            return Err(self.error("fi_av_remove", i64::from(rc)));
        }
        Ok(())
    }

    /// `fi_av_insert` of one address. `addr` must be at least as long as the
    /// provider's address format requires (the caller checks the length).
    pub(crate) fn av_insert(&mut self, addr: &[u8]) -> Result<u64, TransportError> {
        self.av_insert_into(self.av, addr)
    }

    fn av_insert_into(&self, av: *mut FidAv, addr: &[u8]) -> Result<u64, TransportError> {
        // SAFETY: the AV is open.
        let ops = unsafe { (*av).ops };
        let insert = op!(self, ops, FiOpsAv, insert, "fi_av_insert")?;
        // Copy into a zero-padded buffer: the provider reads as many bytes as
        // its address format needs, which must stay inside our memory.
        let mut buf = addr.to_vec();
        buf.resize(addr.len() + PAD, 0);
        let mut fi_addr: u64 = FI_ADDR_UNSPEC;
        // SAFETY: valid AV, address buffer, one output slot.
        let rc = unsafe { insert(av, buf.as_ptr().cast(), 1, &mut fi_addr, 0, ptr::null_mut()) };
        if rc < 0 {
            return Err(self.error("fi_av_insert", i64::from(rc)));
        }
        if rc != 1 || fi_addr == FI_ADDR_UNSPEC {
            return Err(self.error("fi_av_insert", -(libc::EINVAL as i64)));
        }
        Ok(fi_addr)
    }

    /// Registers `[addr, addr+len)`. `cuda` selects FI_HMEM_CUDA memory.
    pub(crate) fn mr_reg(
        &mut self,
        addr: u64,
        len: usize,
        access: u64,
        requested_key: u64,
        cuda: Option<u32>,
    ) -> Result<Mr, TransportError> {
        // SAFETY: the domain is open; `mr` is its MR ops table.
        let ops = unsafe { (*self.domain).mr };
        let mut mr: *mut FidMr = ptr::null_mut();
        let dom_fid = self.domain.cast::<Fid>();
        let rc = match cuda {
            None => {
                let reg = op!(self, ops, FiOpsMr, reg, "fi_mr_reg")?;
                // SAFETY: the caller guarantees (MemRegion contract) that the
                // range is valid memory that outlives the registration.
                unsafe {
                    reg(
                        dom_fid,
                        addr as usize as *const c_void,
                        len,
                        access,
                        0,
                        requested_key,
                        0,
                        &mut mr,
                        ptr::null_mut(),
                    )
                }
            }
            Some(dev) => {
                let regattr = op!(self, ops, FiOpsMr, regattr, "fi_mr_regattr")?;
                let iov = libc::iovec {
                    iov_base: addr as usize as *mut c_void,
                    iov_len: len,
                };
                let attr = Padded::new(FiMrAttr {
                    mr_iov: &iov,
                    iov_count: 1,
                    access,
                    offset: 0,
                    requested_key,
                    context: ptr::null_mut(),
                    auth_key_size: 0,
                    auth_key: ptr::null_mut(),
                    iface: FI_HMEM_CUDA,
                    device: u64::from(dev),
                });
                // SAFETY: as above for CUDA memory; `attr` is padded.
                unsafe { regattr(dom_fid, attr.as_ptr(), 0, &mut mr) }
            }
        };
        self.check("fi_mr_reg", i64::from(rc))?;
        if mr.is_null() {
            return Err(self.error("fi_mr_reg", -(libc::EINVAL as i64)));
        }
        if self.mr_endpoint {
            let bound = self
                .fid_bind(mr.cast(), self.ep.cast(), 0, "fi_mr_bind")
                .and_then(|()| self.fid_control(mr.cast(), FI_ENABLE, "fi_mr_enable"));
            if let Err(e) = bound {
                Self::close(mr.cast());
                return Err(e);
            }
        }
        self.mrs.push(mr);
        // SAFETY: `mr` is a valid open registration.
        let (desc, key) = unsafe { ((*mr).mem_desc, (*mr).key) };
        Ok(Mr {
            ptr: mr,
            desc: Desc(desc),
            key,
        })
    }

    /// Closes a registration.
    pub(crate) fn mr_close(&mut self, mr: Mr) -> Result<(), TransportError> {
        self.mrs.retain(|m| *m != mr.ptr);
        let rc = Self::close(mr.ptr.cast());
        self.check("fi_close(mr)", i64::from(rc))
    }

    /// The context pointer of slot `i`.
    fn slot_ctx(&mut self, i: usize) -> Result<*mut c_void, TransportError> {
        let s = self
            .slots
            .get_mut(i)
            .ok_or_else(|| self_error_slot(&self.nic, i))?;
        let p: *mut OpSlot = s;
        Ok(p.cast())
    }

    fn slot_of(&self, ctx: *mut c_void) -> Option<usize> {
        if ctx.is_null() {
            return None;
        }
        let base = self.slots.as_ptr() as usize;
        let off = (ctx as usize).checked_sub(base)?;
        let i = off / size_of::<OpSlot>();
        (off % size_of::<OpSlot>() == 0 && i < self.slots.len()).then_some(i)
    }

    /// `fi_writemsg` through the pre-filled template of slot `i`: only
    /// addresses, lengths, key and data change. Returns the raw code.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn writemsg(
        &mut self,
        ep: usize,
        i: usize,
        src: u64,
        len: usize,
        desc: Desc,
        dest: u64,
        raddr: u64,
        key: u64,
        data: Option<u64>,
        more: bool,
    ) -> Result<i64, TransportError> {
        let ep = self.ep_at(ep)?;
        // SAFETY: the endpoint is open; `rma` is its RMA ops table.
        let rma = unsafe { (*ep).rma };
        let writemsg = op!(self, rma, FiOpsRma, writemsg, "fi_writemsg")?;
        let s = self
            .slots
            .get_mut(i)
            .ok_or_else(|| self_error_slot(&self.nic, i))?;
        s.iov[0].iov_base = src as usize as *mut c_void;
        s.iov[0].iov_len = len;
        s.desc[0] = desc.0;
        s.rma_iov = FiRmaIov {
            addr: raddr,
            len,
            key,
        };
        s.msg.addr = dest;
        s.msg.data = data.unwrap_or(0);
        let mut flags = FI_COMPLETION;
        if self.delivery_complete && len > 0 {
            flags |= FI_DELIVERY_COMPLETE;
        }
        if data.is_some() {
            flags |= FI_REMOTE_CQ_DATA;
        }
        if more {
            flags |= FI_MORE;
        }
        let msg: *const FiMsgRma = &s.msg;
        // SAFETY: the template's pointers all point into this slot, which
        // stays allocated and untouched until the operation's completion; the
        // source range is registered memory (checked by the caller).
        let rc = unsafe { writemsg(ep, msg, flags) };
        Ok(rc as i64)
    }

    /// Endpoint `ep`: 0 is the main one, `k + 1` the `k`th of
    /// [`Resources::open_tx_ep`].
    fn ep_at(&self, ep: usize) -> Result<*mut FidEp, TransportError> {
        let p = match ep {
            0 => self.ep,
            k => self.tx_eps.get(k - 1).map_or(ptr::null_mut(), |e| e.0),
        };
        if p.is_null() {
            return Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: format!("internal: endpoint {ep} is not open"),
            });
        }
        Ok(p)
    }

    /// Opens another endpoint of `info` on this domain for the peer of
    /// endpoint name `peer`: it gets an AV of its own holding only that
    /// peer, shares the main CQ (slots identify operations whichever
    /// endpoint carried them) and the domain's registrations, and is
    /// enabled. Returns its index for [`Resources::writemsg`] and
    /// [`Resources::send`] and the peer's address in its AV. Its own
    /// address is told nobody: peers keep sending to the main endpoint.
    ///
    /// Its own AV rather than the main one: shm's `fi_enable` visits every
    /// peer of the endpoint's AV (`smr_exchange_all_peers` reads each
    /// peer's region), and the main AV keeps the entries of peers that are
    /// gone, whose regions may be unmapped (peers in this process).
    pub(crate) fn open_tx_ep(
        &mut self,
        info: &Info,
        peer: &[u8],
    ) -> Result<(usize, u64), TransportError> {
        if self.mr_endpoint {
            // Registrations would have to be bound to each endpoint.
            return Err(TransportError::Unsupported {
                nic: self.nic.clone(),
                what: "extra endpoints with FI_MR_ENDPOINT registrations".into(),
            });
        }
        let av = self.open_av(info)?;
        let fi_addr = match self.av_insert_into(av, peer) {
            Ok(a) => a,
            Err(e) => {
                self.close_quietly(av.cast(), "av");
                return Err(e);
            }
        };
        // SAFETY: the domain is open.
        let dops = unsafe { (*self.domain).ops };
        let mut ep: *mut FidEp = ptr::null_mut();
        let opened = op!(self, dops, FiOpsDomain, endpoint, "fi_endpoint").and_then(|endpoint| {
            // SAFETY: valid domain and info (the one the domain was opened
            // with).
            let rc = unsafe { endpoint(self.domain, info.ptr, &mut ep, ptr::null_mut()) };
            self.check("fi_endpoint", i64::from(rc))
        });
        if let Err(e) = opened {
            self.close_quietly(av.cast(), "av");
            return Err(e);
        }
        let fid = ep.cast::<Fid>();
        let set_up = self
            .fid_bind(fid, av.cast(), 0, "fi_ep_bind(av)")
            .and_then(|()| {
                self.fid_bind(fid, self.cq.cast(), FI_TRANSMIT | FI_RECV, "fi_ep_bind(cq)")
            })
            .and_then(|()| self.fid_control(fid, FI_ENABLE, "fi_enable"));
        if let Err(e) = set_up {
            self.close_quietly(fid, "ep");
            self.close_quietly(av.cast(), "av");
            return Err(e);
        }
        let k = match self.tx_eps.iter().position(|p| p.0.is_null()) {
            Some(k) => {
                self.tx_eps[k] = (ep, av);
                k
            }
            None => {
                self.tx_eps.push((ep, av));
                self.tx_eps.len() - 1
            }
        };
        Ok((k + 1, fi_addr))
    }

    fn close_quietly(&self, fid: *mut Fid, what: &str) {
        let rc = Self::close(fid);
        if rc != 0 {
            tracing::warn!(nic = %self.nic, rc, what, "fi_close failed");
        }
    }

    /// Closes endpoint `ep` of [`Resources::open_tx_ep`] and its AV.
    /// Operations still inside it never complete: the caller has read every
    /// completion the CQ holds and no longer expects any from it.
    pub(crate) fn close_tx_ep(&mut self, ep: usize) -> Result<(), TransportError> {
        let (e, av) = match ep.checked_sub(1).and_then(|k| self.tx_eps.get_mut(k)) {
            Some(p) if !p.0.is_null() => std::mem::replace(p, (ptr::null_mut(), ptr::null_mut())),
            _ => return Err(self.error("fi_close(ep)", -(libc::EINVAL as i64))),
        };
        let rc = Self::close(e.cast());
        self.check("fi_close(ep)", i64::from(rc))?;
        let rc = Self::close(av.cast());
        self.check("fi_close(av)", i64::from(rc))
    }

    /// `fi_sendmsg` of `parts` (one or two `(address, length, descriptor)`
    /// source pieces, sent as one message) with slot `i` as context, with
    /// explicit flags (`FI_DELIVERY_COMPLETE` only when there are bytes:
    /// shm 1.17 never completes a zero-length one). Returns the raw code.
    pub(crate) fn send(
        &mut self,
        ep: usize,
        i: usize,
        parts: &[(u64, usize, Desc)],
        dest: u64,
    ) -> Result<i64, TransportError> {
        let ep = self.ep_at(ep)?;
        // SAFETY: the endpoint is open; `msg` is its MSG ops table.
        let ops = unsafe { (*ep).msg };
        let sendmsg = op!(self, ops, FiOpsMsg, sendmsg, "fi_sendmsg")?;
        let ctx = self.slot_ctx(i)?;
        if parts.is_empty() || parts.len() > 2 {
            return Err(self.error("fi_sendmsg", -(libc::EINVAL as i64)));
        }
        let len: usize = parts.iter().map(|p| p.1).sum();
        let mut flags = FI_COMPLETION;
        if self.delivery_complete && len > 0 {
            flags |= FI_DELIVERY_COMPLETE;
        }
        let s = self
            .slots
            .get_mut(i)
            .ok_or_else(|| self_error_slot(&self.nic, i))?;
        for (k, &(addr, len, desc)) in parts.iter().enumerate() {
            s.iov[k].iov_base = addr as usize as *mut c_void;
            s.iov[k].iov_len = len;
            s.desc[k] = desc.0;
        }
        let msg = FiMsg {
            msg_iov: s.iov.as_ptr(),
            desc: s.desc.as_mut_ptr(),
            iov_count: parts.len(),
            addr: dest,
            context: ctx,
            data: 0,
        };
        // SAFETY: registered source memory valid until completion; the iovs
        // and descriptors live in the reserved slot; the provider copies the
        // fi_msg itself during the call.
        let rc = unsafe { sendmsg(ep, &msg, flags) };
        Ok(rc as i64)
    }

    /// `fi_recv` (any source) with slot `i` as context. Returns the raw code.
    pub(crate) fn recv(
        &mut self,
        i: usize,
        buf: u64,
        len: usize,
        desc: Desc,
    ) -> Result<i64, TransportError> {
        // SAFETY: the endpoint is open; `msg` is its MSG ops table.
        let msg = unsafe { (*self.ep).msg };
        let recv = op!(self, msg, FiOpsMsg, recv, "fi_recv")?;
        let ctx = self.slot_ctx(i)?;
        // SAFETY: registered buffer valid until completion; slot reserved.
        let rc = unsafe {
            recv(
                self.ep,
                buf as usize as *mut c_void,
                len,
                desc.0,
                FI_ADDR_UNSPEC,
                ctx,
            )
        };
        Ok(rc as i64)
    }

    /// Reads up to `max` CQ entries into `out` (appending).
    pub(crate) fn cq_read(
        &mut self,
        out: &mut Vec<CqEntry>,
        max: usize,
    ) -> Result<CqRead, TransportError> {
        // SAFETY: the CQ is open.
        let ops = unsafe { (*self.cq).ops };
        let read = op!(self, ops, FiOpsCq, read, "fi_cq_read")?;
        let n = max.clamp(1, self.cq_buf.len());
        // SAFETY: buffer of `n` FI_CQ_FORMAT_DATA entries.
        let rc = unsafe { read(self.cq, self.cq_buf.as_mut_ptr().cast(), n) } as i64;
        if rc == -FI_EAGAIN {
            return Ok(CqRead::Empty);
        }
        if rc == -FI_EAVAIL {
            return Ok(CqRead::ErrorAvailable);
        }
        if rc < 0 {
            return Err(self.error("fi_cq_read", rc));
        }
        let got = usize::try_from(rc).unwrap_or(0).min(n);
        for k in 0..got {
            let e = self.cq_buf[k];
            out.push(CqEntry {
                slot: self.slot_of(e.op_context),
                flags: e.flags,
                len: e.len,
                data: e.data,
            });
        }
        Ok(if got == 0 {
            CqRead::Empty
        } else {
            CqRead::Entries(got)
        })
    }

    /// The CQ's wait object as a file descriptor (`fi_control(FI_GETWAIT)`),
    /// or `None` if the provider gives none.
    fn cq_getwait(&self) -> Option<c_int> {
        let fid = self.cq.cast::<Fid>();
        let control = op!(self, self.fid_ops(fid), FiOps, control, "fi_control").ok()?;
        let mut fd: c_int = -1;
        // SAFETY: the CQ is open; FI_GETWAIT on an FI_WAIT_FD CQ writes one
        // int (the fd) through the pointer, which points at `fd`.
        let rc = unsafe { control(fid, FI_GETWAIT, (&mut fd as *mut c_int).cast()) };
        (rc == 0 && fd >= 0).then_some(fd)
    }

    /// The CQ's wait fd, when it has one: readable when `fi_cq_read` may
    /// find something (a completion, or socket data only progress moves).
    /// Owned by the provider; closed with the CQ.
    pub(crate) fn wait_fd(&self) -> Option<c_int> {
        self.wait_fd
    }

    /// `fi_trywait` on the CQ: `true` when the caller may block on
    /// [`Resources::wait_fd`], `false` when it must read the CQ first (or the
    /// CQ has no wait fd, or the call failed).
    pub(crate) fn trywait(&mut self) -> bool {
        if self.wait_fd.is_none() {
            return false;
        }
        // SAFETY: the fabric is open.
        let fops = unsafe { (*self.fabric).ops };
        let Ok(trywait) = op!(self, fops, FiOpsFabric, trywait, "fi_trywait") else {
            return false;
        };
        let mut fids = [self.cq.cast::<Fid>()];
        // SAFETY: the fabric and the CQ in `fids` are open; the array holds
        // exactly the one fid we pass as count.
        let rc = unsafe { trywait(self.fabric, fids.as_mut_ptr(), 1) };
        rc == 0
    }

    /// Reads one CQ error entry (`fi_cq_readerr`), with its text.
    pub(crate) fn cq_readerr(&mut self) -> Result<Option<CqError>, TransportError> {
        // SAFETY: the CQ is open.
        let ops = unsafe { (*self.cq).ops };
        let readerr = op!(self, ops, FiOpsCq, readerr, "fi_cq_readerr")?;
        let mut e = Padded::new(FiCqErrEntry {
            op_context: ptr::null_mut(),
            flags: 0,
            len: 0,
            buf: ptr::null_mut(),
            data: 0,
            tag: 0,
            olen: 0,
            err: 0,
            prov_errno: 0,
            err_data: ptr::null_mut(),
            err_data_size: 0,
        });
        // SAFETY: padded error entry; err_data_size 0 lets the provider
        // point err_data at its own buffer (valid until the next CQ read).
        let rc = unsafe { readerr(self.cq, e.as_mut(), 0) } as i64;
        if rc == -FI_EAGAIN {
            return Ok(None);
        }
        if rc < 0 {
            return Err(self.error("fi_cq_readerr", rc));
        }
        let v = e.get();
        let mut message = self.lib.strerror(i64::from(v.err));
        if v.prov_errno != 0 {
            let prov = self.cq_strerror(v.prov_errno, v.err_data);
            message = format!("{message}; provider errno {}: {prov}", v.prov_errno);
        }
        Ok(Some(CqError {
            slot: self.slot_of(v.op_context),
            flags: v.flags,
            err: i64::from(v.err),
            prov_errno: i64::from(v.prov_errno),
            olen: v.olen,
            message,
        }))
    }

    fn cq_strerror(&self, prov_errno: c_int, err_data: *mut c_void) -> String {
        // SAFETY: the CQ is open.
        let ops = unsafe { (*self.cq).ops };
        let Ok(strerror) = op!(self, ops, FiOpsCq, strerror, "fi_cq_strerror") else {
            return String::from("(no fi_cq_strerror)");
        };
        let mut buf = vec![0 as c_char; 256];
        // SAFETY: err_data is what readerr just returned (still valid: no CQ
        // read in between); output buffer of the given length.
        let p = unsafe { strerror(self.cq, prov_errno, err_data, buf.as_mut_ptr(), buf.len()) };
        if let Some(last) = buf.last_mut() {
            *last = 0;
        }
        let p = if p.is_null() { buf.as_ptr() } else { p };
        cstr_owned(p)
    }
}

fn self_error_slot(nic: &str, i: usize) -> TransportError {
    TransportError::InvalidArgument {
        nic: nic.to_string(),
        what: format!("internal: operation slot {i} out of range"),
    }
}

impl Drop for Resources {
    fn drop(&mut self) {
        // Endpoints first (cancels outstanding operations), then
        // registrations, AV, CQ, domain, fabric.
        let tx: Vec<(*mut FidEp, *mut FidAv)> = self.tx_eps.drain(..).collect();
        let mut fids: Vec<*mut Fid> = tx.iter().map(|p| p.0.cast::<Fid>()).collect();
        fids.push(self.ep.cast());
        fids.extend(tx.iter().map(|p| p.1.cast::<Fid>()));
        fids.extend(self.mrs.drain(..).map(|m| m.cast::<Fid>()));
        fids.extend([
            self.av.cast(),
            self.cq.cast(),
            self.domain.cast(),
            self.fabric.cast(),
        ]);
        for fid in fids {
            let rc = Self::close(fid);
            if rc != 0 {
                tracing::warn!(nic = %self.nic, rc, "fi_close failed during teardown");
            }
        }
    }
}

/// A struct followed by [`PAD`] zero bytes, 8-byte aligned.
struct Padded<T> {
    buf: Vec<u64>,
    _t: std::marker::PhantomData<T>,
}

impl<T> Padded<T> {
    fn new(v: T) -> Self {
        const { assert!(std::mem::align_of::<T>() <= 8) };
        let words = (size_of::<T>() + PAD).div_ceil(8);
        let mut buf = vec![0u64; words];
        // SAFETY: the buffer is 8-aligned and at least size_of::<T>() bytes.
        unsafe { ptr::write(buf.as_mut_ptr().cast::<T>(), v) };
        Padded {
            buf,
            _t: std::marker::PhantomData,
        }
    }
    fn as_mut(&mut self) -> *mut T {
        self.buf.as_mut_ptr().cast()
    }
    fn as_ptr(&self) -> *const T {
        self.buf.as_ptr().cast()
    }
    fn get(&self) -> &T {
        // SAFETY: initialised in `new`; the provider only writes valid values
        // of the same C type into it.
        unsafe { &*self.as_ptr() }
    }
}

/// Whether `flags` describe a peer's WRITE with remote CQ data landing here
/// (its `op_context` is not ours and must not be interpreted).
pub(crate) fn is_remote_write(flags: u64) -> bool {
    flags & FI_REMOTE_CQ_DATA != 0 && (flags & FI_REMOTE_WRITE != 0 || flags & FI_RECV == 0)
}

/// Whether process `pid` exists on this host (`kill(pid, 0)`); used to
/// detect dead `shm` peers, which the shm provider never reports.
pub(crate) fn process_alive(pid: i32) -> bool {
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 performs only the existence and permission check.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

// ---------------------------------------------------------------------------
// Backend-owned and registered memory the message layer reads and writes
// ---------------------------------------------------------------------------

/// Whether `off..off + len` lies within `0..total`.
fn fits(off: usize, len: usize, total: usize) -> bool {
    off.checked_add(len).is_some_and(|end| end <= total)
}

/// A zeroed, page-aligned heap buffer owned by one domain and registered
/// with it: SEND headers and the bounce buffers incoming messages land in.
/// The provider (or the NIC) writes into parts of it while they are posted;
/// this side only copies in and out of parts that are not, and never forms
/// references to its bytes.
pub(crate) struct CtlBuf {
    ptr: ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: plain heap memory owned by this value; access goes through
// `&self`/`&mut self` methods of the one domain that owns it.
unsafe impl Send for CtlBuf {}

impl CtlBuf {
    /// A zeroed buffer of `len` bytes (at least one), or `None` when the
    /// allocation fails.
    pub(crate) fn new(len: usize) -> Option<CtlBuf> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(CtlBuf {
            ptr: ptr::NonNull::new(p)?,
            layout,
        })
    }

    /// Start address (for registration and iovs).
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }

    /// Copies `src` to `off`; false (nothing written) when out of range.
    pub(crate) fn write(&mut self, off: usize, src: &[u8]) -> bool {
        if !fits(off, src.len(), self.len()) {
            return false;
        }
        // SAFETY: `off..off + src.len()` lies inside the allocation (checked
        // above); the caller writes only parts no posted operation uses.
        unsafe {
            ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len());
        }
        true
    }

    /// A copy of `len` bytes at `off`; `None` when out of range.
    pub(crate) fn read(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        if !fits(off, len, self.len()) {
            return None;
        }
        let mut v = vec![0u8; len];
        // SAFETY: `off..off + len` lies inside the allocation (checked
        // above) and `v` holds `len` bytes; the caller reads only parts that
        // no posted operation writes (a completed receive).
        unsafe {
            ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len);
        }
        Some(v)
    }
}

impl Drop for CtlBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Host memory of one live registration: where the message layer copies a
/// received message into the user's receive buffer. Held only while the
/// region is registered with the domain (dropped on deregistration).
pub(crate) struct HostWindow {
    ptr: ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: a window onto memory the registrant promised (MemRegion::new) to
// keep valid for reads and writes while registered, from any thread.
unsafe impl Send for HostWindow {}

impl HostWindow {
    /// The window of host region `region`; `None` for device memory (which
    /// plain copies cannot reach).
    pub(crate) fn of(region: &weft_transport::MemRegion) -> Option<HostWindow> {
        match region.device() {
            weft_transport::Device::Host => Some(HostWindow {
                ptr: region.ptr(),
                len: region.len(),
            }),
            weft_transport::Device::Cuda(_) => None,
        }
    }

    /// Copies `src` to `off` within the region; false (nothing written) when
    /// out of range.
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> bool {
        if !fits(off, src.len(), self.len) {
            return false;
        }
        // SAFETY: the range lies inside the registered region (checked
        // above), which `MemRegion::new`'s contract keeps valid for writes
        // while it is registered; this window exists only while it is. The
        // contract also lets the NIC and peers write it concurrently, so no
        // reference to it is formed.
        unsafe {
            ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len());
        }
        true
    }
}
