//! Delivery: bytes, immediates, reordering, replay, loss, null mode, realtime.

use crate::common::*;
use std::time::Duration;
use weft_loopback::{Action, Fabric, FabricConfig, OpKind, Rule, TraceKind};
use weft_transport::{Access, Completion, Domain, WrId, WriteWr};

/// Posts `n` writes of `len` bytes each (write i -> dst offset i*len, imm i)
/// and runs the fabric to idle. Returns (initiator completions, target
/// completions).
fn many_writes(
    fabric: &Fabric,
    n: usize,
    len: usize,
) -> (
    Vec<Completion>,
    Vec<Completion>,
    Vec<u8>,
    HostBuffer,
    HostBuffer,
) {
    let (mut a, mut b) = pair(fabric);
    let src = mem::patterned(3, n * len);
    let dst = mem::filled(n * len, 0);
    let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
    let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
    let peer = a.add_peer(b.local_addr()).unwrap();
    let wrs: Vec<WriteWr> = (0..n)
        .map(|i| WriteWr {
            wr: WrId(i as u64),
            peer,
            src: ms.slice((i * len) as u64, len as u64).unwrap(),
            dst: remote(&md, (i * len) as u64),
            imm: Some(i as u32),
        })
        .collect();
    let mut posted = 0;
    let (mut ca, mut cb) = (Vec::new(), Vec::new());
    while posted < wrs.len() {
        posted += a.post_writes(&wrs[posted..]).unwrap();
        fabric.step();
        ca.extend(poll_all(&mut a));
    }
    fabric.run_until_idle();
    ca.extend(poll_all(&mut a));
    cb.extend(poll_all(&mut b));
    let bytes = dst.snapshot();
    drop((a, b));
    (ca, cb, bytes, src, dst)
}

#[test]
fn write_copies_bytes_and_reports_imm_once() {
    for_seeds(0..20, |seed| {
        for cfg in [FabricConfig::adversarial(seed), FabricConfig::ideal(seed)] {
            let fabric = Fabric::new(cfg);
            let (ca, cb, bytes, src, _dst) = many_writes(&fabric, 40, 5000);
            let mut w = write_results(&ca);
            w.sort_by_key(|x| x.0);
            assert_eq!(w.len(), 40, "seed {seed}");
            assert!(w.iter().all(|(_, r)| r.is_ok()), "seed {seed}: {w:?}");
            let mut im = imms(&cb);
            im.sort();
            assert_eq!(im, (0..40).collect::<Vec<_>>(), "seed {seed}");
            assert_eq!(bytes, src.snapshot(), "seed {seed}");
        }
    });
}

#[test]
fn reordering_happens_across_and_within_writes() {
    let (mut across, mut within) = (0, 0);
    for seed in 0..20 {
        let s = with_seed(seed, || {
            let fabric = Fabric::new(FabricConfig::adversarial(seed));
            let (_, _, bytes, src, _) = many_writes(&fabric, 50, 40_000);
            assert_eq!(bytes, src.snapshot(), "seed {seed}");
            fabric.stats()
        });
        assert!(s.chunks_delivered > 50, "seed {seed}: {s:?}");
        across += s.inversions_across;
        within += s.inversions_within;
    }
    assert!(across > 0, "no cross-write inversion over seeds 0..20");
    assert!(within > 0, "no within-write inversion over seeds 0..20");
}

#[test]
fn ideal_profile_does_not_reorder() {
    for_seeds(0..5, |seed| {
        let fabric = Fabric::new(FabricConfig::ideal(seed));
        let _ = many_writes(&fabric, 50, 40_000);
        let s = fabric.stats();
        assert_eq!(s.inversions_across, 0, "seed {seed}");
        assert_eq!(s.inversions_within, 0, "seed {seed}");
        assert_eq!(s.drops, 0, "seed {seed}");
    });
}

#[test]
fn imm_reported_only_after_all_chunks_landed() {
    for_seeds(0..10, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed).with_trace(true));
        let (mut a, mut b) = pair(&fabric);
        let len = 200_000usize;
        let src = mem::patterned(9, len);
        let dst = mem::filled(len, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        a.post_write(&WriteWr {
            wr: WrId(1),
            peer,
            src: ms.slice(0, len as u64).unwrap(),
            dst: remote(&md, 0),
            imm: Some(77),
        })
        .unwrap();
        let mut seen = false;
        while fabric.step() {
            let c = poll_all(&mut b);
            if !c.is_empty() {
                assert_eq!(imms(&c), vec![77], "seed {seed}");
                assert!(!seen, "seed {seed}: imm twice");
                seen = true;
                assert_eq!(
                    dst.snapshot(),
                    src.snapshot(),
                    "seed {seed}: imm before payload"
                );
            } else if !seen {
                assert_ne!(
                    dst.snapshot(),
                    src.snapshot(),
                    "seed {seed}: payload complete, no imm yet"
                );
            }
        }
        assert!(seen, "seed {seed}");
        // The trace agrees: every chunk landed before the immediate.
        let t = fabric.trace();
        let imm_at = t
            .iter()
            .position(|e| matches!(e.what, TraceKind::ImmDelivered { .. }))
            .unwrap();
        let chunks = match t[0].what {
            TraceKind::Posted { chunks, .. } => chunks as usize,
            ref other => panic!("seed {seed}: {other:?}"),
        };
        let landed_before = t[..imm_at]
            .iter()
            .filter(|e| matches!(e.what, TraceKind::ChunkLanded { .. }))
            .count();
        assert_eq!(landed_before, chunks, "seed {seed}");
        assert!(chunks > 1, "seed {seed}");
        let c = poll_all(&mut a);
        assert_eq!(write_results(&c), vec![(1, Ok(()))], "seed {seed}");
        drop((a, b));
    });
}

#[test]
fn write_completion_only_after_delivery() {
    for_seeds(0..10, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (mut a, mut b) = pair(&fabric);
        let src = mem::patterned(1, 100_000);
        let dst = mem::filled(100_000, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        a.post_write(&WriteWr {
            wr: WrId(9),
            peer,
            src: ms.slice(0, 100_000).unwrap(),
            dst: remote(&md, 0),
            imm: None,
        })
        .unwrap();
        loop {
            let c = poll_all(&mut a);
            if !c.is_empty() {
                assert_eq!(write_results(&c), vec![(9, Ok(()))], "seed {seed}");
                assert_eq!(dst.snapshot(), src.snapshot(), "seed {seed}");
                break;
            }
            assert!(fabric.step(), "seed {seed}: idle without completion");
        }
        assert!(
            poll_all(&mut b).is_empty(),
            "seed {seed}: no imm was asked for"
        );
        drop((a, b));
    });
}

#[test]
fn same_seed_same_trace_different_seed_different_trace() {
    let run = |seed: u64| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed).with_trace(true));
        let (ca, cb, bytes, _, _) = many_writes(&fabric, 30, 20_000);
        (fabric.trace(), ca, cb, bytes, fabric.stats(), fabric.now())
    };
    for_seeds([1, 2, 99], |seed| {
        let (t1, a1, b1, d1, s1, n1) = run(seed);
        let (t2, a2, b2, d2, s2, n2) = run(seed);
        assert!(!t1.is_empty());
        assert_eq!(t1, t2, "seed {seed}: trace differs between runs");
        assert_eq!((a1, b1, d1, s1, n1), (a2, b2, d2, s2, n2), "seed {seed}");
        let (t3, ..) = run(seed + 1000);
        assert_ne!(
            t1,
            t3,
            "seeds {seed} and {} gave the same trace",
            seed + 1000
        );
    });
}

#[test]
fn drop_rule_retransmits_and_delivers_exactly_once() {
    for_seeds(0..10, |seed| {
        let mut cfg = FabricConfig::adversarial(seed);
        cfg.drop_prob = 0.0;
        let fabric = Fabric::new(cfg);
        fabric.add_rule(Rule::new(Action::Drop).kind(OpKind::Write));
        let (ca, cb, bytes, src, _) = many_writes(&fabric, 20, 30_000);
        let s = fabric.stats();
        assert_eq!(
            s.drops, s.chunks_delivered,
            "seed {seed}: every chunk lost once"
        );
        assert_eq!(s.retransmits, s.drops, "seed {seed}");
        assert_eq!(write_results(&ca).len(), 20, "seed {seed}");
        assert!(
            write_results(&ca).iter().all(|(_, r)| r.is_ok()),
            "seed {seed}"
        );
        let mut im = imms(&cb);
        im.sort();
        assert_eq!(im, (0..20).collect::<Vec<_>>(), "seed {seed}");
        assert_eq!(bytes, src.snapshot(), "seed {seed}");
    });
}

#[test]
fn heavy_random_loss_still_exactly_once() {
    for_seeds(0..10, |seed| {
        let mut cfg = FabricConfig::adversarial(seed);
        cfg.drop_prob = 0.5;
        let fabric = Fabric::new(cfg);
        let (ca, cb, bytes, src, _) = many_writes(&fabric, 30, 20_000);
        let s = fabric.stats();
        assert!(s.drops > 10, "seed {seed}: {s:?}");
        let mut w: Vec<u64> = write_results(&ca).iter().map(|x| x.0).collect();
        w.sort();
        assert_eq!(w, (0..30).collect::<Vec<_>>(), "seed {seed}");
        assert!(
            write_results(&ca).iter().all(|(_, r)| r.is_ok()),
            "seed {seed}"
        );
        let mut im = imms(&cb);
        im.sort();
        assert_eq!(im, (0..30).collect::<Vec<_>>(), "seed {seed}");
        assert_eq!(bytes, src.snapshot(), "seed {seed}");
    });
}

#[test]
fn delay_rule_delays() {
    with_seed(5, || {
        let run = |delay: Option<Duration>| {
            let fabric = Fabric::new(FabricConfig::ideal(5));
            if let Some(d) = delay {
                fabric.add_rule(Rule::new(Action::Delay(d)));
            }
            let _ = many_writes(&fabric, 1, 100);
            fabric.now().as_nanos()
        };
        let base = run(None);
        let delayed = run(Some(Duration::from_millis(3)));
        assert!(delayed >= base + 3_000_000, "{base} vs {delayed}");
    });
}

#[test]
fn null_mode_copies_nothing_but_completes_at_next_poll() {
    with_seed(0, || {
        let fabric = Fabric::new(FabricConfig::null());
        let (mut a, mut b) = pair(&fabric);
        let src = mem::patterned(1, 4096);
        let dst = mem::filled(4096, 0xee);
        let rbuf = mem::filled(256, 0xee);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let mr = b.register(&rbuf.region(), Access::LocalOnly).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        b.post_recv(WrId(50), mr.slice(0, 256).unwrap()).unwrap();
        let wrs: Vec<WriteWr> = (0..8)
            .map(|i| WriteWr {
                wr: WrId(i),
                peer,
                src: ms.slice(i * 512, 512).unwrap(),
                dst: remote(&md, i * 512),
                imm: Some(i as u32 + 100),
            })
            .collect();
        assert_eq!(a.post_writes(&wrs).unwrap(), 8);
        a.post_send(WrId(60), peer, ms.slice(0, 100).unwrap())
            .unwrap();
        // No step, no advance: the next poll sees everything.
        let ca = poll_all(&mut a);
        let cb = poll_all(&mut b);
        assert_eq!(write_results(&ca).len(), 8);
        assert!(ca.contains(&Completion::Send {
            wr: WrId(60),
            result: Ok(())
        }));
        let mut im = imms(&cb);
        im.sort();
        assert_eq!(im, (100..108).collect::<Vec<_>>());
        assert!(cb.contains(&Completion::Recv {
            wr: WrId(50),
            result: Ok(100),
            from: Some(a.local_addr().clone()),
        }));
        assert!(
            dst.snapshot().iter().all(|&x| x == 0xee),
            "null mode wrote bytes"
        );
        assert!(
            rbuf.snapshot().iter().all(|&x| x == 0xee),
            "null mode wrote bytes"
        );
        assert_eq!(fabric.now().as_nanos(), 0);
        drop((a, b));
    });
}

#[test]
fn realtime_mode_from_two_threads() {
    with_seed(3, || {
        let mut cfg = FabricConfig::adversarial(3);
        cfg.jitter = Duration::from_micros(50);
        let fabric = Fabric::new_realtime(cfg);
        let (mut a, mut b) = pair(&fabric);
        let n = 64usize;
        let len = 8192usize;
        let src = mem::patterned(4, n * len);
        let dst = mem::filled(n * len, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        let target = std::thread::spawn(move || {
            let mut got = Vec::new();
            while got.len() < n {
                got.extend(imms(&poll_all(&mut b)));
                std::thread::yield_now();
            }
            (b, got)
        });
        let initiator = std::thread::spawn(move || {
            let mut done = 0;
            let mut next = 0;
            while done < n {
                if next < n {
                    let wr = WriteWr {
                        wr: WrId(next as u64),
                        peer,
                        src: ms.slice((next * len) as u64, len as u64).unwrap(),
                        dst: remote(&md, (next * len) as u64),
                        imm: Some(next as u32),
                    };
                    next += a.post_writes(&[wr]).unwrap();
                }
                let c = poll_all(&mut a);
                assert!(write_results(&c).iter().all(|(_, r)| r.is_ok()), "{c:?}");
                done += write_results(&c).len();
                std::thread::yield_now();
            }
            a
        });
        let a = initiator.join().unwrap();
        let (b, mut got) = target.join().unwrap();
        got.sort();
        assert_eq!(got, (0..n as u32).collect::<Vec<_>>());
        assert_eq!(dst.snapshot(), src.snapshot());
        assert!(fabric.now().as_nanos() > 0);
        drop((a, b));
    });
}

#[test]
fn send_recv_pool_any_order() {
    for_seeds(0..10, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (mut a, mut b) = pair(&fabric);
        let src = mem::patterned(2, 16 * 1000);
        let pool = mem::filled(16 * 1024, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let mp = b.register(&pool.region(), Access::LocalOnly).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        for i in 0..16u64 {
            b.post_recv(WrId(100 + i), mp.slice(i * 1024, 1024).unwrap())
                .unwrap();
        }
        for i in 0..16u64 {
            a.post_send(WrId(i), peer, ms.slice(i * 1000, 1000).unwrap())
                .unwrap();
        }
        fabric.run_until_idle();
        let ca = poll_all(&mut a);
        let cb = poll_all(&mut b);
        let sends = ca
            .iter()
            .filter(|c| matches!(c, Completion::Send { result: Ok(()), .. }))
            .count();
        assert_eq!(sends, 16, "seed {seed}: {ca:?}");
        let mut recv_ids: Vec<u64> = cb
            .iter()
            .map(|c| match c {
                Completion::Recv {
                    wr,
                    result: Ok(1000),
                    ..
                } => wr.0,
                other => panic!("seed {seed}: {other:?}"),
            })
            .collect();
        recv_ids.sort();
        assert_eq!(recv_ids, (100..116).collect::<Vec<_>>(), "seed {seed}");
        // Each buffer holds one message, whole: every 1000-byte message of
        // the source appears exactly once at the start of some buffer.
        let data = pool.snapshot();
        let s = src.snapshot();
        let mut found: Vec<usize> = (0..16)
            .map(|slot| {
                let got = &data[slot * 1024..slot * 1024 + 1000];
                (0..16)
                    .find(|m| &s[m * 1000..m * 1000 + 1000] == got)
                    .unwrap_or_else(|| panic!("seed {seed}: slot {slot} holds no message"))
            })
            .collect();
        found.sort();
        assert_eq!(found, (0..16).collect::<Vec<_>>(), "seed {seed}");
        drop((a, b));
    });
}

#[test]
fn many_small_writes_are_fast_enough_for_engine_tests() {
    with_seed(11, || {
        // 20k imm-only + small writes through the adversarial profile.
        let fabric = Fabric::new(FabricConfig::adversarial(11));
        let (ca, cb, bytes, src, _) = many_writes(&fabric, 20_000, 8);
        assert_eq!(write_results(&ca).len(), 20_000);
        assert_eq!(imms(&cb).len(), 20_000);
        assert_eq!(bytes, src.snapshot());
    });
}
