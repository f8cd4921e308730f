//! The `weft-kvcache` CLI as separate prefill and decode processes over
//! libfabric tcp and shm: a full run, a decoder killed mid-request and a
//! prefiller killed mid-request (the survivor reports a typed error and
//! exits; nothing hangs). Skips (prints SKIP) where libfabric is missing.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};
use weft::{LibfabricOptions, ProviderConfig, ProviderSpec};

/// Hang detection only: nothing here is a timed assertion.
const HANG: Duration = Duration::from_secs(120);

struct Proc {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

fn spawn(args: &[&str]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_weft-kvcache"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn weft-kvcache");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    Proc {
        child,
        lines: rx,
        seen: Vec::new(),
    }
}

impl Proc {
    /// The first line (from now on) starting with `prefix`.
    fn expect(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + HANG;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.starts_with(prefix) {
                        return l;
                    }
                }
                Err(e) => panic!("no line {prefix:?} ({e}); saw {:?}", self.seen),
            }
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}").expect("write stdin");
        stdin.flush().expect("flush");
    }

    fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + HANG;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(l);
                }
                return s;
            }
            assert!(Instant::now() < deadline, "hang; saw {:?}", self.seen);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

fn available(provider: &str) -> bool {
    let spec: ProviderSpec = format!("libfabric:{provider}").parse().expect("spec");
    let cfg = ProviderConfig::default()
        .with_nics(1)
        .with_libfabric(LibfabricOptions::same_machine(provider));
    match weft::provider_with(&spec, &cfg).and_then(|b| b.host()) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIP: libfabric:{provider} unavailable: {e}");
            false
        }
    }
}

const SHAPE: [&str; 10] = [
    "--layers",
    "6",
    "--kv-heads",
    "2",
    "--page-len",
    "16384",
    "--tail-len",
    "4096",
    "--pages",
    "128",
];

fn args<'a>(role: &'a str, provider: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![role, "--provider", provider, "--hb-timeout-ms", "3000"];
    v.extend_from_slice(&SHAPE);
    v.extend_from_slice(extra);
    v
}

/// Starts a prefiller and a decoder connected through a pipe (the
/// prefiller's `ready ADDR` line goes to the decoder's stdin).
fn pair(provider: &str, pre_extra: &[&str], dec_extra: &[&str]) -> (Proc, Proc) {
    let spec = format!("libfabric:{provider}");
    let mut pre = spawn(&args("prefill", &spec, pre_extra));
    let ready = pre.expect("ready ");
    let mut de = args("decode", &spec, &["--peer", "-"]);
    de.extend_from_slice(dec_extra);
    let mut dec = spawn(&de);
    dec.send(&ready);
    (pre, dec)
}

#[test]
fn processes_transfer_over_tcp_and_shm() {
    for provider in ["tcp", "shm"] {
        if !available(provider) {
            continue;
        }
        let (mut pre, mut dec) = pair(
            provider,
            &["--max-requests", "12", "--watcher"],
            &[
                "--requests",
                "12",
                "--prompt-pages",
                "9",
                "--concurrency",
                "3",
            ],
        );
        let s = dec.expect("summary ");
        assert!(s.contains("requests=12"), "{provider}: {s}");
        assert!(dec.wait().success(), "{provider}: decoder {:?}", dec.seen);
        assert_eq!(
            dec.seen.iter().filter(|l| l.starts_with("done ")).count(),
            12,
            "{provider}: {:?}",
            dec.seen
        );
        assert!(pre.wait().success(), "{provider}: prefiller {:?}", pre.seen);
        assert_eq!(
            pre.seen.iter().filter(|l| l.starts_with("served ")).count(),
            12
        );
    }
}

#[test]
fn a_killed_decoder_makes_the_prefiller_drop_the_request() {
    for provider in ["tcp", "shm"] {
        if !available(provider) {
            continue;
        }
        // 6 layers of 100 ms: the kill lands mid-request
        let (mut pre, mut dec) = pair(
            provider,
            &["--max-requests", "1", "--layer-us", "100000"],
            &["--requests", "1"],
        );
        pre.expect("accepted id=1");
        dec.kill();
        let l = pre.expect("serve-error id=1");
        assert!(
            l.contains("kind=DecoderDead") || l.contains("kind=TransferFailed"),
            "{provider}: {l}"
        );
        let st = pre.wait();
        assert_eq!(st.code(), Some(3), "{provider}: {:?}", pre.seen);
    }
}

#[test]
fn a_killed_prefiller_fails_the_decoders_requests() {
    for provider in ["tcp", "shm"] {
        if !available(provider) {
            continue;
        }
        let (mut pre, mut dec) = pair(
            provider,
            &["--layer-us", "100000"],
            &["--requests", "2", "--concurrency", "2"],
        );
        pre.expect("accepted id=1");
        pre.kill();
        let l = dec.expect("error id=1");
        assert!(l.contains("kind=PrefillerDead"), "{provider}: {l}");
        let st = dec.wait();
        assert_eq!(st.code(), Some(3), "{provider}: {:?}", dec.seen);
    }
}

/// A fresh directory for a `dir:` rendezvous store.
fn store_dir(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!(
        "weft-kvcache-rdv-{tag}-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("store dir");
    p
}

#[test]
fn processes_find_each_other_through_a_dir_store() {
    for provider in ["tcp", "shm"] {
        if !available(provider) {
            continue;
        }
        let dir = store_dir(provider);
        let rdv = format!("dir:{}", dir.display());
        let spec = format!("libfabric:{provider}");
        let mut pre = spawn(&args(
            "prefill",
            &spec,
            &["--rendezvous", &rdv, "--name", "p0", "--max-requests", "8"],
        ));
        pre.expect("ready ");
        // No address is pasted: the decoder finds the prefiller in the store.
        let mut dec = spawn(&args(
            "decode",
            &spec,
            &[
                "--rendezvous",
                &rdv,
                "--requests",
                "8",
                "--prompt-pages",
                "5",
                "--concurrency",
                "2",
            ],
        ));
        let s = dec.expect("summary ");
        assert!(s.contains("requests=8"), "{provider}: {s}");
        assert!(dec.wait().success(), "{provider}: decoder {:?}", dec.seen);
        assert_eq!(
            dec.seen.iter().filter(|l| l.starts_with("done ")).count(),
            8,
            "{provider}: {:?}",
            dec.seen
        );
        assert!(pre.wait().success(), "{provider}: prefiller {:?}", pre.seen);
        // Both left cleanly: nothing of them stays in the store.
        let store = weft::rendezvous::DirStore::open(&dir, Default::default()).expect("open");
        let left = weft::rendezvous::Store::list(&store, "weft/kvcache/").expect("list");
        assert!(left.is_empty(), "{provider}: {left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
