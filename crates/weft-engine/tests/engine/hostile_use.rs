//! The public API used as a hostile user would: callbacks that re-submit
//! SENDs into tiny queues, handles passed to the wrong engine, and
//! `expect_imm_count` racing `shutdown`. Each test was written against a
//! defect found by an adversarial review and fails on the code before its
//! fix.

use crate::common::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;
use weft_engine::{DoneResult, EngineError, OnDone, Pages, QueueFullPolicy, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};

/// Two engines whose request queues hold one request (blocking policy),
/// with two WRs in flight per NIC (and two planned WRs waiting at most) and receive pools of two buffers: the
/// shape in which a callback blocked on a full queue used to stop its
/// engine's receive buffers from being re-posted, and two such engines
/// waited on each other for good.
fn tight_pair(seed: u64) -> (Fabric, TransferEngine, TransferEngine) {
    let fabric = Fabric::new_realtime(FabricConfig {
        max_inflight: 2,
        // Far beyond the test: a stuck SEND must show up as a hang, not be
        // cleared by the receiver-not-ready timeout.
        rnr_timeout: Duration::from_secs(3600),
        ..FabricConfig::adversarial(seed)
    });
    let cfg = {
        let mut c = test_config();
        c.queue_capacity = 1;
        c.queue_full = QueueFullPolicy::Block;
        c.max_pending_wrs = 2;
        c
    };
    let a = engine(&fabric, fabric.add_host(1), 1, cfg.clone(), false);
    let b = engine(&fabric, fabric.add_host(1), 1, cfg, false);
    (fabric, a, b)
}

/// Progress counter with a hang check that names the count reached.
fn wait_count(what: &str, n: &AtomicU64, want: u64) {
    let mut last = (0, std::time::Instant::now());
    loop {
        let now = n.load(Ordering::SeqCst);
        if now >= want {
            return;
        }
        if now != last.0 {
            last = (now, std::time::Instant::now());
        }
        // Not a timing assertion: 60 s without a single message moving is a
        // deadlock, whatever the machine's speed.
        assert!(
            last.1.elapsed() < Duration::from_secs(60),
            "deadlock: {what} stopped at {now} of {want}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// SEND chains whose `on_done` submits the next SEND, both ways at once,
/// sixteen chains per side into queues of one: every message arrives.
#[test]
fn send_chains_resubmitted_from_callbacks_never_deadlock() {
    for seed in seeds_or([17]) {
        let _g = SeedGuard::new(
            seed,
            "send_chains_resubmitted_from_callbacks_never_deadlock",
        );
        let (_fabric, a, b) = tight_pair(seed);
        let chains = 16u64;
        let per_chain: u64 = 200;
        let received = Arc::new(AtomicU64::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        for e in [&a, &b] {
            let r = received.clone();
            e.submit_recvs(256, 2, move |m| {
                if m.is_ok() {
                    r.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap();
        }
        fn chain(
            e: TransferEngine,
            to: weft_engine::GroupAddress,
            left: u64,
            sent: Arc<AtomicU64>,
            failed: Arc<AtomicU64>,
        ) {
            if left == 0 {
                return;
            }
            let (e2, to2, s2, f2) = (e.clone(), to.clone(), sent.clone(), failed.clone());
            let msg = left.to_le_bytes();
            let r = e.submit_send(
                &to,
                &msg,
                OnDone::callback(move |r: DoneResult| {
                    match r {
                        Ok(()) => s2.fetch_add(1, Ordering::SeqCst),
                        Err(_) => f2.fetch_add(1, Ordering::SeqCst),
                    };
                    chain(e2, to2, left - 1, s2, f2);
                }),
            );
            if r.is_err() {
                failed.fetch_add(1, Ordering::SeqCst);
            }
        }
        // Started from their own thread: a submit into a full queue blocks,
        // and this thread must stay free to notice a hang.
        let starter = {
            let (a, b, sent, failed) = (a.clone(), b.clone(), sent.clone(), failed.clone());
            std::thread::spawn(move || {
                for _ in 0..chains {
                    chain(
                        a.clone(),
                        b.main_address(),
                        per_chain,
                        sent.clone(),
                        failed.clone(),
                    );
                    chain(
                        b.clone(),
                        a.main_address(),
                        per_chain,
                        sent.clone(),
                        failed.clone(),
                    );
                }
            })
        };
        let total = 2 * chains * per_chain;
        wait_count("SEND chains", &received, total);
        wait_count("SEND completions", &sent, total);
        starter.join().unwrap();
        assert_eq!(failed.load(Ordering::SeqCst), 0);
        a.shutdown();
        b.shutdown();
    }
}

/// Ping-pong where each receive callback sends the reply, sixteen balls in
/// play over queues of one: every exchange completes.
#[test]
fn replies_sent_from_receive_callbacks_never_deadlock() {
    for seed in seeds_or([18]) {
        let _g = SeedGuard::new(seed, "replies_sent_from_receive_callbacks_never_deadlock");
        let (_fabric, a, b) = tight_pair(seed);
        let balls = 16u64;
        let hops: u64 = 400;
        let received = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        for (me, peer) in [(&a, &b), (&b, &a)] {
            let (e, to) = (me.clone(), peer.main_address());
            let (r, f) = (received.clone(), failed.clone());
            me.submit_recvs(256, 2, move |m| {
                let Ok(bytes) = m else {
                    f.fetch_add(1, Ordering::SeqCst);
                    return;
                };
                r.fetch_add(1, Ordering::SeqCst);
                let left = u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8]));
                if left > 1 {
                    let f2 = f.clone();
                    let on_done = OnDone::callback(move |r: DoneResult| {
                        if r.is_err() {
                            f2.fetch_add(1, Ordering::SeqCst);
                        }
                    });
                    if e.submit_send(&to, &(left - 1).to_le_bytes(), on_done)
                        .is_err()
                    {
                        f.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
            .unwrap();
        }
        let starter = {
            let (a, to) = (a.clone(), b.main_address());
            std::thread::spawn(move || {
                for _ in 0..balls {
                    let (od, _flag) = OnDone::flag();
                    a.submit_send(&to, &hops.to_le_bytes(), od).unwrap();
                }
            })
        };
        wait_count("ping-pong hops", &received, balls * hops);
        starter.join().unwrap();
        assert_eq!(failed.load(Ordering::SeqCst), 0);
        a.shutdown();
        b.shutdown();
    }
}

/// A memory-region handle of one engine is refused by another engine in
/// every submit that takes one and in `unreg_mr`; nothing is sent and the
/// engine's own region in the same slot stays registered.
#[test]
fn foreign_mr_handles_are_refused() {
    let fabric = Fabric::new_realtime(FabricConfig::ideal(5));
    let ea = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
    let eb = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
    let ec = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
    let a_src = mem::patterned(1, 4096);
    let c_src = mem::patterned(2, 4096);
    let dst = mem::zeroed(4096);
    // Same slot on both engines: the first registration of each.
    let (a_h, _) = ea.reg_mr(a_src.region()).unwrap();
    let (c_h, _) = ec.reg_mr(c_src.region()).unwrap();
    let (_, d_desc) = eb.reg_mr(dst.region()).unwrap();
    let imm = 3;
    let arrived = Arc::new(AtomicU64::new(0));
    let is_foreign = |r: Result<weft_engine::TransferId, EngineError>| {
        matches!(r, Err(EngineError::InvalidArgument { .. }))
    };

    let (od, _f) = OnDone::flag();
    let r = ea.submit_single_write(64, Some(imm), (&c_h, 0), (&d_desc, 0), od);
    assert!(
        is_foreign(r.clone()),
        "single write with a foreign handle: {r:?}"
    );
    let pages = Pages {
        indices: vec![0, 1],
        stride: 64,
        offset: 0,
    };
    let (od, _f) = OnDone::flag();
    let r = ea.submit_paged_writes(64, Some(imm), (&c_h, &pages), (&d_desc, &pages), od);
    assert!(
        is_foreign(r.clone()),
        "paged writes with a foreign handle: {r:?}"
    );
    let group = ea.add_peer_group(&[eb.main_address()]).unwrap();
    let (od, _f) = OnDone::flag();
    let r = ea.submit_scatter(
        &group,
        od,
        Some(imm),
        &c_h,
        &[weft_engine::ScatterDst {
            len: 64,
            src_offset: 0,
            dst: d_desc.clone(),
            dst_offset: 0,
        }],
    );
    assert!(
        is_foreign(r.clone()),
        "scatter with a foreign handle: {r:?}"
    );
    assert!(
        matches!(ea.unreg_mr(c_h), Err(EngineError::InvalidArgument { .. })),
        "unreg_mr of a foreign handle"
    );

    // Nothing reached the peer: a round for one more arrival than the
    // correct write below makes never completes early.
    let a2 = arrived.clone();
    eb.expect_imm_count(imm, 1, move |r| {
        if r.is_ok() {
            a2.fetch_add(1, Ordering::SeqCst);
        }
    })
    .unwrap();
    // The engine's own handle in that slot still works (not deregistered).
    let (od, flag) = OnDone::flag();
    ea.submit_single_write(64, Some(imm), (&a_h, 0), (&d_desc, 0), od)
        .unwrap();
    flag.wait().unwrap();
    wait_until("the one real write's immediate", HANG, || {
        arrived.load(Ordering::SeqCst) == 1
    });
    assert_eq!(eb.imm_pending(imm), 0, "no stray immediate arrived");
    assert_eq!(dst.bytes(0, 64), a_src.bytes(0, 64));
    ec.unreg_mr(c_h).unwrap();
    ea.unreg_mr(a_h).unwrap();
    for e in [&ea, &eb, &ec] {
        e.shutdown();
    }
}

/// Threads arming rounds while another thread shuts the engine down:
/// every accepted arm is resolved (fired or failed with `ShutDown`) by the
/// time `shutdown` returns, and no round is left armed.
#[test]
fn arms_racing_shutdown_all_resolve() {
    let iterations = 300;
    for it in 0..iterations {
        let fabric = Fabric::new_realtime(FabricConfig::ideal(it));
        let e = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
        // Eight armers on two cores: the shutdown lands while several are
        // between their shutdown check and their arm.
        let threads = 8;
        // Enough values that the armers are still arming while shutdown
        // runs (test_config allows 4096).
        let per_thread = 4000 / threads;
        let accepted = Arc::new(AtomicU64::new(0));
        let resolved = Arc::new(AtomicU64::new(0));
        let start = Arc::new(Barrier::new(threads + 1));
        let values: Vec<Vec<u32>> = (0..threads)
            .map(|_| (0..per_thread).map(|_| e.alloc_imm().unwrap()).collect())
            .collect();
        let armers: Vec<_> = values
            .into_iter()
            .map(|vals| {
                let (e, acc, res, st) =
                    (e.clone(), accepted.clone(), resolved.clone(), start.clone());
                std::thread::spawn(move || {
                    st.wait();
                    for v in vals {
                        let res = res.clone();
                        // Never arrives: only shutdown can resolve it.
                        match e.expect_imm_count(v, 1, move |_| {
                            res.fetch_add(1, Ordering::SeqCst);
                        }) {
                            Ok(()) => {
                                acc.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(EngineError::ShutDown) => {}
                            Err(other) => panic!("unexpected arm error {other}"),
                        }
                    }
                })
            })
            .collect();
        start.wait();
        e.shutdown();
        for h in armers {
            h.join().unwrap();
        }
        assert_eq!(
            resolved.load(Ordering::SeqCst),
            accepted.load(Ordering::SeqCst),
            "iteration {it}: an accepted arm was never resolved"
        );
        assert_eq!(e.armed_imm_rounds(), 0, "iteration {it}: rounds left armed");
    }
}
