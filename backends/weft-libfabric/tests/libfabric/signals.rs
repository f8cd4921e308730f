//! Signals stay the application's once libfabric is open: every process
//! here is a child (a fresh libfabric load), with engines on `tcp` and
//! `shm` and a write between them.
//!
//! - `dispositions_are_kept`: the handlers of every kept signal are the
//!   ones the process had before, and an application's SIGTERM handler
//!   installed before the engines runs when SIGTERM comes.
//! - `sigint_and_a_crash_keep_their_signal_status`: with default
//!   dispositions, SIGINT kills the process by SIGINT and a segfault by
//!   SIGSEGV (not an exit status of 1), and no backtrace file appears.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use weft_engine::{OnDone, TransferEngine};
use weft_libfabric::SA_RESTORER;
use weft_testkit::child::{self, spawn_role};

static GOT_TERM: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    GOT_TERM.store(true, Ordering::SeqCst);
}

/// The handler address and flags of every kept signal (`SA_RESTORER`
/// aside: the C library adds it to every action it installs).
fn dispositions() -> Vec<(i32, usize, i32)> {
    weft_libfabric::KEPT_SIGNALS
        .iter()
        .map(|&s| {
            // SAFETY: a zeroed sigaction is a valid out-parameter; query only.
            let mut a: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let rc = unsafe { libc::sigaction(s, std::ptr::null(), &mut a) };
            assert_eq!(rc, 0, "sigaction({s})");
            (s, a.sa_sigaction, a.sa_flags & !SA_RESTORER)
        })
        .collect()
}

/// Engines on tcp and shm, one write each between two engines of the
/// provider; `None` when libfabric is missing here.
fn open_and_write() -> Option<Vec<TransferEngine>> {
    let mut engines = Vec::new();
    for name in ["tcp", "shm"] {
        let cfg = weft_engine::EngineConfig::default();
        let a = crate::common::one_nic_engine(name, cfg.clone())?;
        let b = crate::common::one_nic_engine(name, cfg)?;
        let src = weft_testkit::mem::patterned(1, 4096);
        let dst = weft_testkit::mem::zeroed(4096);
        let s = a.register(src.region()).expect("register src");
        let d = b.register(dst.region()).expect("register dst");
        let (on, flag) = OnDone::flag();
        a.submit_single_write(4096, None, (&s.handle(), 0), (d.desc(), 0), on)
            .expect("submit");
        flag.wait_timeout(Duration::from_secs(60))
            .expect("write finishes")
            .expect("write succeeds");
        assert_eq!(dst.read(0, 4096), src.read(0, 4096));
        drop((s, d));
        engines.push(a);
        engines.push(b);
    }
    Some(engines)
}

#[test]
fn signals_entry() {
    let Some(role) = child::role() else { return };
    // Where a backtrace file would land.
    if let Some(d) = std::env::var_os("WEFT_SIGNALS_DIR") {
        std::env::set_current_dir(d).expect("chdir");
    }
    match role.as_str() {
        "keep" => {
            // SAFETY: installs a handler that only stores to an atomic.
            unsafe { libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t) };
            let before = dispositions();
            let Some(engines) = open_and_write() else {
                child::send_line("skip").unwrap();
                std::process::exit(0);
            };
            let after = dispositions();
            let changed: Vec<String> = before
                .iter()
                .zip(&after)
                .filter(|(b, a)| b != a)
                .map(|(b, a)| {
                    format!(
                        "signal {}: {:#x}/{:#x} -> {:#x}/{:#x}",
                        b.0, b.1, b.2, a.1, a.2
                    )
                })
                .collect();
            child::send_line(&format!("changed {}", changed.join("; "))).unwrap();
            // SAFETY: raising a signal whose handler only stores an atomic.
            unsafe { libc::raise(libc::SIGTERM) };
            let ran = GOT_TERM.load(Ordering::SeqCst);
            child::send_line(&format!("term handler ran: {ran}")).unwrap();
            for e in &engines {
                e.shutdown();
            }
            std::process::exit(0);
        }
        "wait" => {
            // The application's disposition is the default one, whatever
            // this process inherited (a shell starting a job in the
            // background without job control ignores SIGINT for it).
            // SAFETY: restores the default disposition; no handler runs.
            unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
            let Some(_engines) = open_and_write() else {
                child::send_line("skip").unwrap();
                std::process::exit(0);
            };
            child::send_line("open").unwrap();
            // Killed by the parent's SIGINT (default disposition).
            std::thread::sleep(Duration::from_secs(120));
            std::process::exit(3);
        }
        "crash" => {
            let Some(_engines) = open_and_write() else {
                child::send_line("skip").unwrap();
                std::process::exit(0);
            };
            child::send_line("open").unwrap();
            // SAFETY: not safe, on purpose: a store through a null pointer
            // is the crash whose exit status is checked (Rust's SIGSEGV
            // handler, there for stack overflows, puts the default
            // disposition back and the store faults again).
            unsafe { std::ptr::null_mut::<u8>().write_volatile(1) };
            std::process::exit(4);
        }
        other => panic!("unknown role {other}"),
    }
}

fn first_line(c: &mut child::ChildProcess) -> String {
    c.recv_line_timeout(Duration::from_secs(120))
        .expect("child line")
        .expect("child alive")
}

#[test]
fn dispositions_are_kept() {
    let mut c = spawn_role("signals_entry", "keep", &[]).expect("spawn");
    let line = first_line(&mut c);
    if line == "skip" {
        eprintln!("SKIP: libfabric tcp/shm unavailable");
        return;
    }
    assert_eq!(
        line, "changed ",
        "dispositions changed by opening libfabric"
    );
    assert_eq!(first_line(&mut c), "term handler ran: true");
    assert!(c.wait().expect("wait").success());
}

#[test]
fn sigint_and_a_crash_keep_their_signal_status() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempdir();
    let run = |role: &str, signal: Option<i32>| {
        let env = [("WEFT_SIGNALS_DIR", dir.as_os_str())];
        let mut c = spawn_role("signals_entry", role, &env).expect("spawn");
        let line = first_line(&mut c);
        if line == "skip" {
            return None;
        }
        assert_eq!(line, "open");
        if let Some(s) = signal {
            c.signal(s).expect("signal");
        }
        Some(c.wait().expect("wait"))
    };
    let int = run("wait", Some(libc::SIGINT));
    let crash = run("crash", None);
    let (Some(int), Some(crash)) = (int, crash) else {
        eprintln!("SKIP: libfabric tcp/shm unavailable");
        return;
    };
    assert_eq!(int.signal(), Some(libc::SIGINT), "SIGINT: {int:?}");
    assert_eq!(crash.signal(), Some(libc::SIGSEGV), "crash: {crash:?}");
    let btr: Vec<_> = std::fs::read_dir(&dir)
        .expect("read dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".btr"))
        .map(|e| e.file_name())
        .collect();
    assert!(btr.is_empty(), "backtrace files left: {btr:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("weft-signals-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}
