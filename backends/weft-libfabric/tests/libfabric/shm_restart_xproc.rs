//! shm restart loop across processes with a write unanswered at every
//! kill, in a test binary of its own: it counts this process's regions in
//! `/dev/shm`, which other tests' engines in the same process would change.
//! Children are this binary re-executed (see `engine_xproc.rs`). Skipped
//! (printed) when libfabric is unavailable.

use crate::common::xflow::{
    initiator_or_skip, is_unreachable, singles, wait_flag, wait_ok, wait_round, DEADLINE,
};

use std::time::{Duration, Instant};
use weft_conformance::engine::EngineHarness;
use weft_engine::{OnDone, TransferEngine};
use weft_testkit::mem;
use weft_transport::HostBuffer;

/// This process's shm regions (`/dev/shm/<pid>:...`): the initiator's
/// endpoints, main and per-peer.
fn own_shm_regions() -> usize {
    let prefix = format!("{}:", std::process::id());
    std::fs::read_dir("/dev/shm").map_or(0, |d| {
        d.flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .count()
    })
}

/// shm restart loop with a write unanswered at each kill: a peer process
/// gets a verified round, is stopped (SIGSTOP) with a write to it posted,
/// SIGKILLed, removed and restarted (a new pid, so a new shm address), 20
/// times, a survivor alongside. The unanswered write fails
/// (`PeerUnreachable` or `PeerRemoved`); a write to the survivor after
/// each kill completes (the dead peer's stuck response-queue entry is on
/// its own endpoint); writes to the removed incarnation's descriptor fail
/// with `PeerRemoved`; the resolved peer count and this process's regions
/// in `/dev/shm` are back to their baseline (the per-peer endpoint of each
/// removed incarnation is closed: nothing leaks).
#[test]
fn shm_peer_restart_with_writes_unanswered() {
    const WLEN: u64 = 64 << 10;
    const LEN: usize = (4 * WLEN) as usize;
    const SEED: u64 = 0x5eed_0022;
    let t0 = Instant::now();
    let src: HostBuffer;
    let mut h = crate::common::XprocEngines::new("shm", SEED);
    let Some(init) = initiator_or_skip(&mut h) else {
        return;
    };
    src = mem::patterned(SEED, LEN + 4096);
    let (smr, _) = init.reg_mr(src.region()).expect("reg src");
    let peers = |e: &TransferEngine| -> u64 {
        e.stats()
            .groups
            .iter()
            .flat_map(|g| g.nics.iter())
            .map(|n| n.peers)
            .sum()
    };
    let survivor = h.add_peer(LEN).expect("spawn survivor");
    for f in singles(&mut h, &init, &smr, SEED, survivor, 1, true, 4, WLEN, |k| {
        k * WLEN
    }) {
        wait_ok("write to the survivor", &f);
    }
    wait_round(&mut h, survivor, 1);
    let baseline = peers(&init);
    let regions = own_shm_regions();
    let mut gone = Vec::new();
    for k in 0..20u64 {
        let p = h.add_peer(LEN).expect("spawn an incarnation");
        let addr = h.peer(p).address();
        assert!(
            !gone
                .iter()
                .any(|g: &weft_engine::GroupAddress| g.incarnation == addr.incarnation),
            "incarnation {k} repeats an earlier incarnation"
        );
        let tag = 100 + k;
        for f in singles(&mut h, &init, &smr, SEED, p, tag, true, 4, WLEN, |i| {
            i * WLEN + k
        }) {
            wait_ok(&format!("write to incarnation {k}"), &f);
        }
        wait_round(&mut h, p, tag);
        let desc = h.peer(p).desc();
        // A write it never answers, then the kill.
        h.stop_peer(p).expect("SIGSTOP");
        let pending = singles(&mut h, &init, &smr, SEED, p, 0, false, 1, WLEN, |_| k);
        h.kill_peer(p).expect("SIGKILL");
        init.remove_peer(&addr).expect("remove_peer");
        let e = wait_flag("write pending at the kill", &pending[0])
            .expect_err("a write to a peer stopped and killed before answering succeeded");
        assert!(
            e.is_peer_removed() || is_unreachable(&e),
            "incarnation {k}: write pending at the kill: {e}"
        );
        let (od, flag) = OnDone::flag();
        init.submit_single_write(64, None, (&smr, 0), (&desc, 0), od)
            .expect("submit to the removed peer");
        let e = wait_flag("write to the removed peer", &flag)
            .expect_err("write to a removed peer succeeded");
        assert!(e.is_peer_removed(), "write to the removed peer: {e}");
        // The survivor is not blocked by the dead incarnation.
        let stag = 1000 + k;
        for f in singles(
            &mut h,
            &init,
            &smr,
            SEED,
            survivor,
            stag,
            true,
            2,
            WLEN,
            |i| i * WLEN + k + 1,
        ) {
            wait_ok(&format!("write to the survivor after kill {k}"), &f);
        }
        wait_round(&mut h, survivor, stag);
        assert_eq!(
            peers(&init),
            baseline,
            "incarnation {k}: peers after removal"
        );
        let t = Instant::now();
        while own_shm_regions() != regions {
            assert!(
                t.elapsed() < DEADLINE,
                "incarnation {k}: this process has {} regions in /dev/shm, {regions} before \
                 the loop (per-peer endpoints not closed): {:?}",
                own_shm_regions(),
                std::fs::read_dir("/dev/shm")
                    .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        gone.push(addr);
    }
    h.peer(survivor).shutdown().expect("survivor exits cleanly");
    drop(h);
    eprintln!(
        "shm_peer_restart_with_writes_unanswered: {:.2} s, {regions} own /dev/shm regions \
         throughout",
        t0.elapsed().as_secs_f64()
    );
}
