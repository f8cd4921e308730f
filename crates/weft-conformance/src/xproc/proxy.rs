//! The parent side of the domain proxy: [`CrossProcess`], a conformance
//! [`Harness`] whose every host is a child process, and [`ProxyDomain`].

use super::frame::{recv_frame, send_frame};
use super::wire::{Req, Resp, WriteW};
use super::{XprocBackend, DEADLINE, ENTRY_TEST, ENV_NICS, ENV_PROFILE, ENV_SOCKET, ROLE_DOMAINS};
use crate::{BufId, Harness, HarnessError, HostId};
use std::ffi::OsStr;
use std::ops::Range;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use weft_testkit::child::{spawn_role, ChildProcess};
use weft_transport::{
    Access, Capabilities, Completion, Device, Domain, LocalMr, LocalSlice, MemRegion, MrKey,
    NetAddr, NicInfo, PeerId, PostError, Rkey, TransportError, WrId, WriteWr,
};

// ---------------------------------------------------------------------------
// Parent side
// ---------------------------------------------------------------------------

type Conn = Arc<Mutex<UnixStream>>;

fn call(conn: &Conn, req: &Req) -> Resp {
    match try_call(conn, req) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    }
}

/// [`call`], with a failure as an error rather than a panic.
fn try_call(conn: &Conn, req: &Req) -> Result<Resp, String> {
    let mut s = conn
        .lock()
        .map_err(|_| "peer connection poisoned".to_string())?;
    send_frame(&mut *s, req).map_err(|e| format!("peer process gone (sending {req:?}): {e}"))?;
    recv_frame(&mut *s).map_err(|e| format!("peer process gone (awaiting reply): {e}"))
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
    fn remove_peer(&mut self, peer: PeerId) -> Result<(), TransportError> {
        match call(
            &self.conn,
            &Req::RemovePeer {
                nic: self.nic,
                peer: peer.0,
            },
        ) {
            Resp::Done(r) => r.map_err(Into::into),
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

/// A host process; dropping it kills and reaps the child.
struct ChildHost {
    child: ChildProcess,
    conn: Conn,
    domains: Vec<ProxyDomain>,
    killed: bool,
}

impl ChildHost {
    /// Kills and reaps the child (if not yet), then lets the backend clean
    /// up after it.
    fn reap<B: XprocBackend>(&mut self, backend: Option<&mut B>) {
        let _ = self.child.kill();
        if let Some(b) = backend {
            b.reaped(self.child.id());
        }
    }
}

/// Every host is a child process (this test binary, re-executed to run only
/// the [`ENTRY_TEST`] test).
pub struct CrossProcess<B: XprocBackend> {
    profile: String,
    /// `Err` (the reason) when the backend is unavailable: every case that
    /// needs a host is skipped with it.
    backend: Result<B, HarnessError>,
    seed: u64,
    dir: std::path::PathBuf,
    hosts: Vec<ChildHost>,
}

impl<B: XprocBackend> CrossProcess<B> {
    /// A harness for the backend `profile` names (cases are skipped with a
    /// message when it is unavailable).
    pub fn new(profile: &str, seed: u64) -> Self {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("weft-xproc-{}-{n}", std::process::id()));
        Self {
            profile: profile.to_string(),
            backend: B::from_profile(profile),
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

impl<B: XprocBackend> Drop for CrossProcess<B> {
    fn drop(&mut self) {
        for h in &mut self.hosts {
            h.reap(self.backend.as_mut().ok());
        }
        self.hosts.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl<B: XprocBackend> Harness for CrossProcess<B> {
    fn name(&self) -> String {
        super::harness_name(&self.backend, &self.profile)
    }
    fn seed(&self) -> u64 {
        self.seed
    }
    fn add_host(&mut self, nics: usize) -> Result<HostId, HarnessError> {
        let max = self.backend.as_ref().map_err(Clone::clone)?.max_nics();
        if nics > max {
            return Err(HarnessError::Unsupported(format!(
                "{nics} NICs per host (max {max})"
            )));
        }
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| HarnessError::Failed(format!("mkdir: {e}")))?;
        let id = HostId(self.hosts.len());
        let path = self.dir.join(format!("host{}.sock", id.0));
        let listener = UnixListener::bind(&path)
            .map_err(|e| HarnessError::Failed(format!("bind {}: {e}", path.display())))?;
        let nics_s = nics.to_string();
        let child = spawn_role(
            ENTRY_TEST,
            ROLE_DOMAINS,
            &[
                (ENV_SOCKET, path.as_os_str()),
                (ENV_PROFILE, OsStr::new(&self.profile)),
                (ENV_NICS, OsStr::new(&nics_s)),
            ],
        )
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
        let deadline = std::time::Instant::now() + DEADLINE;
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
                        return Err(HarnessError::Failed(format!(
                            "peer process did not connect within {DEADLINE:?}"
                        )));
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
    fn alloc(&mut self, host: HostId, len: usize) -> Result<BufId, HarnessError> {
        match call(&self.conn(host), &Req::Alloc(len as u64)) {
            Resp::Buf(r) => r.map(BufId).map_err(HarnessError::Failed),
            r => unexpected(r),
        }
    }
    fn write_mem(
        &mut self,
        host: HostId,
        buf: BufId,
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
        buf: BufId,
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
        buf: BufId,
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
        if !h.killed {
            // Out of the provider first (see `Req::Freeze`); a child that
            // cannot answer is killed all the same.
            if let Err(e) = try_call(&h.conn, &Req::Freeze) {
                eprintln!("xproc: freezing host {host:?} before its kill failed: {e}");
            }
        }
        h.child
            .kill()
            .map_err(|e| HarnessError::Failed(format!("kill: {e}")))?;
        h.killed = true;
        let pid = h.child.id();
        if let Ok(b) = self.backend.as_mut() {
            b.reaped(pid);
        }
        Ok(())
    }
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        self.backend
            .as_mut()
            .map_err(|e| e.clone())?
            .unreachable_addr()
    }
}
