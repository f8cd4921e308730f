//! [`NvlinkDomain`]: registrations, peers, posting and polling of one
//! same-host domain.

use crate::conn::{InConn, OutConn};
use crate::inbound::{RecvBuf, Target};
use crate::keys::{Keys, TABLE_BYTES};
use crate::out::{Posted, Src};
use crate::proto::Status;
use crate::sys::{self, Mapping};
use crate::{Addr, NvlinkConfig};
use std::collections::{BTreeMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use weft_transport::{
    Access, Capabilities, Completion, DataPath, Device, DeviceMemoryPath, DirectKind, LocalMr,
    LocalSlice, MemRegion, MrKey, NetAddr, NicInfo, PeerId, PostError, Rkey, TransportError, WrId,
    WriteWr,
};

static NEXT_INDEX: AtomicU32 = AtomicU32::new(0);

const TAG_LISTEN: u64 = 0;
const TAG_BELL: u64 = 1;
const TAG_OUT: u64 = 1 << 32;
const TAG_IN: u64 = 2 << 32;
/// How often a busy domain looks at its sockets (new peers, dead peers).
const CHECK_EVERY: Duration = Duration::from_micros(200);
/// Most inbound connections (greeted or not) a domain keeps: anyone on the
/// host can connect, so their number (and the shared files they map) is
/// bounded; a connection beyond it is closed at once.
const MAX_INBOUND: usize = 4096;

enum PeerState {
    Live(Box<OutConn>),
    Dead(String),
    Removed,
}

struct PeerSlot {
    addr: NetAddr,
    state: PeerState,
}

/// One same-host domain (see the crate docs).
pub struct NvlinkDomain {
    info: NicInfo,
    /// The host identity in this domain's address.
    host: [u8; 16],
    caps: Capabilities,
    config: NvlinkConfig,
    listener: OwnedFd,
    bell: OwnedFd,
    ep: OwnedFd,
    keys: Keys,
    peers: BTreeMap<u32, PeerSlot>,
    by_addr: BTreeMap<Vec<u8>, u32>,
    next_peer: u32,
    greeting: BTreeMap<u64, OwnedFd>,
    inbound: BTreeMap<u64, InConn>,
    next_in: u64,
    recvs: VecDeque<RecvBuf>,
    done: Vec<Completion>,
    inflight: usize,
    last_check: Instant,
    ready: Vec<u64>,
}

impl std::fmt::Debug for NvlinkDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvlinkDomain")
            .field("nic", &self.info.name)
            .field("peers", &self.peers.len())
            .field("inbound", &self.inbound.len())
            .finish_non_exhaustive()
    }
}

fn os<'a>(nic: &'a str, op: &'static str) -> impl Fn(std::io::Error) -> TransportError + 'a {
    move |e| TransportError::Provider {
        nic: nic.to_string(),
        op,
        code: e.raw_os_error().unwrap_or(0) as i64,
        message: e.to_string(),
    }
}

impl NvlinkDomain {
    /// Opens lane `lane` with `config`: listens at a new address of this
    /// process.
    pub fn open(config: NvlinkConfig, lane: usize) -> Result<NvlinkDomain, TransportError> {
        let index = NEXT_INDEX.fetch_add(1, Ordering::Relaxed);
        let name = format!("nvlink{lane}");
        let host = config.host.unwrap_or_else(sys::host_id);
        let me = Addr {
            host,
            pid: std::process::id(),
            index,
        };
        let listener = sys::listen(&me.socket_name()).map_err(os(&name, "listen"))?;
        let bell = sys::eventfd().map_err(os(&name, "eventfd"))?;
        let ep = sys::epoll().map_err(os(&name, "epoll_create1"))?;
        sys::epoll_add(ep.as_raw_fd(), listener.as_raw_fd(), TAG_LISTEN)
            .map_err(os(&name, "epoll_ctl"))?;
        sys::epoll_add(ep.as_raw_fd(), bell.as_raw_fd(), TAG_BELL)
            .map_err(os(&name, "epoll_ctl"))?;
        let table = Mapping::create("weft-nvlink-keys", TABLE_BYTES).map_err(os(&name, "memfd"))?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ (me.pid as u64) << 20
            ^ (index as u64) << 8;
        let caps = Capabilities {
            max_write_len: 1 << 30,
            max_send_len: 8 << 20,
            max_inflight: config.max_inflight,
            max_recvs: 4096,
            max_batch: 64,
            ordered: false,
            device_memory: config.peer_memory.is_some(),
            software_progress: true,
        };
        Ok(NvlinkDomain {
            host,
            info: NicInfo {
                name,
                addr: me.encode(),
                numa_node: None,
                link_gbps: None,
            },
            caps,
            config,
            listener,
            bell,
            ep,
            keys: Keys::new(table, seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            peers: BTreeMap::new(),
            by_addr: BTreeMap::new(),
            next_peer: 1,
            greeting: BTreeMap::new(),
            inbound: BTreeMap::new(),
            next_in: 0,
            recvs: VecDeque::new(),
            done: Vec::new(),
            inflight: 0,
            last_check: Instant::now(),
            ready: Vec::new(),
        })
    }

    fn nic(&self) -> String {
        self.info.name.clone()
    }

    /// A local slice's memory, checked against its registration.
    fn local(&self, s: &LocalSlice) -> Result<Src, TransportError> {
        match self.keys.get(s.mr.0) {
            Some(r) if r.holds(s.addr, s.len) => Ok(Src {
                addr: s.addr,
                dev: r.device,
                len: s.len,
            }),
            Some(_) => Err(TransportError::LocalAccess {
                nic: self.nic(),
                what: format!(
                    "[{:#x}, +{}) outside registration {:#x}",
                    s.addr, s.len, s.mr.0
                ),
            }),
            None => Err(TransportError::LocalAccess {
                nic: self.nic(),
                what: format!("unknown local key {:#x}", s.mr.0),
            }),
        }
    }

    /// The live connection of `peer`, or the error a post to it gets.
    fn conn(&mut self, peer: PeerId) -> Result<&mut OutConn, TransportError> {
        let nic = self.info.name.clone();
        match self.peers.get_mut(&peer.0) {
            None => Err(TransportError::InvalidArgument {
                nic,
                what: format!("unknown peer handle {}", peer.0),
            }),
            Some(PeerSlot {
                addr,
                state: PeerState::Removed,
            }) => Err(TransportError::PeerRemoved {
                nic,
                peer: addr.clone(),
            }),
            Some(PeerSlot {
                addr,
                state: PeerState::Dead(why),
            }) => Err(TransportError::PeerUnreachable {
                nic,
                peer: addr.clone(),
                reason: why.clone(),
            }),
            Some(PeerSlot {
                state: PeerState::Live(c),
                ..
            }) => Ok(c),
        }
    }

    fn status_error(
        nic: &str,
        peer: &NetAddr,
        st: Status,
        rkey: u64,
        addr: u64,
        len: u64,
    ) -> TransportError {
        match st {
            Status::Ok => unreachable!("not an error"),
            Status::RemoteAccess(reason) => TransportError::RemoteAccess {
                nic: nic.to_string(),
                peer: peer.clone(),
                rkey,
                addr,
                len,
                reason,
            },
            Status::TooLong { capacity } => TransportError::MessageTooLong {
                nic: nic.to_string(),
                peer: peer.clone(),
                len,
                capacity,
            },
            Status::NotReady => TransportError::ReceiverNotReady {
                nic: nic.to_string(),
                peer: peer.clone(),
            },
        }
    }

    fn post_one_write(&mut self, wr: &WriteWr) -> Result<(), TransportError> {
        let src = self.local(&wr.src)?;
        let nic = self.nic();
        let pm = self.config.peer_memory.clone();
        let dst = wr
            .dst
            .addr()
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: nic.clone(),
                what: "target address overflows".into(),
            })?;
        let peer_addr = self.peers.get(&wr.peer.0).map(|p| p.addr.clone());
        let posted = match self.conn(wr.peer) {
            Ok(c) => c
                .core
                .write(wr.wr, src, wr.dst.rkey.0, dst, wr.imm, pm.as_ref())?,
            Err(e @ TransportError::PeerUnreachable { .. }) => {
                self.done.push(Completion::Write {
                    wr: wr.wr,
                    result: Err(e),
                });
                self.inflight += 1;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if let Posted::Refused(st) = posted {
            let peer = peer_addr.unwrap_or(NetAddr(Vec::new()));
            let e = Self::status_error(&nic, &peer, st, wr.dst.rkey.0, dst, src.len);
            self.done.push(Completion::Write {
                wr: wr.wr,
                result: Err(e),
            });
        }
        self.inflight += 1;
        Ok(())
    }

    /// Accepts, greets, notices dead peers; drains the doorbell.
    fn check_sockets(&mut self) {
        self.last_check = Instant::now();
        let mut ready = std::mem::take(&mut self.ready);
        sys::epoll_ready(self.ep.as_raw_fd(), &mut ready);
        for &tag in &ready {
            match tag {
                TAG_LISTEN => self.accept_all(),
                TAG_BELL => sys::drain_bell(self.bell.as_raw_fd()),
                t if t & TAG_IN != 0 && t & TAG_OUT == 0 => self.inbound_event(t),
                t => self.outbound_event((t & 0xffff_ffff) as u32),
            }
        }
        self.ready = ready;
    }

    fn accept_all(&mut self) {
        loop {
            match sys::accept(self.listener.as_raw_fd()) {
                Ok(Some(s)) => {
                    if self.inbound.len() + self.greeting.len() >= MAX_INBOUND {
                        tracing::warn!(nic = %self.info.name, "nvlink: {MAX_INBOUND} inbound connections already; refused one");
                        continue;
                    }
                    let tag = TAG_IN | self.next_in;
                    self.next_in += 1;
                    if sys::epoll_add(self.ep.as_raw_fd(), s.as_raw_fd(), tag).is_ok() {
                        self.greeting.insert(tag, s);
                        self.inbound_event(tag);
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(nic = %self.info.name, %e, "nvlink: accept failed");
                    return;
                }
            }
        }
    }

    fn inbound_event(&mut self, tag: u64) {
        if let Some(sock) = self.greeting.remove(&tag) {
            match InConn::greet(&sock, self.bell.as_raw_fd(), self.keys.table_fd()) {
                Ok(None) => {
                    self.greeting.insert(tag, sock);
                }
                Ok(Some((map, bell, h))) => {
                    let from = Addr {
                        host: self.host,
                        pid: h.pid,
                        index: h.index,
                    }
                    .encode();
                    let c = InConn::new(sock, map, bell, h.fwd as usize, from);
                    self.inbound.insert(tag, c);
                }
                Err(e) => {
                    tracing::warn!(nic = %self.info.name, %e, "nvlink: refused a connection");
                    sys::epoll_del(self.ep.as_raw_fd(), sock.as_raw_fd());
                }
            }
            return;
        }
        let gone = self.inbound.get(&tag).is_some_and(|c| !c.alive());
        if gone {
            self.drop_inbound(tag);
        }
    }

    fn outbound_event(&mut self, id: u32) {
        let Some(PeerSlot {
            state: PeerState::Live(c),
            ..
        }) = self.peers.get_mut(&id)
        else {
            return;
        };
        match c.read_socket() {
            Ok(true) => c.ring(),
            Ok(false) => {}
            Err(why) => self.kill_peer(id, why),
        }
    }

    /// Forgets an inbound connection (its initiator is gone or broke the
    /// protocol). A receive buffer its unfinished SEND had taken goes back
    /// to the front of the posted ones: it was never reported filled.
    fn drop_inbound(&mut self, tag: u64) {
        if let Some(c) = self.inbound.remove(&tag) {
            sys::epoll_del(self.ep.as_raw_fd(), c.sock.as_raw_fd());
            if let Some(b) = c.core.abandon() {
                self.recvs.push_front(b);
            }
        }
    }

    /// Fails everything in flight to `id` and marks it dead.
    fn kill_peer(&mut self, id: u32, why: String) {
        let Some(slot) = self.peers.get_mut(&id) else {
            return;
        };
        tracing::debug!(nic = %self.info.name, peer = %slot.addr, %why, "nvlink: peer unreachable");
        let err = TransportError::PeerUnreachable {
            nic: self.info.name.clone(),
            peer: slot.addr.clone(),
            reason: why.clone(),
        };
        if let PeerState::Live(mut c) = std::mem::replace(&mut slot.state, PeerState::Dead(why)) {
            let pm = self.config.peer_memory.as_ref();
            c.core.fail_all(pm, &err, &mut self.done);
            sys::epoll_del(self.ep.as_raw_fd(), c.sock.as_raw_fd());
            if let (Some(pm), Some(t)) = (pm, c.core.token()) {
                pm.forget_peer(t);
            }
        }
    }

    /// One pass over every connection's rings.
    fn progress_rings(&mut self) {
        let pm = self.config.peer_memory.clone();
        let mut broken = Vec::new();
        for (&id, slot) in self.peers.iter_mut() {
            let PeerState::Live(c) = &mut slot.state else {
                continue;
            };
            let nic = &self.info.name;
            let peer = &slot.addr;
            let status = |st: Status| match st {
                Status::Ok => Ok(()),
                st => Err(Self::status_error(nic, peer, st, 0, 0, 0)),
            };
            match c.core.progress(pm.as_ref(), &mut self.done, &status) {
                Ok(true) => c.ring(),
                Ok(false) => {}
                Err(e) => broken.push((id, format!("protocol error: {}", e.0))),
            }
        }
        for (id, why) in broken {
            self.kill_peer(id, why);
        }
        let now = Instant::now();
        let mut bad = Vec::new();
        for (&tag, c) in self.inbound.iter_mut() {
            let mut t = Target {
                keys: &self.keys,
                recvs: &mut self.recvs,
                out: &mut self.done,
                pm: pm.as_ref(),
                now,
                rnr: self.config.rnr_timeout,
                nic: &self.info.name,
            };
            match c.core.progress(&mut t) {
                Ok(true) => c.ring(),
                Ok(false) => {}
                Err(e) => bad.push((tag, e.0)),
            }
        }
        for (tag, why) in bad {
            tracing::warn!(nic = %self.info.name, %why, "nvlink: dropping a connection that broke the protocol");
            self.drop_inbound(tag);
        }
    }
}

impl weft_transport::Domain for NvlinkDomain {
    fn info(&self) -> &NicInfo {
        &self.info
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn data_path(&self) -> DataPath {
        let dm = match &self.config.peer_memory {
            Some(_) => DeviceMemoryPath::Direct(DirectKind::PeerMapped),
            None => DeviceMemoryPath::Unsupported,
        };
        DataPath::from_capabilities("nvlink", "same-host", &self.caps).with_device_memory(dm)
    }

    fn register(&mut self, region: &MemRegion, access: Access) -> Result<LocalMr, TransportError> {
        let (addr, len, device) = (region.addr(), region.len() as u64, region.device());
        let pm = self
            .config
            .peer_memory
            .as_ref()
            .filter(|p| p.serves(device));
        let export = match (device, pm) {
            (Device::Host, None) => None,
            (Device::Host, Some(pm)) if access == Access::RemoteWrite => {
                pm.export(addr, len, device).ok()
            }
            (Device::Host, Some(_)) => None,
            (_, None) => {
                return Err(TransportError::Unsupported {
                    nic: self.nic(),
                    what: format!(
                        "{device} memory without peer-memory support (NvlinkConfig::peer_memory)"
                    ),
                })
            }
            (_, Some(pm)) if access == Access::RemoteWrite => Some(pm.export(addr, len, device)?),
            (_, Some(_)) => None,
        };
        let key = self.keys.insert(addr, len, access, device, export);
        Ok(LocalMr {
            key: MrKey(key),
            rkey: Rkey(key),
            addr,
            len,
            device,
        })
    }

    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError> {
        self.keys
            .remove(mr.0)
            .map(drop)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: self.nic(),
                what: format!("deregister of unknown key {:#x}", mr.0),
            })
    }

    fn add_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        let to = Addr::parse(addr).ok_or_else(|| TransportError::InvalidArgument {
            nic: self.nic(),
            what: format!("not an nvlink address: {addr}"),
        })?;
        if let Some(&id) = self.by_addr.get(&addr.0) {
            return Ok(PeerId(id));
        }
        let id = self.next_peer;
        self.next_peer += 1;
        let state = if to.host != self.host {
            PeerState::Dead("on another host".into())
        } else {
            let me = Addr::parse(&self.info.addr).map_or(0, |a| a.index);
            match OutConn::connect(&to, me, self.config.ring_bytes, self.bell.as_raw_fd()) {
                Ok(c) => match sys::epoll_add(
                    self.ep.as_raw_fd(),
                    c.sock.as_raw_fd(),
                    TAG_OUT | id as u64,
                ) {
                    Ok(()) => PeerState::Live(Box::new(c)),
                    Err(e) => PeerState::Dead(format!("epoll: {e}")),
                },
                Err(why) => PeerState::Dead(why),
            }
        };
        self.peers.insert(
            id,
            PeerSlot {
                addr: addr.clone(),
                state,
            },
        );
        self.by_addr.insert(addr.0.clone(), id);
        Ok(PeerId(id))
    }

    fn remove_peer(&mut self, peer: PeerId) -> Result<(), TransportError> {
        let Some(slot) = self.peers.get_mut(&peer.0) else {
            return Ok(());
        };
        let err = TransportError::PeerRemoved {
            nic: self.info.name.clone(),
            peer: slot.addr.clone(),
        };
        match std::mem::replace(&mut slot.state, PeerState::Removed) {
            PeerState::Live(mut c) => {
                let pm = self.config.peer_memory.as_ref();
                c.core.fail_all(pm, &err, &mut self.done);
                sys::epoll_del(self.ep.as_raw_fd(), c.sock.as_raw_fd());
                if let (Some(pm), Some(t)) = (pm, c.core.token()) {
                    pm.forget_peer(t);
                }
            }
            PeerState::Dead(_) | PeerState::Removed => {}
        }
        if self.by_addr.get(&slot.addr.0) == Some(&peer.0) {
            self.by_addr.remove(&slot.addr.0);
        }
        Ok(())
    }

    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError> {
        if src.len > self.caps.max_send_len {
            return Err(TransportError::InvalidArgument {
                nic: self.nic(),
                what: format!(
                    "SEND of {} bytes over max_send_len {}",
                    src.len, self.caps.max_send_len
                ),
            });
        }
        if self.inflight >= self.caps.max_inflight {
            return Err(TransportError::QueueFull { nic: self.nic() });
        }
        let s = self.local(&src)?;
        match self.conn(peer) {
            Ok(c) => c.core.send(wr, s),
            Err(e @ TransportError::PeerUnreachable { .. }) => {
                self.done.push(Completion::Send { wr, result: Err(e) })
            }
            Err(e) => return Err(e),
        }
        self.inflight += 1;
        Ok(())
    }

    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        if self.recvs.len() >= self.caps.max_recvs {
            return Err(TransportError::QueueFull { nic: self.nic() });
        }
        let s = self.local(&buf)?;
        self.recvs.push_back(RecvBuf {
            wr,
            addr: s.addr,
            len: s.len,
            dev: s.dev,
        });
        Ok(())
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        let room = self.caps.max_inflight.saturating_sub(self.inflight);
        let n = wrs.len().min(self.caps.max_batch).min(room);
        for (i, wr) in wrs[..n].iter().enumerate() {
            self.post_one_write(wr)
                .map_err(|error| PostError { posted: i, error })?;
        }
        // Push what fits now rather than at the next poll.
        if n > 0 {
            self.progress_rings();
        }
        Ok(n)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        if self.last_check.elapsed() >= CHECK_EVERY {
            self.check_sockets();
        }
        self.progress_rings();
        let n = self.done.len();
        for c in self.done.drain(..) {
            if matches!(c, Completion::Write { .. } | Completion::Send { .. }) {
                self.inflight -= 1;
            }
            out.push(c);
        }
        Ok(n)
    }

    fn same_host(&self) -> bool {
        true
    }

    fn prefers(&self, addr: &NetAddr) -> bool {
        Addr::parse(addr).is_some_and(|a| a.host == self.host)
    }

    fn wait_fd(&self) -> Option<RawFd> {
        Some(self.ep.as_raw_fd())
    }

    fn try_wait(&mut self) -> bool {
        if !self.done.is_empty() || !self.greeting.is_empty() {
            return false;
        }
        for slot in self.peers.values() {
            if let PeerState::Live(c) = &slot.state {
                if c.core.moving() || !c.core.rx.arm() {
                    return false;
                }
            }
        }
        self.inbound
            .values()
            .all(|c| !c.core.blocked() && c.core.rx.arm())
    }
}

impl Drop for NvlinkDomain {
    fn drop(&mut self) {
        if let Some(pm) = &self.config.peer_memory {
            let nic = self.info.name.clone();
            for slot in self.peers.values_mut() {
                if let PeerState::Live(c) = &mut slot.state {
                    let mut sink = Vec::new();
                    c.core.fail_all(
                        Some(pm),
                        &TransportError::Canceled { nic: nic.clone() },
                        &mut sink,
                    );
                    if let Some(t) = c.core.token() {
                        pm.forget_peer(t);
                    }
                }
            }
        }
    }
}
