//! `weft-rl run` and its hidden `worker` subcommand: ranks as child
//! processes (libfabric tcp / shm) or threads (loopback).

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::worker::{self, Cluster, Peer, SpawnFn, Spec, ThreadPeer};

/// Lines a worker writes to the parent start with this.
const PREFIX: &str = "@rl ";

/// A rank in a child process of this binary.
struct ProcPeer {
    child: Child,
    stdin: Option<std::process::ChildStdin>,
    rx: mpsc::Receiver<String>,
}

impl ProcPeer {
    fn spawn(spec: &Spec, role: &str, rank: u32) -> Result<ProcPeer, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["worker", role, &rank.to_string(), &spec.encode()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawning {role} {rank}: {e}"))?;
        let out = child.stdout.take().ok_or("no child stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(l) = line.strip_prefix(PREFIX) {
                    if tx.send(l.to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let stdin = child.stdin.take();
        Ok(ProcPeer { child, stdin, rx })
    }
}

impl Peer for ProcPeer {
    fn send(&mut self, line: &str) -> Result<(), String> {
        let s = self.stdin.as_mut().ok_or("stdin closed")?;
        writeln!(s, "{line}")
            .and_then(|_| s.flush())
            .map_err(|e| e.to_string())
    }
    fn recv(&mut self, timeout: Duration) -> Result<Option<String>, String> {
        Ok(self.rx.recv_timeout(timeout).ok())
    }
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ProcPeer {
    fn drop(&mut self) {
        self.stdin.take();
        if matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The child side of `weft-rl worker ROLE RANK SPEC`.
pub fn worker_main(role: &str, rank: u32, spec: &str) -> Result<(), String> {
    let spec = Spec::decode(spec)?;
    let b = worker::backend(&spec)?;
    let e = worker::engine(&b, spec.nics)?;
    let mut send = |l: &str| {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{PREFIX}{l}");
        let _ = o.flush();
    };
    let mut recv = || {
        let mut s = String::new();
        match std::io::stdin().lock().read_line(&mut s) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(s.trim_end().to_string()),
        }
    };
    worker::serve(role, rank, &spec, e, &mut send, &mut recv)
}

/// Starts a cluster for `spec`: threads on one backend for loopback,
/// processes otherwise.
pub fn start(spec: &Spec) -> Result<(Cluster, Box<SpawnFn<'static>>), String> {
    let mut spawn: Box<SpawnFn<'static>> = if spec.provider.starts_with("loopback") {
        let b = worker::backend(spec)?;
        let s = spec.clone();
        Box::new(move |role, rank| {
            Ok(Box::new(ThreadPeer::spawn(&s, &b, role, rank)?) as Box<dyn Peer>)
        })
    } else {
        let s = spec.clone();
        Box::new(move |role, rank| Ok(Box::new(ProcPeer::spawn(&s, role, rank)?) as Box<dyn Peer>))
    };
    let c = Cluster::start(spec, &mut *spawn)?;
    Ok((c, spawn))
}

/// `weft-rl run`: `steps` P2P updates and as many Rank0 updates, side by
/// side, each checked bit-exact; with `kill`, a trainer is killed during
/// one more update, the old weights are checked, it is replaced and the
/// update retried.
pub fn run(spec: &Spec, steps: u64, kill: bool) -> Result<(), String> {
    let (ml, plan) = spec.build()?;
    let bytes = plan.inference_bytes();
    println!(
        "{} over {}: {} trainers -> {} inference ranks, {} into inference per update, {} groups / {} waves",
        spec.model,
        spec.provider,
        spec.train.ranks(),
        spec.infer.ranks,
        weft_rl::summary::human(bytes as f64),
        plan.groups.len(),
        plan.groups.iter().map(|g| g.waves.len()).sum::<usize>()
    );
    let _ = ml;
    let (mut c, mut spawn) = start(spec)?;
    let all_ok = |r: &[Result<(), String>]| -> Result<(), String> {
        match r.iter().find_map(|x| x.as_ref().err()) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    };
    println!("| update | path | wall ms | GB/s into inference | bytes differing from reference |");
    println!("|---|---|---|---|---|");
    let mut version = 0;
    for s in 0..steps {
        let data = 1000 + s;
        let (r, t) = c.step("p2p", version, data, &mut |_| {})?;
        all_ok(&r)?;
        let bad: u64 = c.check(data, None)?.iter().sum();
        println!(
            "| {s} | weft P2P | {:.1} | {:.2} | {bad} |",
            t.as_secs_f64() * 1e3,
            bytes as f64 / t.as_secs_f64() / 1e9
        );
        let (r, t) = c.step("rank0", version, data, &mut |_| {})?;
        all_ok(&r)?;
        let bad0: u64 = c.check(data, Some((version % 2) as usize))?.iter().sum();
        println!(
            "| {s} | Rank0 | {:.1} | {:.2} | {bad0} |",
            t.as_secs_f64() * 1e3,
            bytes as f64 / t.as_secs_f64() / 1e9
        );
        if bad + bad0 > 0 {
            return Err(format!(
                "update {s}: {bad} (P2P) and {bad0} (Rank0) bytes differ"
            ));
        }
        version += 1;
    }
    if kill {
        let data = 5000;
        let victim = 1.min(spec.train.ranks() - 1);
        let (r, _) = c.step("p2p", version, data, &mut |c| {
            std::thread::sleep(Duration::from_millis(5));
            c.trainers[victim as usize].kill();
        })?;
        let failed = r.iter().filter(|x| x.is_err()).count();
        println!(
            "kill: trainer {victim} killed during update {version}: {failed}/{} ranks failed",
            r.len()
        );
        for (k, x) in r.iter().enumerate() {
            if let Err(e) = x {
                println!("  rank {k}: {e}");
            }
        }
        if failed != r.len() {
            return Err(format!(
                "only {failed} of {} ranks failed the step",
                r.len()
            ));
        }
        let bad: u64 = c.check(1000 + steps - 1, None)?.iter().sum();
        println!(
            "kill: live weights still version {} : {bad} bytes differ",
            version - 1
        );
        if bad > 0 {
            return Err("the previous weights were damaged".into());
        }
        c.replace_trainer(victim, &mut *spawn)?;
        c.recover()?;
        let (r, t) = c.step("p2p", version, data, &mut |_| {})?;
        all_ok(&r)?;
        let bad: u64 = c.check(data, None)?.iter().sum();
        println!(
            "kill: retry with a new trainer {victim}: {:.1} ms, {bad} bytes differ",
            t.as_secs_f64() * 1e3
        );
        if bad > 0 {
            return Err("retry wrote wrong bytes".into());
        }
    }
    c.quit();
    Ok(())
}
