//! [`LibfabricDomain`]: one NIC (fabric + domain + RDM endpoint + AV + CQ)
//! as a weft [`Domain`]. No `unsafe` here: every native call goes through
//! [`crate::ffi`].
//!
//! The domain's state is split by what owns it: [`slots`] (what each
//! operation slot is used for), [`peers`], [`post`] (the native operation
//! templates and issuing them), [`backlog`] (work the provider answered
//! EAGAIN for), [`cq`] (completion polling), [`errors`] (libfabric errors
//! to transport errors), [`messages`] (SEND/RECV with receiver ACKs),
//! [`liveness`] (dead peers, the sweep), [`limbo`] (tcp: operations
//! cancelled by a closed connection), [`peer_eps`] (shm: one transmit
//! endpoint per peer) and [`shm`]. Time is an input: each
//! entry point below makes one [`Clock`] and passes it down, so the logic
//! reads no clock of its own.
#![forbid(unsafe_code)]

mod backlog;
mod clock;
mod cq;
mod errors;
mod keys;
mod limbo;
mod liveness;
pub(crate) mod messages;
mod passive;
mod peer_eps;
mod peers;
mod post;
mod shm;
pub use shm::freed_dead_locks as freed_dead_shm_locks;
mod slots;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use weft_transport::{
    Access, Capabilities, Completion, Device, Domain, LocalMr, LocalSlice, MemRegion, MrKey,
    NetAddr, NicInfo, PeerId, PostError, Rkey, TransportError, WrId, WriteWr,
};

use self::backlog::Backlog;
use self::clock::Clock;
use self::cq::Completions;
use self::limbo::Limbo;
use self::liveness::Sweeper;
use self::messages::wire as msg;
use self::messages::Messages;
use self::peer_eps::PeerEps;
use self::peers::Peers;
use self::slots::Slots;
use crate::ffi::{self, CtlBuf, Desc, Info, Lib, Mr, MrWindow, Resources};

/// Options fixed when a domain is opened (derived from the provider config).
#[derive(Debug, Clone)]
pub(crate) struct DomainOptions {
    pub(crate) max_inflight: usize,
    pub(crate) max_recvs: usize,
    pub(crate) max_batch: usize,
    pub(crate) fi_more: bool,
    pub(crate) hmem: bool,
    /// Register CUDA memory `FI_HMEM_DEVICE_ONLY` (shm: CUDA IPC).
    pub(crate) hmem_ipc: bool,
    pub(crate) connect_timeout: Duration,
    /// How long a peer with operations in flight may go without a
    /// completion before it is declared unreachable.
    pub(crate) write_timeout: Duration,
    /// Largest SEND payload (bounce buffers hold this plus a header).
    pub(crate) max_send_len: u64,
    /// How long an incoming message waits for a receive buffer.
    pub(crate) rnr_timeout: Duration,
    /// How long a sent message waits for the receiver's answer.
    pub(crate) ack_timeout: Duration,
    /// Internal bounce buffers posted for incoming messages.
    pub(crate) bounces: usize,
    /// Internal slots for the ACKs this domain sends.
    pub(crate) acks: usize,
    /// Most per-peer endpoints open at once (providers with the
    /// per-endpoint completion-order defect only: `peer_eps`).
    pub(crate) max_peer_endpoints: usize,
    /// Ask for a CQ wait fd (software-progress providers only).
    pub(crate) wait_fd: bool,
    /// Most peers created by incoming messages and not added by the user
    /// (`passive.rs`).
    pub(crate) max_passive_peers: usize,
}

struct MrEntry {
    mr: Mr,
    addr: u64,
    len: u64,
    device: Device,
    /// Registered for remote writes.
    remote: bool,
    /// Where received messages are copied and device SENDs staged from
    /// (host memory, or device memory with a CUDA runtime loaded).
    window: Option<MrWindow>,
}

impl MrEntry {
    /// Offset of address `addr` in the registration (not checked against
    /// its length); `None` below its start.
    fn offset(&self, addr: u64) -> Option<u64> {
        addr.checked_sub(self.addr)
    }
}

/// One NIC driven through libfabric. Created by
/// [`crate::LibfabricProvider`]'s `open`.
///
/// Memory-registration modes are handled per the provider's `mr_mode`:
/// descriptors are always passed (`FI_MR_LOCAL`), remote addresses are
/// `base + offset` with `FI_MR_VIRT_ADDR` and `offset` otherwise, keys come
/// from `fi_mr_key` with `FI_MR_PROV_KEY` and from a per-domain counter
/// otherwise, and with `FI_MR_ENDPOINT` every registration is bound to the
/// endpoint and enabled.
pub struct LibfabricDomain {
    // First field, dropped first: closes the endpoint (cancelling work) and
    // every registration before the memory below is freed.
    res: Resources,
    lib: &'static Lib,
    _info: Arc<Info>,
    nic: NicInfo,
    caps: Capabilities,
    opts: DomainOptions,
    virt_addr: bool,
    prov_key: bool,
    hmem: bool,
    is_shm: bool,
    /// shm: this domain's key table, which its peers check WRITEs against
    /// (`keys.rs`); `None` elsewhere or when it could not be created.
    keys: Option<ffi::KeyTable>,
    /// shm: the doorbell this domain's worker sleeps on (`keys.rs`).
    bell: Option<ffi::Bell>,
    /// shm: the peer [`LibfabricDomain::ring_busy_peer`] looks at next.
    ring_cursor: usize,
    /// shm: the last `try_wait` let the worker sleep on the doorbell.
    asleep: bool,
    /// Remotely writable CUDA registrations per device: while any exist on
    /// a provider that copies with CUDA itself, immediates are reported only
    /// after its copies completed (`ffi::CudaFence`).
    cuda_targets: BTreeMap<u32, usize>,
    /// Every CUDA registration per device: while any exist, the threads
    /// that post and poll get the lowest device's context made current
    /// (`ffi::CudaFence::bind`).
    cuda_mrs: BTreeMap<u32, usize>,
    /// The provider reports socket errnos as `prov_errno` (tcp, shm; not
    /// EFA, whose provider errnos are its own status codes).
    prov_errno_is_errno: bool,
    mrs: BTreeMap<MrKey, MrEntry>,
    next_key: u64,
    peers: Peers,
    /// Peers created by messages from unknown addresses.
    passive: passive::Passive,
    sweeper: Sweeper,
    slots: Slots,
    cq: Completions,
    backlog: Backlog,
    dummy: Box<[u8; 64]>,
    dummy_desc: Desc,
    /// SEND/RECV: header and bounce buffers, queued ACKs, posted receive
    /// buffers, held messages.
    msgs: Messages,
    /// tcp;ofi_rxm tears a connection down when the target rejects a
    /// WRITE (bad key, out of bounds); the operations it cancels with it
    /// wait in `limbo`.
    is_tcp: bool,
    limbo: Limbo,
    /// shm: one transmit endpoint per peer (`peer_eps`).
    peer_eps: PeerEps,
}

impl std::fmt::Debug for LibfabricDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibfabricDomain")
            .field("nic", &self.nic)
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

/// Staging buffers (each `max_send_len`) of a domain opened with hmem: how
/// many SENDs from device memory may be in flight at once (more wait as
/// `QueueFull`).
const STAGING_BUFFERS: u16 = 16;

const LOCAL_ACCESS: u64 = ffi::FI_SEND | ffi::FI_RECV | ffi::FI_WRITE | ffi::FI_READ;

impl LibfabricDomain {
    pub(crate) fn open(
        lib: &'static Lib,
        info: Arc<Info>,
        name: String,
        opts: DomainOptions,
    ) -> Result<LibfabricDomain, TransportError> {
        let mut clock = Clock::system();
        let slots = opts.max_inflight + opts.bounces + opts.acks;
        if info.prov_name == "shm" {
            shm::remove_stale_shm_regions();
        }
        let want_fd = opts.wait_fd && info.data_progress == ffi::FI_PROGRESS_MANUAL;
        let res = Resources::open(lib, &name, &info, slots, want_fd)?;
        let addr = NetAddr(res.getname()?);
        if info.prov_name == "shm" {
            if let Some(region) = shm::region_name(&addr.0) {
                shm::local_opened(&region);
            }
        }
        if addr.0.len() > msg::MAX_ADDR {
            return Err(TransportError::Unsupported {
                nic: name,
                what: format!(
                    "endpoint names of {} bytes (the message header carries at most {})",
                    addr.0.len(),
                    msg::MAX_ADDR
                ),
            });
        }
        if info.tx_iov_limit == 1 {
            return Err(TransportError::Unsupported {
                nic: name,
                what: "a provider whose SENDs take one iov (the message layer needs two)".into(),
            });
        }
        let max_send_len = opts.max_send_len.max(1);
        let bounce_len = (msg::HDR_MAX + usize::try_from(max_send_len).unwrap_or(usize::MAX))
            .next_multiple_of(64);
        // Header areas of the TX slots and of the ACK slots, then bounces,
        // then (with hmem) the staging buffers of SENDs from device memory.
        let bounce_off = (opts.max_inflight + opts.acks) * msg::HDR_MAX;
        let stage_off = bounce_off + opts.bounces * bounce_len;
        let stages = if opts.hmem { STAGING_BUFFERS } else { 0 };
        let stage_len = if stages == 0 {
            0
        } else {
            usize::try_from(max_send_len)
                .unwrap_or(usize::MAX)
                .next_multiple_of(64)
        };
        let ctl_len = stage_off + usize::from(stages) * stage_len;
        let ctl = CtlBuf::new(ctl_len).ok_or_else(|| TransportError::InvalidArgument {
            nic: name.clone(),
            what: format!("cannot allocate {ctl_len} bytes of message buffers"),
        })?;
        let numa_node = info.pci.and_then(|(d, b, dev, f)| {
            std::fs::read_to_string(format!(
                "/sys/bus/pci/devices/{d:04x}:{b:02x}:{dev:02x}.{f:x}/numa_node"
            ))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok())
        });
        let nic = NicInfo {
            name: name.clone(),
            addr,
            numa_node,
            link_gbps: info.link_bps.map(|b| b as f64 / 1e9),
        };
        let max_msg = u64::try_from(info.max_msg_size).unwrap_or(u64::MAX);
        let max_msg = if max_msg == 0 { 1 << 30 } else { max_msg };
        let caps = Capabilities {
            max_write_len: max_msg,
            max_send_len: max_send_len.min(max_msg.saturating_sub(msg::HDR_MAX as u64).max(1)),
            max_inflight: opts.max_inflight,
            max_recvs: opts.max_recvs,
            max_batch: opts.max_batch,
            ordered: false,
            device_memory: opts.hmem && info.caps & ffi::FI_HMEM != 0,
            software_progress: info.data_progress == ffi::FI_PROGRESS_MANUAL,
        };
        let mr_mode = info.mr_mode;
        let basic = mr_mode & ffi::FI_MR_BASIC != 0;
        let virt_addr = basic || mr_mode & ffi::FI_MR_VIRT_ADDR != 0;
        let prov_key = basic || mr_mode & ffi::FI_MR_PROV_KEY != 0;
        tracing::info!(
            nic = %name,
            provider = %info.prov_name,
            fabric = %info.fabric_name,
            mr_mode = format_args!("{mr_mode:#x}"),
            mode = format_args!("{:#x}", info.mode),
            mr_key_size = info.mr_key_size,
            virt_addr,
            prov_key,
            delivery_complete = info.tx_op_flags & ffi::FI_DELIVERY_COMPLETE != 0,
            addr = %nic.addr,
            "libfabric domain open"
        );
        let info_prov = info.prov_name.clone();
        let keys = if info.prov_name == "shm" {
            shm::region_name(&nic.addr.0).and_then(|region| match ffi::KeyTable::create(&region) {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!(region, error = %e, "no shm key table: peers cannot refuse stale keys early");
                    None
                }
            })
        } else {
            None
        };
        let bell = match (&keys, shm::region_name(&nic.addr.0)) {
            (Some(_), Some(region)) => ffi::Bell::create(&region)
                .map_err(|e| {
                    tracing::warn!(region, error = %e, "no shm doorbell: an idle engine keeps polling")
                })
                .ok(),
            _ => None,
        };
        let mut d = LibfabricDomain {
            keys,
            bell,
            ring_cursor: 0,
            asleep: false,
            cuda_targets: BTreeMap::new(),
            cuda_mrs: BTreeMap::new(),
            lib,
            hmem: caps.device_memory,
            is_shm: info.prov_name == "shm",
            is_tcp: info.prov_name.contains("tcp"),
            prov_errno_is_errno: !info.prov_name.starts_with("efa"),
            _info: info,
            nic,
            caps,
            virt_addr,
            prov_key,
            mrs: BTreeMap::new(),
            next_key: 1,
            peers: Peers::default(),
            passive: passive::Passive::default(),
            sweeper: Sweeper::new(clock.now()),
            slots: Slots::new(opts.max_inflight, opts.bounces, opts.acks, stages),
            msgs: Messages {
                ctl,
                ctl_desc: Desc::null(),
                bounce_off,
                bounce_len,
                stage_off,
                stage_len,
                acks_out: VecDeque::new(),
                user_recvs: VecDeque::new(),
                held: VecDeque::new(),
                send_gen: 0,
                dropped: Default::default(),
            },
            limbo: Limbo::new(opts.max_inflight),
            peer_eps: PeerEps::new(
                peer_eps::needs_peer_endpoints(&info_prov),
                opts.max_peer_endpoints,
                slots,
            ),
            opts,
            cq: Completions {
                stash: Vec::new(),
                stashed_tx: 0,
                scratch: Vec::with_capacity(64),
            },
            backlog: Backlog::default(),
            dummy: Box::new([0u8; 64]),
            dummy_desc: Desc::null(),
            res,
        };
        // A small registered buffer: the valid source descriptor of
        // zero-length (immediate-only) WRITEs, which EFA requires.
        let dummy_addr = d.dummy.as_ptr() as usize as u64;
        let key = d.alloc_key();
        let mr = d
            .res
            .mr_reg(dummy_addr, d.dummy.len(), LOCAL_ACCESS, key, None, false)?;
        d.dummy_desc = mr.desc;
        let key = d.alloc_key();
        let mr = d.res.mr_reg(
            d.msgs.ctl.addr(),
            d.msgs.ctl.len(),
            LOCAL_ACCESS,
            key,
            None,
            false,
        )?;
        d.msgs.ctl_desc = mr.desc;
        for j in 0..d.opts.bounces {
            d.post_bounce(j, &mut clock)?;
        }
        Ok(d)
    }

    /// A failed registration of device memory: a provider that advertises
    /// FI_HMEM but was built without CUDA support (Debian's and Ubuntu's
    /// libfabric: "Cannot register memory for uninitialized iface",
    /// `-FI_ENOSYS`) is `Unsupported`, and the data-path report says so from
    /// then on; any other error stays as it is.
    fn hmem_refused(&mut self, cuda: Option<u32>, e: TransportError) -> TransportError {
        let enosys = matches!(&e, TransportError::Provider { code, .. }
            if *code == -i64::from(libc::ENOSYS) || *code == i64::from(libc::ENOSYS));
        match cuda {
            Some(i) if enosys => {
                self.hmem = false;
                self.caps.device_memory = false;
                TransportError::Unsupported {
                    nic: self.nic_name(),
                    what: format!(
                        "registering cuda:{i} memory: provider {} advertises FI_HMEM but this \
                         libfabric has no CUDA support (fi_mr_regattr: ENOSYS; build libfabric \
                         --with-cuda)",
                        self._info.prov_name
                    ),
                }
            }
            _ => e,
        }
    }

    /// Before immediates (or receives) in `new` are reported: on a
    /// provider that moves GPU memory with `cudaMemcpy` itself (shm, tcp),
    /// waits for those copies on every device with remotely writable CUDA
    /// registrations, so a WRITE's bytes are in place when its immediate is
    /// seen. EFA and verbs NICs write GPU memory themselves: nothing to do.
    fn fence_cuda_copies(&mut self, new: &[Completion]) {
        let copies_itself = self.is_shm || self.is_tcp;
        if !copies_itself
            || !new
                .iter()
                .any(|c| matches!(c, Completion::Imm { .. } | Completion::Recv { .. }))
        {
            return;
        }
        let Some(fence) = ffi::CudaFence::get() else {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(nic = %self.nic.name, "no CUDA runtime loaded: immediates of CUDA WRITEs may be reported before their bytes land")
            });
            return;
        };
        for &d in self.cuda_targets.keys() {
            if let Err(code) = fence.wait(d) {
                tracing::warn!(nic = %self.nic.name, device = d, code, "cudaStreamSynchronize before reporting immediates failed");
            }
        }
    }

    /// With CUDA registrations: makes the lowest such device's context
    /// current on this thread before libfabric is called (once per thread).
    fn bind_cuda(&self) {
        let Some(&dev) = self.cuda_mrs.keys().next() else {
            return;
        };
        let Some(fence) = ffi::CudaFence::get() else {
            return;
        };
        if let Err(code) = fence.bind(dev) {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(nic = %self.nic.name, device = dev, code, "cudaSetDevice failed: libfabric's CUDA calls on this thread have no context")
            });
        }
    }

    /// The next requested key for a registration (never 0).
    fn alloc_key(&mut self) -> u64 {
        let k = self.next_key;
        self.next_key = self.next_key.wrapping_add(1).max(1);
        k
    }

    /// This NIC's name, for errors.
    pub(super) fn nic_name(&self) -> String {
        self.nic.name.clone()
    }

    /// An `InvalidArgument` error of this NIC.
    pub(super) fn invalid(&self, what: impl Into<String>) -> TransportError {
        TransportError::InvalidArgument {
            nic: self.nic_name(),
            what: what.into(),
        }
    }

    /// Checks that `s` lies in a registration of this domain and returns its
    /// descriptor.
    pub(super) fn local(&self, s: &LocalSlice, what: &str) -> Result<Desc, TransportError> {
        let e = self
            .mrs
            .get(&s.mr)
            .ok_or_else(|| TransportError::LocalAccess {
                nic: self.nic_name(),
                what: format!("{what}: unknown or deregistered local key {}", s.mr.0),
            })?;
        let inside = e
            .offset(s.addr)
            .and_then(|off| off.checked_add(s.len))
            .is_some_and(|end| end <= e.len);
        if !inside {
            return Err(TransportError::LocalAccess {
                nic: self.nic_name(),
                what: format!(
                    "{what}: [{:#x}, +{}) outside registration {} [{:#x}, +{})",
                    s.addr, s.len, s.mr.0, e.addr, e.len
                ),
            });
        }
        if let Device::Cuda(_) = e.device {
            if !self.hmem {
                return Err(TransportError::LocalAccess {
                    nic: self.nic_name(),
                    what: format!("{what}: CUDA memory without FI_HMEM"),
                });
            }
        }
        Ok(e.mr.desc)
    }
}

impl Domain for LibfabricDomain {
    fn info(&self) -> &NicInfo {
        &self.nic
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn data_path(&self) -> weft_transport::DataPath {
        use weft_transport::{DeviceMemoryPath, DirectKind};
        let prov = &self._info.prov_name;
        // EFA and verbs-based providers hand FI_HMEM memory to the NIC;
        // tcp and shm copy it through host memory themselves.
        let dm = if !self.caps.device_memory {
            DeviceMemoryPath::Unsupported
        } else if prov.starts_with("efa") || prov.contains("verbs") {
            DeviceMemoryPath::Direct(DirectKind::FiHmem)
        } else {
            DeviceMemoryPath::Staged {
                how: format!("FI_HMEM copies of provider {prov}"),
            }
        };
        weft_transport::DataPath::from_capabilities(
            &format!("libfabric:{prov}"),
            &self._info.fabric_name,
            &self.caps,
        )
        .with_device_memory(dm)
    }

    fn register(&mut self, region: &MemRegion, access: Access) -> Result<LocalMr, TransportError> {
        let cuda = match region.device() {
            Device::Host => None,
            Device::Cuda(i) if self.hmem => Some(i),
            Device::Cuda(i) => {
                return Err(TransportError::Unsupported {
                    nic: self.nic_name(),
                    what: format!(
                        "registering cuda:{i} memory: provider lacks FI_HMEM or the domain \
                         was not opened with hmem enabled"
                    ),
                })
            }
        };
        let flags = match access {
            Access::LocalOnly => LOCAL_ACCESS,
            Access::RemoteWrite => LOCAL_ACCESS | ffi::FI_REMOTE_WRITE | ffi::FI_REMOTE_READ,
        };
        let requested = self.alloc_key();
        let mr = self
            .res
            .mr_reg(
                region.addr(),
                region.len(),
                flags,
                requested,
                cuda,
                self.opts.hmem_ipc,
            )
            .map_err(|e| self.hmem_refused(cuda, e))?;
        let rkey = if self.prov_key { mr.key } else { requested };
        if let Some(dev) = cuda {
            *self.cuda_mrs.entry(dev).or_default() += 1;
        }
        if access == Access::RemoteWrite {
            self.publish_key(rkey, region.addr(), region.len() as u64);
            if let Some(dev) = cuda {
                *self.cuda_targets.entry(dev).or_default() += 1;
            }
        }
        let key = MrKey(requested);
        let local = LocalMr {
            key,
            rkey: Rkey(rkey),
            addr: region.addr(),
            len: region.len() as u64,
            device: region.device(),
        };
        self.mrs.insert(
            key,
            MrEntry {
                mr,
                addr: local.addr,
                len: local.len,
                device: local.device,
                remote: access == Access::RemoteWrite,
                window: MrWindow::of(region),
            },
        );
        Ok(local)
    }

    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError> {
        let e = self
            .mrs
            .remove(&mr)
            .ok_or_else(|| self.invalid(format!("deregister: unknown local key {}", mr.0)))?;
        // Peers stop using the key before the provider forgets it.
        self.withdraw_key(if self.prov_key { e.mr.key } else { mr.0 });
        if let Device::Cuda(dev) = e.device {
            uncount(&mut self.cuda_mrs, dev);
            if e.remote {
                uncount(&mut self.cuda_targets, dev);
            }
        }
        self.res.mr_close(e.mr)
    }

    fn add_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        let pid = self.insert_peer(addr)?;
        // The user knows this id now: never removed to make room.
        self.passive.list.remove(pid);
        Ok(pid)
    }

    fn remove_peer(&mut self, peer: PeerId) -> Result<(), TransportError> {
        self.remove(peer);
        Ok(())
    }

    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError> {
        self.bind_cuda();
        self.send(wr, peer, src, &mut Clock::system())
    }

    /// Queues `buf` for the next incoming message. The message layer copies
    /// messages into it, so it must be host memory (CUDA buffers are
    /// rejected with `Unsupported`).
    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        self.recv(wr, buf)
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        self.bind_cuda();
        self.writes(wrs, &mut Clock::system())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        let clock = &mut Clock::system();
        let before = out.len();
        self.bind_cuda();
        self.wake_from_bell();
        out.append(&mut self.cq.stash);
        self.cq.stashed_tx = 0;
        // Completions first: they drive the software providers' progress
        // and free the resources (slots, shm inject buffers) the backlog
        // waits for.
        self.drain_cq(out, clock)?;
        if !self.peers.removing.is_empty() {
            self.settle_removed(out);
        }
        if !self.limbo.entries.is_empty() {
            self.settle_limbo(out, clock);
        }
        if !self.msgs.held.is_empty() {
            self.expire_held(clock);
        }
        if !self.msgs.acks_out.is_empty() {
            self.flush_acks(clock);
        }
        if !self.backlog.queue.is_empty() {
            self.flush_backlog(out, clock);
        }
        self.sweep(out, clock);
        if self.peer_eps.enabled && self.peer_eps.check {
            self.close_peer_eps(out, clock);
        }
        self.ring_busy_peer();
        if !self.cuda_targets.is_empty() {
            self.fence_cuda_copies(&out[before..]);
        }
        Ok(out.len() - before)
    }

    /// The CQ's `FI_WAIT_FD` (software-progress providers, with
    /// [`crate::LibfabricConfig::wait_fd`]): readable when the provider has
    /// something to progress, including what peers send into this host.
    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        self.res
            .wait_fd()
            .or_else(|| self.bell.as_ref().map(|b| b.fd()))
    }

    /// `true` only when this domain has nothing of its own pending (no
    /// stashed completions, no operation or ACK in flight, no backlog,
    /// held message, cancelled operation, removal or endpoint to close:
    /// all of them need polls, some on timers) and `fi_trywait` agrees, or
    /// on shm (no wait object) once its peers will ring its doorbell.
    fn try_wait(&mut self) -> bool {
        let idle = self.cq.stash.is_empty()
            && self.slots.idle()
            && self.backlog.queue.is_empty()
            && self.msgs.held.is_empty()
            && self.msgs.acks_out.is_empty()
            && self.limbo.entries.is_empty()
            && self.peers.removing.is_empty()
            && !(self.peer_eps.enabled && self.peer_eps.check);
        if self.res.wait_fd().is_none() {
            // shm: no wait object of the provider's; the doorbell.
            return self.shm_try_wait(idle);
        }
        idle && self.res.trywait()
    }
}

impl Drop for LibfabricDomain {
    /// Stops watching the regions of the shm peers still held, and tells
    /// same-process peers that this endpoint is closing (before its region
    /// goes with `res`).
    fn drop(&mut self) {
        if self.is_shm {
            if let Some(region) = shm::region_name(&self.nic.addr.0) {
                shm::local_closed(&region);
            }
        }
        for p in self.peers.table.iter_mut().filter(|p| p.watched) {
            p.watched = false;
            if let Some(name) = shm::region_name(&p.addr.0) {
                shm::unwatch_region(&name);
            }
        }
    }
}

/// One registration of `dev` fewer in a per-device count.
fn uncount(map: &mut BTreeMap<u32, usize>, dev: u32) {
    if let Some(n) = map.get_mut(&dev) {
        *n -= 1;
        if *n == 0 {
            map.remove(&dev);
        }
    }
}
