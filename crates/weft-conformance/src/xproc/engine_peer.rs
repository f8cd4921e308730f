//! Engine peers in child processes: the line protocol, the child's loop
//! ([`run_peer`]), the parent's handle ([`ProcPeer`]) and the engine-suite
//! harness ([`XprocEngines`]).

use super::frame::{from_line, to_line};
use super::{XprocBackend, DEADLINE, ENTRY_TEST, ENV_PEER_BUF, ENV_PROFILE, ROLE_ENGINE};
use crate::engine::{EngineHarness, EnginePeer, Kind, LocalPeer, Region};
use crate::HarnessError;
use serde::{Deserialize, Serialize};
use std::ffi::OsStr;
use std::io::{ErrorKind, Write};
use std::time::{Duration, Instant};
use weft_engine::{GroupAddress, Imm, MrDesc, TransferEngine};
use weft_testkit::child::{self, spawn_role, ChildProcess};

#[derive(Debug, Serialize, Deserialize)]
enum ToPeer {
    /// Arm `imm` for the immediates of all `kinds`; when the round fires,
    /// check `regions` and report `Done { tag }`.
    Expect {
        tag: u64,
        imm: Imm,
        kinds: Vec<Kind>,
        regions: Vec<Region>,
    },
    /// Post a receive pool (a polled one: `TransferEngine::recv_queue`);
    /// reply `Posted`.
    Recvs { len: u64, count: u32, polled: bool },
    /// Reply `Received` with the messages received since the last one.
    TakeReceived,
    /// Shut the engine down and exit.
    Quit,
}

#[derive(Debug, Serialize, Deserialize)]
enum FromPeer {
    Hello {
        pid: u32,
        addr: GroupAddress,
        desc: MrDesc,
        imms: Vec<Imm>,
    },
    Armed {
        tag: u64,
        result: Result<u64, String>,
    },
    Done {
        tag: u64,
        result: Result<(), String>,
    },
    Posted(Result<(), String>),
    Received(Vec<Result<Vec<u8>, String>>),
    Bye,
}

/// Sends one protocol line to the parent (from any thread).
fn say(msg: &FromPeer) {
    let line = match to_line(msg) {
        Ok(l) => l,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "encode {msg:?}: {e}");
            return;
        }
    };
    // A parent that went away is noticed on stdin.
    let _ = child::send_line(&line);
}

/// The child's loop: a [`LocalPeer`] serving the parent's lines on stdin
/// until `Quit` or end of input.
pub(crate) fn run_peer<B: XprocBackend>(backend: &B) -> Result<(), String> {
    let len: usize = std::env::var(ENV_PEER_BUF)
        .map_err(|e| format!("{ENV_PEER_BUF}: {e}"))?
        .parse()
        .map_err(|e| format!("{ENV_PEER_BUF}: {e}"))?;
    let mut peer = LocalPeer::with_memory(backend.engine()?, backend.alloc(len)?)?.with_round_hook(
        |tag, result| {
            say(&FromPeer::Done {
                tag,
                result: result.clone(),
            })
        },
    );
    say(&FromPeer::Hello {
        pid: std::process::id(),
        addr: peer.address(),
        desc: peer.desc(),
        imms: peer.imms(),
    });
    loop {
        let line = match child::recv_line() {
            Ok(None) => break, // parent gone
            Ok(Some(l)) => l,
            Err(e) => return Err(format!("read stdin: {e}")),
        };
        let msg: ToPeer = from_line(&line).map_err(|e| format!("bad request line: {e}"))?;
        match msg {
            ToPeer::Quit => break,
            ToPeer::Expect {
                tag,
                imm,
                kinds,
                regions,
            } => {
                let result = peer
                    .expect(tag, imm, kinds, regions)
                    .map_err(|e| e.to_string());
                say(&FromPeer::Armed { tag, result });
            }
            ToPeer::Recvs { len, count, polled } => {
                let r = peer
                    .post_recvs(len, count, polled)
                    .map_err(|e| e.to_string());
                say(&FromPeer::Posted(r));
            }
            ToPeer::TakeReceived => say(&FromPeer::Received(peer.take_received())),
        }
    }
    peer.shutdown().map_err(|e| e.to_string())?;
    say(&FromPeer::Bye);
    Ok(())
}

/// One engine peer in a child process. Dropping it kills and reaps the
/// process.
pub struct ProcPeer {
    idx: usize,
    child: ChildProcess,
    pid: u32,
    addr: GroupAddress,
    desc: MrDesc,
    imms: Vec<Imm>,
    /// Rounds reported while waiting for something else.
    rounds: Vec<(u64, Result<(), String>)>,
}

impl ProcPeer {
    fn spawn(idx: usize, profile: &str, buf_len: usize) -> Result<ProcPeer, HarnessError> {
        let buf_len = buf_len.to_string();
        let child = spawn_role(
            ENTRY_TEST,
            ROLE_ENGINE,
            &[
                (ENV_PROFILE, OsStr::new(profile)),
                (ENV_PEER_BUF, OsStr::new(&buf_len)),
            ],
        )
        .map_err(|e| HarnessError::Failed(format!("spawn peer process: {e}")))?;
        // Guard first, so the child is reaped if the hello never comes.
        let mut p = ProcPeer {
            idx,
            child,
            pid: 0,
            addr: GroupAddress {
                nics: Vec::new(),
                incarnation: Default::default(),
            },
            desc: MrDesc {
                addr: 0,
                len: 0,
                rkeys: Vec::new(),
                incarnation: Default::default(),
            },
            imms: Vec::new(),
            rounds: Vec::new(),
        };
        match p.recv("hello")? {
            FromPeer::Hello {
                pid,
                addr,
                desc,
                imms,
            } => {
                p.pid = pid;
                p.addr = addr;
                p.desc = desc;
                p.imms = imms;
            }
            m => return Err(p.fail(format!("expected hello, got {m:?}"))),
        }
        if p.pid != p.child.id() {
            return Err(p.fail(format!("pid {} in hello, child is {}", p.pid, p.child.id())));
        }
        Ok(p)
    }

    fn fail(&self, what: String) -> HarnessError {
        HarnessError::Failed(format!("peer process {}: {what}", self.idx))
    }

    /// The next message that is not a round report (those are kept).
    fn recv(&mut self, what: &str) -> Result<FromPeer, HarnessError> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.child.recv_line_timeout(left) {
                Ok(Some(line)) => match from_line(&line) {
                    Ok(FromPeer::Done { tag, result }) => self.rounds.push((tag, result)),
                    Ok(m) => return Ok(m),
                    Err(e) => return Err(self.fail(format!("undecodable line: {e}"))),
                },
                Err(e) if e.kind() == ErrorKind::TimedOut => {
                    return Err(self.fail(format!("no {what} within {DEADLINE:?}")))
                }
                Err(e) => return Err(self.fail(format!("read while waiting for {what}: {e}"))),
                Ok(None) => {
                    let status = self.child.try_wait();
                    return Err(self.fail(format!("exited while waiting for {what} ({status:?})")));
                }
            }
        }
    }

    fn send(&mut self, m: &ToPeer) -> Result<(), HarnessError> {
        let line = to_line(m).map_err(|e| self.fail(format!("encode: {e}")))?;
        self.child
            .send_line(&line)
            .map_err(|e| self.fail(format!("write to stdin: {e}")))
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends `sig` to the child (e.g. `SIGSTOP`, `SIGCONT`); fails once it
    /// has exited.
    pub fn signal(&mut self, sig: i32) -> Result<(), HarnessError> {
        let pid = self.pid;
        self.child
            .signal(sig)
            .map_err(|e| self.fail(format!("kill({pid}, {sig}): {e}")))
    }

    /// SIGSTOPs the child and returns once every one of its threads is
    /// stopped: the signal is delivered asynchronously, and a thread still
    /// running after `kill` returns could answer one more operation (a
    /// WRITE meant to hit a stopped peer would then succeed).
    pub fn stop(&mut self) -> Result<(), HarnessError> {
        self.signal(libc::SIGSTOP)?;
        let pid = self.pid;
        let start = Instant::now();
        loop {
            match all_threads_stopped(pid) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.fail(format!("reading /proc/{pid}/task: {e}"))),
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(self.fail("still running 10 s after SIGSTOP".into()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGKILLs the process and reaps it.
    pub fn kill(&mut self) -> Result<(), HarnessError> {
        let status = self
            .child
            .kill()
            .map_err(|e| self.fail(format!("kill and reap peer: {e}")))?;
        if status.success() {
            return Err(self.fail("killed peer exited successfully?".into()));
        }
        Ok(())
    }
}

/// Whether every thread of process `pid` is in the stopped state (`T`, or
/// `t` when traced), from `/proc/<pid>/task/<tid>/stat`. A thread that
/// exits meanwhile is skipped.
fn all_threads_stopped(pid: u32) -> std::io::Result<bool> {
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = entry?.path().join("stat");
        let stat = match std::fs::read_to_string(&path) {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        // "tid (comm) S ...": the state follows the last ')' (comm may
        // hold spaces and parentheses).
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        if !matches!(state, Some('T' | 't')) {
            return Ok(false);
        }
    }
    Ok(true)
}

impl EnginePeer for ProcPeer {
    fn address(&self) -> GroupAddress {
        self.addr.clone()
    }

    fn desc(&self) -> MrDesc {
        self.desc.clone()
    }

    fn imms(&self) -> Vec<Imm> {
        self.imms.clone()
    }

    fn expect(
        &mut self,
        tag: u64,
        imm: Imm,
        kinds: Vec<Kind>,
        regions: Vec<Region>,
    ) -> Result<u64, HarnessError> {
        self.send(&ToPeer::Expect {
            tag,
            imm,
            kinds,
            regions,
        })?;
        match self.recv("armed")? {
            FromPeer::Armed { tag: t, result } if t == tag => result.map_err(HarnessError::Failed),
            m => Err(self.fail(format!("expected armed {tag}, got {m:?}"))),
        }
    }

    fn take_rounds(&mut self) -> Vec<(u64, Result<(), String>)> {
        while let Ok(Some(line)) = self.child.recv_line_timeout(Duration::ZERO) {
            match from_line(&line) {
                Ok(FromPeer::Done { tag, result }) => self.rounds.push((tag, result)),
                other => {
                    let _ = writeln!(
                        std::io::stderr(),
                        "peer process {}: unexpected {other:?}",
                        self.idx
                    );
                }
            }
        }
        std::mem::take(&mut self.rounds)
    }

    fn post_recvs(&mut self, len: u64, count: u32, polled: bool) -> Result<(), HarnessError> {
        self.send(&ToPeer::Recvs { len, count, polled })?;
        match self.recv("posted")? {
            FromPeer::Posted(r) => r.map_err(HarnessError::Failed),
            m => Err(self.fail(format!("expected posted, got {m:?}"))),
        }
    }

    fn take_received(&mut self) -> Vec<Result<Vec<u8>, String>> {
        let r = self
            .send(&ToPeer::TakeReceived)
            .and_then(|()| match self.recv("received")? {
                FromPeer::Received(v) => Ok(v),
                m => Err(self.fail(format!("expected received, got {m:?}"))),
            });
        match r {
            Ok(v) => v,
            Err(e) => vec![Err(e.to_string())],
        }
    }

    /// Asks the peer to shut down and checks it exits cleanly.
    fn shutdown(&mut self) -> Result<(), HarnessError> {
        self.send(&ToPeer::Quit)?;
        match self.recv("bye")? {
            FromPeer::Bye => {}
            m => return Err(self.fail(format!("expected bye, got {m:?}"))),
        }
        self.child.close_stdin();
        let start = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => break,
                Ok(Some(status)) => return Err(self.fail(format!("exited with {status}"))),
                Ok(None) if start.elapsed() > DEADLINE => {
                    return Err(self.fail("did not exit after bye".into()))
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => return Err(self.fail(format!("try_wait: {e}"))),
            }
        }
        Ok(())
    }
}

/// An [`EngineHarness`] whose initiator lives in this process and whose
/// every peer is a child process running an engine of `B`.
pub struct XprocEngines<B: XprocBackend> {
    // Drop order: peers (killed and reaped), then the initiator is shut
    // down in `Drop`.
    peers: Vec<ProcPeer>,
    initiator: Option<TransferEngine>,
    profile: String,
    backend: Result<B, HarnessError>,
    seed: u64,
    stop_hook: bool,
}

impl<B: XprocBackend> XprocEngines<B> {
    /// A harness for the backend `profile` names (scenarios are skipped
    /// with a message when it is unavailable). Peers can be stopped
    /// (SIGSTOP) as well as killed.
    pub fn new(profile: &str, seed: u64) -> Self {
        Self {
            peers: Vec::new(),
            initiator: None,
            profile: profile.into(),
            backend: B::from_profile(profile),
            seed,
            stop_hook: true,
        }
    }

    /// Reports the stop hook as unsupported, so the peer-death scenario
    /// kills a running peer in mid-stream instead of a stopped one.
    pub fn without_stop_hook(mut self) -> Self {
        self.stop_hook = false;
        self
    }

    /// Peer `ix` as a process (to signal it, e.g. `SIGCONT`).
    pub fn proc_peer(&mut self, ix: usize) -> &mut ProcPeer {
        match self.peers.get_mut(ix) {
            Some(p) => p,
            None => panic!("engine suite bug: no peer {ix}"),
        }
    }
}

impl<B: XprocBackend> Drop for XprocEngines<B> {
    fn drop(&mut self) {
        for p in &mut self.peers {
            let _ = p.child.kill();
            if let Ok(b) = self.backend.as_mut() {
                b.reaped(p.pid);
            }
        }
        self.peers.clear();
        if let Some(e) = &self.initiator {
            e.shutdown();
        }
    }
}

impl<B: XprocBackend> EngineHarness for XprocEngines<B> {
    fn name(&self) -> String {
        super::harness_name(&self.backend, &self.profile)
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn initiator(&mut self) -> Result<TransferEngine, HarnessError> {
        if let Some(e) = &self.initiator {
            return Ok(e.clone());
        }
        let b = self.backend.as_ref().map_err(Clone::clone)?;
        let e = b.engine().map_err(HarnessError::Failed)?;
        self.initiator = Some(e.clone());
        Ok(e)
    }

    fn add_peer(&mut self, buf_len: usize) -> Result<usize, HarnessError> {
        self.backend.as_ref().map_err(Clone::clone)?;
        let ix = self.peers.len();
        let p = ProcPeer::spawn(ix, &self.profile, buf_len)?;
        self.peers.push(p);
        Ok(ix)
    }

    fn peer(&mut self, ix: usize) -> &mut dyn EnginePeer {
        self.proc_peer(ix)
    }

    fn progress(&mut self) {
        std::thread::sleep(Duration::from_micros(200));
    }

    fn wait_budget(&self) -> u64 {
        300_000
    }

    fn kill_peer(&mut self, ix: usize) -> Result<(), HarnessError> {
        let p = self.proc_peer(ix);
        p.kill()?;
        let pid = p.pid;
        if let Ok(b) = self.backend.as_mut() {
            b.reaped(pid);
        }
        Ok(())
    }

    fn stop_peer(&mut self, ix: usize) -> Result<(), HarnessError> {
        if !self.stop_hook {
            return Err(HarnessError::Unsupported(
                "stop hook switched off (peers are killed while running)".into(),
            ));
        }
        self.proc_peer(ix).stop()
    }
}
