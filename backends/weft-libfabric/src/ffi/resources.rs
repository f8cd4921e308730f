//! Opened resources: fabric, domain, address vector, completion queue,
//! endpoints and memory registrations, and closing them. The data path
//! (posting and completions) is in `post`.

use super::*;

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
        super::keep_signals(|| Self::open_inner(lib, nic, info, slots, wait_fd))
    }

    fn open_inner(
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

    /// Registers `[addr, addr+len)`. `cuda` selects FI_HMEM_CUDA memory;
    /// `device_only` marks it `FI_HMEM_DEVICE_ONLY` (shm then moves it with
    /// CUDA IPC).
    pub(crate) fn mr_reg(
        &mut self,
        addr: u64,
        len: usize,
        access: u64,
        requested_key: u64,
        cuda: Option<u32>,
        device_only: bool,
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
                // `FI_HMEM_DEVICE_ONLY`: device memory (not managed), which
                // lets shm move it with CUDA IPC instead of staging it
                // through host bounce buffers.
                let flags = if device_only { FI_HMEM_DEVICE_ONLY } else { 0 };
                // SAFETY: as above for CUDA memory; `attr` is padded.
                unsafe { regattr(dom_fid, attr.as_ptr(), flags, &mut mr) }
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

/// Whether process `pid` runs on this host (`kill(pid, 0)`, and not a
/// zombie: a killed process its parent has not reaped yet is dead for
/// its peers); used to detect dead `shm` peers, which the shm provider
/// never reports.
pub(crate) fn process_alive(pid: i32) -> bool {
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 performs only the existence and permission check.
    let rc = unsafe { libc::kill(pid, 0) };
    if rc != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    // `/proc/<pid>/stat`: "pid (comm) S ...", the state after the last ')'.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state == 'Z' || state == 'X'),
        // Gone between the two calls.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        // Not readable (e.g. `/proc` mounted with `hidepid`): it exists.
        Err(_) => true,
    }
}

// After `op!`: macros are in scope only below their definition.
mod post;
