//! `pingpong`: SEND/RECV and WRITE-with-immediate ping-pong between two
//! engines, one per process, measured the way libfabric's `fi_pingpong`
//! measures (util/pingpong.c) and, where that tool is installed, next to it
//! on the same provider in the same invocation.
//!
//! The method, as `fi_pingpong`'s:
//! - iterations per size: 10 000 below 64 KiB, 1 000 from 64 KiB
//!   (`size_to_count`), unless `--iters`;
//! - one timer around the whole loop of the client (ping, wait for pong);
//!   the server loops (wait for ping, pong) untimed;
//! - latency = elapsed / (2 × iterations): half a round trip (its
//!   `usec/xfer`); bandwidth = 2 × iterations × size / elapsed (its `MB/sec`,
//!   10^6 bytes/s).
//!
//! One difference, stated in the rows: before each timed loop the weft
//! client runs 1 % of the iterations (at least 1) untimed, so the first size
//! does not pay connection setup. `fi_pingpong` has no warm-up; its RDM
//! endpoints connect inside the first size's loop. `fi_pingpong` has no RMA
//! mode, so the WRITE-with-immediate rows use its SEND/RECV number as their
//! baseline too.
//!
//! Each side waits on its own main thread, as `fi_pingpong` does: a SEND
//! ping-pong waits for the receive callback's counter, a WRITE ping-pong for
//! the [`OnDone::flag`] of an `expect_imm_count` round armed before its
//! ping (so every round is armed early). Libfabric backends run the server
//! engine in a child process (the binary re-executes itself as
//! `weft-bench pingpong-peer`); loopback backends, whose hosts live in one
//! process, and library callers without a peer binary run it on a thread.
//!
//! The same two-process setup measures CPU cost (module `stream`): process and
//! engine-thread CPU per GB moved (1 MiB WRITEs) and per million WRs (64 B
//! WRITEs), on the initiator and on the target.

use crate::backend::{BackendKind, Testbed};
use crate::cpu::CpuSample;
use crate::engines::wait_until;
use crate::fi_pingpong::FiPingpong;
use crate::report::Row;
use crate::stats::median;
use crate::{Config, Progress};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Instant;
use weft::{DoneCounter, GroupAddress, MrDesc, OnDone};

mod side;
use side::{e2s, peer_from, serve, Peer, Side};

const BENCH: &str = "pingpong";
/// Largest ping-pong message (the libfabric backend's `max_send_len`).
pub const MAX_MSG: u64 = 64 << 10;
/// Size of each side's buffers (the CPU-cost stream writes 1 MiB).
const BUF_LEN: u64 = 1 << 20;
/// Receive buffers each side keeps posted.
const RECV_BUFS: u32 = 16;

/// Arguments of `pingpong` (and of its part of `all`).
#[derive(Debug, Clone, clap::Args, Default)]
pub struct PingArgs {
    /// Message sizes in bytes, at most 65536 (default 64,256,1024,4096,16384,65536).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<u64>,
    /// Iterations per size (default fi_pingpong's: 10000 below 64 KiB, 1000 from
    /// 64 KiB; quick: 100).
    #[arg(long)]
    pub iters: Option<u64>,
    /// fi_pingpong binary to run side by side: a path, `auto` (looked up in
    /// PATH; the default) or `off`.
    #[arg(long)]
    pub fi_pingpong: Option<String>,
    /// Skip the CPU-cost stream rows.
    #[arg(long)]
    pub no_cpu: bool,
}

impl PingArgs {
    /// Progress steps of one backend.
    pub fn steps(&self, quick: bool) -> usize {
        self.sizes(quick).len() + 2
    }

    fn sizes(&self, quick: bool) -> Vec<u64> {
        if !self.sizes.is_empty() {
            return self.sizes.iter().map(|&s| s.clamp(1, MAX_MSG)).collect();
        }
        if quick {
            vec![64, 4096]
        } else {
            vec![64, 256, 1024, 4096, 16384, 65536]
        }
    }

    /// `fi_pingpong`'s `size_to_count`, or `--iters`.
    fn iters(&self, size: u64, quick: bool) -> u64 {
        match self.iters {
            Some(n) => n.max(1),
            None if quick => 100,
            None if size >= 1 << 20 => 100,
            None if size >= 1 << 16 => 1000,
            None => 10_000,
        }
    }
}

/// The two ping-pong kinds (and the CPU-cost stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// `submit_send` → receive callback, both ways.
    SendRecv,
    /// `submit_send` → `RecvQueue::try_recv` polled by the caller, both
    /// ways (a second engine per side, whose pool is polled).
    SendQueue,
    /// `submit_single_write` with an immediate → `expect_imm_count`, both ways.
    WriteImm,
    /// One-way WRITEs with a window (CPU cost); the server only idles.
    Stream,
}

impl Op {
    fn case(self) -> &'static str {
        match self {
            Op::SendRecv => "send_recv",
            Op::SendQueue => "send_recv_polled",
            Op::WriteImm => "write_imm",
            Op::Stream => "stream",
        }
    }
}

/// The ping-pong kinds, in table order.
const PING_OPS: [Op; 3] = [Op::SendRecv, Op::SendQueue, Op::WriteImm];

/// Control messages between the two sides (one JSON object per line).
#[derive(Debug, Serialize, Deserialize)]
enum Msg {
    Hello {
        addr: GroupAddress,
        /// The polled engine's address.
        qaddr: GroupAddress,
        desc: MrDesc,
        imm: u32,
    },
    Run {
        op: Op,
        size: u64,
        iters: u64,
    },
    Ready,
    /// Client → server after a stream.
    End,
    Done {
        cpu_ns: Option<u64>,
        engine_ns: Option<u64>,
        err: Option<String>,
    },
    Quit,
}

/// A line-oriented control channel to the other side.
trait Ctl {
    fn send_line(&mut self, line: String) -> Result<(), String>;
    fn recv_line(&mut self) -> Result<String, String>;
    fn send(&mut self, m: &Msg) -> Result<(), String> {
        let line = serde_json::to_string(m).map_err(|e| format!("encode: {e}"))?;
        self.send_line(line)
    }
    fn recv(&mut self) -> Result<Msg, String> {
        let line = self.recv_line()?;
        serde_json::from_str(&line).map_err(|e| format!("undecodable control line {line:?}: {e}"))
    }
}

struct ChanCtl {
    tx: mpsc::Sender<String>,
    rx: mpsc::Receiver<String>,
}

impl Ctl for ChanCtl {
    fn send_line(&mut self, line: String) -> Result<(), String> {
        self.tx
            .send(line)
            .map_err(|_| "peer thread gone".to_string())
    }
    fn recv_line(&mut self) -> Result<String, String> {
        self.rx.recv().map_err(|_| "peer thread gone".to_string())
    }
}

struct StdioCtl<R, W> {
    r: R,
    w: W,
}

impl<R: BufRead, W: Write> Ctl for StdioCtl<R, W> {
    fn send_line(&mut self, line: String) -> Result<(), String> {
        writeln!(self.w, "{line}")
            .and_then(|()| self.w.flush())
            .map_err(|e| format!("control write: {e}"))
    }
    fn recv_line(&mut self) -> Result<String, String> {
        let mut s = String::new();
        match self.r.read_line(&mut s) {
            Ok(0) => Err("control channel closed (peer exited)".into()),
            Ok(_) => Ok(s.trim_end().to_string()),
            Err(e) => Err(format!("control read: {e}")),
        }
    }
}

/// A peer process; killed and reaped when dropped.
struct PeerProc {
    child: Child,
    ctl: StdioCtl<BufReader<ChildStdout>, ChildStdin>,
}

impl Ctl for PeerProc {
    fn send_line(&mut self, line: String) -> Result<(), String> {
        self.ctl.send_line(line)
    }
    fn recv_line(&mut self) -> Result<String, String> {
        self.ctl.recv_line()
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.ctl.send(&Msg::Quit);
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Entry of `weft-bench pingpong-peer --backend B`: the server side in a
/// child process, on stdin/stdout.
pub fn peer_main(kind: &BackendKind) -> Result<(), String> {
    let tb = Testbed::new(kind, 1)?;
    let side = Side::new(tb.host()?, tb.host()?)?;
    let mut ctl = StdioCtl {
        r: std::io::stdin().lock(),
        w: std::io::stdout().lock(),
    };
    serve(&side, &mut ctl)
}

/// The client's view of one run.
struct Measured {
    /// Client wall time of the timed loop (s).
    secs: f64,
    /// Client process / engine-thread CPU over it (ns).
    cpu: (Option<u64>, Option<u64>),
    /// Server process / engine-thread CPU over its loop (ns).
    peer_cpu: (Option<u64>, Option<u64>),
}

struct Session {
    side: Side,
    peer: Peer,
    /// A [`PeerProc`] (dropping it reaps the child) or a channel.
    ctl: Box<dyn Ctl>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
    where_: &'static str,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.ctl.send(&Msg::Quit);
            let _ = t.join();
        }
    }
}

impl Session {
    fn open(tb: &Testbed, peer_exe: Option<&PathBuf>) -> Result<Session, String> {
        let process = peer_exe
            .filter(|_| matches!(tb.kind(), BackendKind::Libfabric(_) | BackendKind::Nvlink));
        if let Some(exe) = process {
            let mut child = Command::new(exe)
                .args(["pingpong-peer", "--backend", &tb.kind().to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("spawning {}: {e}", exe.display()))?;
            let (Some(w), Some(r)) = (child.stdin.take(), child.stdout.take()) else {
                let _ = child.kill();
                let _ = child.wait();
                return Err("peer process without pipes".into());
            };
            let mut pp = PeerProc {
                child,
                ctl: StdioCtl {
                    r: BufReader::new(r),
                    w,
                },
            };
            let peer = peer_from(pp.recv()?)?;
            let side = Side::new(tb.host()?, tb.host()?)?;
            pp.send(&side.hello())?;
            return Ok(Session {
                side,
                peer,
                ctl: Box::new(pp),
                thread: None,
                where_: "two processes",
            });
        }
        let (host, qhost) = (tb.host()?, tb.host()?);
        let (atx, brx) = mpsc::channel();
        let (btx, arx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("pingpong-peer".into())
            .spawn(move || {
                let side = Side::new(host, qhost)?;
                let mut ctl = ChanCtl { tx: btx, rx: brx };
                serve(&side, &mut ctl)
            })
            .map_err(e2s)?;
        let mut ctl = ChanCtl { tx: atx, rx: arx };
        let peer = match ctl.recv() {
            Ok(m) => peer_from(m)?,
            Err(_) => {
                return Err(match thread.join() {
                    Ok(Err(e)) => e,
                    _ => "peer thread failed".into(),
                })
            }
        };
        let side = Side::new(tb.host()?, tb.host()?)?;
        ctl.send(&side.hello())?;
        Ok(Session {
            side,
            peer,
            ctl: Box::new(ctl),
            thread: Some(thread),
            where_: "one process, two threads",
        })
    }

    /// One run: `warm` untimed iterations, then `iters` timed ones.
    fn run(&mut self, op: Op, size: u64, iters: u64, warm: u64) -> Result<Measured, String> {
        self.ctl.send(&Msg::Run {
            op,
            size,
            iters: warm + iters,
        })?;
        match self.ctl.recv()? {
            Msg::Ready => {}
            m => return Err(format!("expected Ready, got {m:?}")),
        }
        let s = &self.side;
        let p = &self.peer;
        let mut cpu = None;
        let mut t0 = Instant::now();
        let r = match op {
            Op::SendRecv => {
                let base = s.recvd.load(Ordering::Acquire);
                (1..=warm + iters).try_for_each(|i| {
                    if i == warm + 1 {
                        cpu = Some(CpuSample::now());
                        t0 = Instant::now();
                    }
                    s.send(p, size)?;
                    s.wait_recv(base + i)
                })
            }
            Op::SendQueue => (1..=warm + iters).try_for_each(|i| {
                if i == warm + 1 {
                    cpu = Some(CpuSample::now());
                    t0 = Instant::now();
                }
                s.send_queued(p, size)?;
                s.take_queued()
            }),
            Op::WriteImm => (1..=warm + iters).try_for_each(|i| {
                if i == warm + 1 {
                    cpu = Some(CpuSample::now());
                    t0 = Instant::now();
                }
                let flag = s.arm(size)?;
                s.write(p, size, Some(p.imm), OnDone::Ignore)?;
                Side::wait_flag(&flag)
            }),
            Op::Stream => {
                cpu = Some(CpuSample::now());
                t0 = Instant::now();
                stream(s, p, size, iters)
            }
        };
        let secs = t0.elapsed().as_secs_f64();
        let used = cpu.map(|c| c.since()).unwrap_or_default();
        if op == Op::Stream {
            self.ctl.send(&Msg::End)?;
        }
        let done = self.ctl.recv()?;
        r?;
        match done {
            Msg::Done {
                cpu_ns,
                engine_ns,
                err: None,
            } => Ok(Measured {
                secs,
                cpu: (used.process_ns, used.engine_ns),
                peer_cpu: (cpu_ns, engine_ns),
            }),
            Msg::Done { err: Some(e), .. } => Err(format!("peer: {e}")),
            m => Err(format!("expected Done, got {m:?}")),
        }
    }
}

/// `n` one-way WRITEs of `size` bytes, at most 64 outstanding.
fn stream(s: &Side, p: &Peer, size: u64, n: u64) -> Result<(), String> {
    let c = Arc::new(DoneCounter::new());
    for i in 0..n {
        wait_until(|| i - c.total() < 64)?;
        s.write(p, size, None, OnDone::counter(&c))?;
    }
    wait_until(|| c.total() >= n)?;
    if c.failed() > 0 {
        return Err(format!("{} writes failed", c.failed()));
    }
    Ok(())
}

/// Runs `pingpong` on `kind`: both ping-pongs at every size (interleaved
/// with `fi_pingpong` on libfabric backends, `cfg.rounds()` times, medians
/// reported), then the CPU-cost stream.
pub fn run(cfg: &Config, args: &PingArgs, kind: &BackendKind, progress: &mut Progress) -> Vec<Row> {
    let backend = kind.to_string();
    let sizes = args.sizes(cfg.quick);
    progress.step(&format!("pingpong {backend} setup"));
    let tb = match Testbed::new(kind, 1) {
        Ok(t) => t,
        Err(why) => return vec![Row::unavailable(BENCH, "all", &backend, 1, why)],
    };
    let mut sess = match Session::open(&tb, cfg.peer_exe.as_ref()) {
        Ok(s) => s,
        Err(why) => return vec![Row::failed(BENCH, "setup", &backend, 1, why)],
    };
    let fi_prov = match kind {
        BackendKind::Libfabric(p) => Some(p.clone()),
        _ => None,
    };
    let fi = fi_prov
        .as_ref()
        .and_then(|_| FiPingpong::find(args.fi_pingpong.as_deref().unwrap_or("auto")));
    let fi_note = match (&fi_prov, &fi) {
        (None, _) => "no fi_pingpong for this backend".to_string(),
        (Some(_), None) => "fi_pingpong not installed".to_string(),
        (Some(_), Some(f)) => format!("fi_pingpong SEND/RECV ({})", f.path().display()),
    };
    let mut rows = Vec::new();
    for &size in &sizes {
        progress.step(&format!("pingpong {backend} {size} B"));
        let iters = args.iters(size, cfg.quick);
        let warm = (iters / 100).max(1);
        let mut lat: [Vec<f64>; 3] = Default::default();
        let mut cpu: [Vec<f64>; 3] = Default::default();
        let mut fi_lat = Vec::new();
        let mut fi_mb = Vec::new();
        let mut err: [Option<String>; 3] = Default::default();
        let mut fi_err = None;
        for _ in 0..cfg.rounds() {
            for (k, op) in PING_OPS.into_iter().enumerate() {
                if err[k].is_some() {
                    continue;
                }
                match sess.run(op, size, iters, warm) {
                    Ok(m) => {
                        lat[k].push(m.secs * 1e6 / (2 * iters) as f64);
                        if let (Some(a), Some(b)) = (m.cpu.0, m.peer_cpu.0) {
                            cpu[k].push((a + b) as f64 / 1e3 / (2 * iters) as f64);
                        }
                    }
                    Err(e) => err[k] = Some(e),
                }
            }
            if let (Some(f), Some(p)) = (&fi, &fi_prov) {
                if fi_err.is_none() {
                    match f.run(p, size, iters) {
                        Ok(r) => {
                            fi_lat.push(r.usec_per_xfer);
                            fi_mb.push(r.mb_per_s);
                        }
                        Err(e) => fi_err = Some(e),
                    }
                }
            }
        }
        let base = (!fi_lat.is_empty()).then(|| median(&mut fi_lat));
        let base_mb = (!fi_mb.is_empty()).then(|| median(&mut fi_mb));
        for (k, op) in PING_OPS.into_iter().enumerate() {
            if let Some(e) = err[k].take() {
                rows.push(Row::failed(BENCH, op.case(), &backend, 1, e));
                continue;
            }
            let us = median(&mut lat[k]);
            let mut row = Row::new(
                BENCH,
                op.case(),
                &backend,
                1,
                crate::report::fmt_bytes(size),
                "latency (half RTT)",
                "us",
                us,
                base.map(|b| (b, fi_note.as_str())),
            )
            .size(size)
            .extra("iters", iters as f64)
            .extra("warmup_iters", warm as f64)
            .extra("mb_per_s", 2.0 * size as f64 / us)
            .extra(
                "two_processes",
                f64::from(u8::from(sess.where_ == "two processes")),
            );
            if !cpu[k].is_empty() {
                row = row.extra("cpu_us_per_xfer_both_sides", median(&mut cpu[k]));
            }
            if let Some(mb) = base_mb {
                row = row.extra("fi_pingpong_mb_per_s", mb);
            }
            if base.is_none() {
                row.baseline_name = match &fi_err {
                    Some(e) => format!("fi_pingpong failed: {e}"),
                    None => fi_note.clone(),
                };
            }
            rows.push(row);
        }
    }
    if !args.no_cpu {
        progress.step(&format!("pingpong {backend} CPU cost"));
        rows.extend(cpu_rows(cfg, &mut sess, &backend));
    }
    rows
}

/// CPU per GB (1 MiB WRITEs) and per million WRs (64 B WRITEs), initiator
/// and target, process and engine threads.
fn cpu_rows(cfg: &Config, sess: &mut Session, backend: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    let cases: [(u64, u64, &str); 2] = if cfg.quick {
        [(1 << 20, 64, "cpu_per_gb"), (64, 2_000, "cpu_per_mwr")]
    } else {
        [(1 << 20, 2_000, "cpu_per_gb"), (64, 100_000, "cpu_per_mwr")]
    };
    for (size, n, case) in cases {
        let mut v: Vec<[Option<f64>; 4]> = Vec::new();
        let mut secs = Vec::new();
        for _ in 0..cfg.rounds() {
            match sess.run(Op::Stream, size, n, 0) {
                Ok(m) => {
                    // Per GB (10^9 bytes) or per 10^6 WRs, in CPU seconds.
                    let per = if case == "cpu_per_gb" {
                        (size * n) as f64 / 1e9
                    } else {
                        n as f64 / 1e6
                    };
                    let f = |x: Option<u64>| x.map(|ns| ns as f64 / 1e9 / per);
                    v.push([f(m.cpu.0), f(m.cpu.1), f(m.peer_cpu.0), f(m.peer_cpu.1)]);
                    secs.push(m.secs);
                }
                Err(e) => {
                    rows.push(Row::failed(BENCH, case, backend, 1, e));
                    break;
                }
            }
        }
        if v.is_empty() {
            continue;
        }
        let col = |i: usize| {
            let mut c: Vec<f64> = v.iter().filter_map(|r| r[i]).collect();
            (!c.is_empty()).then(|| median(&mut c))
        };
        let Some(init) = col(0) else {
            rows.push(Row::unavailable(
                BENCH,
                case,
                backend,
                1,
                "no per-thread CPU times (/proc) on this system".into(),
            ));
            continue;
        };
        let unit = if case == "cpu_per_gb" {
            "CPU s/GB"
        } else {
            "CPU s/M WRs"
        };
        let wall = median(&mut secs);
        let mut row = Row::new(
            BENCH,
            case,
            backend,
            1,
            format!("{n} x {}", crate::report::fmt_bytes(size)),
            "initiator process CPU",
            unit,
            init,
            None,
        )
        .size(size)
        .extra("wall_s", wall);
        for (i, k) in [
            (1, "initiator_engine_threads"),
            (2, "target_process"),
            (3, "target_engine_threads"),
        ] {
            if let Some(x) = col(i) {
                row = row.extra(k, x);
            }
        }
        rows.push(row);
    }
    rows
}
