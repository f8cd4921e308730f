//! [`LibfabricDomain`]: one NIC (fabric + domain + RDM endpoint + AV + CQ)
//! as a weft [`Domain`]. No `unsafe` here: every native call goes through
//! [`crate::ffi`].
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft_transport::{
    Access, Capabilities, Completion, Device, Domain, LocalMr, LocalSlice, MemRegion, MrKey,
    NetAddr, NicInfo, PeerId, PostError, RemoteAccessReason, Rkey, TransportError, WrId, WriteWr,
};

use crate::ffi::{
    self, CqEntry, CqError, CqRead, CtlBuf, Desc, HostWindow, Info, Lib, Mr, Resources,
};
use crate::msg::{self, AckStatus, Header};

/// Options fixed when a domain is opened (derived from the provider config).
#[derive(Debug, Clone)]
pub(crate) struct DomainOptions {
    pub(crate) max_inflight: usize,
    pub(crate) max_recvs: usize,
    pub(crate) max_batch: usize,
    pub(crate) fi_more: bool,
    pub(crate) hmem: bool,
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
}

/// tcp: how long an operation cancelled by a broken connection waits to
/// learn whether an earlier operation's rejection broke it.
const LIMBO_WAIT: Duration = Duration::from_millis(200);
/// tcp: the pause before such an operation is issued again.
const LIMBO_RETRY: Duration = Duration::from_millis(1);

/// How often `poll` sweeps its peers: `shm` peer processes that exited,
/// peers stalled past `write_timeout`, SENDs whose answer is overdue.
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);
/// `poll` calls between two reads of the clock for [`SWEEP_INTERVAL`].
const SWEEP_CLOCK_EVERY: u32 = 16;

#[derive(Debug, Clone, Copy)]
enum SlotUse {
    Free,
    Write {
        wr: WrId,
        peer: PeerId,
        rkey: u64,
        raddr: u64,
        len: u64,
    },
    /// A SEND: done when the provider has completed it (`sent`) and the
    /// receiver has answered (`ack`), in either order.
    Send {
        wr: WrId,
        peer: PeerId,
        len: u64,
        /// Sequence number in the header (slot index | generation << 32).
        seq: u64,
        /// When the provider completed it.
        sent: Option<Instant>,
        /// The receiver's answer.
        ack: Option<AckStatus>,
    },
    /// Internal bounce buffer `j`, posted as a receive.
    Bounce {
        j: usize,
    },
    /// An ACK to `peer`, in flight.
    Ack {
        peer: PeerId,
    },
    /// Reported failed (dead peer) but not yet returned by the provider:
    /// the slot is reused only once libfabric hands its context back.
    Zombie,
}

struct Peer {
    addr: NetAddr,
    fi_addr: u64,
    /// Why the peer is considered unreachable; posts to it then fail at once.
    dead: Option<String>,
    /// Our operations to it not yet completed.
    inflight: usize,
    /// Since when posts to it (with nothing in flight) keep failing with
    /// EAGAIN: the provider is still trying to connect.
    eagain_since: Option<Instant>,
    /// Process id of an `shm` peer, for liveness checks.
    pid: Option<i32>,
    /// Its entries in the EAGAIN backlog: while there are any, new work to
    /// the peer joins the backlog behind them without a futile attempt.
    backlogged: usize,
    /// Operations issued to it so far (the issue number of the latest).
    issued: u64,
    /// tcp: issue number of the latest operation the peer rejected by
    /// closing the connection (a remote access violation).
    rejected: Option<u64>,
    /// Operations to it resolved so far (wrapping): its liveness signal.
    done: u64,
    /// `done` at the previous sweep.
    done_seen: u64,
    /// Since which sweep it has had work in flight and nothing resolved.
    stalled_since: Option<Instant>,
}

/// tcp: an operation that failed because the connection broke, waiting to
/// learn whether the break was a rejection of an earlier operation (then it
/// never reached the target and is issued again) or the peer's death.
#[derive(Debug)]
struct Limbo {
    i: usize,
    peer: PeerId,
    /// Issue number of the attempt that failed.
    issue_no: u64,
    /// The error it failed with.
    error: TransportError,
    /// Not re-issued before (lets tcp;ofi_rxm notice the broken connection).
    not_before: Instant,
    /// Failed for the peer's death if no rejection is seen by then.
    until: Instant,
}

/// Work the provider answered EAGAIN for: reserved slot `i`, never issued.
#[derive(Debug, Clone, Copy)]
struct Parked {
    i: usize,
    native: Native,
    /// Target peer (`None` for receives); kept here because `sweep` may
    /// turn the slot into a zombie while the entry is still queued.
    peer: Option<PeerId>,
}

/// What to hand to libfabric for one reserved slot.
#[derive(Debug, Clone, Copy)]
enum Native {
    Write {
        src: u64,
        len: usize,
        desc: Desc,
        dest: u64,
        raddr: u64,
        key: u64,
        data: Option<u64>,
    },
    /// A message: our header, then (unless empty) the payload.
    Send {
        hdr: (u64, usize, Desc),
        payload: Option<(u64, usize, Desc)>,
        dest: u64,
    },
    Recv {
        addr: u64,
        len: usize,
        desc: Desc,
    },
}

/// A receive buffer posted by the user: filled by the message layer.
#[derive(Debug, Clone, Copy)]
struct UserRecv {
    wr: WrId,
    mr: MrKey,
    addr: u64,
    len: u64,
}

/// An incoming message that found no receive buffer posted, waiting for one
/// until `since + rnr_timeout`.
#[derive(Debug)]
struct Held {
    from: PeerId,
    seq: u64,
    payload: Vec<u8>,
    since: Instant,
}

struct MrEntry {
    mr: Mr,
    addr: u64,
    len: u64,
    device: Device,
    /// Where received messages are copied (host memory only).
    window: Option<HostWindow>,
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
    /// The provider reports socket errnos as `prov_errno` (tcp, shm; not
    /// EFA, whose provider errnos are its own status codes).
    prov_errno_is_errno: bool,
    mrs: BTreeMap<MrKey, MrEntry>,
    next_key: u64,
    peers: BTreeMap<NetAddr, PeerId>,
    peer_table: Vec<Peer>,
    last_sweep: Instant,
    /// `poll` calls since the clock was last read for a sweep.
    polls_unswept: u32,
    slots: Vec<SlotUse>,
    free_tx: Vec<usize>,
    stash: Vec<Completion>,
    /// SEND/WRITE completions in `stash`: their slots are free again but
    /// they still count as outstanding until `poll` returns them.
    stashed_tx: usize,
    /// Accepted work the provider answered EAGAIN for (e.g. while
    /// tcp;ofi_rxm connects to a new peer, or while shm's inject pool is
    /// full): slots reserved, re-issued by `poll` in order (per peer), failed
    /// if the peer turns out unreachable.
    backlog: VecDeque<Parked>,
    /// Receives in `backlog`.
    backlogged_recvs: usize,
    /// Scratch for `flush_backlog`: peers that answered EAGAIN in this pass.
    blocked: Vec<PeerId>,
    cq_scratch: Vec<CqEntry>,
    dummy: Box<[u8; 64]>,
    dummy_desc: Desc,
    /// SEND headers (one `HDR_MAX` area per TX and ACK slot), then the
    /// bounce buffers; registered, freed after `res` is closed.
    ctl: CtlBuf,
    ctl_desc: Desc,
    /// Start of the bounce buffers in `ctl`, and the size of each.
    bounce_off: usize,
    bounce_len: usize,
    /// First ACK slot (bounce slots lie between `max_inflight` and it).
    ack_base: usize,
    free_ack: Vec<usize>,
    /// ACKs waiting for a free ACK slot.
    acks_out: VecDeque<(PeerId, u64, AckStatus)>,
    /// Posted user receive buffers, filled in order.
    user_recvs: VecDeque<UserRecv>,
    /// Messages waiting for a receive buffer.
    held: VecDeque<Held>,
    /// Generation of SEND sequence numbers (stale ACKs never match).
    send_gen: u32,
    /// tcp;ofi_rxm tears a connection down when the target rejects a
    /// WRITE (bad key, out of bounds); the operations it cancels with it
    /// wait in `limbo`.
    is_tcp: bool,
    /// Per TX slot: what was handed to libfabric (re-issued from limbo).
    natives: Vec<Option<Native>>,
    /// Per TX slot: the peer's issue number of its latest attempt.
    issue_no: Vec<u64>,
    /// Per TX slot: when it first failed with a broken connection.
    first_fail: Vec<Option<Instant>>,
    limbo: Vec<Limbo>,
}

impl std::fmt::Debug for LibfabricDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibfabricDomain")
            .field("nic", &self.nic)
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

const LOCAL_ACCESS: u64 = ffi::FI_SEND | ffi::FI_RECV | ffi::FI_WRITE | ffi::FI_READ;

impl LibfabricDomain {
    pub(crate) fn open(
        lib: &'static Lib,
        info: Arc<Info>,
        name: String,
        opts: DomainOptions,
    ) -> Result<LibfabricDomain, TransportError> {
        let ack_base = opts.max_inflight + opts.bounces;
        let slots = ack_base + opts.acks;
        if info.prov_name == "shm" {
            remove_stale_shm_regions();
        }
        let res = Resources::open(lib, &name, &info, slots)?;
        let addr = NetAddr(res.getname()?);
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
        // Header areas of the TX slots and of the ACK slots, then bounces.
        let bounce_off = (opts.max_inflight + opts.acks) * msg::HDR_MAX;
        let ctl_len = bounce_off + opts.bounces * bounce_len;
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
        let mut d = LibfabricDomain {
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
            peers: BTreeMap::new(),
            peer_table: Vec::new(),
            last_sweep: Instant::now(),
            polls_unswept: 0,
            slots: vec![SlotUse::Free; slots],
            free_tx: (0..opts.max_inflight).rev().collect(),
            free_ack: (ack_base..slots).rev().collect(),
            ctl,
            ctl_desc: Desc::null(),
            bounce_off,
            bounce_len,
            ack_base,
            acks_out: VecDeque::new(),
            user_recvs: VecDeque::new(),
            held: VecDeque::new(),
            send_gen: 0,
            natives: vec![None; opts.max_inflight],
            issue_no: vec![0; opts.max_inflight],
            first_fail: vec![None; opts.max_inflight],
            limbo: Vec::new(),
            opts,
            stash: Vec::new(),
            stashed_tx: 0,
            backlog: VecDeque::new(),
            backlogged_recvs: 0,
            blocked: Vec::new(),
            cq_scratch: Vec::with_capacity(64),
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
            .mr_reg(dummy_addr, d.dummy.len(), LOCAL_ACCESS, key, None)?;
        d.dummy_desc = mr.desc;
        let key = d.alloc_key();
        let mr = d
            .res
            .mr_reg(d.ctl.addr(), d.ctl.len(), LOCAL_ACCESS, key, None)?;
        d.ctl_desc = mr.desc;
        for j in 0..d.opts.bounces {
            d.post_bounce(j)?;
        }
        Ok(d)
    }

    /// Posts bounce buffer `j` (slot `max_inflight + j`) as a receive.
    fn post_bounce(&mut self, j: usize) -> Result<(), TransportError> {
        let i = self.opts.max_inflight + j;
        let native = Native::Recv {
            addr: self.ctl.addr() + (self.bounce_off + j * self.bounce_len) as u64,
            len: self.bounce_len,
            desc: self.ctl_desc,
        };
        self.submit(i, SlotUse::Bounce { j }, native, false)
    }

    fn alloc_key(&mut self) -> u64 {
        let k = self.next_key;
        self.next_key = self.next_key.wrapping_add(1).max(1);
        k
    }

    fn nic_name(&self) -> String {
        self.nic.name.clone()
    }

    fn invalid(&self, what: impl Into<String>) -> TransportError {
        TransportError::InvalidArgument {
            nic: self.nic_name(),
            what: what.into(),
        }
    }

    fn peer(&self, peer: PeerId) -> Result<&Peer, TransportError> {
        usize::try_from(peer.0)
            .ok()
            .and_then(|i| self.peer_table.get(i))
            .ok_or_else(|| self.invalid(format!("unknown peer handle {}", peer.0)))
    }

    fn peer_addr(&self, peer: PeerId) -> NetAddr {
        self.peer(peer)
            .map(|p| p.addr.clone())
            .unwrap_or_else(|_| NetAddr(Vec::new()))
    }

    /// Checks that `s` lies in a registration of this domain and returns its
    /// descriptor.
    fn local(&self, s: &LocalSlice, what: &str) -> Result<Desc, TransportError> {
        let e = self
            .mrs
            .get(&s.mr)
            .ok_or_else(|| TransportError::LocalAccess {
                nic: self.nic_name(),
                what: format!("{what}: unknown or deregistered local key {}", s.mr.0),
            })?;
        let inside = s
            .addr
            .checked_sub(e.addr)
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

    /// Maps a failed operation to a typed error. `prov_errno` is the CQ
    /// error entry's provider errno (0 for post-time errors).
    fn op_error(
        &self,
        slot: SlotUse,
        err: i64,
        prov_errno: i64,
        message: String,
        olen: usize,
    ) -> TransportError {
        let nic = self.nic_name();
        let errno = err.unsigned_abs() as i32;
        let (peer, op): (Option<PeerId>, &'static str) = match slot {
            SlotUse::Write { peer, .. } => (Some(peer), "fi_writemsg"),
            SlotUse::Send { peer, .. } => (Some(peer), "fi_send"),
            SlotUse::Ack { peer } => (Some(peer), "fi_send"),
            SlotUse::Bounce { .. } => (None, "fi_recv"),
            SlotUse::Free | SlotUse::Zombie => (None, "completion"),
        };
        let peer_addr = peer.map(|p| self.peer_addr(p));
        // We never cancel operations ourselves (closing the domain drops
        // them unreported). tcp;ofi_rxm cancels (ECANCELED) the operations
        // of a connection that broke: the one the target rejected (bad key
        // or out of bounds: provider errno ENOENT or another access errno)
        // is a remote access error; the others carry the socket error
        // (ENOTCONN, EPIPE, ECONNRESET, or none): the peer is gone (e.g.
        // its process was killed mid-transfer) or the pair is unusable.
        let prov = i32::try_from(prov_errno.unsigned_abs()).unwrap_or(0);
        let rejected = !self.prov_errno_is_errno || prov == libc::ENOENT || is_remote_access(prov);
        let canceled = errno == libc::ECANCELED && peer.is_some();
        if is_unreachable(errno) || (canceled && !rejected) {
            if let Some(peer) = peer_addr {
                return TransportError::PeerUnreachable {
                    nic,
                    peer,
                    reason: message,
                };
            }
        }
        let canceled_write = errno == libc::ECANCELED && matches!(slot, SlotUse::Write { .. });
        if errno == libc::ECANCELED && !canceled_write {
            return TransportError::Canceled { nic };
        }
        match slot {
            SlotUse::Write {
                rkey, raddr, len, ..
            } if canceled_write || is_remote_access(errno) => TransportError::RemoteAccess {
                nic,
                peer: peer_addr.unwrap_or(NetAddr(Vec::new())),
                rkey,
                addr: raddr,
                len,
                reason: if errno == libc::EKEYREJECTED || errno == libc::ENOKEY {
                    RemoteAccessReason::UnknownKey
                } else if errno == libc::ERANGE || errno == libc::EFAULT {
                    RemoteAccessReason::OutOfBounds
                } else {
                    // tcp/shm report every key or bounds violation as
                    // EINVAL/EACCES: the cause is not distinguishable.
                    RemoteAccessReason::UnknownKey
                },
            },
            SlotUse::Send { len, .. } if i64::from(errno) == ffi::FI_ETRUNC => {
                TransportError::MessageTooLong {
                    nic,
                    peer: peer_addr.unwrap_or(NetAddr(Vec::new())),
                    len,
                    capacity: len.saturating_sub(olen as u64),
                }
            }
            _ => TransportError::Provider {
                nic,
                op,
                code: -i64::from(errno),
                message,
            },
        }
    }

    fn post_error(&self, slot: SlotUse, rc: i64) -> TransportError {
        self.op_error(slot, rc, 0, self.lib.strerror(rc), 0)
    }

    fn release(&mut self, i: usize) -> SlotUse {
        let Some(s) = self.slots.get_mut(i) else {
            return SlotUse::Free;
        };
        let used = std::mem::replace(s, SlotUse::Free);
        match used {
            SlotUse::Free | SlotUse::Bounce { .. } => {}
            SlotUse::Write { peer, .. } | SlotUse::Send { peer, .. } | SlotUse::Ack { peer } => {
                self.free_slot(i);
                if let Some(p) = self.peer_table.get_mut(peer.0 as usize) {
                    p.inflight = p.inflight.saturating_sub(1);
                    p.done = p.done.wrapping_add(1);
                }
            }
            SlotUse::Zombie => self.free_slot(i),
        }
        used
    }

    /// Puts TX or ACK slot `i` back on its free list (bounce slots have none:
    /// they are re-posted).
    fn free_slot(&mut self, i: usize) {
        if i < self.opts.max_inflight {
            self.free_tx.push(i);
        } else if i >= self.ack_base {
            self.free_ack.push(i);
        }
    }

    /// Offset in `ctl` of the header area of TX or ACK slot `i`.
    fn hdr_off(&self, i: usize) -> usize {
        let k = if i >= self.ack_base {
            self.opts.max_inflight + (i - self.ack_base)
        } else {
            i
        };
        k * msg::HDR_MAX
    }

    /// The result a SEND reports for the receiver's answer.
    fn ack_result(&self, peer: PeerId, len: u64, a: AckStatus) -> Result<(), TransportError> {
        let nic = self.nic_name();
        match a {
            AckStatus::Delivered => Ok(()),
            AckStatus::NotReady => Err(TransportError::ReceiverNotReady {
                nic,
                peer: self.peer_addr(peer),
            }),
            AckStatus::TooLong { capacity } => Err(TransportError::MessageTooLong {
                nic,
                peer: self.peer_addr(peer),
                len,
                capacity,
            }),
        }
    }

    fn complete(
        &mut self,
        slot: SlotUse,
        result: Result<u64, TransportError>,
        out: &mut Vec<Completion>,
    ) {
        match slot {
            SlotUse::Write { wr, .. } => out.push(Completion::Write {
                wr,
                result: result.map(|_| ()),
            }),
            SlotUse::Send { wr, .. } => out.push(Completion::Send {
                wr,
                result: result.map(|_| ()),
            }),
            SlotUse::Free | SlotUse::Zombie | SlotUse::Bounce { .. } | SlotUse::Ack { .. } => {}
        }
    }

    /// Drains the CQ (bounded) into `out`.
    fn drain_cq(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        let before = out.len();
        for _ in 0..8 {
            let mut scratch = std::mem::take(&mut self.cq_scratch);
            scratch.clear();
            let r = self.res.cq_read(&mut scratch, 64);
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    self.cq_scratch = scratch;
                    return Err(e);
                }
            };
            for e in &scratch {
                self.on_entry(*e, out);
            }
            self.cq_scratch = scratch;
            match r {
                CqRead::Entries(n) if n >= 64 => continue,
                CqRead::Entries(_) | CqRead::Empty => break,
                CqRead::ErrorAvailable => {
                    // Bounded: at most a batch of error entries per round.
                    for _ in 0..64 {
                        match self.res.cq_readerr()? {
                            Some(err) => self.on_error(err, out),
                            None => break,
                        }
                    }
                }
            }
        }
        Ok(out.len() - before)
    }

    fn on_entry(&mut self, e: CqEntry, out: &mut Vec<Completion>) {
        tracing::trace!(nic = %self.nic.name, flags = format_args!("{:#x}", e.flags), slot = ?e.slot, len = e.len, data = e.data, "cq entry");
        if ffi::is_remote_write(e.flags) {
            // The peer's immediate: remote CQ data, 32 bits on the wire.
            match u32::try_from(e.data) {
                Ok(imm) => out.push(Completion::Imm { imm }),
                Err(_) => {
                    tracing::warn!(nic = %self.nic.name, data = e.data, "remote CQ data wider than 32 bits ignored")
                }
            }
            return;
        }
        let Some(i) = e.slot else {
            tracing::debug!(nic = %self.nic.name, flags = format_args!("{:#x}", e.flags), "CQ entry without our context ignored");
            return;
        };
        match self.slots.get(i).copied().unwrap_or(SlotUse::Free) {
            SlotUse::Bounce { j } => {
                self.on_message(j, e.len, out);
                self.repost_bounce(j);
                return;
            }
            SlotUse::Send {
                peer,
                len,
                sent: None,
                ack,
                ..
            } => {
                match ack {
                    Some(a) => {
                        let r = self.ack_result(peer, len, a);
                        let used = self.release(i);
                        self.complete(used, r.map(|_| 0), out);
                    }
                    // Sent; done when the receiver answers.
                    None => {
                        if let Some(SlotUse::Send { sent, .. }) = self.slots.get_mut(i) {
                            *sent = Some(Instant::now());
                        }
                        if let Some(p) = self.peer_table.get_mut(peer.0 as usize) {
                            p.done = p.done.wrapping_add(1);
                        }
                    }
                }
                return;
            }
            _ => {}
        }
        let used = self.release(i);
        match used {
            SlotUse::Free => {
                tracing::warn!(nic = %self.nic.name, slot = i, "completion for a free slot ignored");
            }
            SlotUse::Zombie => {
                tracing::debug!(nic = %self.nic.name, slot = i, "completion of an operation already failed (slot freed)");
            }
            SlotUse::Ack { .. } => {}
            _ => self.complete(used, Ok(0), out),
        }
    }

    /// Re-posts bounce buffer `j` after its message was handled.
    fn repost_bounce(&mut self, j: usize) {
        if let Err(e) = self.post_bounce(j) {
            tracing::warn!(nic = %self.nic.name, bounce = j, error = %e, "bounce buffer lost: re-posting failed");
        }
    }

    /// A message of `len` bytes arrived in bounce buffer `j`.
    fn on_message(&mut self, j: usize, len: usize, out: &mut Vec<Completion>) {
        let off = self.bounce_off + j * self.bounce_len;
        let Some(mut bytes) = self.ctl.read(off, len.min(self.bounce_len)) else {
            return;
        };
        let (h, hlen) = match msg::decode(&bytes) {
            Ok(x) => x,
            Err(why) => {
                tracing::warn!(nic = %self.nic.name, len, %why, "malformed message dropped");
                return;
            }
        };
        match h {
            Header::Ack { seq, status, from } => self.on_ack(seq, status, &from, out),
            Header::Data {
                seq,
                len: plen,
                from,
            } => {
                // `decode` checked that the header fits.
                bytes.drain(..hlen);
                let payload = bytes;
                if payload.len() as u64 != plen {
                    tracing::warn!(nic = %self.nic.name, header = plen, got = payload.len(), "message with a wrong length dropped");
                    return;
                }
                let addr = NetAddr(from);
                let peer = match self.add_peer(&addr) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(nic = %self.nic.name, peer = %addr, error = %e, "message from an unusable address dropped (not answered)");
                        return;
                    }
                };
                let m = Held {
                    from: peer,
                    seq,
                    payload,
                    since: Instant::now(),
                };
                if let Some(m) = self.deliver(m, out) {
                    if self.opts.rnr_timeout.is_zero()
                        || self.held.len() >= self.opts.bounces.max(1) * 4
                    {
                        self.acks_out
                            .push_back((m.from, m.seq, AckStatus::NotReady));
                    } else {
                        self.held.push_back(m);
                    }
                }
            }
        }
    }

    /// Places `m` into the first posted receive buffer and queues the
    /// answer; gives `m` back when no buffer is posted.
    fn deliver(&mut self, m: Held, out: &mut Vec<Completion>) -> Option<Held> {
        while let Some(r) = self.user_recvs.front().copied() {
            if m.payload.len() as u64 > r.len {
                // The buffer stays posted; the message is dropped.
                self.acks_out
                    .push_back((m.from, m.seq, AckStatus::TooLong { capacity: r.len }));
                return None;
            }
            self.user_recvs.pop_front();
            let placed = self.mrs.get(&r.mr).and_then(|e| {
                let off = usize::try_from(r.addr.checked_sub(e.addr)?).ok()?;
                e.window.as_ref()?.write(off, &m.payload).then_some(())
            });
            match placed {
                Some(()) => {
                    out.push(Completion::Recv {
                        wr: r.wr,
                        result: Ok(m.payload.len() as u64),
                    });
                    self.acks_out
                        .push_back((m.from, m.seq, AckStatus::Delivered));
                    return None;
                }
                None => {
                    // Deregistered while posted: that buffer fails, the
                    // message tries the next one.
                    out.push(Completion::Recv {
                        wr: r.wr,
                        result: Err(TransportError::LocalAccess {
                            nic: self.nic_name(),
                            what: format!(
                                "RECV buffer [{:#x}, +{}): registration {} is gone",
                                r.addr, r.len, r.mr.0
                            ),
                        }),
                    });
                }
            }
        }
        Some(m)
    }

    /// The receiver's answer to our SEND `seq`.
    fn on_ack(&mut self, seq: u64, status: AckStatus, from: &[u8], out: &mut Vec<Completion>) {
        let i = (seq & 0xffff_ffff) as usize;
        let Some(SlotUse::Send {
            peer,
            len,
            seq: s,
            sent,
            ack: None,
            ..
        }) = self.slots.get(i).copied()
        else {
            tracing::debug!(nic = %self.nic.name, seq, "stale or unknown ACK ignored");
            return;
        };
        if s != seq || self.peer(peer).map(|p| p.addr.0.as_slice()) != Ok(from) {
            tracing::debug!(nic = %self.nic.name, seq, "ACK for another message ignored");
            return;
        }
        if sent.is_some() {
            let r = self.ack_result(peer, len, status);
            let used = self.release(i);
            self.complete(used, r.map(|_| 0), out);
        } else if let Some(SlotUse::Send { ack, .. }) = self.slots.get_mut(i) {
            *ack = Some(status);
        }
    }

    /// Sends queued ACKs while ACK slots are free.
    fn flush_acks(&mut self) {
        while let Some(&(peer, seq, status)) = self.acks_out.front() {
            let Some(i) = self.free_ack.pop() else {
                return;
            };
            self.acks_out.pop_front();
            let dest = match self.live_peer(peer) {
                Ok(d) => d,
                Err(_) => {
                    self.free_ack.push(i);
                    continue;
                }
            };
            let h = msg::ack(seq, status, &self.nic.addr.0);
            let off = self.hdr_off(i);
            if !self.ctl.write(off, &h) {
                self.free_ack.push(i);
                continue;
            }
            let native = Native::Send {
                hdr: (self.ctl.addr() + off as u64, h.len(), self.ctl_desc),
                payload: None,
                dest,
            };
            if let Err(e) = self.submit(i, SlotUse::Ack { peer }, native, false) {
                tracing::debug!(nic = %self.nic.name, peer = %self.peer_addr(peer), error = %e, "ACK not sent");
            }
        }
    }

    /// Answers held messages whose RNR timeout passed with `NotReady`.
    fn expire_held(&mut self) {
        let t = self.opts.rnr_timeout;
        while self.held.front().is_some_and(|m| m.since.elapsed() >= t) {
            if let Some(m) = self.held.pop_front() {
                self.acks_out
                    .push_back((m.from, m.seq, AckStatus::NotReady));
            }
        }
    }

    fn on_error(&mut self, err: CqError, out: &mut Vec<Completion>) {
        let Some(i) = err.slot else {
            tracing::warn!(
                nic = %self.nic.name,
                flags = format_args!("{:#x}", err.flags),
                err = err.err,
                prov_errno = err.prov_errno,
                message = %err.message,
                "CQ error entry without our context (target-side error?)"
            );
            return;
        };
        if let Some(SlotUse::Bounce { j }) = self.slots.get(i).copied() {
            // A message that did not fit (FI_ETRUNC: a peer with a larger
            // max_send_len) or a cancelled receive at close: nothing to
            // answer (the sender's SEND times out); the buffer goes back.
            tracing::warn!(nic = %self.nic.name, err = err.err, message = %err.message, "incoming message failed");
            if err.err.unsigned_abs() as i32 != libc::ECANCELED {
                self.repost_bounce(j);
            }
            return;
        }
        let used = self.release(i);
        match used {
            SlotUse::Free => {
                tracing::warn!(nic = %self.nic.name, slot = i, message = %err.message, "error for a free slot ignored");
                return;
            }
            SlotUse::Zombie => {
                tracing::debug!(nic = %self.nic.name, slot = i, message = %err.message, "error for an operation already failed (slot freed)");
                return;
            }
            SlotUse::Ack { peer } => {
                tracing::debug!(nic = %self.nic.name, peer = %self.peer_addr(peer), message = %err.message, "ACK failed");
                return;
            }
            _ => {}
        }
        tracing::debug!(
            nic = %self.nic.name,
            err = err.err,
            prov_errno = err.prov_errno,
            message = %err.message,
            "CQ error entry"
        );
        let e = self.op_error(used, err.err, err.prov_errno, err.message, err.olen);
        if self.is_tcp {
            if let Some(e) = self.tcp_failure(i, used, e) {
                self.finish_error(used, e, out);
            }
            return;
        }
        self.finish_error(used, e, out);
    }

    /// tcp: what a failed operation `i` becomes. A rejected WRITE records
    /// its issue number; an operation cancelled by the broken connection
    /// goes to limbo (the slot stays reserved) and `None` is returned.
    fn tcp_failure(
        &mut self,
        i: usize,
        used: SlotUse,
        e: TransportError,
    ) -> Option<TransportError> {
        let peer = Self::slot_peer(used)?;
        let no = self.issue_no.get(i).copied().unwrap_or(0);
        match &e {
            TransportError::RemoteAccess { .. } => {
                if let Some(p) = self.peer_table.get_mut(peer.0 as usize) {
                    p.rejected = Some(p.rejected.map_or(no, |r| r.max(no)));
                }
                Some(e)
            }
            TransportError::PeerUnreachable { .. }
                if matches!(
                    used,
                    SlotUse::Write { .. } | SlotUse::Send { sent: None, .. }
                ) && self.peer(peer).is_ok_and(|p| p.dead.is_none()) =>
            {
                // `release` ran: the slot is free again; take it back.
                let now = Instant::now();
                if let Some(k) = self.free_tx.iter().rposition(|&x| x == i) {
                    self.free_tx.remove(k);
                }
                self.slots[i] = used;
                if let Some(f) = self.first_fail.get_mut(i) {
                    f.get_or_insert(now);
                }
                self.limbo.push(Limbo {
                    i,
                    peer,
                    issue_no: no,
                    error: e,
                    not_before: now + LIMBO_RETRY,
                    until: now + LIMBO_WAIT,
                });
                None
            }
            _ => Some(e),
        }
    }

    /// tcp: settles operations in limbo. Issued after the latest rejection
    /// of their peer (so behind it on the closed connection: never
    /// delivered): issued again, until `connect_timeout` after their first
    /// failure. Issued before it: they may have been delivered before the
    /// connection closed, so they fail (`Failed`, outcome unknown) without
    /// condemning the peer. No rejection within `LIMBO_WAIT`: the peer is
    /// gone, as the error said.
    fn settle_limbo(&mut self, out: &mut Vec<Completion>) {
        let now = Instant::now();
        let mut k = 0;
        while k < self.limbo.len() {
            let l = &self.limbo[k];
            let (i, peer, no) = (l.i, l.peer, l.issue_no);
            let (dead, rejected) = match self.peer(peer) {
                Ok(p) => (p.dead.is_some(), p.rejected),
                Err(_) => (true, None),
            };
            let used = self.slots.get(i).copied().unwrap_or(SlotUse::Free);
            let behind = rejected.is_some_and(|r| no > r);
            if !dead && !behind && rejected.is_none() && now < l.until {
                k += 1;
                continue;
            }
            if behind && !dead && now < l.not_before {
                k += 1;
                continue;
            }
            let l = self.limbo.swap_remove(k);
            let first = self.first_fail.get(i).copied().flatten().unwrap_or(now);
            if behind && !dead && first.elapsed() < self.opts.connect_timeout {
                let Some(native) = self.natives.get(i).copied().flatten() else {
                    let _ = self.release_limbo(i);
                    continue;
                };
                tracing::debug!(nic = %self.nic.name, peer = %self.peer_addr(peer), slot = i, "re-issuing an operation cancelled by a connection the peer closed");
                match self.issue(i, native, false) {
                    Ok(0) => self.on_posted(i, peer),
                    Ok(rc) if rc == -ffi::FI_EAGAIN => self.park(i, native, Some(peer)),
                    Ok(rc) => {
                        let e = self.post_error(used, rc);
                        let used = self.release_limbo(i);
                        self.finish_error(used, e, out);
                    }
                    Err(e) => {
                        let used = self.release_limbo(i);
                        self.complete(used, Err(e), out);
                    }
                }
                continue;
            }
            let used = self.release_limbo(i);
            let e = if dead {
                self.live_peer(peer).err().unwrap_or(l.error)
            } else if rejected.is_some() && !behind {
                TransportError::Failed {
                    nic: self.nic_name(),
                    wr: match used {
                        SlotUse::Write { wr, .. } | SlotUse::Send { wr, .. } => Some(wr),
                        _ => None,
                    },
                    what: format!(
                        "the connection to {} closed after the peer rejected a later operation; \
                         whether this one was delivered is unknown ({})",
                        self.peer_addr(peer),
                        l.error
                    ),
                }
            } else {
                l.error
            };
            self.finish_error(used, e, out);
        }
    }

    /// Frees the slot of a limbo entry (not counted in flight).
    fn release_limbo(&mut self, i: usize) -> SlotUse {
        let used = self.slots.get(i).copied().unwrap_or(SlotUse::Free);
        self.unreserve(i);
        used
    }

    /// Reports failed operation `used` (a dead peer is marked so).
    fn finish_error(&mut self, used: SlotUse, e: TransportError, out: &mut Vec<Completion>) {
        if let TransportError::PeerUnreachable { reason, .. } = &e {
            if let SlotUse::Write { peer, .. } | SlotUse::Send { peer, .. } = used {
                self.mark_dead(peer, reason.clone());
            }
        }
        tracing::debug!(nic = %self.nic.name, error = %e, "operation failed");
        self.complete(used, Err(e), out);
    }

    /// Rejects addresses that cannot be endpoint names of this provider
    /// before libfabric sees them (tcp;ofi_rxm's AV misbehaves after
    /// inserting garbage sockaddrs).
    fn check_addr_format(&self, addr: &NetAddr) -> Result<(), TransportError> {
        let own = &self.nic.addr.0;
        let fmt = self._info.addr_format;
        let bad = |why: &str| TransportError::InvalidArgument {
            nic: self.nic_name(),
            what: format!("peer address {addr}: {why}"),
        };
        if fmt == ffi::FI_ADDR_STR || self.is_shm {
            return Ok(());
        }
        if addr.0.len() != own.len() {
            return Err(bad(&format!(
                "{} bytes, this provider's addresses have {}",
                addr.0.len(),
                own.len()
            )));
        }
        if ffi::SOCKADDR_FORMATS.contains(&fmt) && addr.0.get(..2) != own.get(..2) {
            return Err(bad("wrong socket address family"));
        }
        Ok(())
    }

    fn mark_dead(&mut self, peer: PeerId, reason: String) {
        if let Some(p) = self.peer_table.get_mut(peer.0 as usize) {
            if p.dead.is_none() {
                tracing::warn!(nic = %self.nic.name, peer = %p.addr, %reason, "peer unreachable");
                p.dead = Some(reason);
            }
        }
    }

    /// The peer's fi_addr, or PeerUnreachable if it is known dead.
    fn live_peer(&self, peer: PeerId) -> Result<u64, TransportError> {
        let p = self.peer(peer)?;
        match &p.dead {
            Some(reason) => Err(TransportError::PeerUnreachable {
                nic: self.nic_name(),
                peer: p.addr.clone(),
                reason: reason.clone(),
            }),
            None => Ok(p.fi_addr),
        }
    }

    /// A post to `peer` got EAGAIN even after progress. With nothing in
    /// flight to the peer that means the provider is still (re)connecting;
    /// past the connect timeout the peer is declared unreachable.
    fn on_eagain(&mut self, peer: PeerId) -> Result<(), TransportError> {
        let timeout = self.opts.connect_timeout;
        let Some(p) = self.peer_table.get_mut(peer.0 as usize) else {
            return Ok(());
        };
        if p.inflight > 0 {
            p.eagain_since = None;
            return Ok(());
        }
        let since = *p.eagain_since.get_or_insert_with(Instant::now);
        if since.elapsed() < timeout {
            return Ok(());
        }
        let reason = format!(
            "no connection after {:.1} s (provider kept answering EAGAIN)",
            since.elapsed().as_secs_f64()
        );
        self.mark_dead(peer, reason);
        self.live_peer(peer).map(|_| ())
    }

    /// Slot `i` was issued to `peer`: counts it and gives it the peer's next
    /// issue number.
    fn on_posted(&mut self, i: usize, peer: PeerId) {
        if let Some(p) = self.peer_table.get_mut(peer.0 as usize) {
            p.inflight += 1;
            p.eagain_since = None;
            p.issued += 1;
            if let Some(q) = self.issue_no.get_mut(i) {
                *q = p.issued;
            }
        }
    }

    /// Every [`SWEEP_INTERVAL`]: fails every in-flight operation to `shm`
    /// peers whose process is gone (the shm provider never completes them)
    /// and to peers of any provider with work in flight and no completion
    /// for `write_timeout` (hung, or gone without closing the connection);
    /// then the SENDs whose answer is overdue.
    fn sweep(&mut self, out: &mut Vec<Completion>) {
        // The clock is read every few polls only: an engine polls a
        // software provider continuously, and the deadlines here are coarse.
        self.polls_unswept += 1;
        if self.polls_unswept < SWEEP_CLOCK_EVERY {
            return;
        }
        self.polls_unswept = 0;
        if self.last_sweep.elapsed() < SWEEP_INTERVAL {
            return;
        }
        let now = Instant::now();
        self.last_sweep = now;
        let timeout = self.opts.write_timeout;
        // Peers with work in the EAGAIN backlog (reserved, never issued, so
        // not counted in `inflight`) are checked too.
        let mut newly_dead = Vec::new();
        for (k, p) in self.peer_table.iter_mut().enumerate() {
            if p.dead.is_some() {
                continue;
            }
            if let Some(pid) = p.pid {
                let busy = p.inflight > 0 || p.backlogged > 0;
                if busy && !ffi::process_alive(pid) {
                    newly_dead.push((PeerId(k as u32), "peer process exited".to_string()));
                    continue;
                }
            }
            if p.inflight == 0 || p.done != p.done_seen {
                p.done_seen = p.done;
                p.stalled_since = None;
                continue;
            }
            let since = *p.stalled_since.get_or_insert(now);
            if now.duration_since(since) >= timeout {
                newly_dead.push((
                    PeerId(k as u32),
                    format!(
                        "none of {} operations in flight completed within {:.1} s (peer hung or gone without closing the connection)",
                        p.inflight,
                        timeout.as_secs_f64()
                    ),
                ));
            }
        }
        // A stalled peer's operations stay inside the provider (none of
        // ours can cancel a WRITE): their slots become zombies until the
        // provider returns them, which it does if the peer wakes up.
        for (peer, reason) in newly_dead {
            self.mark_dead(peer, reason);
            for i in 0..self.slots.len() {
                let used = self.slots[i];
                // Still inside libfabric (a SEND already completed there
                // only waits for the answer: handled below).
                let to_peer = matches!(used,
                    SlotUse::Write { peer: p, .. }
                    | SlotUse::Send { peer: p, sent: None, .. }
                    | SlotUse::Ack { peer: p } if p == peer);
                if to_peer {
                    self.slots[i] = SlotUse::Zombie;
                    if let Some(p) = self.peer_table.get_mut(peer.0 as usize) {
                        p.inflight = p.inflight.saturating_sub(1);
                    }
                    let e = self
                        .live_peer(peer)
                        .err()
                        .unwrap_or(TransportError::NicDown {
                            nic: self.nic_name(),
                        });
                    self.complete(used, Err(e), out);
                }
            }
        }
        self.sweep_unanswered(out);
    }

    /// Fails SENDs the provider completed but the receiver never answered:
    /// at once when the peer is known dead, else after `ack_timeout` (which
    /// declares the peer unreachable: it neither answers nor reports an
    /// error).
    fn sweep_unanswered(&mut self, out: &mut Vec<Completion>) {
        let timeout = self.opts.ack_timeout;
        for i in 0..self.opts.max_inflight.min(self.slots.len()) {
            let SlotUse::Send {
                peer,
                sent: Some(at),
                ..
            } = self.slots[i]
            else {
                continue;
            };
            let dead = self.peer(peer).is_ok_and(|p| p.dead.is_some());
            if !dead && at.elapsed() < timeout {
                continue;
            }
            if !dead {
                self.mark_dead(
                    peer,
                    format!(
                        "no answer to a SEND within {:.1} s (receiver gone or not polling)",
                        timeout.as_secs_f64()
                    ),
                );
            }
            let e = self
                .live_peer(peer)
                .err()
                .unwrap_or(TransportError::NicDown {
                    nic: self.nic_name(),
                });
            let used = self.release(i);
            self.complete(used, Err(e), out);
        }
    }

    fn issue(&mut self, i: usize, n: Native, more: bool) -> Result<i64, TransportError> {
        match n {
            Native::Write {
                src,
                len,
                desc,
                dest,
                raddr,
                key,
                data,
            } => self
                .res
                .writemsg(i, src, len, desc, dest, raddr, key, data, more),
            Native::Send { hdr, payload, dest } => match payload {
                Some(p) => self.res.send(i, &[hdr, p], dest),
                None => self.res.send(i, &[hdr], dest),
            },
            Native::Recv { addr, len, desc } => self.res.recv(i, addr, len, desc),
        }
    }

    /// Returns a reserved, never-issued slot to its free list.
    fn unreserve(&mut self, i: usize) {
        let Some(s) = self.slots.get_mut(i) else {
            return;
        };
        *s = SlotUse::Free;
        self.free_slot(i);
    }

    fn slot_peer(slot: SlotUse) -> Option<PeerId> {
        match slot {
            SlotUse::Write { peer, .. } | SlotUse::Send { peer, .. } | SlotUse::Ack { peer } => {
                Some(peer)
            }
            _ => None,
        }
    }

    /// Issues reserved slot `i` (already taken off its free list). On EAGAIN
    /// after one progress round the work joins the backlog and is still
    /// accepted; on any other error the slot is released and the error
    /// returned. Work for a peer (or receives) with entries already in the
    /// backlog joins it directly, behind them: issuing it first would
    /// overtake them, and the attempt would most likely fail anyway.
    fn submit(
        &mut self,
        i: usize,
        slot: SlotUse,
        n: Native,
        more: bool,
    ) -> Result<(), TransportError> {
        self.slots[i] = slot;
        if self.is_tcp {
            // Kept for re-issue from limbo (a new operation: no failure yet).
            if let Some(x) = self.natives.get_mut(i) {
                *x = Some(n);
            }
            if let Some(f) = self.first_fail.get_mut(i) {
                *f = None;
            }
        }
        let peer = Self::slot_peer(slot);
        let queued = match peer {
            Some(p) => self
                .peer_table
                .get(p.0 as usize)
                .is_some_and(|p| p.backlogged > 0),
            None => self.backlogged_recvs > 0,
        };
        if queued {
            self.park(i, n, peer);
            return Ok(());
        }
        for attempt in 0..2 {
            let rc = match self.issue(i, n, more) {
                Ok(rc) => rc,
                Err(e) => {
                    self.unreserve(i);
                    return Err(e);
                }
            };
            if rc == 0 {
                if let Some(p) = peer {
                    self.on_posted(i, p);
                }
                return Ok(());
            }
            if rc != -ffi::FI_EAGAIN {
                self.unreserve(i);
                return Err(self.post_error(slot, rc));
            }
            if attempt == 0 {
                if let Err(e) = self.progress_into_stash() {
                    self.unreserve(i);
                    return Err(e);
                }
            }
        }
        if let Some(p) = peer {
            if let Err(e) = self.on_eagain(p) {
                self.unreserve(i);
                return Err(e);
            }
        }
        self.park(i, n, peer);
        Ok(())
    }

    /// Appends never-issued work to the backlog.
    fn park(&mut self, i: usize, native: Native, peer: Option<PeerId>) {
        self.count_parked(peer, true);
        self.backlog.push_back(Parked { i, native, peer });
    }

    fn count_parked(&mut self, peer: Option<PeerId>, add: bool) {
        let n = match peer {
            Some(p) => match self.peer_table.get_mut(p.0 as usize) {
                Some(p) => &mut p.backlogged,
                None => return,
            },
            None => &mut self.backlogged_recvs,
        };
        *n = if add { *n + 1 } else { n.saturating_sub(1) };
    }

    /// Fails a backlogged (never issued) slot with `e`.
    fn fail_backlogged(&mut self, i: usize, e: TransportError, out: &mut Vec<Completion>) {
        let used = self.slots.get(i).copied().unwrap_or(SlotUse::Free);
        self.unreserve(i);
        self.complete(used, Err(e), out);
    }

    /// Re-issues backlogged work (one pass, no FI_MORE), in order. Once the
    /// provider answers EAGAIN for a peer (or for a receive), the rest of
    /// that peer's entries stay queued untried until the next pass: its
    /// resources (shm's inject pool, tcp;ofi_rxm's pending connection) are
    /// not freed within the pass, and retrying every entry would make each
    /// `poll` cost O(backlog). Every entry ends exactly once: issued (its
    /// completion comes from the CQ), failed into `out`, or queued again.
    fn flush_backlog(&mut self, out: &mut Vec<Completion>) {
        let mut blocked = std::mem::take(&mut self.blocked);
        blocked.clear();
        let mut recvs_blocked = false;
        // Entries still ahead in this pass that belong to blocked peers:
        // once only those are left, the pass ends without touching them.
        let mut skippable = 0usize;
        let mut left = self.backlog.len();
        while left > 0 {
            if left == skippable {
                // Keep the order: the untouched entries go behind the ones
                // already queued again in this pass (all earlier work).
                self.backlog.rotate_left(left);
                break;
            }
            left -= 1;
            let Some(e) = self.backlog.pop_front() else {
                break;
            };
            let Parked { i, native, peer } = e;
            let slot = self.slots.get(i).copied().unwrap_or(SlotUse::Free);
            if matches!(slot, SlotUse::Zombie | SlotUse::Free) {
                // Already failed by `sweep` (dead peer) while still queued:
                // never issued, so nothing of it is left in libfabric.
                self.count_parked(peer, false);
                self.unreserve(i);
                continue;
            }
            if let Some(p) = peer {
                if let Err(err) = self.live_peer(p) {
                    self.count_parked(peer, false);
                    self.fail_backlogged(i, err, out);
                    continue;
                }
            }
            let skip = match peer {
                Some(p) => blocked.contains(&p),
                None => recvs_blocked,
            };
            if skip {
                skippable = skippable.saturating_sub(1);
                self.backlog.push_back(e);
                continue;
            }
            let rc = match self.issue(i, native, false) {
                Ok(rc) => rc,
                Err(err) => {
                    self.count_parked(peer, false);
                    self.fail_backlogged(i, err, out);
                    continue;
                }
            };
            if rc == 0 {
                self.count_parked(peer, false);
                if let Some(p) = peer {
                    self.on_posted(i, p);
                }
            } else if rc == -ffi::FI_EAGAIN {
                match peer {
                    Some(p) => match self.on_eagain(p) {
                        Err(err) => {
                            // Declared unreachable: this entry fails here,
                            // the peer's later ones by `live_peer` above.
                            self.count_parked(peer, false);
                            self.fail_backlogged(i, err, out);
                        }
                        Ok(()) => {
                            // This entry and the peer's later ones, all
                            // still ahead (none was skipped before).
                            blocked.push(p);
                            skippable += self
                                .peer_table
                                .get(p.0 as usize)
                                .map_or(0, |p| p.backlogged.saturating_sub(1));
                            self.backlog.push_back(e);
                        }
                    },
                    None => {
                        recvs_blocked = true;
                        skippable += self.backlogged_recvs.saturating_sub(1);
                        self.backlog.push_back(e);
                    }
                }
            } else {
                let err = self.post_error(slot, rc);
                if let TransportError::PeerUnreachable { reason, .. } = &err {
                    if let Some(p) = peer {
                        self.mark_dead(p, reason.clone());
                    }
                }
                self.count_parked(peer, false);
                self.fail_backlogged(i, err, out);
            }
        }
        self.blocked = blocked;
    }

    /// Reads the CQ into the stash (used when the provider says EAGAIN).
    fn progress_into_stash(&mut self) -> Result<(), TransportError> {
        let mut stash = std::mem::take(&mut self.stash);
        let before = stash.len();
        let r = self.drain_cq(&mut stash);
        self.stashed_tx += stash[before..]
            .iter()
            .filter(|c| matches!(c, Completion::Send { .. } | Completion::Write { .. }))
            .count();
        self.stash = stash;
        r.map(|_| ())
    }
}

/// The shm provider (1.17) names an endpoint's region
/// `/dev/shm/<pid>:<domain>:<endpoint>` and fails `fi_enable` with `EBUSY`
/// when that file exists. A process killed with SIGKILL leaves its regions
/// behind, so a later process that happens to get the same pid could not
/// open shm endpoints at all. Before this process opens its first shm
/// endpoint, no region named after its pid can be its own: those files are
/// left over from a dead process, and are removed (once per process).
fn remove_stale_shm_regions() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prefix = format!("{}:", std::process::id());
        let Ok(dir) = std::fs::read_dir("/dev/shm") else {
            return;
        };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            // Only the provider's own `<pid>:<n>:<n>` names.
            let number = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
            let ours = rest
                .split_once(':')
                .is_some_and(|(d, e)| number(d) && number(e));
            if !ours {
                continue;
            }
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!(region = %name, "removed a stale shm region of a dead process with this pid"),
                Err(e) => tracing::warn!(region = %name, error = %e, "could not remove a stale shm region"),
            }
        }
    });
}

/// For an `shm` address (`fi_shm://<pid>:...`): the peer's pid, and whether
/// it is already known unreachable (its region is gone: the 1.17 shm
/// provider crashes when posting to such an address, so it must never be
/// used).
fn shm_peer(addr: &[u8]) -> (Option<i32>, Option<String>) {
    let Some(rest) = addr.strip_prefix(b"fi_shm://") else {
        return (None, Some("not an shm endpoint name (fi_shm://...)".into()));
    };
    let name: Vec<u8> = rest.iter().copied().take_while(|&b| b != 0).collect();
    let name = String::from_utf8_lossy(&name).into_owned();
    let pid = name.split(':').next().and_then(|p| p.parse::<i32>().ok());
    let region = std::path::Path::new("/dev/shm").join(&name);
    let dead = if name.is_empty() || name.contains('/') || !region.exists() {
        Some(format!("shm region {} does not exist", region.display()))
    } else if pid.is_some_and(|p| !ffi::process_alive(p)) {
        Some("shm peer process has exited".to_string())
    } else {
        None
    };
    (pid, dead)
}

fn is_unreachable(errno: i32) -> bool {
    matches!(
        errno,
        libc::ECONNREFUSED
            | libc::ECONNRESET
            | libc::ECONNABORTED
            | libc::EHOSTUNREACH
            | libc::EHOSTDOWN
            | libc::ENETUNREACH
            | libc::ENETDOWN
            | libc::ENOTCONN
            | libc::ETIMEDOUT
            | libc::EPIPE
            | libc::ESHUTDOWN
            | libc::EADDRNOTAVAIL
    )
}

fn is_remote_access(errno: i32) -> bool {
    matches!(
        errno,
        libc::EACCES
            | libc::EPERM
            | libc::EKEYREJECTED
            | libc::ENOKEY
            | libc::EINVAL
            | libc::EFAULT
            | libc::ERANGE
            | libc::EREMOTEIO
    )
}

impl Domain for LibfabricDomain {
    fn info(&self) -> &NicInfo {
        &self.nic
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
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
            .mr_reg(region.addr(), region.len(), flags, requested, cuda)?;
        let rkey = if self.prov_key { mr.key } else { requested };
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
                window: HostWindow::of(region),
            },
        );
        Ok(local)
    }

    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError> {
        let e = self
            .mrs
            .remove(&mr)
            .ok_or_else(|| self.invalid(format!("deregister: unknown local key {}", mr.0)))?;
        self.res.mr_close(e.mr)
    }

    fn add_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        if let Some(p) = self.peers.get(addr) {
            return Ok(*p);
        }
        if addr.0.is_empty() || addr.0.len() > 4096 {
            return Err(self.invalid(format!(
                "peer address of {} bytes is not a libfabric endpoint name",
                addr.0.len()
            )));
        }
        let id =
            u32::try_from(self.peer_table.len()).map_err(|_| self.invalid("too many peers"))?;
        self.check_addr_format(addr)?;
        let (pid, dead) = if self.is_shm {
            shm_peer(&addr.0)
        } else {
            (None, None)
        };
        let fi_addr = self.res.av_insert(&addr.0).map_err(|e| match e {
            TransportError::Provider { message, code, .. } => TransportError::PeerUnreachable {
                nic: self.nic_name(),
                peer: addr.clone(),
                reason: format!("fi_av_insert rejected the address: {message} (code {code})"),
            },
            other => other,
        })?;
        self.peer_table.push(Peer {
            addr: addr.clone(),
            fi_addr,
            dead,
            inflight: 0,
            eagain_since: None,
            pid,
            backlogged: 0,
            issued: 0,
            rejected: None,
            done: 0,
            done_seen: 0,
            stalled_since: None,
        });
        self.peers.insert(addr.clone(), PeerId(id));
        Ok(PeerId(id))
    }

    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError> {
        let dest = self.live_peer(peer)?;
        if src.len > self.caps.max_send_len {
            return Err(self.invalid(format!(
                "SEND of {} bytes exceeds max_send_len {}",
                src.len, self.caps.max_send_len
            )));
        }
        let len = usize::try_from(src.len).map_err(|_| self.invalid("SEND too long"))?;
        let payload = if src.len == 0 {
            None
        } else {
            Some((src.addr, len, self.local(&src, "SEND source")?))
        };
        if self.free_tx.len() <= self.stashed_tx {
            return Err(TransportError::QueueFull {
                nic: self.nic_name(),
            });
        }
        let Some(i) = self.free_tx.pop() else {
            return Err(TransportError::QueueFull {
                nic: self.nic_name(),
            });
        };
        self.send_gen = self.send_gen.wrapping_add(1);
        let seq = u64::from(self.send_gen) << 32 | i as u64;
        let h = msg::data(seq, src.len, &self.nic.addr.0);
        let off = self.hdr_off(i);
        if !self.ctl.write(off, &h) {
            self.free_slot(i);
            return Err(self.invalid("SEND header does not fit its slot"));
        }
        let slot = SlotUse::Send {
            wr,
            peer,
            len: src.len,
            seq,
            sent: None,
            ack: None,
        };
        self.submit(
            i,
            slot,
            Native::Send {
                hdr: (self.ctl.addr() + off as u64, h.len(), self.ctl_desc),
                payload,
                dest,
            },
            false,
        )
    }

    /// Queues `buf` for the next incoming message. The message layer copies
    /// messages into it, so it must be host memory (CUDA buffers are
    /// rejected with `Unsupported`).
    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        self.local(&buf, "RECV buffer")?;
        let host = self.mrs.get(&buf.mr).is_some_and(|e| e.window.is_some());
        if !host {
            return Err(TransportError::Unsupported {
                nic: self.nic_name(),
                what: "RECV into device memory (messages are copied from bounce buffers)".into(),
            });
        }
        if self.user_recvs.len() >= self.caps.max_recvs {
            return Err(TransportError::QueueFull {
                nic: self.nic_name(),
            });
        }
        self.user_recvs.push_back(UserRecv {
            wr,
            mr: buf.mr,
            addr: buf.addr,
            len: buf.len,
        });
        // A message already waiting takes it at once (reported by `poll`).
        if let Some(m) = self.held.pop_front() {
            let mut stash = std::mem::take(&mut self.stash);
            if let Some(m) = self.deliver(m, &mut stash) {
                self.held.push_front(m);
            }
            self.stash = stash;
        }
        Ok(())
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        let n = wrs.len().min(self.caps.max_batch);
        for (k, wr) in wrs.iter().take(n).enumerate() {
            let fail = |error| PostError { posted: k, error };
            let dest = self.live_peer(wr.peer).map_err(fail)?;
            if wr.src.len > self.caps.max_write_len {
                return Err(fail(self.invalid(format!(
                    "WRITE of {} bytes exceeds max_write_len {}",
                    wr.src.len, self.caps.max_write_len
                ))));
            }
            let len =
                usize::try_from(wr.src.len).map_err(|_| fail(self.invalid("WRITE too long")))?;
            let (src, desc) = if wr.src.len == 0 {
                (self.dummy.as_ptr() as usize as u64, self.dummy_desc)
            } else {
                (
                    wr.src.addr,
                    self.local(&wr.src, "WRITE source").map_err(fail)?,
                )
            };
            let raddr = if self.virt_addr {
                wr.dst.addr().ok_or_else(|| {
                    fail(self.invalid(format!(
                        "remote address {:#x} + {:#x} overflows",
                        wr.dst.base, wr.dst.offset
                    )))
                })?
            } else {
                wr.dst.offset
            };
            if self.free_tx.len() <= self.stashed_tx {
                return Ok(k);
            }
            let Some(i) = self.free_tx.pop() else {
                return Ok(k);
            };
            let slot = SlotUse::Write {
                wr: wr.wr,
                peer: wr.peer,
                rkey: wr.dst.rkey.0,
                raddr,
                len: wr.src.len,
            };
            let more = self.opts.fi_more
                && k + 1 < n
                && !self.free_tx.is_empty()
                && self.backlog.is_empty();
            let native = Native::Write {
                src,
                len,
                desc,
                dest,
                raddr,
                key: wr.dst.rkey.0,
                data: wr.imm.map(u64::from),
            };
            self.submit(i, slot, native, more).map_err(fail)?;
        }
        Ok(n)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        let before = out.len();
        out.append(&mut self.stash);
        self.stashed_tx = 0;
        // Completions first: they drive the software providers' progress
        // and free the resources (slots, shm inject buffers) the backlog
        // waits for.
        self.drain_cq(out)?;
        if !self.limbo.is_empty() {
            self.settle_limbo(out);
        }
        if !self.held.is_empty() {
            self.expire_held();
        }
        if !self.acks_out.is_empty() {
            self.flush_acks();
        }
        if !self.backlog.is_empty() {
            self.flush_backlog(out);
        }
        self.sweep(out);
        Ok(out.len() - before)
    }
}
