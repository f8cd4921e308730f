//! Loading libibverbs at run time and listing its devices.

use super::*;

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
pub(super) struct Api {
    _lib: Library,
    pub(super) get_device_list: GetDeviceListFn,
    pub(super) free_device_list: FreeDeviceListFn,
    pub(super) get_device_name: GetDeviceNameFn,
    pub(super) open_device: OpenDeviceFn,
    pub(super) close_device: CloseDeviceFn,
    pub(super) query_port: QueryPortFn,
    pub(super) query_gid: QueryGidFn,
    pub(super) query_gid_ex: Option<QueryGidExFn>,
    pub(super) alloc_pd: AllocPdFn,
    pub(super) dealloc_pd: DeallocPdFn,
    pub(super) reg_mr_iova2: Option<RegMrIova2Fn>,
    pub(super) reg_mr: RegMrFn,
    pub(super) reg_dmabuf_mr: Option<RegDmabufMrFn>,
    pub(super) dereg_mr: DeregMrFn,
    pub(super) create_cq: CreateCqFn,
    pub(super) destroy_cq: DestroyCqFn,
    pub(super) create_srq: CreateSrqFn,
    pub(super) destroy_srq: DestroySrqFn,
    pub(super) create_qp: CreateQpFn,
    pub(super) modify_qp: ModifyQpFn,
    pub(super) destroy_qp: DestroyQpFn,
    pub(super) create_ah: CreateAhFn,
    pub(super) destroy_ah: DestroyAhFn,
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

pub(super) fn sysfs_gid_type(dev: &str, port: u8, index: u32) -> Option<GidType> {
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
        Ok(IbvDevice::new(api, ctx, name))
    }
}
