//! Loading libfabric at run time, and discovery (`fi_getinfo`).

use super::*;

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
    pub(super) fabric: FabricFn,
    strerror: StrerrorFn,
    /// `fi_version()` of the loaded library.
    pub(crate) version: u32,
    /// The API version we request (1.17, or the library's if older).
    pub(crate) api: u32,
}

static LIB: OnceLock<Result<Lib, TransportError>> = OnceLock::new();

/// Loads libfabric once per process.
pub(crate) fn lib() -> Result<&'static Lib, TransportError> {
    LIB.get_or_init(|| super::keep_signals(load))
        .as_ref()
        .map_err(Clone::clone)
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
    pub(super) ptr: *mut FiInfo,
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

pub(super) fn cstr_owned(p: *const c_char) -> String {
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
    super::keep_signals(|| getinfo_inner(lib, h))
}

fn getinfo_inner(lib: &Lib, h: &Hints<'_>) -> Result<Vec<Info>, TransportError> {
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
