//! Test support shared by the libfabric test binaries:
//!
//! - [`provider`]: a [`LibfabricProvider`] for `tcp` (on `lo`) or `shm`, or
//!   `None` with a printed SKIP line when libfabric is not installed;
//! - [`LfInProcess`]: the conformance suite's [`InProcessBackend`] with every
//!   host in the test process;
//! - [`CrossProcess`]: a [`Harness`] whose every host is a **child process**
//!   (this test binary re-executed, see [`child_entry`]) reached over a Unix
//!   socket: domains are proxies that forward each call, memory is allocated,
//!   filled and read in the child. Killing a host kills its process.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::ops::Range;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use weft_conformance::{Harness, HarnessError, HostId, InProcessBackend};
use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::{
    Access, Capabilities, Completion, Device, Domain, LocalMr, LocalSlice, MemRegion, MrKey,
    NetAddr, NicInfo, PeerId, PostError, Provider, RemoteAccessReason, RemoteSlice, Rkey,
    TransportError, WrId, WriteWr,
};

/// Most NICs a test host opens.
pub const MAX_NICS: usize = 4;

/// A provider for `name` (`"tcp"` on `lo`, or `"shm"`) with `MAX_NICS`
/// endpoints of the same NIC, or `None` (printed) when libfabric is missing.
pub fn provider(name: &str) -> Option<LibfabricProvider> {
    let domain = match name {
        "tcp" => "lo",
        other => other,
    };
    let cfg = LibfabricConfig::new(name)
        .with_domains(vec![domain; MAX_NICS])
        .with_connect_timeout(Duration::from_secs(3));
    match LibfabricProvider::with_config(cfg) {
        Ok(p) => Some(p),
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "SKIP: libfabric provider {name} unavailable: {e}"
            );
            None
        }
    }
}

fn unreachable_addr_for(provider: &LibfabricProvider, name: &str) -> Result<NetAddr, HarnessError> {
    if name == "shm" {
        // A well-formed shm name whose region does not exist.
        return Ok(NetAddr(b"fi_shm://999999999:7:7\0".to_vec()));
    }
    // A tcp endpoint that existed and is closed again: its port refuses.
    let d = provider
        .open(0)
        .map_err(|e| HarnessError::Failed(format!("open for unreachable_addr: {e}")))?;
    let addr = d.local_addr().clone();
    drop(d);
    Ok(addr)
}

// ---------------------------------------------------------------------------
// In-process
// ---------------------------------------------------------------------------

/// Every host in this process.
pub struct LfInProcess {
    pub name: String,
    pub provider: Option<LibfabricProvider>,
    pub seed: u64,
}

impl LfInProcess {
    /// The conformance harness for provider `name` (cases are skipped with
    /// a message when libfabric is missing).
    pub fn harness(name: &str, seed: u64) -> weft_conformance::InProcess<LfInProcess> {
        weft_conformance::InProcess::new(LfInProcess {
            name: name.to_string(),
            provider: provider(name),
            seed,
        })
    }
}

fn missing() -> HarnessError {
    HarnessError::Unsupported("libfabric is not installed (apt-get install libfabric1)".into())
}

impl InProcessBackend for LfInProcess {
    fn name(&self) -> String {
        format!("libfabric:{}/in-process", self.name)
    }
    fn seed(&self) -> u64 {
        self.seed
    }
    fn add_host(
        &mut self,
        _host: HostId,
        nics: usize,
    ) -> Result<Vec<Box<dyn Domain>>, HarnessError> {
        if nics > MAX_NICS {
            return Err(HarnessError::Unsupported(format!(
                "{nics} NICs per host (max {MAX_NICS})"
            )));
        }
        let provider = self.provider.as_ref().ok_or_else(missing)?;
        (0..nics)
            .map(|i| {
                provider
                    .open(i)
                    .map_err(|e| HarnessError::Failed(format!("open nic {i}: {e}")))
            })
            .collect()
    }
    fn progress(&mut self) {
        std::thread::yield_now();
    }
    fn kill_host(&mut self, host: HostId) -> Result<(), HarnessError> {
        Err(HarnessError::Unsupported(format!(
            "{host} shares this process (the cross-process harness kills hosts)"
        )))
    }
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        unreachable_addr_for(self.provider.as_ref().ok_or_else(missing)?, &self.name)
    }
}

// ---------------------------------------------------------------------------
// Wire types of the proxy protocol (postcard over a Unix socket)
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
enum ErrW {
    PeerUnreachable {
        nic: String,
        peer: Vec<u8>,
        reason: String,
    },
    RemoteAccess {
        nic: String,
        peer: Vec<u8>,
        rkey: u64,
        addr: u64,
        len: u64,
        reason: u8,
    },
    LocalAccess {
        nic: String,
        what: String,
    },
    ReceiverNotReady {
        nic: String,
        peer: Vec<u8>,
    },
    MessageTooLong {
        nic: String,
        peer: Vec<u8>,
        len: u64,
        capacity: u64,
    },
    QueueFull {
        nic: String,
    },
    InvalidArgument {
        nic: String,
        what: String,
    },
    Unsupported {
        nic: String,
        what: String,
    },
    LibraryUnavailable {
        library: String,
        reason: String,
    },
    NoDevice {
        what: String,
    },
    Provider {
        nic: String,
        op: String,
        code: i64,
        message: String,
    },
    Failed {
        nic: String,
        wr: Option<u64>,
        what: String,
    },
    NicDown {
        nic: String,
    },
    Canceled {
        nic: String,
    },
    Other {
        text: String,
    },
}

fn leak_op(op: String) -> &'static str {
    // Provider op names are a small fixed set of libfabric call names.
    const KNOWN: &[&str] = &[
        "fi_writemsg",
        "fi_send",
        "fi_recv",
        "completion",
        "fi_mr_reg",
        "fi_mr_regattr",
        "fi_mr_bind",
        "fi_mr_enable",
        "fi_close(mr)",
        "fi_cq_read",
        "fi_cq_readerr",
        "fi_av_insert",
        "fi_getname",
    ];
    KNOWN
        .iter()
        .copied()
        .find(|k| *k == op)
        .unwrap_or("libfabric (remote)")
}

impl From<&TransportError> for ErrW {
    fn from(e: &TransportError) -> Self {
        use TransportError as T;
        match e.clone() {
            T::PeerUnreachable { nic, peer, reason } => ErrW::PeerUnreachable {
                nic,
                peer: peer.0,
                reason,
            },
            T::RemoteAccess {
                nic,
                peer,
                rkey,
                addr,
                len,
                reason,
            } => ErrW::RemoteAccess {
                nic,
                peer: peer.0,
                rkey,
                addr,
                len,
                reason: match reason {
                    RemoteAccessReason::UnknownKey => 0,
                    RemoteAccessReason::NotWritable => 1,
                    RemoteAccessReason::OutOfBounds => 2,
                    _ => 0,
                },
            },
            T::LocalAccess { nic, what } => ErrW::LocalAccess { nic, what },
            T::ReceiverNotReady { nic, peer } => ErrW::ReceiverNotReady { nic, peer: peer.0 },
            T::MessageTooLong {
                nic,
                peer,
                len,
                capacity,
            } => ErrW::MessageTooLong {
                nic,
                peer: peer.0,
                len,
                capacity,
            },
            T::QueueFull { nic } => ErrW::QueueFull { nic },
            T::InvalidArgument { nic, what } => ErrW::InvalidArgument { nic, what },
            T::Unsupported { nic, what } => ErrW::Unsupported { nic, what },
            T::LibraryUnavailable { library, reason } => {
                ErrW::LibraryUnavailable { library, reason }
            }
            T::NoDevice { what } => ErrW::NoDevice { what },
            T::Provider {
                nic,
                op,
                code,
                message,
            } => ErrW::Provider {
                nic,
                op: op.to_string(),
                code,
                message,
            },
            T::Failed { nic, wr, what } => ErrW::Failed {
                nic,
                wr: wr.map(|w| w.0),
                what,
            },
            T::NicDown { nic } => ErrW::NicDown { nic },
            T::Canceled { nic } => ErrW::Canceled { nic },
            other => ErrW::Other {
                text: other.to_string(),
            },
        }
    }
}

impl From<ErrW> for TransportError {
    fn from(e: ErrW) -> Self {
        use TransportError as T;
        match e {
            ErrW::PeerUnreachable { nic, peer, reason } => T::PeerUnreachable {
                nic,
                peer: NetAddr(peer),
                reason,
            },
            ErrW::RemoteAccess {
                nic,
                peer,
                rkey,
                addr,
                len,
                reason,
            } => T::RemoteAccess {
                nic,
                peer: NetAddr(peer),
                rkey,
                addr,
                len,
                reason: match reason {
                    1 => RemoteAccessReason::NotWritable,
                    2 => RemoteAccessReason::OutOfBounds,
                    _ => RemoteAccessReason::UnknownKey,
                },
            },
            ErrW::LocalAccess { nic, what } => T::LocalAccess { nic, what },
            ErrW::ReceiverNotReady { nic, peer } => T::ReceiverNotReady {
                nic,
                peer: NetAddr(peer),
            },
            ErrW::MessageTooLong {
                nic,
                peer,
                len,
                capacity,
            } => T::MessageTooLong {
                nic,
                peer: NetAddr(peer),
                len,
                capacity,
            },
            ErrW::QueueFull { nic } => T::QueueFull { nic },
            ErrW::InvalidArgument { nic, what } => T::InvalidArgument { nic, what },
            ErrW::Unsupported { nic, what } => T::Unsupported { nic, what },
            ErrW::LibraryUnavailable { library, reason } => {
                T::LibraryUnavailable { library, reason }
            }
            ErrW::NoDevice { what } => T::NoDevice { what },
            ErrW::Provider {
                nic,
                op,
                code,
                message,
            } => T::Provider {
                nic,
                op: leak_op(op),
                code,
                message,
            },
            ErrW::Failed { nic, wr, what } => T::Failed {
                nic,
                wr: wr.map(WrId),
                what,
            },
            ErrW::NicDown { nic } => T::NicDown { nic },
            ErrW::Canceled { nic } => T::Canceled { nic },
            ErrW::Other { text } => T::Failed {
                nic: "remote".into(),
                wr: None,
                what: text,
            },
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
struct SliceW {
    mr: u64,
    addr: u64,
    len: u64,
}

impl From<LocalSlice> for SliceW {
    fn from(s: LocalSlice) -> Self {
        SliceW {
            mr: s.mr.0,
            addr: s.addr,
            len: s.len,
        }
    }
}
impl From<SliceW> for LocalSlice {
    fn from(s: SliceW) -> Self {
        LocalSlice {
            mr: MrKey(s.mr),
            addr: s.addr,
            len: s.len,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
struct WriteW {
    wr: u64,
    peer: u32,
    src: SliceW,
    base: u64,
    offset: u64,
    rkey: u64,
    imm: Option<u32>,
}

impl From<&WriteWr> for WriteW {
    fn from(w: &WriteWr) -> Self {
        WriteW {
            wr: w.wr.0,
            peer: w.peer.0,
            src: w.src.into(),
            base: w.dst.base,
            offset: w.dst.offset,
            rkey: w.dst.rkey.0,
            imm: w.imm,
        }
    }
}
impl From<WriteW> for WriteWr {
    fn from(w: WriteW) -> Self {
        WriteWr {
            wr: WrId(w.wr),
            peer: PeerId(w.peer),
            src: w.src.into(),
            dst: RemoteSlice {
                base: w.base,
                offset: w.offset,
                rkey: Rkey(w.rkey),
            },
            imm: w.imm,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
enum CompW {
    Send(u64, Result<(), ErrW>),
    Recv(u64, Result<u64, ErrW>),
    Write(u64, Result<(), ErrW>),
    Imm(u32),
}

impl From<&Completion> for CompW {
    fn from(c: &Completion) -> Self {
        match c {
            Completion::Send { wr, result } => {
                CompW::Send(wr.0, result.as_ref().map(|_| ()).map_err(ErrW::from))
            }
            Completion::Recv { wr, result } => {
                CompW::Recv(wr.0, result.as_ref().map(|n| *n).map_err(ErrW::from))
            }
            Completion::Write { wr, result } => {
                CompW::Write(wr.0, result.as_ref().map(|_| ()).map_err(ErrW::from))
            }
            Completion::Imm { imm } => CompW::Imm(*imm),
        }
    }
}
impl From<CompW> for Completion {
    fn from(c: CompW) -> Self {
        match c {
            CompW::Send(wr, r) => Completion::Send {
                wr: WrId(wr),
                result: r.map_err(Into::into),
            },
            CompW::Recv(wr, r) => Completion::Recv {
                wr: WrId(wr),
                result: r.map_err(Into::into),
            },
            CompW::Write(wr, r) => Completion::Write {
                wr: WrId(wr),
                result: r.map_err(Into::into),
            },
            CompW::Imm(imm) => Completion::Imm { imm },
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct InfoW {
    name: String,
    addr: Vec<u8>,
    numa: Option<u32>,
    link: Option<f64>,
    max_write_len: u64,
    max_send_len: u64,
    max_inflight: u64,
    max_recvs: u64,
    max_batch: u64,
    ordered: bool,
    device_memory: bool,
    software_progress: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
enum Req {
    Info(u32),
    Alloc(u64),
    WriteMem {
        buf: u64,
        offset: u64,
        data: Vec<u8>,
    },
    ReadMem {
        buf: u64,
        offset: u64,
        len: u64,
    },
    Register {
        nic: u32,
        buf: u64,
        start: u64,
        end: u64,
        remote: bool,
    },
    Deregister {
        nic: u32,
        key: u64,
    },
    AddPeer {
        nic: u32,
        addr: Vec<u8>,
    },
    PostSend {
        nic: u32,
        wr: u64,
        peer: u32,
        src: SliceW,
    },
    PostRecv {
        nic: u32,
        wr: u64,
        buf: SliceW,
    },
    PostWrites {
        nic: u32,
        wrs: Vec<WriteW>,
    },
    Poll(u32),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
enum Resp {
    Info(InfoW),
    Buf(Result<u64, String>),
    Unit(Result<(), String>),
    Bytes(Result<Vec<u8>, String>),
    Mr(Result<(u64, u64, u64, u64), ErrW>),
    Done(Result<(), ErrW>),
    Peer(Result<u32, ErrW>),
    Posted(Result<u64, (u64, ErrW)>),
    Polled(Result<Vec<CompW>, ErrW>),
}

fn send_frame<T: Serialize>(s: &mut UnixStream, v: &T) -> std::io::Result<()> {
    let bytes = postcard::to_allocvec(v).map_err(|e| std::io::Error::other(e.to_string()))?;
    let len = u32::try_from(bytes.len()).map_err(|_| std::io::Error::other("frame too long"))?;
    s.write_all(&len.to_le_bytes())?;
    s.write_all(&bytes)?;
    s.flush()
}

fn recv_frame<T: for<'de> Deserialize<'de>>(s: &mut UnixStream) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 1 << 30 {
        return Err(std::io::Error::other("frame too long"));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    postcard::from_bytes(&buf).map_err(|e| std::io::Error::other(e.to_string()))
}

// ---------------------------------------------------------------------------
// Child side
// ---------------------------------------------------------------------------

const ENV_SOCKET: &str = "WEFT_LF_PEER_SOCKET";
const ENV_PROVIDER: &str = "WEFT_LF_PEER_PROVIDER";
const ENV_NICS: &str = "WEFT_LF_PEER_NICS";
/// Name of the `#[test]` every test binary using [`CrossProcess`] must
/// define as `fn peer_process_entry() { common::child_entry() }`.
pub const ENTRY_TEST: &str = "peer_process_entry";

struct ChildMem {
    ptr: NonNull<u8>,
    len: usize,
}

struct ChildState {
    domains: Vec<Box<dyn Domain>>,
    pending: Vec<Vec<Completion>>,
    /// SEND+WRITE WRs per NIC whose completion the parent has not polled
    /// yet. The background poller frees the domain's slots early, so the
    /// child enforces `max_inflight` as the parent sees it.
    outstanding: Vec<usize>,
    mem: Vec<ChildMem>,
}

// SAFETY: the raw allocations are owned by the state and only touched under
// its mutex (or by NICs, as with any registered memory).
unsafe impl Send for ChildState {}

/// The body of the `peer_process_entry` test. In a child started by
/// [`CrossProcess`] it serves requests until the parent goes away, then
/// exits the process. Run normally, it checks that the proxy codec
/// round-trips every message kind.
pub fn child_entry() {
    let Ok(path) = std::env::var(ENV_SOCKET) else {
        codec_selftest();
        return;
    };
    let code = match serve(&path) {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "weft-libfabric peer process: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn codec_selftest() {
    let reqs = vec![
        Req::PostWrites {
            nic: 1,
            wrs: vec![WriteW {
                wr: 9,
                peer: 2,
                src: SliceW {
                    mr: 1,
                    addr: 2,
                    len: 3,
                },
                base: 4,
                offset: 5,
                rkey: 6,
                imm: Some(7),
            }],
        },
        Req::WriteMem {
            buf: 1,
            offset: 2,
            data: vec![1, 2, 3],
        },
    ];
    for r in reqs {
        let b = postcard::to_allocvec(&r).unwrap();
        assert_eq!(postcard::from_bytes::<Req>(&b).unwrap(), r);
    }
    let errs = [
        TransportError::PeerUnreachable {
            nic: "n".into(),
            peer: NetAddr(vec![1]),
            reason: "r".into(),
        },
        TransportError::RemoteAccess {
            nic: "n".into(),
            peer: NetAddr(vec![2]),
            rkey: 1,
            addr: 2,
            len: 3,
            reason: RemoteAccessReason::OutOfBounds,
        },
        TransportError::QueueFull { nic: "n".into() },
        TransportError::Provider {
            nic: "n".into(),
            op: "fi_writemsg",
            code: -5,
            message: "m".into(),
        },
    ];
    for e in errs {
        let w = ErrW::from(&e);
        let b = postcard::to_allocvec(&w).unwrap();
        let back: TransportError = postcard::from_bytes::<ErrW>(&b).unwrap().into();
        assert_eq!(back, e);
    }
}

fn serve(path: &str) -> Result<(), String> {
    let provider_name = std::env::var(ENV_PROVIDER).map_err(|e| e.to_string())?;
    let nics: usize = std::env::var(ENV_NICS)
        .map_err(|e| e.to_string())?
        .parse()
        .map_err(|e| format!("{ENV_NICS}: {e}"))?;
    let provider = provider(&provider_name).ok_or("libfabric unavailable in child")?;
    let mut domains = Vec::new();
    for i in 0..nics {
        domains.push(provider.open(i).map_err(|e| format!("open nic {i}: {e}"))?);
    }
    let state = Arc::new(Mutex::new(ChildState {
        pending: vec![Vec::new(); nics],
        outstanding: vec![0; nics],
        domains,
        mem: Vec::new(),
    }));
    let mut sock = UnixStream::connect(path).map_err(|e| format!("connect {path}: {e}"))?;
    // Background progress: a real peer keeps polling its CQs, which the
    // software providers need to make progress at all.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bg = {
        let state = Arc::clone(&state);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(mut st) = state.lock() {
                    let st = &mut *st;
                    for (d, p) in st.domains.iter_mut().zip(st.pending.iter_mut()) {
                        if let Err(e) = d.poll(p) {
                            let _ = writeln!(std::io::stderr(), "child poll: {e}");
                        }
                    }
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        })
    };
    let result = loop {
        let req: Req = match recv_frame(&mut sock) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(format!("read request: {e}")),
        };
        let resp = {
            let mut st = state.lock().map_err(|_| "state poisoned".to_string())?;
            handle(&mut st, req)
        };
        if let Err(e) = send_frame(&mut sock, &resp) {
            break Err(format!("write response: {e}"));
        }
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = bg.join();
    result
}

fn handle(st: &mut ChildState, req: Req) -> Resp {
    fn dom(st: &mut ChildState, nic: u32) -> Result<&mut Box<dyn Domain>, TransportError> {
        st.domains
            .get_mut(nic as usize)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: format!("nic{nic}"),
                what: "no such nic in child".into(),
            })
    }
    fn mem(st: &ChildState, buf: u64, offset: u64, len: u64) -> Result<*mut u8, String> {
        let m = st.mem.get(buf as usize).ok_or("no such buffer")?;
        let end = offset.checked_add(len).ok_or("overflow")?;
        if end > m.len as u64 {
            return Err(format!("[{offset}, +{len}) outside buffer of {}", m.len));
        }
        // SAFETY: offset <= len of the allocation (checked above).
        Ok(unsafe { m.ptr.as_ptr().add(offset as usize) })
    }
    match req {
        Req::Info(nic) => {
            let d = match dom(st, nic) {
                Ok(d) => d,
                Err(e) => return Resp::Polled(Err((&e).into())),
            };
            let (i, c) = (d.info().clone(), d.capabilities().clone());
            Resp::Info(InfoW {
                name: i.name,
                addr: i.addr.0,
                numa: i.numa_node,
                link: i.link_gbps,
                max_write_len: c.max_write_len,
                max_send_len: c.max_send_len,
                max_inflight: c.max_inflight as u64,
                max_recvs: c.max_recvs as u64,
                max_batch: c.max_batch as u64,
                ordered: c.ordered,
                device_memory: c.device_memory,
                software_progress: c.software_progress,
            })
        }
        Req::Alloc(len) => {
            let r = (|| {
                let layout = std::alloc::Layout::from_size_align((len as usize).max(1), 4096)
                    .map_err(|e| e.to_string())?;
                // SAFETY: non-zero size.
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                let ptr = NonNull::new(p).ok_or("out of memory")?;
                st.mem.push(ChildMem {
                    ptr,
                    len: len as usize,
                });
                Ok(st.mem.len() as u64 - 1)
            })();
            Resp::Buf(r)
        }
        Req::WriteMem { buf, offset, data } => {
            Resp::Unit(mem(st, buf, offset, data.len() as u64).map(|p| {
                // SAFETY: the span is inside the allocation; `data` is separate.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) }
            }))
        }
        Req::ReadMem { buf, offset, len } => Resp::Bytes(mem(st, buf, offset, len).map(|p| {
            let mut out = vec![0u8; len as usize];
            // SAFETY: the span is inside the allocation; `out` is separate.
            unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), len as usize) };
            out
        })),
        Req::Register {
            nic,
            buf,
            start,
            end,
            remote,
        } => {
            let r = (|| {
                let len = end.checked_sub(start).ok_or_else(|| fail("bad range"))?;
                let p = mem(st, buf, start, len).map_err(|e| fail(&e))?;
                let ptr = NonNull::new(p).ok_or_else(|| fail("null"))?;
                // SAFETY: the allocation lives until the child exits and is
                // only accessed through raw pointers.
                let region = unsafe { MemRegion::new(ptr, len as usize, Device::Host) };
                let access = if remote {
                    Access::RemoteWrite
                } else {
                    Access::LocalOnly
                };
                let mr = dom(st, nic)?.register(&region, access)?;
                Ok((mr.key.0, mr.rkey.0, mr.addr, mr.len))
            })();
            Resp::Mr(r.map_err(|e: TransportError| (&e).into()))
        }
        Req::Deregister { nic, key } => Resp::Done(
            dom(st, nic)
                .and_then(|d| d.deregister(MrKey(key)))
                .map_err(|e| (&e).into()),
        ),
        Req::AddPeer { nic, addr } => Resp::Peer(
            dom(st, nic)
                .and_then(|d| d.add_peer(&NetAddr(addr)))
                .map(|p| p.0)
                .map_err(|e| (&e).into()),
        ),
        Req::PostSend { nic, wr, peer, src } => {
            let r = (|| {
                let used = st.outstanding.get(nic as usize).copied().unwrap_or(0);
                let d = dom(st, nic)?;
                if used >= d.capabilities().max_inflight {
                    return Err(TransportError::QueueFull {
                        nic: d.info().name.clone(),
                    });
                }
                d.post_send(WrId(wr), PeerId(peer), src.into())?;
                if let Some(o) = st.outstanding.get_mut(nic as usize) {
                    *o += 1;
                }
                Ok(())
            })();
            Resp::Done(r.map_err(|e: TransportError| (&e).into()))
        }
        Req::PostRecv { nic, wr, buf } => Resp::Done(
            dom(st, nic)
                .and_then(|d| d.post_recv(WrId(wr), buf.into()))
                .map_err(|e| (&e).into()),
        ),
        Req::PostWrites { nic, wrs } => {
            let wrs: Vec<WriteWr> = wrs.into_iter().map(Into::into).collect();
            let used = st.outstanding.get(nic as usize).copied().unwrap_or(0);
            let r = match dom(st, nic) {
                Err(e) => Err((0, (&e).into())),
                Ok(d) => {
                    let room = d.capabilities().max_inflight.saturating_sub(used);
                    let take = wrs.len().min(room);
                    match d.post_writes(&wrs[..take]) {
                        Ok(n) => Ok(n),
                        Err(e) => Err((e.posted, ErrW::from(&e.error))),
                    }
                }
            };
            let accepted = match &r {
                Ok(n) => *n,
                Err((n, _)) => *n,
            };
            if let Some(o) = st.outstanding.get_mut(nic as usize) {
                *o += accepted;
            }
            Resp::Posted(r.map(|n| n as u64).map_err(|(n, e)| (n as u64, e)))
        }
        Req::Poll(nic) => {
            let idx = nic as usize;
            let r = (|| {
                let mut out =
                    std::mem::take(st.pending.get_mut(idx).ok_or_else(|| fail("no nic"))?);
                dom(st, nic)?.poll(&mut out)?;
                let done = out
                    .iter()
                    .filter(|c| matches!(c, Completion::Send { .. } | Completion::Write { .. }))
                    .count();
                if let Some(o) = st.outstanding.get_mut(idx) {
                    *o = o.saturating_sub(done);
                }
                Ok(out.iter().map(CompW::from).collect())
            })();
            Resp::Polled(r.map_err(|e: TransportError| (&e).into()))
        }
    }
}

fn fail(what: &str) -> TransportError {
    TransportError::Failed {
        nic: "child".into(),
        wr: None,
        what: what.into(),
    }
}

// ---------------------------------------------------------------------------
// Parent side
// ---------------------------------------------------------------------------

type Conn = Arc<Mutex<UnixStream>>;

fn call(conn: &Conn, req: &Req) -> Resp {
    let mut s = match conn.lock() {
        Ok(s) => s,
        Err(_) => panic!("peer connection poisoned"),
    };
    if let Err(e) = send_frame(&mut s, req) {
        panic!("peer process gone (sending {req:?}): {e}");
    }
    match recv_frame(&mut s) {
        Ok(r) => r,
        Err(e) => panic!("peer process gone (awaiting reply): {e}"),
    }
}

/// A [`Domain`] living in a child process.
pub struct ProxyDomain {
    conn: Conn,
    nic: u32,
    info: NicInfo,
    caps: Capabilities,
}

fn unexpected(r: Resp) -> ! {
    panic!("protocol error: unexpected reply {r:?}")
}

impl Domain for ProxyDomain {
    fn info(&self) -> &NicInfo {
        &self.info
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
    fn register(
        &mut self,
        _region: &MemRegion,
        _access: Access,
    ) -> Result<LocalMr, TransportError> {
        Err(TransportError::Unsupported {
            nic: self.info.name.clone(),
            what: "register through the harness (memory lives in the peer process)".into(),
        })
    }
    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError> {
        match call(
            &self.conn,
            &Req::Deregister {
                nic: self.nic,
                key: mr.0,
            },
        ) {
            Resp::Done(r) => r.map_err(Into::into),
            r => unexpected(r),
        }
    }
    fn add_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        match call(
            &self.conn,
            &Req::AddPeer {
                nic: self.nic,
                addr: addr.0.clone(),
            },
        ) {
            Resp::Peer(r) => r.map(PeerId).map_err(Into::into),
            r => unexpected(r),
        }
    }
    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError> {
        match call(
            &self.conn,
            &Req::PostSend {
                nic: self.nic,
                wr: wr.0,
                peer: peer.0,
                src: src.into(),
            },
        ) {
            Resp::Done(r) => r.map_err(Into::into),
            r => unexpected(r),
        }
    }
    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        match call(
            &self.conn,
            &Req::PostRecv {
                nic: self.nic,
                wr: wr.0,
                buf: buf.into(),
            },
        ) {
            Resp::Done(r) => r.map_err(Into::into),
            r => unexpected(r),
        }
    }
    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        let req = Req::PostWrites {
            nic: self.nic,
            wrs: wrs.iter().map(WriteW::from).collect(),
        };
        match call(&self.conn, &req) {
            Resp::Posted(Ok(n)) => Ok(n as usize),
            Resp::Posted(Err((posted, e))) => Err(PostError {
                posted: posted as usize,
                error: e.into(),
            }),
            r => unexpected(r),
        }
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        match call(&self.conn, &Req::Poll(self.nic)) {
            Resp::Polled(Ok(v)) => {
                let n = v.len();
                out.extend(v.into_iter().map(Completion::from));
                Ok(n)
            }
            Resp::Polled(Err(e)) => Err(e.into()),
            r => unexpected(r),
        }
    }
}

struct ChildHost {
    child: Child,
    conn: Conn,
    domains: Vec<ProxyDomain>,
    killed: bool,
}

impl Drop for ChildHost {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        remove_shm_regions(self.child.id());
    }
}

/// Removes the shm regions (`/dev/shm/<pid>:<n>:<n>`) a reaped child left
/// behind: SIGKILL skips the provider's clean-up, and the files would pile
/// up (16 MiB of tmpfs each) and clash with a later process of that pid.
fn remove_shm_regions(pid: u32) {
    let prefix = format!("{pid}:");
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for e in dir.flatten() {
        if e.file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix))
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Every host is a child process (this test binary, re-executed to run only
/// the [`ENTRY_TEST`] test).
pub struct CrossProcess {
    name: String,
    provider: Option<LibfabricProvider>,
    seed: u64,
    dir: std::path::PathBuf,
    hosts: Vec<ChildHost>,
}

impl CrossProcess {
    /// A harness for provider `name` (cases are skipped with a message when
    /// libfabric is missing).
    pub fn new(name: &str, seed: u64) -> CrossProcess {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("weft-lf-{}-{n}", std::process::id()));
        CrossProcess {
            name: name.to_string(),
            provider: provider(name),
            seed,
            dir,
            hosts: Vec::new(),
        }
    }

    fn host(&mut self, host: HostId) -> &mut ChildHost {
        match self.hosts.get_mut(host.0) {
            Some(h) if !h.killed => h,
            _ => panic!("conformance suite bug: unknown or killed {host}"),
        }
    }

    fn conn(&mut self, host: HostId) -> Conn {
        Arc::clone(&self.host(host).conn)
    }
}

impl Drop for CrossProcess {
    fn drop(&mut self) {
        self.hosts.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Harness for CrossProcess {
    fn name(&self) -> String {
        format!("libfabric:{}/cross-process", self.name)
    }
    fn seed(&self) -> u64 {
        self.seed
    }
    fn add_host(&mut self, nics: usize) -> Result<HostId, HarnessError> {
        if nics > MAX_NICS {
            return Err(HarnessError::Unsupported(format!(
                "{nics} NICs per host (max {MAX_NICS})"
            )));
        }
        if self.provider.is_none() {
            return Err(missing());
        }
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| HarnessError::Failed(format!("mkdir: {e}")))?;
        let id = HostId(self.hosts.len());
        let path = self.dir.join(format!("host{}.sock", id.0));
        let listener = UnixListener::bind(&path)
            .map_err(|e| HarnessError::Failed(format!("bind {}: {e}", path.display())))?;
        let exe = std::env::current_exe().map_err(|e| HarnessError::Failed(e.to_string()))?;
        let child = Command::new(exe)
            .args([ENTRY_TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(ENV_SOCKET, &path)
            .env(ENV_PROVIDER, &self.name)
            .env(ENV_NICS, nics.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| HarnessError::Failed(format!("spawn peer process: {e}")))?;
        let mut host = ChildHost {
            child,
            conn: Arc::new(Mutex::new(
                UnixStream::pair()
                    .map_err(|e| HarnessError::Failed(e.to_string()))?
                    .0,
            )),
            domains: Vec::new(),
            killed: false,
        };
        // Accept with a deadline: the child might fail before connecting.
        listener
            .set_nonblocking(true)
            .map_err(|e| HarnessError::Failed(e.to_string()))?;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Ok(Some(status)) = host.child.try_wait() {
                        return Err(HarnessError::Failed(format!(
                            "peer process exited early: {status}"
                        )));
                    }
                    if std::time::Instant::now() > deadline {
                        return Err(HarnessError::Failed(
                            "peer process did not connect within 60 s".into(),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(HarnessError::Failed(format!("accept: {e}"))),
            }
        };
        stream
            .set_nonblocking(false)
            .map_err(|e| HarnessError::Failed(e.to_string()))?;
        // A generous bound so a wedged child fails the case instead of hanging it.
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .map_err(|e| HarnessError::Failed(e.to_string()))?;
        host.conn = Arc::new(Mutex::new(stream));
        for nic in 0..nics {
            let info = match call(&host.conn, &Req::Info(nic as u32)) {
                Resp::Info(i) => i,
                r => return Err(HarnessError::Failed(format!("info: {r:?}"))),
            };
            host.domains.push(ProxyDomain {
                conn: Arc::clone(&host.conn),
                nic: nic as u32,
                info: NicInfo {
                    name: info.name,
                    addr: NetAddr(info.addr),
                    numa_node: info.numa,
                    link_gbps: info.link,
                },
                caps: Capabilities {
                    max_write_len: info.max_write_len,
                    max_send_len: info.max_send_len,
                    max_inflight: info.max_inflight as usize,
                    max_recvs: info.max_recvs as usize,
                    max_batch: info.max_batch as usize,
                    ordered: info.ordered,
                    device_memory: info.device_memory,
                    software_progress: info.software_progress,
                },
            });
        }
        self.hosts.push(host);
        Ok(id)
    }
    fn alloc(&mut self, host: HostId, len: usize) -> Result<weft_conformance::BufId, HarnessError> {
        match call(&self.conn(host), &Req::Alloc(len as u64)) {
            Resp::Buf(r) => r.map(weft_conformance::BufId).map_err(HarnessError::Failed),
            r => unexpected(r),
        }
    }
    fn write_mem(
        &mut self,
        host: HostId,
        buf: weft_conformance::BufId,
        offset: usize,
        data: &[u8],
    ) -> Result<(), HarnessError> {
        match call(
            &self.conn(host),
            &Req::WriteMem {
                buf: buf.0,
                offset: offset as u64,
                data: data.to_vec(),
            },
        ) {
            Resp::Unit(r) => r.map_err(HarnessError::Failed),
            r => unexpected(r),
        }
    }
    fn read_mem(
        &mut self,
        host: HostId,
        buf: weft_conformance::BufId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, HarnessError> {
        match call(
            &self.conn(host),
            &Req::ReadMem {
                buf: buf.0,
                offset: offset as u64,
                len: len as u64,
            },
        ) {
            Resp::Bytes(r) => r.map_err(HarnessError::Failed),
            r => unexpected(r),
        }
    }
    fn register(
        &mut self,
        host: HostId,
        nic: usize,
        buf: weft_conformance::BufId,
        range: Range<usize>,
        access: Access,
    ) -> Result<LocalMr, TransportError> {
        let req = Req::Register {
            nic: nic as u32,
            buf: buf.0,
            start: range.start as u64,
            end: range.end as u64,
            remote: access == Access::RemoteWrite,
        };
        match call(&self.conn(host), &req) {
            Resp::Mr(r) => r
                .map(|(key, rkey, addr, len)| LocalMr {
                    key: MrKey(key),
                    rkey: Rkey(rkey),
                    addr,
                    len,
                    device: Device::Host,
                })
                .map_err(Into::into),
            r => unexpected(r),
        }
    }
    fn domain(&mut self, host: HostId, nic: usize) -> &mut dyn Domain {
        match self.host(host).domains.get_mut(nic) {
            Some(d) => d,
            None => panic!("conformance suite bug: {host} has no nic{nic}"),
        }
    }
    fn progress(&mut self) {
        std::thread::yield_now();
    }
    fn wait_budget(&self) -> u64 {
        // Each round is a round trip to every polled child (~tens of µs).
        400_000
    }
    fn kill_host(&mut self, host: HostId) -> Result<(), HarnessError> {
        let h = self.host(host);
        h.child
            .kill()
            .map_err(|e| HarnessError::Failed(format!("kill: {e}")))?;
        let _ = h.child.wait();
        remove_shm_regions(h.child.id());
        h.killed = true;
        Ok(())
    }
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        unreachable_addr_for(self.provider.as_ref().ok_or_else(missing)?, &self.name)
    }
}

/// Generates one `#[test]` per conformance case (seed 0) for `$factory`;
/// cases listed under `known_failures` are `#[ignore]`d with the provider
/// limitation that breaks them (run them with `-- --ignored`). A further
/// test checks that every case of the suite is listed exactly once.
#[macro_export]
macro_rules! lf_conformance {
    ($factory:expr; pass: $($name:ident),* $(,)?; known_failures: $($iname:ident = $why:literal),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                weft_conformance::run_case_for_seeds(&$factory, stringify!($name), [0u64]);
            }
        )*
        $(
            #[test]
            #[ignore = $why]
            fn $iname() {
                weft_conformance::run_case_for_seeds(&$factory, stringify!($iname), [0u64]);
            }
        )*
        #[test]
        fn every_case_listed() {
            let mut listed: Vec<&str> = vec![$(stringify!($name),)* $(stringify!($iname),)*];
            listed.sort_unstable();
            let mut all: Vec<&str> = weft_conformance::cases().iter().map(|c| c.name).collect();
            all.sort_unstable();
            assert_eq!(listed, all, "conformance case list out of date");
        }
    };
}
