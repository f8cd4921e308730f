//! The real libibverbs behind the seam, loaded at run time (`libibverbs.so.1`
//! via `libloading`), so the crate builds without rdma-core installed.
//!
//! All FFI of the crate lives here. Struct layouts are hand-written
//! `#[repr(C)]` copies of rdma-core 44's `<infiniband/verbs.h>` for the parts
//! used (sizes checked by tests against the values the C compiler gives).
//! `ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv` and `ibv_poll_cq`
//! are `static inline` in verbs.h and dispatch through `context->ops`; this
//! module does the same through [`IbvContext::ops`]. Every call's return
//! value goes through [`check`] / [`check_ptr`].

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

type GetDeviceListFn = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceListFn = unsafe extern "C" fn(*mut *mut c_void);
type GetDeviceNameFn = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type OpenDeviceFn = unsafe extern "C" fn(*mut c_void) -> *mut IbvContext;
type CloseDeviceFn = unsafe extern "C" fn(*mut IbvContext) -> c_int;
type QueryPortFn = unsafe extern "C" fn(*mut IbvContext, u8, *mut IbvPortAttr) -> c_int;
type QueryGidFn = unsafe extern "C" fn(*mut IbvContext, u8, c_int, *mut [u8; 16]) -> c_int;
type QueryGidExFn =
    unsafe extern "C" fn(*mut IbvContext, u32, u32, *mut IbvGidEntry, u32, usize) -> c_int;
type AllocPdFn = unsafe extern "C" fn(*mut IbvContext) -> *mut c_void;
type DeallocPdFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type RegMrIova2Fn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, u64, u32) -> *mut IbvMr;
type RegMrFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut IbvMr;
type RegDmabufMrFn = unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut IbvMr;
type DeregMrFn = unsafe extern "C" fn(*mut IbvMr) -> c_int;
type CreateCqFn =
    unsafe extern "C" fn(*mut IbvContext, c_int, *mut c_void, *mut c_void, c_int) -> *mut IbvCq;
type DestroyCqFn = unsafe extern "C" fn(*mut IbvCq) -> c_int;
type CreateSrqFn = unsafe extern "C" fn(*mut c_void, *mut IbvSrqInitAttr) -> *mut IbvSrq;
type DestroySrqFn = unsafe extern "C" fn(*mut IbvSrq) -> c_int;
type CreateQpFn = unsafe extern "C" fn(*mut c_void, *mut IbvQpInitAttr) -> *mut IbvQp;
type ModifyQpFn = unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int) -> c_int;
type DestroyQpFn = unsafe extern "C" fn(*mut IbvQp) -> c_int;
type CreateAhFn = unsafe extern "C" fn(*mut c_void, *mut IbvAhAttr) -> *mut c_void;
type DestroyAhFn = unsafe extern "C" fn(*mut c_void) -> c_int;

/// The resolved entry points.
struct Api {
    _lib: Library,
    get_device_list: GetDeviceListFn,
    free_device_list: FreeDeviceListFn,
    get_device_name: GetDeviceNameFn,
    open_device: OpenDeviceFn,
    close_device: CloseDeviceFn,
    query_port: QueryPortFn,
    query_gid: QueryGidFn,
    query_gid_ex: Option<QueryGidExFn>,
    alloc_pd: AllocPdFn,
    dealloc_pd: DeallocPdFn,
    reg_mr_iova2: Option<RegMrIova2Fn>,
    reg_mr: RegMrFn,
    reg_dmabuf_mr: Option<RegDmabufMrFn>,
    dereg_mr: DeregMrFn,
    create_cq: CreateCqFn,
    destroy_cq: DestroyCqFn,
    create_srq: CreateSrqFn,
    destroy_srq: DestroySrqFn,
    create_qp: CreateQpFn,
    modify_qp: ModifyQpFn,
    destroy_qp: DestroyQpFn,
    create_ah: CreateAhFn,
    destroy_ah: DestroyAhFn,
}

impl Api {
    fn load() -> Result<Api, String> {
        // SAFETY: loading libibverbs runs its constructors, which only set
        // up the provider registry; no other library invariants are touched.
        let lib = unsafe { Library::new(LIBIBVERBS) }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($t:ty, $name:literal) => {{
                // SAFETY: the symbol is declared in verbs.h with exactly the
                // function type `$t`.
                let s = unsafe { lib.get::<$t>(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: {e}", $name))?;
                *s
            }};
        }
        macro_rules! opt_sym {
            ($t:ty, $name:literal) => {{
                // SAFETY: as in `sym!`.
                unsafe { lib.get::<$t>(concat!($name, "\0").as_bytes()) }
                    .ok()
                    .map(|s| *s)
            }};
        }
        Ok(Api {
            get_device_list: sym!(GetDeviceListFn, "ibv_get_device_list"),
            free_device_list: sym!(FreeDeviceListFn, "ibv_free_device_list"),
            get_device_name: sym!(GetDeviceNameFn, "ibv_get_device_name"),
            open_device: sym!(OpenDeviceFn, "ibv_open_device"),
            close_device: sym!(CloseDeviceFn, "ibv_close_device"),
            query_port: sym!(QueryPortFn, "ibv_query_port"),
            query_gid: sym!(QueryGidFn, "ibv_query_gid"),
            query_gid_ex: opt_sym!(QueryGidExFn, "_ibv_query_gid_ex"),
            alloc_pd: sym!(AllocPdFn, "ibv_alloc_pd"),
            dealloc_pd: sym!(DeallocPdFn, "ibv_dealloc_pd"),
            reg_mr_iova2: opt_sym!(RegMrIova2Fn, "ibv_reg_mr_iova2"),
            reg_mr: sym!(RegMrFn, "ibv_reg_mr"),
            reg_dmabuf_mr: opt_sym!(RegDmabufMrFn, "ibv_reg_dmabuf_mr"),
            dereg_mr: sym!(DeregMrFn, "ibv_dereg_mr"),
            create_cq: sym!(CreateCqFn, "ibv_create_cq"),
            destroy_cq: sym!(DestroyCqFn, "ibv_destroy_cq"),
            create_srq: sym!(CreateSrqFn, "ibv_create_srq"),
            destroy_srq: sym!(DestroySrqFn, "ibv_destroy_srq"),
            create_qp: sym!(CreateQpFn, "ibv_create_qp"),
            modify_qp: sym!(ModifyQpFn, "ibv_modify_qp"),
            destroy_qp: sym!(DestroyQpFn, "ibv_destroy_qp"),
            create_ah: sym!(CreateAhFn, "ibv_create_ah"),
            destroy_ah: sym!(DestroyAhFn, "ibv_destroy_ah"),
            _lib: lib,
        })
    }
}

/// The real libibverbs, loaded on first use.
pub struct IbvLib {
    api: OnceLock<Result<Arc<Api>, String>>,
}

impl Default for IbvLib {
    fn default() -> Self {
        Self::new()
    }
}

impl IbvLib {
    /// A handle; nothing is loaded until [`VerbsLib::devices`] or
    /// [`VerbsLib::open`].
    pub fn new() -> Self {
        Self {
            api: OnceLock::new(),
        }
    }

    fn api(&self) -> Result<Arc<Api>, TransportError> {
        self.api
            .get_or_init(|| Api::load().map(Arc::new))
            .clone()
            .map_err(|reason| TransportError::LibraryUnavailable {
                library: LIBIBVERBS.to_string(),
                reason,
            })
    }

    /// Device pointers and names, in list order.
    fn list(&self, api: &Api) -> Result<(Vec<String>, DeviceList), TransportError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array is freed by
        // `DeviceList::drop`.
        let list = unsafe { (api.get_device_list)(&mut n) };
        if list.is_null() {
            let errno = last_errno();
            // ENOSYS: no kernel uverbs support at all, i.e. no device.
            if errno == 38 {
                return Ok((Vec::new(), DeviceList::empty()));
            }
            return Err(TransportError::Provider {
                nic: "verbs".into(),
                op: "ibv_get_device_list",
                code: i64::from(errno),
                message: std::io::Error::from_raw_os_error(errno).to_string(),
            });
        }
        let list = DeviceList {
            ptr: list,
            free: Some(api.free_device_list),
            len: n.max(0) as usize,
        };
        let mut names = Vec::with_capacity(list.len);
        for i in 0..list.len {
            // SAFETY: `i < n` entries are valid device pointers.
            let dev = unsafe { *list.ptr.add(i) };
            // SAFETY: `dev` is a valid device; the name is a NUL-terminated
            // string owned by the device.
            let name = unsafe { (api.get_device_name)(dev) };
            let name = if name.is_null() {
                format!("verbs{i}")
            } else {
                // SAFETY: non-null NUL-terminated string (see above).
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned()
            };
            names.push(name);
        }
        Ok((names, list))
    }
}

struct DeviceList {
    ptr: *mut *mut c_void,
    free: Option<FreeDeviceListFn>,
    len: usize,
}

impl DeviceList {
    fn empty() -> Self {
        Self {
            ptr: std::ptr::null_mut(),
            free: None,
            len: 0,
        }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if let (Some(free), false) = (self.free, self.ptr.is_null()) {
            // SAFETY: the list came from ibv_get_device_list and is freed once.
            unsafe { free(self.ptr) };
        }
    }
}

fn sysfs_numa(name: &str) -> Option<u32> {
    let s =
        std::fs::read_to_string(format!("/sys/class/infiniband/{name}/device/numa_node")).ok()?;
    let v: i64 = s.trim().parse().ok()?;
    u32::try_from(v).ok()
}

fn sysfs_gid_type(dev: &str, port: u8, index: u32) -> Option<GidType> {
    let s = std::fs::read_to_string(format!(
        "/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}"
    ))
    .ok()?;
    let s = s.trim();
    if s.eq_ignore_ascii_case("RoCE v2") {
        Some(GidType::RoceV2)
    } else if s.contains("RoCE v1") || s.contains("IB/RoCE") {
        Some(GidType::RoceV1)
    } else {
        None
    }
}

impl VerbsLib for IbvLib {
    type Ops = IbvDevice;

    fn devices(&self) -> Result<Vec<DeviceInfo>, TransportError> {
        let api = self.api()?;
        let (names, _list) = self.list(&api)?;
        Ok(names
            .into_iter()
            .map(|name| DeviceInfo {
                numa_node: sysfs_numa(&name),
                name,
            })
            .collect())
    }

    fn open(&self, nic: usize) -> Result<IbvDevice, TransportError> {
        let api = self.api()?;
        let (names, list) = self.list(&api)?;
        let name = names
            .get(nic)
            .cloned()
            .ok_or_else(|| TransportError::NoDevice {
                what: format!("verbs device index {nic} ({} devices)", names.len()),
            })?;
        // SAFETY: nic < len, so the entry is a valid device pointer.
        let dev = unsafe { *list.ptr.add(nic) };
        // SAFETY: a valid device from the live list.
        let ctx = unsafe { (api.open_device)(dev) };
        let ctx = check_ptr("ibv_open_device", ctx, &name).map_err(|e| e.into_transport(&name))?;
        Ok(IbvDevice {
            api,
            ctx,
            name,
            pds: BTreeMap::new(),
            cqs: BTreeMap::new(),
            srqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            mrs: BTreeMap::new(),
            ahs: BTreeMap::new(),
            start: std::time::Instant::now(),
        })
    }
}

/// One opened libibverbs device context. Handles given out are the object
/// pointers; every call checks them against the live objects of this
/// context first.
pub struct IbvDevice {
    api: Arc<Api>,
    ctx: *mut IbvContext,
    name: String,
    pds: BTreeMap<u64, *mut c_void>,
    cqs: BTreeMap<u64, *mut IbvCq>,
    srqs: BTreeMap<u64, *mut IbvSrq>,
    qps: BTreeMap<u64, *mut IbvQp>,
    mrs: BTreeMap<u64, *mut IbvMr>,
    ahs: BTreeMap<u64, *mut c_void>,
    start: std::time::Instant,
}

// SAFETY: libibverbs objects may be used from any thread (rdma-core locks
// internally where needed); `IbvDevice` owns them and is used through
// `&mut self` only, so there is no unsynchronized sharing.
unsafe impl Send for IbvDevice {}

fn bad_handle(op: &'static str) -> VerbsError {
    VerbsError::new(op, 22, "unknown handle")
}

fn key<T>(p: *mut T) -> u64 {
    p as usize as u64
}

impl IbvDevice {
    fn mr_result(
        &mut self,
        op: &'static str,
        mr: *mut IbvMr,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        let mr = check_ptr(op, mr, &self.name)?;
        // SAFETY: a live MR just returned by libibverbs.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.mrs.insert(key(mr), mr);
        Ok((Mr(key(mr)), lkey, rkey))
    }
}

impl VerbsOps for IbvDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn query_port(&mut self, port: u8) -> Result<PortAttr, VerbsError> {
        let mut a = IbvPortAttr::default();
        // SAFETY: valid context; `a` is at least as large as the
        // `_compat_ibv_port_attr` the exported symbol fills.
        let rc = unsafe { (self.api.query_port)(self.ctx, port, &mut a) };
        check("ibv_query_port", rc, &format!("{} port {port}", self.name))?;
        Ok(PortAttr {
            state: a.state,
            active_mtu: a.active_mtu,
            gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
            max_msg_sz: a.max_msg_sz,
            lid: a.lid,
            link_layer: match a.link_layer {
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
            active_width: a.active_width,
            active_speed: a.active_speed,
        })
    }

    fn query_gid(&mut self, port: u8, index: u32) -> Result<GidEntry, VerbsError> {
        if let Some(ex) = self.api.query_gid_ex {
            let mut e = IbvGidEntry::default();
            // SAFETY: valid context and out-pointer of the stated size.
            let rc = unsafe {
                ex(
                    self.ctx,
                    u32::from(port),
                    index,
                    &mut e,
                    0,
                    std::mem::size_of::<IbvGidEntry>(),
                )
            };
            if check("ibv_query_gid_ex", rc, "").is_ok() {
                return Ok(GidEntry {
                    gid: Gid(e.gid),
                    gid_type: match e.gid_type {
                        0 => Some(GidType::Ib),
                        1 => Some(GidType::RoceV1),
                        2 => Some(GidType::RoceV2),
                        _ => None,
                    },
                });
            }
        }
        let mut gid = [0u8; 16];
        let idx = c_int::try_from(index).map_err(|_| bad_handle("ibv_query_gid"))?;
        // SAFETY: valid context and a 16-byte out buffer.
        let rc = unsafe { (self.api.query_gid)(self.ctx, port, idx, &mut gid) };
        check("ibv_query_gid", rc, &format!("index {index}"))?;
        Ok(GidEntry {
            gid: Gid(gid),
            gid_type: sysfs_gid_type(&self.name, port, index),
        })
    }

    fn alloc_pd(&mut self) -> Result<Pd, VerbsError> {
        // SAFETY: valid context.
        let pd = check_ptr("ibv_alloc_pd", unsafe { (self.api.alloc_pd)(self.ctx) }, "")?;
        self.pds.insert(key(pd), pd);
        Ok(Pd(key(pd)))
    }

    fn dealloc_pd(&mut self, pd: Pd) -> Result<(), VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_dealloc_pd"))?;
        // SAFETY: a live PD of this context.
        check("ibv_dealloc_pd", unsafe { (self.api.dealloc_pd)(p) }, "")?;
        self.pds.remove(&pd.0);
        Ok(())
    }

    fn reg_mr(
        &mut self,
        pd: Pd,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_reg_mr"))?;
        let len = usize::try_from(len).map_err(|_| VerbsError::new("ibv_reg_mr", 22, "length"))?;
        let ptr = addr as usize as *mut c_void;
        let mr = match self.api.reg_mr_iova2 {
            // SAFETY: the caller (a MemRegion's creator) promised the range is
            // valid while registered; PD is live.
            Some(f) => unsafe { f(p, ptr, len, addr, access) },
            // SAFETY: as above; optional flags are not understood by the old
            // entry point, so they are dropped.
            None => unsafe {
                (self.api.reg_mr)(p, ptr, len, (access & !ACCESS_OPTIONAL_RANGE) as c_int)
            },
        };
        self.mr_result("ibv_reg_mr", mr)
    }

    fn reg_dmabuf_mr(
        &mut self,
        pd: Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_reg_dmabuf_mr"))?;
        let f = self
            .api
            .reg_dmabuf_mr
            .ok_or_else(|| VerbsError::new("ibv_reg_dmabuf_mr", 95, "libibverbs lacks it"))?;
        let len =
            usize::try_from(len).map_err(|_| VerbsError::new("ibv_reg_dmabuf_mr", 22, "length"))?;
        // SAFETY: PD is live; the fd/offset/length describe a dma-buf the
        // exporter handed us.
        let mr = unsafe { f(p, offset, len, iova, fd, access as c_int) };
        self.mr_result("ibv_reg_dmabuf_mr", mr)
    }

    fn dereg_mr(&mut self, mr: Mr) -> Result<(), VerbsError> {
        let p = *self
            .mrs
            .get(&mr.0)
            .ok_or_else(|| bad_handle("ibv_dereg_mr"))?;
        // SAFETY: a live MR of this context.
        check("ibv_dereg_mr", unsafe { (self.api.dereg_mr)(p) }, "")?;
        self.mrs.remove(&mr.0);
        Ok(())
    }

    fn create_cq(&mut self, cqe: u32) -> Result<Cq, VerbsError> {
        let n = c_int::try_from(cqe).map_err(|_| VerbsError::new("ibv_create_cq", 22, "cqe"))?;
        // SAFETY: valid context; no channel, vector 0.
        let cq = unsafe {
            (self.api.create_cq)(self.ctx, n, std::ptr::null_mut(), std::ptr::null_mut(), 0)
        };
        let cq = check_ptr("ibv_create_cq", cq, &format!("{cqe} entries"))?;
        self.cqs.insert(key(cq), cq);
        Ok(Cq(key(cq)))
    }

    fn destroy_cq(&mut self, cq: Cq) -> Result<(), VerbsError> {
        let p = *self
            .cqs
            .get(&cq.0)
            .ok_or_else(|| bad_handle("ibv_destroy_cq"))?;
        // SAFETY: a live CQ of this context.
        check("ibv_destroy_cq", unsafe { (self.api.destroy_cq)(p) }, "")?;
        self.cqs.remove(&cq.0);
        Ok(())
    }

    fn create_srq(&mut self, pd: Pd, max_wr: u32) -> Result<Srq, VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_create_srq"))?;
        let mut a = IbvSrqInitAttr {
            srq_context: std::ptr::null_mut(),
            max_wr,
            max_sge: 1,
            srq_limit: 0,
        };
        // SAFETY: live PD, valid attribute struct.
        let s = check_ptr(
            "ibv_create_srq",
            unsafe { (self.api.create_srq)(p, &mut a) },
            "",
        )?;
        self.srqs.insert(key(s), s);
        Ok(Srq(key(s)))
    }

    fn destroy_srq(&mut self, srq: Srq) -> Result<(), VerbsError> {
        let p = *self
            .srqs
            .get(&srq.0)
            .ok_or_else(|| bad_handle("ibv_destroy_srq"))?;
        // SAFETY: a live SRQ of this context.
        check("ibv_destroy_srq", unsafe { (self.api.destroy_srq)(p) }, "")?;
        self.srqs.remove(&srq.0);
        Ok(())
    }

    fn create_qp(&mut self, pd: Pd, init: &QpInit) -> Result<QpCreated, VerbsError> {
        let op = "ibv_create_qp";
        let p = *self.pds.get(&pd.0).ok_or_else(|| bad_handle(op))?;
        let scq = *self
            .cqs
            .get(&init.send_cq.0)
            .ok_or_else(|| bad_handle(op))?;
        let rcq = *self
            .cqs
            .get(&init.recv_cq.0)
            .ok_or_else(|| bad_handle(op))?;
        let srq = match init.srq {
            Some(s) => *self.srqs.get(&s.0).ok_or_else(|| bad_handle(op))? as *mut c_void,
            None => std::ptr::null_mut(),
        };
        let mut a = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq as *mut c_void,
            recv_cq: rcq as *mut c_void,
            srq,
            cap: IbvQpCap {
                max_send_wr: init.max_send_wr,
                max_recv_wr: if init.srq.is_some() {
                    0
                } else {
                    init.max_recv_wr
                },
                max_send_sge: init.max_sge,
                max_recv_sge: init.max_sge,
                max_inline_data: 0,
            },
            qp_type: match init.qp_type {
                QpType::Rc => QPT_RC,
                QpType::Ud => QPT_UD,
            },
            sq_sig_all: 0,
        };
        // SAFETY: live PD/CQs/SRQ, valid attribute struct (updated with the
        // actual capabilities on return).
        let qp = check_ptr(op, unsafe { (self.api.create_qp)(p, &mut a) }, "")?;
        self.qps.insert(key(qp), qp);
        // SAFETY: a live QP.
        let qpn = unsafe { (*qp).qp_num };
        Ok(QpCreated {
            qp: Qp(key(qp)),
            qpn,
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
        })
    }

    fn modify_qp(&mut self, qp: Qp, change: &ModifyQp) -> Result<(), VerbsError> {
        let p = *self
            .qps
            .get(&qp.0)
            .ok_or_else(|| bad_handle("ibv_modify_qp"))?;
        let mut a = IbvQpAttr::default();
        let mask = match *change {
            ModifyQp::Init {
                port,
                pkey_index,
                access,
                qkey,
            } => {
                a.qp_state = QPS_INIT;
                a.port_num = port;
                a.pkey_index = pkey_index;
                match qkey {
                    Some(q) => {
                        a.qkey = q;
                        QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_QKEY
                    }
                    None => {
                        a.qp_access_flags = access;
                        QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS
                    }
                }
            }
            ModifyQp::RtrRc {
                path_mtu,
                dest_qpn,
                rq_psn,
                ah,
                max_dest_rd_atomic,
                min_rnr_timer,
            } => {
                a.qp_state = QPS_RTR;
                a.path_mtu = path_mtu;
                a.dest_qp_num = dest_qpn;
                a.rq_psn = rq_psn;
                a.max_dest_rd_atomic = max_dest_rd_atomic;
                a.min_rnr_timer = min_rnr_timer;
                a.ah_attr = ah_attr(&ah);
                QP_STATE
                    | QP_AV
                    | QP_PATH_MTU
                    | QP_DEST_QPN
                    | QP_RQ_PSN
                    | QP_MAX_DEST_RD_ATOMIC
                    | QP_MIN_RNR_TIMER
            }
            ModifyQp::RtrUd => {
                a.qp_state = QPS_RTR;
                QP_STATE
            }
            ModifyQp::Rts {
                sq_psn,
                timeout,
                retry_cnt,
                rnr_retry,
                max_rd_atomic,
                rc,
            } => {
                a.qp_state = QPS_RTS;
                a.sq_psn = sq_psn;
                if rc {
                    a.timeout = timeout;
                    a.retry_cnt = retry_cnt;
                    a.rnr_retry = rnr_retry;
                    a.max_rd_atomic = max_rd_atomic;
                    QP_STATE
                        | QP_SQ_PSN
                        | QP_TIMEOUT
                        | QP_RETRY_CNT
                        | QP_RNR_RETRY
                        | QP_MAX_QP_RD_ATOMIC
                } else {
                    QP_STATE | QP_SQ_PSN
                }
            }
            ModifyQp::Err => {
                a.qp_state = QPS_ERR;
                QP_STATE
            }
            ModifyQp::Reset => {
                a.qp_state = QPS_RESET;
                QP_STATE
            }
        };
        // SAFETY: a live QP and a fully initialized attribute struct.
        let rc = unsafe { (self.api.modify_qp)(p, &mut a, mask) };
        check("ibv_modify_qp", rc, &format!("{change:?}"))
    }

    fn destroy_qp(&mut self, qp: Qp) -> Result<(), VerbsError> {
        let p = *self
            .qps
            .get(&qp.0)
            .ok_or_else(|| bad_handle("ibv_destroy_qp"))?;
        // SAFETY: a live QP of this context.
        check("ibv_destroy_qp", unsafe { (self.api.destroy_qp)(p) }, "")?;
        self.qps.remove(&qp.0);
        Ok(())
    }

    fn post_send(&mut self, qp: Qp, wrs: &[SendWr]) -> Result<(), PostFailure> {
        let fail = |i, e| PostFailure {
            bad_index: i,
            error: e,
        };
        let p = *self
            .qps
            .get(&qp.0)
            .ok_or_else(|| fail(0, bad_handle("ibv_post_send")))?;
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<IbvSge> = wrs
            .iter()
            .map(|w| {
                let s = w.sge.unwrap_or(Sge {
                    addr: 0,
                    length: 0,
                    lkey: 0,
                });
                IbvSge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                }
            })
            .collect();
        let mut chain: Vec<IbvSendWr> = Vec::with_capacity(wrs.len());
        for (i, w) in wrs.iter().enumerate() {
            let mut raw = IbvSendWr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: c_int::from(w.sge.is_some()),
                opcode: WR_SEND,
                send_flags: if w.signaled { SEND_SIGNALED } else { 0 },
                imm_data: 0,
                wr: [0; 32],
                qp_type: 0,
                _pad: 0,
                tail: [0; 6],
            };
            match w.op {
                SendOp::Send => {}
                SendOp::Write { remote_addr, rkey } => {
                    raw.opcode = WR_RDMA_WRITE;
                    raw.wr[..8].copy_from_slice(&remote_addr.to_ne_bytes());
                    raw.wr[8..12].copy_from_slice(&rkey.to_ne_bytes());
                }
                SendOp::WriteImm {
                    remote_addr,
                    rkey,
                    imm,
                } => {
                    raw.opcode = WR_RDMA_WRITE_WITH_IMM;
                    raw.imm_data = imm.to_be();
                    raw.wr[..8].copy_from_slice(&remote_addr.to_ne_bytes());
                    raw.wr[8..12].copy_from_slice(&rkey.to_ne_bytes());
                }
                SendOp::UdSend {
                    ah,
                    remote_qpn,
                    remote_qkey,
                } => {
                    let ahp = *self
                        .ahs
                        .get(&ah.0)
                        .ok_or_else(|| fail(i, bad_handle("ibv_post_send")))?;
                    raw.wr[..8].copy_from_slice(&(ahp as usize as u64).to_ne_bytes());
                    raw.wr[8..12].copy_from_slice(&remote_qpn.to_ne_bytes());
                    raw.wr[12..16].copy_from_slice(&remote_qkey.to_ne_bytes());
                }
            }
            chain.push(raw);
        }
        // Link the chain (addresses are stable now: no more pushes).
        let base = chain.as_mut_ptr();
        let sbase = sges.as_mut_ptr();
        for i in 0..chain.len() {
            // SAFETY: i and i+1 are in bounds of `chain`/`sges`, which live
            // until after the call below.
            unsafe {
                let w = base.add(i);
                if (*w).num_sge > 0 {
                    (*w).sg_list = sbase.add(i);
                }
                if i + 1 < chain.len() {
                    (*w).next = base.add(i + 1);
                }
            }
        }
        let mut bad: *mut IbvSendWr = std::ptr::null_mut();
        // SAFETY: `p` is a live QP whose context pointer is the opened
        // context; ops.post_send is what ibv_post_send (inline) calls.
        let rc = unsafe {
            let ctx = (*p).context;
            match (*ctx).ops.post_send {
                Some(f) => f(p, base, &mut bad),
                None => 95,
            }
        };
        if rc == 0 {
            return Ok(());
        }
        let idx = if bad.is_null() {
            0
        } else {
            // SAFETY: bad_wr points into our chain array.
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        let code = if rc > 0 { rc } else { last_errno() };
        Err(fail(
            idx.min(wrs.len()),
            VerbsError::new("ibv_post_send", code, format!("bad_wr index {idx}")),
        ))
    }

    fn post_recv(&mut self, qp: Qp, wrs: &[RecvWr]) -> Result<(), PostFailure> {
        let p = *self.qps.get(&qp.0).ok_or_else(|| PostFailure {
            bad_index: 0,
            error: bad_handle("ibv_post_recv"),
        })?;
        // SAFETY: live QP; the context's post_recv is ibv_post_recv's target.
        post_recv_chain("ibv_post_recv", wrs, |head, bad| unsafe {
            match (*(*p).context).ops.post_recv {
                Some(f) => f(p, head, bad),
                None => 95,
            }
        })
    }

    fn post_srq_recv(&mut self, srq: Srq, wrs: &[RecvWr]) -> Result<(), PostFailure> {
        let p = *self.srqs.get(&srq.0).ok_or_else(|| PostFailure {
            bad_index: 0,
            error: bad_handle("ibv_post_srq_recv"),
        })?;
        // SAFETY: live SRQ; the context's post_srq_recv is the target of
        // ibv_post_srq_recv (inline).
        post_recv_chain("ibv_post_srq_recv", wrs, |head, bad| unsafe {
            match (*(*p).context).ops.post_srq_recv {
                Some(f) => f(p, head, bad),
                None => 95,
            }
        })
    }

    fn poll_cq(&mut self, cq: Cq, max: usize, out: &mut Vec<Wc>) -> Result<usize, VerbsError> {
        let p = *self
            .cqs
            .get(&cq.0)
            .ok_or_else(|| bad_handle("ibv_poll_cq"))?;
        let n = max.min(64);
        let mut buf = [IbvWc {
            wr_id: 0,
            status: 0,
            opcode: 0,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num: 0,
            src_qp: 0,
            wc_flags: 0,
            pkey_index: 0,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
        }; 64];
        // SAFETY: live CQ; `buf` holds `n` entries; ops.poll_cq is what
        // ibv_poll_cq (inline) calls.
        let rc = unsafe {
            match (*(*p).context).ops.poll_cq {
                Some(f) => f(p, n as c_int, buf.as_mut_ptr()),
                None => -95,
            }
        };
        if rc < 0 {
            return Err(VerbsError::new("ibv_poll_cq", -rc, ""));
        }
        let got = (rc as usize).min(n);
        for w in &buf[..got] {
            let status = WcStatus::from_raw(w.status);
            out.push(Wc {
                wr_id: w.wr_id,
                status,
                opcode: match w.opcode {
                    0 => WcOpcode::Send,
                    1 => WcOpcode::RdmaWrite,
                    128 => WcOpcode::Recv,
                    129 => WcOpcode::RecvRdmaWithImm,
                    o => WcOpcode::Other(o),
                },
                vendor_err: w.vendor_err,
                byte_len: w.byte_len,
                imm: (status == WcStatus::Success && w.wc_flags & WC_WITH_IMM != 0)
                    .then(|| u32::from_be(w.imm_data)),
                qp_num: w.qp_num,
                src_qp: w.src_qp,
            });
        }
        Ok(got)
    }

    fn create_ah(&mut self, pd: Pd, attr: &AhAttr) -> Result<Ah, VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_create_ah"))?;
        let mut a = ah_attr(attr);
        // SAFETY: live PD and a valid attribute struct.
        let ah = check_ptr(
            "ibv_create_ah",
            unsafe { (self.api.create_ah)(p, &mut a) },
            "",
        )?;
        self.ahs.insert(key(ah), ah);
        Ok(Ah(key(ah)))
    }

    fn destroy_ah(&mut self, ah: Ah) -> Result<(), VerbsError> {
        let p = *self
            .ahs
            .get(&ah.0)
            .ok_or_else(|| bad_handle("ibv_destroy_ah"))?;
        // SAFETY: a live AH of this context.
        check("ibv_destroy_ah", unsafe { (self.api.destroy_ah)(p) }, "")?;
        self.ahs.remove(&ah.0);
        Ok(())
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn entropy(&mut self) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(self.now_ns());
        h.write_u32(std::process::id());
        h.finish()
    }

    fn peer_memory(&self) -> bool {
        std::path::Path::new("/sys/module/nvidia_peermem").exists()
            || std::path::Path::new("/sys/kernel/mm/memory_peers/nv_mem").exists()
    }
}

fn ah_attr(ah: &AhAttr) -> IbvAhAttr {
    IbvAhAttr {
        grh: IbvGlobalRoute {
            dgid: ah.dgid.0,
            flow_label: 0,
            sgid_index: ah.sgid_index,
            hop_limit: ah.hop_limit,
            traffic_class: ah.traffic_class,
        },
        dlid: ah.dlid,
        sl: ah.sl,
        src_path_bits: 0,
        static_rate: 0,
        is_global: u8::from(ah.is_global),
        port_num: ah.port,
    }
}

fn post_recv_chain(
    op: &'static str,
    wrs: &[RecvWr],
    call: impl FnOnce(*mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int,
) -> Result<(), PostFailure> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<IbvSge> = wrs
        .iter()
        .map(|w| {
            let s = w.sge.unwrap_or(Sge {
                addr: 0,
                length: 0,
                lkey: 0,
            });
            IbvSge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            }
        })
        .collect();
    let mut chain: Vec<IbvRecvWr> = wrs
        .iter()
        .map(|w| IbvRecvWr {
            wr_id: w.wr_id,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: c_int::from(w.sge.is_some()),
        })
        .collect();
    let base = chain.as_mut_ptr();
    let sbase = sges.as_mut_ptr();
    for i in 0..chain.len() {
        // SAFETY: in bounds; both vectors outlive the call.
        unsafe {
            let w = base.add(i);
            if (*w).num_sge > 0 {
                (*w).sg_list = sbase.add(i);
            }
            if i + 1 < chain.len() {
                (*w).next = base.add(i + 1);
            }
        }
    }
    let mut bad: *mut IbvRecvWr = std::ptr::null_mut();
    let rc = call(base, &mut bad);
    if rc == 0 {
        return Ok(());
    }
    let idx = if bad.is_null() {
        0
    } else {
        // SAFETY: bad_wr points into our chain.
        usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
    };
    let code = if rc > 0 { rc } else { last_errno() };
    Err(PostFailure {
        bad_index: idx.min(wrs.len()),
        error: VerbsError::new(op, code, format!("bad_wr index {idx}")),
    })
}

impl Drop for IbvDevice {
    fn drop(&mut self) {
        // The domain destroys its objects; release anything left so the
        // context can close.
        for (_, qp) in std::mem::take(&mut self.qps) {
            // SAFETY: live objects of this context, each destroyed once.
            unsafe { (self.api.destroy_qp)(qp) };
        }
        for (_, ah) in std::mem::take(&mut self.ahs) {
            // SAFETY: as above.
            unsafe { (self.api.destroy_ah)(ah) };
        }
        for (_, s) in std::mem::take(&mut self.srqs) {
            // SAFETY: as above.
            unsafe { (self.api.destroy_srq)(s) };
        }
        for (_, cq) in std::mem::take(&mut self.cqs) {
            // SAFETY: as above.
            unsafe { (self.api.destroy_cq)(cq) };
        }
        for (_, mr) in std::mem::take(&mut self.mrs) {
            // SAFETY: as above.
            unsafe { (self.api.dereg_mr)(mr) };
        }
        for (_, pd) in std::mem::take(&mut self.pds) {
            // SAFETY: as above.
            unsafe { (self.api.dealloc_pd)(pd) };
        }
        // SAFETY: the context was opened by ibv_open_device and is closed once.
        unsafe { (self.api.close_device)(self.ctx) };
    }
}

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
