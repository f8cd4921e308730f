//! Regions left in `/dev/shm` by killed processes are reclaimed before a
//! process opens its first shm endpoint: those named after its own pid
//! (which would otherwise fail `fi_enable` with EBUSY on the name clash) and
//! those of other processes that exited. Regions of running processes and
//! files of any other shape stay. The clean-up runs once per process, so the
//! opening side is a child process of its own.

use std::path::PathBuf;
use std::time::Duration;

use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_testkit::child::{self, spawn_role};
use weft_transport::Provider;

/// The child: fakes regions of a dead process with its own pid, opens two
/// shm endpoints, and reports.
#[test]
fn stale_shm_entry() {
    let Some(_) = child::role() else { return };
    let provider = match LibfabricProvider::with_config(LibfabricConfig::new("shm")) {
        Ok(p) => p,
        Err(e) => {
            child::send_line(&format!("skip {e}")).unwrap();
            return;
        }
    };
    let pid = std::process::id();
    // The names shm 1.17 gives this process's first endpoints, as a dead
    // process with this pid would have left them.
    for i in 0..2 {
        std::fs::write(format!("/dev/shm/{pid}:0:{i}"), vec![0u8; 4096])
            .expect("write a fake stale region");
    }
    let d0 = provider.open(0);
    let d1 = provider.open(0);
    let line = match (&d0, &d1) {
        (Ok(a), Ok(b)) if a.local_addr() != b.local_addr() => "opened".to_string(),
        (Ok(_), Ok(_)) => "same address twice".to_string(),
        (Err(e), _) | (_, Err(e)) => format!("open failed: {e}"),
    };
    child::send_line(&line).unwrap();
}

/// A pid that no longer runs: a child that exited and was reaped.
fn dead_pid() -> u32 {
    let mut c = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let pid = c.id();
    c.wait().expect("wait true");
    pid
}

#[test]
fn stale_regions_are_reclaimed() {
    let dead = dead_pid();
    // A running process of this user (not this one: this process removes
    // regions named after its own pid when it opens shm itself).
    let mut sleeper = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("spawn sleep");
    let live = sleeper.id();
    let path = |name: String| PathBuf::from("/dev/shm").join(name);
    let dead_region = path(format!("{dead}:0:0"));
    let dead_keys = path(format!("weft-keys.{dead}:0:0"));
    let dead_bell = path(format!("weft-bell.{dead}:0:0"));
    let dead_other = path(format!("{dead}:weft-test-keep"));
    let live_region = path(format!("{live}:0:0"));
    for p in [
        &dead_region,
        &dead_keys,
        &dead_bell,
        &dead_other,
        &live_region,
    ] {
        std::fs::write(p, vec![0u8; 4096]).expect("write a fake region");
    }
    let mut c = spawn_role("stale_shm_entry", "open", &[]).expect("spawn");
    let line = c
        .recv_line_timeout(Duration::from_secs(120))
        .expect("child line")
        .expect("child alive");
    let _ = c.wait();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let all = [
        &dead_region,
        &dead_keys,
        &dead_bell,
        &dead_other,
        &live_region,
    ];
    let state = all.map(|p| p.exists());
    for p in all {
        let _ = std::fs::remove_file(p);
    }
    if line.starts_with("skip") {
        eprintln!("SKIP: libfabric shm unavailable: {line}");
        return;
    }
    assert_eq!(line, "opened", "child opening shm endpoints");
    assert_eq!(
        state,
        [false, false, false, true, true],
        "exists after the child opened shm: [dead process's region, its key table, its \
         doorbell, its file of another shape, running process's region]"
    );
}
