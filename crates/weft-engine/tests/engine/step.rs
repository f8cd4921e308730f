//! Deterministic scenarios: manual-mode engines driven step by step over
//! the loopback fabric in step mode (adversarial profile).

#![allow(clippy::type_complexity)]

use crate::common::*;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use weft_engine::{
    EngineError, GroupAddress, OnDone, Pages, ScatterDst, ScatterMode, TransferEngine,
};
use weft_loopback::{Action, Fabric, FabricConfig, OpKind, Rule};
use weft_transport::TransportError;

type Log = Arc<Mutex<Vec<String>>>;

fn small_writes_fabric(seed: u64) -> Fabric {
    Fabric::new(FabricConfig {
        // Force the engine to cut writes into several WRs per NIC.
        max_write_len: 48 * 1024,
        max_inflight: 8,
        max_batch: 4,
        ..FabricConfig::adversarial(seed)
    })
}

/// Two manual engines of 2 NICs each over [`small_writes_fabric`]: a
/// patterned source of `len` bytes registered on the first, a zeroed
/// destination of `len` bytes on the second, and the two buffers (keep
/// them until the engines are shut down).
fn two_hosts(seed: u64, len: usize) -> TwoHosts {
    let fabric = small_writes_fabric(seed);
    let (a, b) = (fabric.add_host(2), fabric.add_host(2));
    let ea = engine(&fabric, a, 2, test_config(), true);
    let eb = engine(&fabric, b, 2, test_config(), true);
    let src = Arc::new(mem::patterned(seed, len));
    let dst = Arc::new(mem::zeroed(len));
    let (sh, _) = ea.reg_mr(src.region()).unwrap();
    let (_, dd) = eb.reg_mr(dst.region()).unwrap();
    (fabric, ea, eb, sh, dd, (src, dst))
}

type TwoHosts = (
    Fabric,
    TransferEngine,
    TransferEngine,
    weft_engine::MrHandle,
    weft_transport::MrDesc,
    (
        Arc<weft_transport::HostBuffer>,
        Arc<weft_transport::HostBuffer>,
    ),
);

/// Single and paged writes with immediates over 1..=4 NICs; each
/// expect_imm_count callback checks its bytes are in place. Arms before or
/// after the data landed (early arrivals), chosen by the seed.
#[test]
fn single_and_paged_writes_every_nic_count() {
    for seed in seeds_or([11, 12, 13]) {
        for nics in 1..=4usize {
            let _g = SeedGuard::new(seed, "single_and_paged_writes_every_nic_count");
            let fabric = small_writes_fabric(seed);
            let (a, b) = (fabric.add_host(nics), fabric.add_host(nics));
            let ea = engine(&fabric, a, nics, test_config(), true);
            let eb = engine(&fabric, b, nics, test_config(), true);
            const LEN: usize = 700_000;
            let src = Arc::new(mem::patterned(seed, LEN));
            let dst = Arc::new(mem::zeroed(LEN));
            let (sh, _) = ea.reg_mr(src.region()).unwrap();
            let (_, dd) = eb.reg_mr(dst.region()).unwrap();
            assert_eq!(dd.rkeys.len(), nics);
            let counts = eb.imm_counts(0).unwrap();
            let errors: Log = Arc::default();
            let engines = [ea.clone(), eb.clone()];
            for (round, &(len, soff, doff)) in [
                (1u64, 0u64, 0u64),
                (4095, 3, 5),
                (64 * 1024, 0, 4096),
                (300_001, 17, 9),
                (LEN as u64 - 100, 100, 0),
                (0, 0, 0),
            ]
            .iter()
            .enumerate()
            {
                let imm = eb.alloc_imm().unwrap();
                let n = counts.single_write(len);
                let fired = Arc::new(AtomicBool::new(false));
                let arm = {
                    let (dst, src, errors, fired) =
                        (dst.clone(), src.clone(), errors.clone(), fired.clone());
                    move |r: Result<(), EngineError>| {
                        if let Err(e) = r {
                            errors.lock().push(format!("imm round failed: {e}"));
                        }
                        if dst.bytes(doff as usize, len as usize)
                            != src.bytes(soff as usize, len as usize)
                        {
                            errors
                                .lock()
                                .push(format!("round {round}: data not in place at imm callback"));
                        }
                        fired.store(true, Ordering::SeqCst);
                    }
                };
                let early = (seed + round as u64).is_multiple_of(2);
                if !early {
                    eb.expect_imm_count(imm, n, arm.clone()).unwrap();
                }
                let (od, flag) = OnDone::flag();
                ea.submit_single_write(len, Some(imm), (&sh, soff), (&dd, doff), od)
                    .unwrap();
                if early {
                    // Let every immediate arrive before arming.
                    drive(&fabric, &engines, || flag.is_done());
                    assert_eq!(eb.imm_pending(imm), n, "early arrivals are counted");
                    eb.expect_imm_count(imm, n, arm).unwrap();
                }
                drive(&fabric, &engines, || {
                    fired.load(Ordering::SeqCst) && flag.is_done()
                });
                assert_eq!(flag.result(), Some(Ok(())));
                assert_eq!(eb.imm_pending(imm), 0, "no excess");
                eb.free_imm(imm);
            }
            // Paged writes: 40 pages of 20000 bytes, scattered indices.
            let page = 20_000u64;
            let sp = Pages {
                indices: (0..30).rev().collect(),
                stride: page,
                offset: 0,
            };
            let dp = Pages {
                indices: (0..30).map(|i| (i * 7) % 31).collect(),
                stride: page + 64,
                offset: 32,
            };
            let imm = eb.alloc_imm().unwrap();
            let n = counts.paged_writes(page, sp.len() as u64);
            let fired = Arc::new(AtomicBool::new(false));
            {
                let (dst, src, errors, fired, sp, dp) = (
                    dst.clone(),
                    src.clone(),
                    errors.clone(),
                    fired.clone(),
                    sp.clone(),
                    dp.clone(),
                );
                eb.expect_imm_count(imm, n, move |r| {
                    assert!(r.is_ok());
                    for i in 0..sp.len() {
                        let so = sp.page_offset(i).unwrap() as usize;
                        let d_o = dp.page_offset(i).unwrap() as usize;
                        if dst.bytes(d_o, page as usize) != src.bytes(so, page as usize) {
                            errors.lock().push(format!("page {i} not in place"));
                        }
                    }
                    fired.store(true, Ordering::SeqCst);
                })
                .unwrap();
            }
            let (od, flag) = OnDone::flag();
            ea.submit_paged_writes(page, Some(imm), (&sh, &sp), (&dd, &dp), od)
                .unwrap();
            drive(&fabric, &engines, || {
                fired.load(Ordering::SeqCst) && flag.is_done()
            });
            assert_eq!(flag.result(), Some(Ok(())));
            assert!(errors.lock().is_empty(), "{:?}", errors.lock());
            ea.shutdown();
            eb.shutdown();
            assert_eq!(eb.stats().imm_excess, 0);
        }
    }
}

/// Scatter then barrier from one host to 64 peers (1 or 2 NICs each).
#[test]
fn scatter_and_barrier_to_64_peers() {
    // Seeds 21..=24 cover both modes on 1 and 2 NICs.
    for seed in seeds_or([21, 22, 23, 24]) {
        let _g = SeedGuard::new(seed, "scatter_and_barrier_to_64_peers");
        let nics = 1 + (seed as usize % 2);
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let hs = fabric.add_host(nics);
        let sender = engine(&fabric, hs, nics, test_config(), true);
        let peers: Vec<TransferEngine> = (0..64)
            .map(|_| {
                let h = fabric.add_host(nics);
                engine(&fabric, h, nics, test_config(), true)
            })
            .collect();
        const SLICE: usize = 6000;
        let src = Arc::new(mem::patterned(seed, 64 * SLICE));
        let (sh, _) = sender.reg_mr(src.region()).unwrap();
        let mut dsts = Vec::new();
        let mut descs = Vec::new();
        let mut bufs = Vec::new();
        let fired = Arc::new(AtomicU64::new(0));
        let errors: Log = Arc::default();
        let mode = if (seed / 2).is_multiple_of(2) {
            ScatterMode::ByPeer
        } else {
            ScatterMode::ByBytes
        };
        for (j, p) in peers.iter().enumerate() {
            let buf = Arc::new(mem::zeroed(SLICE + 64));
            let (_, d) = p.reg_mr(buf.region()).unwrap();
            let len = (1000 + j * 70) as u64;
            let n = p.imm_counts(0).unwrap().scatter_dst(len, mode);
            let (b2, s2, f2, e2) = (buf.clone(), src.clone(), fired.clone(), errors.clone());
            p.expect_imm_count(5, n, move |r| {
                if r.is_err() || b2.bytes(7, len as usize) != s2.bytes(j * SLICE, len as usize) {
                    e2.lock()
                        .push(format!("peer {j}: scatter data not in place"));
                }
                f2.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            dsts.push(ScatterDst {
                len,
                src_offset: (j * SLICE) as u64,
                dst: d.clone(),
                dst_offset: 7,
            });
            descs.push(d);
            bufs.push(buf);
        }
        let addrs: Vec<GroupAddress> = peers.iter().map(|p| p.main_address()).collect();
        let pg = sender.add_peer_group(&addrs).unwrap();
        let mut all = vec![sender.clone()];
        all.extend(peers.iter().cloned());
        let (od, flag) = OnDone::flag();
        sender
            .submit_scatter_mode(&pg, od, Some(5), &sh, &dsts, mode)
            .unwrap();
        drive(&fabric, &all, || {
            flag.is_done() && fired.load(Ordering::SeqCst) == 64
        });
        assert_eq!(flag.result(), Some(Ok(())));
        if mode == ScatterMode::ByPeer {
            // ByPeer: destination j goes whole to NIC j % nics.
            let posted: Vec<u64> = sender.stats().groups[0]
                .nics
                .iter()
                .map(|n| n.bytes_posted)
                .collect();
            let want: Vec<u64> = (0..nics)
                .map(|l| {
                    (0..64)
                        .filter(|j| j % nics == l)
                        .map(|j| (1000 + j * 70) as u64)
                        .sum()
                })
                .collect();
            assert_eq!(posted, want, "bytes posted per NIC (seed {seed})");
        }
        // Barrier: exactly one immediate per peer.
        let bfired = Arc::new(AtomicU64::new(0));
        for p in &peers {
            let f = bfired.clone();
            p.expect_imm_count(6, 1, move |r| {
                assert!(r.is_ok());
                f.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        }
        let (od, flag) = OnDone::flag();
        sender.submit_barrier(&pg, od, 6, &descs).unwrap();
        drive(&fabric, &all, || {
            flag.is_done() && bfired.load(Ordering::SeqCst) == 64
        });
        assert_eq!(flag.result(), Some(Ok(())));
        assert!(errors.lock().is_empty(), "{:?}", errors.lock());
        for p in &peers {
            assert_eq!(p.imm_pending(6), 0);
            assert_eq!(p.imm_pending(5), 0);
        }
        for e in &all {
            e.shutdown();
        }
    }
}

/// Injected WR failures fail exactly their transfer's on_done, once, even
/// when several pieces of one transfer fail; other transfers complete and
/// their immediates fire.
#[test]
fn injected_failures_fail_exactly_their_transfer() {
    for seed in seeds_or([31, 32, 33]) {
        let _g = SeedGuard::new(seed, "injected_failures_fail_exactly_their_transfer");
        let (fabric, ea, eb, sh, dd, _bufs) = two_hosts(seed, 1 << 20);
        // Fail every WR carrying immediate 3 (all pieces of transfer 3) and
        // the first WR carrying immediate 5.
        fabric.add_rule(Rule::new(Action::Fail).kind(OpKind::Write).imm(3));
        fabric.add_rule(Rule::new(Action::Fail).kind(OpKind::Write).imm(5).first(1));
        let results: Arc<Mutex<Vec<(u32, Result<(), EngineError>)>>> = Arc::default();
        let fired = Arc::new(AtomicU64::new(0));
        let counts = eb.imm_counts(0).unwrap();
        let len = 200_000u64;
        for imm in 0..10u32 {
            let r = results.clone();
            if imm != 3 && imm != 5 {
                let f = fired.clone();
                eb.expect_imm_count(imm, counts.single_write(len), move |_| {
                    f.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            }
            let off = u64::from(imm) * 100_000 % ((1 << 20) - len);
            ea.submit_single_write(
                len,
                Some(imm),
                (&sh, off),
                (&dd, off),
                OnDone::callback(move |res| r.lock().push((imm, res))),
            )
            .unwrap();
        }
        let engines = [ea.clone(), eb.clone()];
        drive(&fabric, &engines, || {
            results.lock().len() == 10 && fired.load(Ordering::SeqCst) == 8
        });
        let res = results.lock();
        let mut seen: Vec<u32> = res.iter().map(|(i, _)| *i).collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..10).collect::<Vec<_>>(),
            "each on_done exactly once"
        );
        for (imm, r) in res.iter() {
            if *imm == 3 || *imm == 5 {
                match r {
                    Err(e @ EngineError::Transport { group: 0, .. })
                        if matches!(e.transport(), Some(TransportError::Failed { .. })) => {}
                    other => panic!("transfer {imm}: expected injected failure, got {other:?}"),
                }
            } else {
                assert!(r.is_ok(), "transfer {imm}: {r:?}");
            }
        }
        // Failed WRs produce no immediate; transfer 5's other pieces may.
        assert!(eb.imm_pending(3) == 0);
        assert!(eb.imm_pending(5) < counts.single_write(len));
        drop(res);
        ea.shutdown();
        eb.shutdown();
    }
}

/// Counters are bumped in runs (one add per run of transfers sharing a
/// counter in a NIC's completion batch): with two counters interleaved
/// in runs, a flag among them and failures mid-run, each counter still
/// counts exactly its own successes and failures.
#[test]
fn counters_count_interleaved_runs_exactly() {
    use weft_engine::DoneCounter;
    for seed in seeds_or([41, 42, 43]) {
        let _g = SeedGuard::new(seed, "counters_count_interleaved_runs_exactly");
        let (fabric, ea, eb, sh, dd, _bufs) = two_hosts(seed, 1 << 16);
        // Every WR of transfers 3 and 11 fails.
        fabric.add_rule(Rule::new(Action::Fail).kind(OpKind::Write).imm(3));
        fabric.add_rule(Rule::new(Action::Fail).kind(OpKind::Write).imm(11));
        let (ca, cb) = (Arc::new(DoneCounter::new()), Arc::new(DoneCounter::new()));
        // Runs of A and B; transfer 8 reports to a flag.
        let pattern = b"AAABABBAFAAABBBBAB";
        let mut want = [(0u64, 0u64); 2];
        let mut flag = None;
        for (i, &who) in pattern.iter().enumerate() {
            let imm = i as u32;
            let failing = imm == 3 || imm == 11;
            let od = match who {
                b'F' => {
                    let (od, f) = OnDone::flag();
                    flag = Some(f);
                    od
                }
                _ => {
                    let k = usize::from(who == b'B');
                    if failing {
                        want[k].1 += 1;
                    } else {
                        want[k].0 += 1;
                    }
                    OnDone::counter(if k == 0 { &ca } else { &cb })
                }
            };
            let off = (i as u64 * 3000) % ((1 << 16) - 4096);
            ea.submit_single_write(4096, Some(imm), (&sh, off), (&dd, off), od)
                .unwrap();
        }
        let flag = flag.expect("the pattern has a flag");
        let engines = [ea.clone(), eb.clone()];
        let all = pattern.len() as u64 - 1;
        drive(&fabric, &engines, || {
            ca.total() + cb.total() == all && flag.is_done()
        });
        assert_eq!((ca.ok(), ca.failed()), want[0], "counter A");
        assert_eq!((cb.ok(), cb.failed()), want[1], "counter B");
        assert_eq!(flag.result(), Some(Ok(())));
        for c in [&ca, &cb] {
            match c.first_error() {
                Some(e @ EngineError::Transport { .. })
                    if matches!(e.transport(), Some(TransportError::Failed { .. })) => {}
                other => panic!("expected the injected failure, got {other:?}"),
            }
        }
        ea.shutdown();
        eb.shutdown();
    }
}

/// A peer dies in the middle of many transfers: every pending on_done
/// resolves, work to the other peer completes, later submits to the dead
/// peer fail, nothing hangs.
#[test]
fn peer_death_mid_transfer() {
    for seed in seeds_or([41, 42, 43]) {
        let _g = SeedGuard::new(seed, "peer_death_mid_transfer");
        let fabric = small_writes_fabric(seed);
        let nics = 1 + (seed as usize % 3);
        let (a, b, c) = (
            fabric.add_host(nics),
            fabric.add_host(nics),
            fabric.add_host(nics),
        );
        let ea = engine(&fabric, a, nics, test_config(), true);
        let eb = engine(&fabric, b, nics, test_config(), true);
        let ec = engine(&fabric, c, nics, test_config(), true);
        let src = Arc::new(mem::patterned(seed, 1 << 20));
        let db = Arc::new(mem::zeroed(1 << 20));
        let dc = Arc::new(mem::zeroed(1 << 20));
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, ddb) = eb.reg_mr(db.region()).unwrap();
        let (_, ddc) = ec.reg_mr(dc.region()).unwrap();
        let to_b: Arc<Mutex<Vec<Result<(), EngineError>>>> = Arc::default();
        let to_c: Arc<Mutex<Vec<Result<(), EngineError>>>> = Arc::default();
        const N: usize = 60;
        for i in 0..N {
            let len = 10_000 + (i as u64 * 7919) % 150_000;
            let (rb, rc) = (to_b.clone(), to_c.clone());
            ea.submit_single_write(
                len,
                Some(1),
                (&sh, 0),
                (&ddb, 0),
                OnDone::callback(move |r| rb.lock().push(r)),
            )
            .unwrap();
            ea.submit_single_write(
                len,
                Some(1),
                (&sh, 0),
                (&ddc, 0),
                OnDone::callback(move |r| rc.lock().push(r)),
            )
            .unwrap();
        }
        let engines = [ea.clone(), eb.clone(), ec.clone()];
        // Run a little, then kill b.
        let mut steps = 0;
        drive(&fabric, &engines, || {
            steps += 1;
            steps > 50 + (seed as usize % 50)
        });
        fabric.kill_host(b);
        drive(&fabric, &engines, || {
            to_b.lock().len() == N && to_c.lock().len() == N
        });
        assert!(
            to_c.lock().iter().all(|r| r.is_ok()),
            "other peer unaffected"
        );
        let failed = to_b.lock().iter().filter(|r| r.is_err()).count();
        assert!(failed > 0, "some transfers to the dead peer failed");
        for r in to_b.lock().iter().filter_map(|r| r.as_ref().err()) {
            assert!(
                matches!(r, EngineError::Transport { .. })
                    && matches!(r.transport(), Some(TransportError::PeerUnreachable { .. })),
                "{r:?}"
            );
        }
        // Later submits to the dead peer fail too (not hang).
        let (od, flag) = OnDone::flag();
        ea.submit_single_write(100, Some(2), (&sh, 0), (&ddb, 0), od)
            .unwrap();
        drive(&fabric, &engines, || flag.is_done());
        assert!(flag.result().unwrap().is_err());
        ea.shutdown();
        eb.shutdown();
        ec.shutdown();
    }
}

/// Same seed, same calls: same outcome (the step-mode engine is deterministic).
#[test]
fn deterministic_per_seed() {
    fn run(seed: u64) -> Vec<(u32, bool)> {
        let fabric = small_writes_fabric(seed);
        let (a, b) = (fabric.add_host(2), fabric.add_host(2));
        let ea = engine(&fabric, a, 2, test_config(), true);
        let eb = engine(&fabric, b, 2, test_config(), true);
        let src = mem::patterned(seed, 1 << 18);
        let dst = mem::zeroed(1 << 18);
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, dd) = eb.reg_mr(dst.region()).unwrap();
        fabric.add_rule(Rule::new(Action::Fail).kind(OpKind::Write).first(3));
        let order: Arc<Mutex<Vec<(u32, bool)>>> = Arc::default();
        for i in 0..30u32 {
            let o = order.clone();
            ea.submit_single_write(
                1000 + u64::from(i) * 3000,
                None,
                (&sh, 0),
                (&dd, 0),
                OnDone::callback(move |r| o.lock().push((i, r.is_ok()))),
            )
            .unwrap();
        }
        let engines = [ea.clone(), eb.clone()];
        drive(&fabric, &engines, || order.lock().len() == 30);
        ea.shutdown();
        eb.shutdown();
        let v = order.lock().clone();
        v
    }
    for seed in seeds_or([51]) {
        let _g = SeedGuard::new(seed, "deterministic_per_seed");
        assert_eq!(run(seed), run(seed));
    }
}

/// Argument errors are returned synchronously (on_done never called),
/// full queues fail with QueueFull in manual mode, imm allocation survives
/// double frees, and excess immediates are reported on free.
#[test]
fn api_errors_and_allocation() {
    let seed = 7;
    let _g = SeedGuard::new(seed, "api_errors_and_allocation");
    let fabric = Fabric::new(FabricConfig::adversarial(seed));
    let (a, b) = (fabric.add_host(2), fabric.add_host(2));
    let cfg = {
        let mut c = test_config();
        c.queue_capacity = 2;
        c
    };
    let excess: Arc<Mutex<Vec<(u32, u64)>>> = Arc::default();
    let ex2 = excess.clone();
    let ea = engine(&fabric, a, 2, cfg, true);
    let eb = TransferEngine::builder()
        .group(weft_engine::DomainGroupSpec::new(
            Arc::new(fabric.provider(b)),
            vec![0, 1],
        ))
        .config(test_config())
        .manual()
        .on_imm_excess(move |imm, n| ex2.lock().push((imm, n)))
        .build()
        .unwrap();
    let src = mem::patterned(seed, 4096);
    let dst = mem::zeroed(4096);
    let (sh, _) = ea.reg_mr(src.region()).unwrap();
    let (_, dd) = eb.reg_mr(dst.region()).unwrap();
    let called = Arc::new(AtomicU64::new(0));
    let od = || {
        let c = called.clone();
        OnDone::callback(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
        })
    };
    assert!(matches!(
        ea.submit_single_write(4097, None, (&sh, 0), (&dd, 0), od()),
        Err(EngineError::OutOfBounds { .. })
    ));
    assert!(matches!(
        ea.submit_single_write(10, None, (&sh, 4090), (&dd, 0), od()),
        Err(EngineError::OutOfBounds { .. })
    ));
    assert!(matches!(
        ea.submit_single_write(u64::MAX, None, (&sh, 2), (&dd, 0), od()),
        Err(EngineError::OutOfBounds { .. })
    ));
    // Paged: any page past the end (not only the first or the last
    // listed) is refused, on either side; offsets that overflow too.
    let pages = |indices: Vec<u32>, stride: u64| weft_engine::Pages {
        indices,
        stride,
        offset: 0,
    };
    let ok = pages(vec![3, 0, 1], 1024);
    let past = pages(vec![0, 4, 1], 1024);
    let huge = pages(vec![0, u32::MAX, 1], u64::MAX / 2);
    for (sp, dp) in [(&past, &ok), (&ok, &past)] {
        assert!(matches!(
            ea.submit_paged_writes(1024, None, (&sh, sp), (&dd, dp), od()),
            Err(EngineError::OutOfBounds { .. })
        ));
    }
    assert!(matches!(
        ea.submit_paged_writes(
            1000,
            None,
            (&sh, &ok),
            (&dd, &pages(vec![0, 3, 1], 1100)),
            od()
        ),
        Err(EngineError::OutOfBounds { .. })
    ));
    for (sp, dp) in [(&huge, &ok), (&ok, &huge)] {
        assert!(matches!(
            ea.submit_paged_writes(1024, None, (&sh, sp), (&dd, dp), od()),
            Err(EngineError::InvalidArgument { .. })
        ));
    }
    ea.submit_single_write(10, Some(1), (&sh, 0), (&dd, 0), od())
        .unwrap();
    ea.submit_single_write(10, Some(1), (&sh, 0), (&dd, 0), od())
        .unwrap();
    assert_eq!(
        ea.submit_single_write(10, Some(1), (&sh, 0), (&dd, 0), od()),
        Err(EngineError::QueueFull { group: 0 })
    );
    let engines = [ea.clone(), eb.clone()];
    drive(&fabric, &engines, || called.load(Ordering::SeqCst) == 2);
    drive(&fabric, &engines, || eb.imm_pending(1) == 2);
    // Two arrivals nobody expected: reported when the value is freed.
    let imm0 = eb.alloc_imm().unwrap();
    let imm1 = eb.alloc_imm().unwrap();
    assert_eq!((imm0, imm1), (0, 1));
    eb.free_imm(1);
    eb.free_imm(1);
    let x = eb.alloc_imm().unwrap();
    let y = eb.alloc_imm().unwrap();
    assert_ne!(x, y, "a double free must not hand a value out twice");
    drive(&fabric, &engines, || !excess.lock().is_empty());
    assert_eq!(excess.lock().as_slice(), &[(1, 2)]);
    assert_eq!(eb.stats().imm_excess, 2);
    assert!(matches!(eb.expect_imm_count(x, 3, |_| {}), Ok(())));
    assert_eq!(
        eb.expect_imm_count(x, 3, |_| {}),
        Err(EngineError::ImmAlreadyArmed { imm: x })
    );
    assert_eq!(
        called.load(Ordering::SeqCst),
        2,
        "rejected submits never call on_done"
    );
    ea.shutdown();
    eb.shutdown();
}

/// Two manual-mode 1-NIC engines over one fabric, for the immediate-round
/// tests: `ea` writes imm-only WRITEs into `eb`'s registration.
struct ImmPair {
    fabric: Fabric,
    ea: TransferEngine,
    eb: TransferEngine,
    sh: weft_engine::MrHandle,
    dd: weft_engine::MrDesc,
    _bufs: (HostBuffer, HostBuffer),
}

impl ImmPair {
    fn new(seed: u64) -> Self {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let ea = engine(&fabric, a, 1, test_config(), true);
        let eb = engine(&fabric, b, 1, test_config(), true);
        let (src, dst) = (mem::zeroed(64), mem::zeroed(64));
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, dd) = eb.reg_mr(dst.region()).unwrap();
        ImmPair {
            fabric,
            ea,
            eb,
            sh,
            dd,
            _bufs: (src, dst),
        }
    }

    /// Drives both engines until `done`.
    fn drive(&self, done: impl FnMut() -> bool) {
        drive(&self.fabric, &[self.ea.clone(), self.eb.clone()], done);
    }

    /// One zero-length WRITE carrying `imm`, driven until it completed.
    fn write(&self, imm: u32) {
        let (od, flag) = OnDone::flag();
        self.ea
            .submit_single_write(0, Some(imm), (&self.sh, 0), (&self.dd, 0), od)
            .unwrap();
        self.drive(|| flag.is_done());
        assert_eq!(flag.result(), Some(Ok(())));
    }

    fn shutdown(&self) {
        self.eb.shutdown();
        self.ea.shutdown();
    }
}

/// `armed_imm_rounds` counts each armed round from its arm until its
/// callback ran (fired by arrivals, fired at arm by early arrivals, failed
/// by `free_imm` or shutdown) or was dropped (a refused second arm); a
/// zero-count round never counts.
#[test]
fn armed_imm_rounds_follow_each_round() {
    let seed = 21;
    let _g = SeedGuard::new(seed, "armed_imm_rounds_follow_each_round");
    let t = ImmPair::new(seed);
    let eb = &t.eb;
    let fired = Arc::new(AtomicU64::new(0));
    let arm = |imm| {
        let f = fired.clone();
        eb.expect_imm_count(imm, 1, move |_| {
            f.fetch_add(1, Ordering::SeqCst);
        })
    };
    let (x, y) = (eb.alloc_imm().unwrap(), eb.alloc_imm().unwrap());
    assert_eq!(eb.armed_imm_rounds(), 0);
    eb.expect_imm_count(x, 0, |_| {}).unwrap();
    assert_eq!(eb.armed_imm_rounds(), 0, "a zero-count round never waits");
    arm(x).unwrap();
    arm(y).unwrap();
    assert_eq!(eb.armed_imm_rounds(), 2);
    assert!(matches!(arm(x), Err(EngineError::ImmAlreadyArmed { .. })));
    assert_eq!(eb.armed_imm_rounds(), 2, "a refused arm is not counted");
    // x fires by its arrival.
    t.write(x);
    t.drive(|| fired.load(Ordering::SeqCst) == 1);
    assert_eq!(eb.armed_imm_rounds(), 1);
    // An early arrival: the round fires at its arm.
    t.write(x);
    t.drive(|| eb.imm_pending(x) == 1);
    arm(x).unwrap();
    t.drive(|| fired.load(Ordering::SeqCst) == 2);
    assert_eq!(eb.armed_imm_rounds(), 1);
    // y is freed while armed: its callback fails.
    eb.free_imm(y);
    t.drive(|| fired.load(Ordering::SeqCst) == 3);
    assert_eq!(eb.armed_imm_rounds(), 0);
    // A round still armed at shutdown.
    arm(x).unwrap();
    assert_eq!(eb.armed_imm_rounds(), 1);
    t.shutdown();
    assert_eq!(fired.load(Ordering::SeqCst), 4, "shutdown ran the callback");
    assert_eq!(eb.armed_imm_rounds(), 0);
}

/// `expect_imm_count_with` reports to a flag or a counter without the
/// callback thread: set by the worker that counted the last immediate, or
/// by the arm itself when early arrivals already reach the count; a
/// refused arm leaves its flag unset; shutdown fails an unfired round.
#[test]
fn imm_rounds_report_to_flags_and_counters() {
    let seed = 22;
    let _g = SeedGuard::new(seed, "imm_rounds_report_to_flags_and_counters");
    let t = ImmPair::new(seed);
    let eb = &t.eb;
    let x = eb.alloc_imm().unwrap();
    // A flag, set when the second of two immediates is counted.
    let (od, flag) = OnDone::flag();
    eb.expect_imm_count_with(x, 2, od).unwrap();
    let (od2, refused) = OnDone::flag();
    assert!(matches!(
        eb.expect_imm_count_with(x, 1, od2),
        Err(EngineError::ImmAlreadyArmed { .. })
    ));
    t.write(x);
    assert!(!flag.is_done(), "fired before its count");
    t.write(x);
    t.drive(|| flag.is_done());
    assert_eq!(flag.result(), Some(Ok(())));
    assert!(!refused.is_done(), "a refused arm never resolves");
    assert_eq!(eb.armed_imm_rounds(), 0);
    // A counter, bumped by the arm itself: the arrivals came first.
    let counter = Arc::new(weft_engine::DoneCounter::new());
    t.write(x);
    t.drive(|| eb.imm_pending(x) == 1);
    eb.expect_imm_count_with(x, 1, OnDone::counter(&counter))
        .unwrap();
    assert_eq!(counter.ok(), 1, "resolved by the arm");
    assert_eq!(eb.armed_imm_rounds(), 0);
    // Shutdown fails a round still armed.
    let (od, last) = OnDone::flag();
    eb.expect_imm_count_with(x, 1, od).unwrap();
    t.shutdown();
    assert!(
        matches!(last.result(), Some(Err(EngineError::ShutDown))),
        "{:?}",
        last.result()
    );
    assert_eq!(eb.armed_imm_rounds(), 0);
}
