//! TransferEngine end to end over libfabric `tcp` (`tcp;ofi_rxm` on `lo`)
//! across real processes: the test process runs one engine (one group of 2
//! NICs = two endpoints of `lo`) and spawns peer processes (this test binary
//! re-executed to run only [`peer_process_entry`]), each with its own engine
//! of 2 NICs and a registered buffer. Addresses, `MrDesc`s and immediate
//! expectations travel over the child's stdin/stdout as postcard in hex, one
//! message per line. Every peer verifies every byte in its
//! `expect_imm_count` callback and reports back.
//!
//! - `scatter_paged_and_barrier_to_peer_processes`: sharded single writes,
//!   paged writes, scatter (both modes) and a barrier to 3 peer processes.
//! - `peer_process_killed_mid_transfer`: large writes pending to 3 peers,
//!   one of them (stopped, so nothing to it can complete) is SIGKILLed:
//!   every pending op to it resolves with an error, the survivors' writes
//!   complete byte-exact, and fresh scatter/barrier rounds to the survivors
//!   work afterwards.
//! - `peer_process_killed_while_streaming`: the same with a running victim.
//! - `stopped_peer_times_out`: a peer that stops answering without closing
//!   its connection (SIGSTOP) fails every WRITE to it with `PeerUnreachable`
//!   after `write_timeout`, and nothing breaks when it wakes up again.
//!
//! Children are killed and reaped by a drop guard when a test fails, and
//! exit on their own when their stdin closes. Skipped (printed) when
//! libfabric is unavailable.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use weft_engine::{
    DomainGroupSpec, DoneFlag, EngineConfig, EngineError, GroupAddress, Imm, MrDesc, MrHandle,
    OnDone, Pages, ScatterDst, ScatterMode, TransferEngine,
};
use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::{Provider, TransportError};

/// Role of a re-executed child: the size of its buffer in bytes.
const ENV_PEER_BUF: &str = "WEFT_LF_XPROC_PEER_BUF";
/// Prefix of protocol lines on the child's stdout (libtest prints there too).
const LINE_PREFIX: &str = "WEFT-XPROC ";
/// Immediate values each peer allocates (fresh engines agree on them).
const IMMS: usize = 4;

// ---------------------------------------------------------------------------
// Buffers and patterns
// ---------------------------------------------------------------------------

#[path = "support/host_buf.rs"]
mod host_buf;
#[path = "support/wait.rs"]
mod wait;
use host_buf::HostBuf;
use wait::{wait_flag, wait_until, DEADLINE};

/// Byte `i` of the source pattern `seed` (the parent fills its source with
/// it; peers check their destination against it).
fn pat(seed: u64, i: u64) -> u8 {
    let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (x >> 29) as u8
}

// ---------------------------------------------------------------------------
// Protocol
// ---------------------------------------------------------------------------

/// What one submit produces at the receiver (the peer computes the count
/// from its own `imm_counts`, as a real receiver does).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum Kind {
    Single { len: u64 },
    Paged { page_len: u64, pages: u64 },
    Scatter { len: u64, by_bytes: bool },
    Barrier,
}

/// `len` bytes at `dst_off` of the peer's buffer must equal the pattern
/// `seed` from source offset `src_off`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Region {
    src_off: u64,
    dst_off: u64,
    len: u64,
    seed: u64,
}

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
        count: u64,
    },
    Done {
        tag: u64,
        result: Result<(), String>,
    },
    Bye,
}

fn to_line<T: Serialize>(v: &T) -> String {
    let bytes = postcard::to_allocvec(v).expect("encode");
    let mut s = String::with_capacity(LINE_PREFIX.len() + 2 * bytes.len());
    s.push_str(LINE_PREFIX);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn from_line<T: for<'de> Deserialize<'de>>(line: &str) -> Option<Result<T, String>> {
    // libtest may have printed "test peer_process_entry ... " (no newline)
    // just before the first line.
    let at = line.find(LINE_PREFIX)?;
    let hex = line[at + LINE_PREFIX.len()..].trim_end();
    let decode = || -> Result<T, String> {
        if !hex.len().is_multiple_of(2) {
            return Err("odd hex length".into());
        }
        let bytes = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).map_err(|e| e.to_string()))
            .collect::<Result<Vec<u8>, String>>()?;
        postcard::from_bytes(&bytes).map_err(|e| e.to_string())
    };
    Some(decode())
}

// ---------------------------------------------------------------------------
// Engines
// ---------------------------------------------------------------------------

/// A tcp provider with 2 endpoints of `lo`, or `None` (printed).
fn provider() -> Option<Arc<dyn Provider>> {
    provider_with(|c| c)
}

/// [`provider`] with `tweak` applied to its configuration.
fn provider_with(
    tweak: impl FnOnce(LibfabricConfig) -> LibfabricConfig,
) -> Option<Arc<dyn Provider>> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let cfg = tweak(
        LibfabricConfig::new("tcp")
            .with_domains(["lo", "lo"])
            .with_connect_timeout(Duration::from_secs(3)),
    );
    match LibfabricProvider::with_config(cfg) {
        Ok(p) => Some(Arc::new(p)),
        Err(e) => {
            eprintln!("SKIP: libfabric provider tcp unavailable: {e}");
            None
        }
    }
}

/// An engine with one group of 2 tcp NICs.
fn engine(p: Arc<dyn Provider>) -> TransferEngine {
    let cfg = EngineConfig {
        idle_sleep: Some(Duration::from_micros(500)),
        ..EngineConfig::default()
    };
    let e = TransferEngine::builder()
        .group(DomainGroupSpec::new(p, vec![0, 1]))
        .config(cfg)
        .build()
        .expect("engine over tcp builds");
    assert_eq!(e.nic_count(0).expect("group 0"), 2, "2 NICs per engine");
    e
}

// ---------------------------------------------------------------------------
// Child side
// ---------------------------------------------------------------------------

/// Entry point of the peer processes. Run normally (no role in the
/// environment) it does nothing.
#[test]
fn peer_process_entry() {
    let Ok(buf) = std::env::var(ENV_PEER_BUF) else {
        return;
    };
    let code = match run_peer(&buf) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!(
                "weft-libfabric engine peer process {}: {e}",
                std::process::id()
            );
            1
        }
    };
    std::process::exit(code);
}

/// Writes one protocol line to the real stdout (not libtest's capture).
fn say(msg: &FromPeer) {
    static OUT: Mutex<()> = Mutex::new(());
    let _g = OUT.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = std::io::stdout().lock();
    // A parent that went away is noticed on stdin.
    let _ = writeln!(out, "{}", to_line(msg));
    let _ = out.flush();
}

fn check_regions(buf: &HostBuf, regions: &[Region]) -> Result<(), String> {
    for r in regions {
        let got = buf
            .read(r.dst_off as usize, r.len as usize)
            .ok_or_else(|| format!("{r:?} outside the peer's buffer"))?;
        if let Some(k) = (0..r.len).find(|&k| got[k as usize] != pat(r.seed, r.src_off + k)) {
            return Err(format!(
                "{r:?}: byte {k} is {:#04x}, expected {:#04x}",
                got[k as usize],
                pat(r.seed, r.src_off + k)
            ));
        }
    }
    Ok(())
}

fn run_peer(buf_len: &str) -> Result<(), String> {
    let len: usize = buf_len
        .parse()
        .map_err(|e| format!("{ENV_PEER_BUF}: {e}"))?;
    let p = provider().ok_or("libfabric tcp unavailable in the peer process")?;
    let e = engine(p);
    let buf = Arc::new(HostBuf::new(len));
    let (_mr, desc) = e.reg_mr(buf.region()).map_err(|e| format!("reg_mr: {e}"))?;
    let imms = (0..IMMS)
        .map(|_| e.alloc_imm())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("alloc_imm: {e}"))?;
    say(&FromPeer::Hello {
        pid: std::process::id(),
        addr: e.main_address(),
        desc,
        imms,
    });
    let counts = e.imm_counts(0).map_err(|e| format!("imm_counts: {e}"))?;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        let line = match lines.next() {
            None => break, // parent gone
            Some(Ok(l)) => l,
            Some(Err(e)) => return Err(format!("read stdin: {e}")),
        };
        let msg: ToPeer = match from_line(&line) {
            None => continue,
            Some(m) => m.map_err(|e| format!("bad request line: {e}"))?,
        };
        match msg {
            ToPeer::Quit => break,
            ToPeer::Expect {
                tag,
                imm,
                kinds,
                regions,
            } => {
                let count: u64 = kinds
                    .iter()
                    .map(|k| match *k {
                        Kind::Single { len } => counts.single_write(len),
                        Kind::Paged { page_len, pages } => counts.paged_writes(page_len, pages),
                        Kind::Scatter { len, by_bytes } => counts.scatter_dst(
                            len,
                            if by_bytes {
                                ScatterMode::ByBytes
                            } else {
                                ScatterMode::ByPeer
                            },
                        ),
                        Kind::Barrier => counts.barrier(),
                    })
                    .sum();
                let n = u32::try_from(count).map_err(|_| "imm count overflows u32")?;
                let buf = Arc::clone(&buf);
                e.expect_imm_count(imm, n, move |r| {
                    let result = match r {
                        Err(e) => Err(format!("imm round failed: {e}")),
                        Ok(()) => check_regions(&buf, &regions),
                    };
                    say(&FromPeer::Done { tag, result });
                })
                .map_err(|e| format!("expect_imm_count: {e}"))?;
                say(&FromPeer::Armed { tag, count });
            }
        }
    }
    e.shutdown();
    say(&FromPeer::Bye);
    Ok(())
}

// ---------------------------------------------------------------------------
// Parent side
// ---------------------------------------------------------------------------

/// One peer process. Dropping it kills and reaps the process.
struct PeerProc {
    idx: usize,
    child: Child,
    stdin: Option<ChildStdin>,
    rx: Receiver<FromPeer>,
    pid: u32,
    addr: GroupAddress,
    desc: MrDesc,
    imms: Vec<Imm>,
    dead: bool,
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PeerProc {
    fn spawn(idx: usize, buf_len: usize) -> PeerProc {
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = Command::new(exe)
            .args([
                "peer_process_entry",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_PEER_BUF, buf_len.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn peer process");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("child stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let m = match from_line::<FromPeer>(&line) {
                    None => continue, // libtest chatter
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        eprintln!("peer {idx}: undecodable line: {e}");
                        break;
                    }
                };
                if tx.send(m).is_err() {
                    break;
                }
            }
        });
        // Guard first, so the child is reaped if the hello never comes.
        let mut p = PeerProc {
            idx,
            child,
            stdin,
            rx,
            pid: 0,
            addr: GroupAddress { nics: Vec::new() },
            desc: MrDesc {
                addr: 0,
                len: 0,
                rkeys: Vec::new(),
            },
            imms: Vec::new(),
            dead: false,
        };
        match p.recv("hello") {
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
            m => panic!("peer {idx}: expected hello, got {m:?}"),
        }
        assert_eq!(p.pid, p.child.id(), "peer {idx}: pid");
        assert_eq!(p.addr.nics.len(), 2, "peer {idx}: 2 NICs");
        p
    }

    fn recv(&mut self, what: &str) -> FromPeer {
        match self.rx.recv_timeout(DEADLINE) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                panic!("peer {}: no {what} within {DEADLINE:?}", self.idx)
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.try_wait();
                panic!(
                    "peer {}: exited while waiting for {what} ({status:?})",
                    self.idx
                )
            }
        }
    }

    fn send(&mut self, m: &ToPeer) {
        let stdin = self.stdin.as_mut().expect("peer stdin open");
        writeln!(stdin, "{}", to_line(m))
            .and_then(|()| stdin.flush())
            .unwrap_or_else(|e| panic!("peer {}: write to stdin: {e}", self.idx));
    }

    /// Arms a round at the peer and waits until it is armed.
    fn expect(&mut self, tag: u64, imm: Imm, kinds: Vec<Kind>, regions: Vec<Region>) {
        self.send(&ToPeer::Expect {
            tag,
            imm,
            kinds,
            regions,
        });
        match self.recv("armed") {
            FromPeer::Armed { tag: t, count } if t == tag => {
                assert!(
                    count > 0,
                    "peer {}: round {tag} expects no immediate",
                    self.idx
                )
            }
            m => panic!("peer {}: expected armed {tag}, got {m:?}", self.idx),
        }
    }

    /// Waits for round `tag` to fire at the peer with every byte in place.
    fn wait_done(&mut self, tag: u64) {
        match self.recv(&format!("round {tag}")) {
            FromPeer::Done { tag: t, result } if t == tag => {
                if let Err(e) = result {
                    panic!("peer {}: round {tag}: {e}", self.idx);
                }
            }
            m => panic!("peer {}: expected done {tag}, got {m:?}", self.idx),
        }
    }

    fn signal(&self, sig: i32) {
        let pid = i32::try_from(self.pid).expect("pid fits i32");
        // SAFETY: plain kill(2) on our own child, not yet reaped.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig})");
    }

    /// SIGKILLs the process and reaps it.
    fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let status = self.child.wait().expect("reap killed peer");
        assert!(!status.success(), "killed peer exited successfully?");
        self.dead = true;
    }

    /// Asks the peer to shut down and checks it exits cleanly.
    fn quit(&mut self) {
        self.send(&ToPeer::Quit);
        match self.recv("bye") {
            FromPeer::Bye => {}
            m => panic!("peer {}: expected bye, got {m:?}", self.idx),
        }
        drop(self.stdin.take());
        let start = Instant::now();
        loop {
            match self.child.try_wait().expect("try_wait") {
                Some(status) => {
                    assert!(status.success(), "peer {} exited with {status}", self.idx);
                    break;
                }
                None if start.elapsed() > DEADLINE => {
                    panic!("peer {} did not exit after bye", self.idx)
                }
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        self.dead = true;
    }
}

fn wait_ok(what: &str, f: &Arc<DoneFlag>) {
    wait_flag(what, f).unwrap_or_else(|e| panic!("{what} failed: {e}"));
}

fn is_unreachable(e: &EngineError) -> bool {
    matches!(e, EngineError::Transport { .. })
        && matches!(e.transport(), Some(TransportError::PeerUnreachable { .. }))
}

/// Submits `writes` single writes of `wlen` bytes with `imm` to every peer
/// of `par`: write `k` to peer `j` goes from source offset `src_off(k, j)`
/// to destination offset `k * wlen`. Returns the flags, per peer.
fn submit_to_all(
    par: &Parent,
    writes: u64,
    wlen: u64,
    imm: Imm,
    src_off: impl Fn(u64, u64) -> u64,
    what: &str,
) -> Vec<Vec<Arc<DoneFlag>>> {
    let mut flags: Vec<Vec<Arc<DoneFlag>>> = vec![Vec::new(); par.peers.len()];
    for k in 0..writes {
        for (j, fl) in flags.iter_mut().enumerate() {
            let (od, flag) = OnDone::flag();
            par.engine
                .submit_single_write(
                    wlen,
                    Some(imm),
                    (&par.smr, src_off(k, j as u64)),
                    (&par.peers[j].desc, k * wlen),
                    od,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            fl.push(flag);
        }
    }
    flags
}

/// The parent: an engine, a patterned source buffer, and peer processes.
struct Parent {
    engine: TransferEngine,
    /// Registered as `smr`; kept alive until the engine is shut down.
    _src: HostBuf,
    smr: MrHandle,
    seed: u64,
    peers: Vec<PeerProc>,
    imms: Vec<Imm>,
}

impl Parent {
    fn new(peers: usize, src_len: usize, peer_buf: usize, seed: u64) -> Option<Parent> {
        Self::with_provider(provider()?, peers, src_len, peer_buf, seed)
    }

    fn with_provider(
        p: Arc<dyn Provider>,
        peers: usize,
        src_len: usize,
        peer_buf: usize,
        seed: u64,
    ) -> Option<Parent> {
        let engine = engine(p);
        let src = HostBuf::from_fn(src_len, |i| pat(seed, i as u64));
        let (smr, _) = engine.reg_mr(src.region()).expect("reg src");
        let peers: Vec<PeerProc> = (0..peers).map(|j| PeerProc::spawn(j, peer_buf)).collect();
        let imms = peers[0].imms.clone();
        for p in &peers {
            assert_eq!(
                p.imms, imms,
                "fresh engines should hand out the same imm values"
            );
        }
        Some(Parent {
            engine,
            _src: src,
            smr,
            seed,
            peers,
            imms,
        })
    }

    fn region(&self, src_off: u64, dst_off: u64, len: u64) -> Region {
        Region {
            src_off,
            dst_off,
            len,
            seed: self.seed,
        }
    }

    /// Arms peer `j` (round `tag`) for what [`submit_to_all`] with the same
    /// `writes`, `wlen` and `src_off` sends it: single writes `k` of `wlen`
    /// bytes from source offset `src_off(k, j)` to offset `k * wlen`.
    fn expect_singles(
        &mut self,
        j: usize,
        tag: u64,
        imm: Imm,
        writes: u64,
        wlen: u64,
        src_off: impl Fn(u64, u64) -> u64,
    ) {
        let kinds = (0..writes).map(|_| Kind::Single { len: wlen }).collect();
        let regions = (0..writes)
            .map(|k| self.region(src_off(k, j as u64), k * wlen, wlen))
            .collect();
        self.peers[j].expect(tag, imm, kinds, regions);
    }
}

impl Drop for Parent {
    fn drop(&mut self) {
        // Peers first (their guards kill them), then the engine.
        self.peers.clear();
        self.engine.shutdown();
    }
}

/// A scatter round (and a barrier after it) to `members` (peer indices):
/// each peer checks its slice when its immediates are in.
fn scatter_round(
    par: &mut Parent,
    members: &[usize],
    mode: ScatterMode,
    tag: u64,
    imm: Imm,
    bimm: Imm,
) {
    let smr = par.smr;
    let addrs: Vec<GroupAddress> = members.iter().map(|&j| par.peers[j].addr.clone()).collect();
    let h = par.engine.add_peer_group(&addrs).expect("add peer group");
    let by_bytes = mode == ScatterMode::ByBytes;
    let mut dsts = Vec::new();
    for (k, &j) in members.iter().enumerate() {
        let len = [70_001u64, 3, 1_200_000 + 4096 * tag, 65_536][(j + tag as usize) % 4];
        let d = ScatterDst {
            len,
            src_offset: (k as u64) * 1_300_000 + tag,
            dst: par.peers[j].desc.clone(),
            dst_offset: 17 * j as u64 + 4096 * tag,
        };
        let r = par.region(d.src_offset, d.dst_offset, len);
        par.peers[j].expect(tag, imm, vec![Kind::Scatter { len, by_bytes }], vec![r]);
        dsts.push(d);
    }
    let (od, flag) = OnDone::flag();
    par.engine
        .submit_scatter_mode(&h, od, Some(imm), &smr, &dsts, mode)
        .expect("submit scatter");
    let what = format!("scatter {mode:?} round {tag}");
    wait_ok(&what, &flag);
    for &j in members {
        par.peers[j].wait_done(tag);
    }
    // Barrier after the scatter.
    let btag = tag + 1_000;
    for &j in members {
        par.peers[j].expect(btag, bimm, vec![Kind::Barrier], vec![]);
    }
    let descs: Vec<MrDesc> = members.iter().map(|&j| par.peers[j].desc.clone()).collect();
    let (od, flag) = OnDone::flag();
    par.engine
        .submit_barrier(&h, od, bimm, &descs)
        .expect("submit barrier");
    wait_ok("barrier", &flag);
    for &j in members {
        par.peers[j].wait_done(btag);
    }
}

#[test]
fn scatter_paged_and_barrier_to_peer_processes() {
    const PEERS: usize = 3;
    const LEN: usize = 8 << 20;
    let t0 = Instant::now();
    let Some(mut par) = Parent::new(PEERS, LEN, LEN, 0x5eed_0001) else {
        return;
    };
    let imms = par.imms.clone();
    let smr = par.smr;

    // Sharded single writes, all peers at once: one round per peer covering
    // several sizes (below and above the sharding threshold).
    let sizes = [1u64, 4097, 65_539, 1_000_003, (3 << 20) + 777];
    let mut flags = Vec::new();
    for j in 0..PEERS {
        let mut kinds = Vec::new();
        let mut regions = Vec::new();
        let mut wrs = Vec::new();
        let mut dst_off = 0u64;
        for (k, &len) in sizes.iter().enumerate() {
            let src_off = (3 + 5 * k + 11 * j) as u64;
            kinds.push(Kind::Single { len });
            regions.push(par.region(src_off, dst_off, len));
            wrs.push((len, src_off, dst_off));
            dst_off += len + 4096 + 7;
        }
        par.peers[j].expect(1, imms[0], kinds, regions);
        for (len, so, d_o) in wrs {
            let (od, flag) = OnDone::flag();
            par.engine
                .submit_single_write(
                    len,
                    Some(imms[0]),
                    (&smr, so),
                    (&par.peers[j].desc, d_o),
                    od,
                )
                .expect("submit single write");
            flags.push((format!("single write of {len} to peer {j}"), flag));
        }
    }
    for (what, f) in &flags {
        wait_ok(what, f);
    }
    for p in &mut par.peers {
        p.wait_done(1);
    }

    // Paged writes: odd page length, a different page permutation per peer.
    let page = 5000u64;
    let mut flags = Vec::new();
    for j in 0..PEERS {
        let sp = Pages {
            indices: vec![5, 0, 9, 2, 7, 3, 11, 1],
            stride: 8192,
            offset: 17 + j as u64,
        };
        let mut di: Vec<u32> = vec![3, 6, 0, 7, 1, 5, 2, 4];
        di.rotate_left(j);
        let dp = Pages {
            indices: di,
            stride: 6000,
            offset: 5 << 20,
        };
        let regions = (0..sp.indices.len())
            .map(|i| {
                par.region(
                    sp.page_offset(i).expect("src page"),
                    dp.page_offset(i).expect("dst page"),
                    page,
                )
            })
            .collect();
        let kinds = vec![Kind::Paged {
            page_len: page,
            pages: sp.indices.len() as u64,
        }];
        par.peers[j].expect(2, imms[1], kinds, regions);
        let (od, flag) = OnDone::flag();
        par.engine
            .submit_paged_writes(
                page,
                Some(imms[1]),
                (&smr, &sp),
                (&par.peers[j].desc, &dp),
                od,
            )
            .expect("submit paged writes");
        flags.push((format!("paged writes to peer {j}"), flag));
    }
    for (what, f) in &flags {
        wait_ok(what, f);
    }
    for p in &mut par.peers {
        p.wait_done(2);
    }

    // Scatter to every peer process (both spreading modes), each followed
    // by a barrier.
    let all: Vec<usize> = (0..PEERS).collect();
    scatter_round(&mut par, &all, ScatterMode::ByPeer, 3, imms[2], imms[3]);
    scatter_round(&mut par, &all, ScatterMode::ByBytes, 4, imms[2], imms[3]);

    for p in &mut par.peers {
        p.quit();
    }
    eprintln!(
        "scatter_paged_and_barrier_to_peer_processes: {:.2} s",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn peer_process_killed_mid_transfer() {
    const PEERS: usize = 3;
    const VICTIM: usize = 1;
    const WRITES: u64 = 8;
    const WLEN: u64 = 4 << 20;
    const LEN: usize = (WRITES * WLEN) as usize + (1 << 20);
    let t0 = Instant::now();
    let Some(mut par) = Parent::new(PEERS, LEN, LEN, 0x5eed_0002) else {
        return;
    };
    let imms = par.imms.clone();
    let all: Vec<usize> = (0..PEERS).collect();
    // Warm up: connections on both NICs to every peer.
    scatter_round(&mut par, &all, ScatterMode::ByBytes, 1, imms[2], imms[3]);

    // Stop the victim: nothing sent to it can complete (delivery-complete
    // needs its acknowledgement), so its writes are certainly pending when
    // it is killed.
    par.peers[VICTIM].signal(libc::SIGSTOP);
    let smr = par.smr;
    let src_off = |k: u64, j: u64| k * 4096 + j;
    for j in all.iter().copied().filter(|&j| j != VICTIM) {
        par.expect_singles(j, 10, imms[0], WRITES, WLEN, src_off);
    }
    let flags = submit_to_all(&par, WRITES, WLEN, imms[0], src_off, "submit large write");
    // The survivors' writes complete while the victim is stopped.
    for j in all.iter().copied().filter(|&j| j != VICTIM) {
        for (k, f) in flags[j].iter().enumerate() {
            wait_ok(&format!("write {k} to survivor {j}"), f);
        }
        par.peers[j].wait_done(10);
    }
    let pending = flags[VICTIM].iter().filter(|f| !f.is_done()).count();
    assert!(
        pending > 0,
        "every write to the stopped peer completed: the kill would not be mid-transfer"
    );

    // Kill it: every pending op resolves, with an error.
    par.peers[VICTIM].kill();
    let t_kill = Instant::now();
    let mut errors = Vec::new();
    for (k, f) in flags[VICTIM].iter().enumerate() {
        match wait_flag(&format!("write {k} to the killed peer"), f) {
            Ok(()) => panic!("write {k} to a stopped-then-killed peer succeeded"),
            Err(e) => errors.push(e),
        }
    }
    let resolve_s = t_kill.elapsed().as_secs_f64();
    for e in &errors {
        assert!(
            is_unreachable(e),
            "write to the killed peer: expected Transport/PeerUnreachable, got {e}"
        );
    }
    eprintln!(
        "{pending}/{WRITES} writes pending at the kill, all failed ({resolve_s:.2} s after the reap); first: {}",
        errors[0]
    );

    // A new write to the dead peer fails too (no hang).
    let (od, flag) = OnDone::flag();
    par.engine
        .submit_single_write(
            WLEN,
            Some(imms[0]),
            (&smr, 0),
            (&par.peers[VICTIM].desc, 0),
            od,
        )
        .expect("submit to the dead peer");
    let e = wait_flag("write to the dead peer after the kill", &flag)
        .expect_err("write to a dead peer succeeded");
    assert!(
        is_unreachable(&e),
        "write to the dead peer after the kill: {e}"
    );

    // The survivors keep working: fresh scatter + barrier rounds, and
    // large writes again.
    let survivors: Vec<usize> = all.iter().copied().filter(|&j| j != VICTIM).collect();
    scatter_round(
        &mut par,
        &survivors,
        ScatterMode::ByPeer,
        20,
        imms[2],
        imms[3],
    );
    scatter_round(
        &mut par,
        &survivors,
        ScatterMode::ByBytes,
        21,
        imms[2],
        imms[3],
    );
    let mut flags = Vec::new();
    for &j in &survivors {
        let kinds = (0..2).map(|_| Kind::Single { len: WLEN }).collect();
        let regions = (0..2u64)
            .map(|k| par.region(k * 8192 + 5, (k + 1) * WLEN, WLEN))
            .collect();
        par.peers[j].expect(30, imms[1], kinds, regions);
        for k in 0..2u64 {
            let (od, flag) = OnDone::flag();
            par.engine
                .submit_single_write(
                    WLEN,
                    Some(imms[1]),
                    (&smr, k * 8192 + 5),
                    (&par.peers[j].desc, (k + 1) * WLEN),
                    od,
                )
                .expect("submit write after the kill");
            flags.push(flag);
        }
    }
    for f in &flags {
        wait_ok("write to a survivor after the kill", f);
    }
    for &j in &survivors {
        par.peers[j].wait_done(30);
    }
    for &j in &survivors {
        par.peers[j].quit();
    }
    eprintln!(
        "peer_process_killed_mid_transfer: {:.2} s",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn peer_process_killed_while_streaming() {
    const PEERS: usize = 2;
    const VICTIM: usize = 0;
    const SURVIVOR: usize = 1;
    const WRITES: u64 = 32;
    const WLEN: u64 = 2 << 20;
    const LEN: usize = (WRITES * WLEN) as usize + (1 << 20);
    let t0 = Instant::now();
    let Some(mut par) = Parent::new(PEERS, LEN, LEN, 0x5eed_0003) else {
        return;
    };
    let imms = par.imms.clone();
    scatter_round(&mut par, &[0, 1], ScatterMode::ByBytes, 1, imms[2], imms[3]);

    // Stream to both peers; kill the victim (running, not stopped) once a
    // few of its writes landed, with the rest in flight or queued.
    let src_off = |k: u64, _: u64| k * 512 + 1;
    par.expect_singles(SURVIVOR, 10, imms[0], WRITES, WLEN, src_off);
    let flags = submit_to_all(
        &par,
        WRITES,
        WLEN,
        imms[0],
        src_off,
        "submit streaming write",
    );
    wait_until("a few writes to the victim", || {
        flags[VICTIM].iter().filter(|f| f.is_done()).count() >= 2
    });
    let pending = flags[VICTIM].iter().filter(|f| !f.is_done()).count();
    par.peers[VICTIM].kill();
    let mut failed = 0;
    for (k, f) in flags[VICTIM].iter().enumerate() {
        // Writes the victim acknowledged before dying succeed; every other
        // one fails with PeerUnreachable. None may hang.
        match wait_flag(&format!("write {k} to the killed peer"), f) {
            Ok(()) => {}
            Err(e) if is_unreachable(&e) => failed += 1,
            Err(e) => {
                panic!("write {k} to the killed peer: expected success or PeerUnreachable, got {e}")
            }
        }
    }
    eprintln!("{pending}/{WRITES} writes to the victim unresolved at the kill, {failed} failed");
    for (k, f) in flags[SURVIVOR].iter().enumerate() {
        wait_ok(&format!("write {k} to the survivor"), f);
    }
    par.peers[SURVIVOR].wait_done(10);
    // The survivor keeps working.
    scatter_round(
        &mut par,
        &[SURVIVOR],
        ScatterMode::ByBytes,
        20,
        imms[2],
        imms[3],
    );
    par.peers[SURVIVOR].quit();
    eprintln!(
        "peer_process_killed_while_streaming: {:.2} s",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn stopped_peer_times_out() {
    const PEERS: usize = 2;
    const VICTIM: usize = 0;
    const SURVIVOR: usize = 1;
    const WRITES: u64 = 8;
    const WLEN: u64 = 4 << 20;
    const LEN: usize = (WRITES * WLEN) as usize + (1 << 20);
    const TIMEOUT: Duration = Duration::from_secs(2);
    let t0 = Instant::now();
    let Some(p) = provider_with(|c| c.with_write_timeout(TIMEOUT)) else {
        return;
    };
    let Some(mut par) = Parent::with_provider(p, PEERS, LEN, LEN, 0x5eed_0004) else {
        return;
    };
    let imms = par.imms.clone();
    let smr = par.smr;
    scatter_round(&mut par, &[0, 1], ScatterMode::ByBytes, 1, imms[2], imms[3]);

    // The victim stops answering but keeps its connections (the kernel
    // still accepts data into its socket buffers).
    par.peers[VICTIM].signal(libc::SIGSTOP);
    let src_off = |k: u64, _: u64| k * 512 + 3;
    par.expect_singles(SURVIVOR, 10, imms[0], WRITES, WLEN, src_off);
    let t_submit = Instant::now();
    let flags = submit_to_all(&par, WRITES, WLEN, imms[0], src_off, "submit large write");
    for (k, f) in flags[SURVIVOR].iter().enumerate() {
        wait_ok(&format!("write {k} to the survivor"), f);
    }
    par.peers[SURVIVOR].wait_done(10);

    // Every write to the stopped peer fails as unreachable, and not before
    // the timeout ran out.
    for (k, f) in flags[VICTIM].iter().enumerate() {
        match wait_flag(&format!("write {k} to the stopped peer"), f) {
            Ok(()) => panic!("write {k} to a stopped peer succeeded"),
            Err(e) => assert!(
                is_unreachable(&e),
                "write {k} to the stopped peer: expected Transport/PeerUnreachable, got {e}"
            ),
        }
    }
    let failed_after = t_submit.elapsed();
    assert!(
        failed_after >= TIMEOUT,
        "writes to the stopped peer failed after {failed_after:?}, before the {TIMEOUT:?} timeout"
    );
    eprintln!(
        "stopped_peer_times_out: {WRITES} writes failed {:.2} s after submit",
        failed_after.as_secs_f64()
    );

    // New work to it fails at once.
    let (od, flag) = OnDone::flag();
    par.engine
        .submit_single_write(64, None, (&smr, 0), (&par.peers[VICTIM].desc, 0), od)
        .expect("submit to the timed-out peer");
    let e = wait_flag("write to the timed-out peer", &flag)
        .expect_err("write to a timed-out peer succeeded");
    assert!(is_unreachable(&e), "write to the timed-out peer: {e}");

    // It wakes up: the parent is unharmed, and the survivor keeps working.
    par.peers[VICTIM].signal(libc::SIGCONT);
    for round in 0..2 {
        scatter_round(
            &mut par,
            &[SURVIVOR],
            ScatterMode::ByPeer,
            20 + round,
            imms[2],
            imms[3],
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    par.peers[SURVIVOR].quit();
    eprintln!(
        "stopped_peer_times_out: {:.2} s",
        t0.elapsed().as_secs_f64()
    );
}
