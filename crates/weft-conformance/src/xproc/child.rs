//! The child side of the domain proxy: a host whose domains live in this
//! (child) process and serve the parent's requests.

use super::frame::{recv_frame, send_frame};
use super::wire::{CompW, ErrW, InfoW, Req, Resp, SliceW, WriteW};
use super::{XprocBackend, ENV_NICS, ENV_SOCKET};
use crate::TestMemory;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use weft_transport::{
    Access, Completion, Domain, MrKey, NetAddr, PeerId, RemoteAccessReason, TransportError, WrId,
    WriteWr,
};

/// Field order matters: the domains (and their registrations) drop before
/// the memory they registered.
struct ChildState {
    domains: Vec<Box<dyn Domain>>,
    pending: Vec<Vec<Completion>>,
    /// SEND+WRITE WRs per NIC whose completion the parent has not polled
    /// yet. The background poller frees the domain's slots early, so the
    /// child enforces `max_inflight` as the parent sees it.
    outstanding: Vec<usize>,
    mem: Vec<Box<dyn TestMemory>>,
}

/// Checks that the proxy codec round-trips every message kind (what the
/// entry test does when run normally, not as a child).
pub(crate) fn codec_selftest() {
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
        Req::RemovePeer { nic: 1, peer: 3 },
        Req::Freeze,
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
        TransportError::PeerRemoved {
            nic: "n".into(),
            peer: NetAddr(vec![3]),
        },
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

/// Serves the parent listening on the Unix socket `ENV_SOCKET` names with
/// `ENV_NICS` domains of `backend`, until the parent goes away.
pub(crate) fn serve<B: XprocBackend>(backend: &B) -> Result<(), String> {
    let path = std::env::var(ENV_SOCKET).map_err(|e| format!("{ENV_SOCKET}: {e}"))?;
    let path = path.as_str();
    let nics: usize = std::env::var(ENV_NICS)
        .map_err(|e| e.to_string())?
        .parse()
        .map_err(|e| format!("{ENV_NICS}: {e}"))?;
    let domains = backend.open_domains(nics)?;
    if domains.len() != nics {
        return Err(format!(
            "backend opened {} domains, asked for {nics}",
            domains.len()
        ));
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
        if req == Req::Freeze {
            // Every provider call of this process (commands and the
            // background poller) holds the state lock: holding it until
            // the parent's SIGKILL means the kill never lands inside the
            // provider. A process killed there can leave a provider lock in
            // shared memory held for good (libfabric shm's region lock),
            // and the peers that write to it then spin in `fi_write`
            // forever: a provider hazard, not what `peer_death` tests.
            let _held = state.lock().map_err(|_| "state poisoned".to_string())?;
            if let Err(e) = send_frame(&mut sock, &Resp::Unit(Ok(()))) {
                break Err(format!("write response: {e}"));
            }
            loop {
                std::thread::park();
            }
        }
        let resp = {
            let mut st = state.lock().map_err(|_| "state poisoned".to_string())?;
            handle(&mut st, req, &|len| backend.alloc(len))
        };
        if let Err(e) = send_frame(&mut sock, &resp) {
            break Err(format!("write response: {e}"));
        }
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = bg.join();
    result
}

fn handle(
    st: &mut ChildState,
    req: Req,
    alloc: &dyn Fn(usize) -> Result<Box<dyn TestMemory>, String>,
) -> Resp {
    fn dom(st: &mut ChildState, nic: u32) -> Result<&mut Box<dyn Domain>, TransportError> {
        st.domains
            .get_mut(nic as usize)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: format!("nic{nic}"),
                what: "no such nic in child".into(),
            })
    }
    fn mem(st: &ChildState, buf: u64) -> Result<&dyn TestMemory, String> {
        st.mem
            .get(buf as usize)
            .map(|b| &**b)
            .ok_or_else(|| "no such buffer".into())
    }
    fn outside(offset: u64, len: u64, m: &dyn TestMemory) -> String {
        format!("[{offset}, +{len}) outside buffer of {}", m.len())
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
            let r = usize::try_from(len)
                .map_err(|e| e.to_string())
                .and_then(alloc)
                .map(|b| {
                    st.mem.push(b);
                    st.mem.len() as u64 - 1
                });
            Resp::Buf(r)
        }
        Req::WriteMem { buf, offset, data } => Resp::Unit(mem(st, buf).and_then(|m| {
            let fits = usize::try_from(offset).is_ok_and(|off| m.write(off, &data));
            fits.then_some(())
                .ok_or_else(|| outside(offset, data.len() as u64, m))
        })),
        Req::ReadMem { buf, offset, len } => Resp::Bytes(mem(st, buf).and_then(|m| {
            usize::try_from(offset)
                .ok()
                .zip(usize::try_from(len).ok())
                .and_then(|(off, n)| m.read(off, n))
                .ok_or_else(|| outside(offset, len, m))
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
                let m = mem(st, buf).map_err(|e| fail(&e))?;
                // The buffer lives in the state, after the domains that
                // register it (they drop first).
                let region = usize::try_from(start)
                    .ok()
                    .zip(usize::try_from(end).ok())
                    .and_then(|(s, e)| m.sub_region(s..e))
                    .ok_or_else(|| fail(&outside(start, len, m)))?;
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
        Req::RemovePeer { nic, peer } => Resp::Done(
            dom(st, nic)
                .and_then(|d| d.remove_peer(PeerId(peer)))
                .map_err(|e| (&e).into()),
        ),
        // Answered by `serve` itself (it must keep the state lock).
        Req::Freeze => Resp::Unit(Err("freeze is handled by serve".into())),
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
