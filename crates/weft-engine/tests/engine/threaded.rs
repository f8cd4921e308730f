//! Threaded scenarios: engines with real worker/callback/watcher threads
//! over the loopback fabric in realtime mode (adversarial profile).

#![allow(clippy::type_complexity)]

use crate::common::*;
use parking_lot::Mutex;
use rand::Rng;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use weft_engine::{DoneCounter, EngineError, OnDone, Pages, QueueFullPolicy, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};

type Log = Arc<Mutex<Vec<String>>>;

/// Number of writes of the mixed test: `WEFT_MIXED_WRITES`, else 100k in
/// release and 20k in debug builds.
fn mixed_count() -> usize {
    std::env::var("WEFT_MIXED_WRITES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) {
            20_000
        } else {
            100_000
        })
}

const SLOTS: usize = 4;
const SLOT_LEN: usize = 96 * 1024;

/// Mixed single and paged writes with immediates between `hosts` hosts of
/// `nics` NICs; every expect_imm_count callback checks all its bytes are in
/// place; arming happens before or after submitting (early arrivals).
/// The threaded tests' engine configuration: [`test_config`], with
/// `caller_posts` on for odd seeds, so the fixed seeds cover both the
/// queue hand-off and the submitting thread posting itself.
fn threaded_config(seed: u64) -> weft_engine::EngineConfig {
    let mut c = test_config();
    c.caller_posts = seed % 2 == 1;
    c
}

fn mixed_writes(seed: u64, hosts: usize, nics: usize, total: usize) {
    let _g = SeedGuard::new(seed, "mixed_writes");
    let fabric = Fabric::new_realtime(FabricConfig {
        max_write_len: 40 * 1024,
        ..FabricConfig::adversarial(seed)
    });
    let engines: Vec<TransferEngine> = (0..hosts)
        .map(|_| {
            let h = fabric.add_host(nics);
            engine(&fabric, h, nics, threaded_config(seed), false)
        })
        .collect();
    let src_len = 1 << 20;
    let srcs: Vec<Arc<HostBuffer>> = (0..hosts)
        .map(|s| Arc::new(mem::patterned(seed ^ s as u64, src_len)))
        .collect();
    let dsts: Vec<Arc<HostBuffer>> = (0..hosts)
        .map(|_| Arc::new(mem::zeroed(hosts * SLOTS * SLOT_LEN)))
        .collect();
    let src_mrs: Vec<_> = engines
        .iter()
        .zip(&srcs)
        .map(|(e, b)| e.reg_mr(b.region()).unwrap().0)
        .collect();
    let dst_descs: Vec<_> = engines
        .iter()
        .zip(&dsts)
        .map(|(e, b)| e.reg_mr(b.region()).unwrap().1)
        .collect();
    // imm of slot (s, k) at receiver r
    let imms: Vec<Vec<u32>> = engines
        .iter()
        .map(|e| (0..hosts * SLOTS).map(|_| e.alloc_imm().unwrap()).collect())
        .collect();
    let free: Arc<Mutex<Vec<(usize, usize, usize)>>> = Arc::new(Mutex::new(
        (0..hosts)
            .flat_map(|r| {
                (0..hosts)
                    .filter(move |&s| s != r)
                    .flat_map(move |s| (0..SLOTS).map(move |k| (s, r, k)))
            })
            .collect(),
    ));
    let errors: Log = Arc::default();
    let fired = Arc::new(AtomicU64::new(0));
    let done = Arc::new(DoneCounter::new());
    let mut rng = weft_testkit::seed::rng(seed);
    let mut issued = 0usize;
    while issued < total {
        let pick = {
            let mut f = free.lock();
            if f.is_empty() {
                None
            } else {
                let i = rng.gen_range(0..f.len());
                Some(f.swap_remove(i))
            }
        };
        let Some((s, r, k)) = pick else {
            std::thread::yield_now();
            continue;
        };
        let slot_off = ((s * SLOTS + k) * SLOT_LEN) as u64;
        let imm = imms[r][s * SLOTS + k];
        let counts = engines[r].imm_counts(0).unwrap();
        let paged = rng.gen_bool(0.2);
        // (src offset, dst offset, len) of every region to check
        let mut regions = Vec::new();
        let mut single_src = 0u64;
        let n;
        let sp;
        let dp;
        let len;
        if paged {
            let page = 4096u64;
            let pages = rng.gen_range(1..=16u32);
            sp = Pages {
                indices: (0..pages).map(|_| rng.gen_range(0..200)).collect(),
                stride: page,
                offset: rng.gen_range(0..64),
            };
            let mut idx: Vec<u32> = (0..(SLOT_LEN as u32 / page as u32)).collect();
            for i in (1..idx.len()).rev() {
                idx.swap(i, rng.gen_range(0..=i));
            }
            idx.truncate(pages as usize);
            dp = Pages {
                indices: idx,
                stride: page,
                offset: slot_off,
            };
            for i in 0..pages as usize {
                regions.push((sp.page_offset(i).unwrap(), dp.page_offset(i).unwrap(), page));
            }
            n = counts.paged_writes(page, u64::from(pages));
            len = page;
        } else {
            len = match rng.gen_range(0..10) {
                0..=5 => rng.gen_range(0..4096u64),
                6..=8 => rng.gen_range(4096..32 * 1024),
                _ => rng.gen_range(64 * 1024..SLOT_LEN as u64),
            };
            let so = rng.gen_range(0..(src_len as u64 - len));
            single_src = so;
            regions.push((so, slot_off, len));
            n = counts.single_write(len);
            sp = Pages {
                indices: vec![],
                stride: 0,
                offset: 0,
            };
            dp = sp.clone();
        }
        let cb = {
            let (src, dst, errors, fired, free) = (
                srcs[s].clone(),
                dsts[r].clone(),
                errors.clone(),
                fired.clone(),
                free.clone(),
            );
            move |res: Result<(), EngineError>| {
                if let Err(e) = res {
                    errors.lock().push(format!("imm round failed: {e}"));
                }
                for &(so, d_o, l) in &regions {
                    if src.bytes(so as usize, l as usize) != dst.bytes(d_o as usize, l as usize) {
                        errors.lock().push(format!(
                            "{s}->{r} slot {k}: bytes not in place when the imm count fired"
                        ));
                    }
                }
                fired.fetch_add(1, Ordering::SeqCst);
                free.lock().push((s, r, k));
            }
        };
        let early = rng.gen_bool(0.3);
        if !early {
            engines[r].expect_imm_count(imm, n, cb.clone()).unwrap();
        }
        let od = OnDone::counter(&done);
        if paged {
            engines[s]
                .submit_paged_writes(len, Some(imm), (&src_mrs[s], &sp), (&dst_descs[r], &dp), od)
                .unwrap();
        } else {
            engines[s]
                .submit_single_write(
                    len,
                    Some(imm),
                    (&src_mrs[s], single_src),
                    (&dst_descs[r], slot_off),
                    od,
                )
                .unwrap();
        }
        if early {
            engines[r].expect_imm_count(imm, n, cb).unwrap();
        }
        issued += 1;
    }
    wait_until("all imm callbacks and on_dones", HANG, || {
        fired.load(Ordering::SeqCst) == total as u64 && done.total() == total as u64
    });
    assert_eq!(done.failed(), 0, "{:?}", done.first_error());
    assert!(
        errors.lock().is_empty(),
        "{:?}",
        &errors.lock()[..errors.lock().len().min(5)]
    );
    for e in &engines {
        e.shutdown();
        assert_eq!(e.stats().imm_excess, 0, "no excess immediates");
    }
}

#[test]
fn mixed_writes_2_to_16_hosts() {
    let total = mixed_count();
    // (hosts, nics): spread the total over a few topologies.
    let topologies = [(2usize, 1usize), (4, 4), (8, 2), (16, 3)];
    for (i, seed) in seeds_or([61]).into_iter().enumerate() {
        for (j, &(h, n)) in topologies.iter().enumerate() {
            let share = if j == 0 {
                total - total / 4 * 3
            } else {
                total / 4
            };
            mixed_writes(seed + (i * 10 + j) as u64, h, n, share);
        }
    }
}

/// Every host sends to every other host; each message arrives exactly once
/// with its content; large messages (over a send slot) work too.
#[test]
fn send_recv_storm() {
    for seed in seeds_or([71]) {
        let _g = SeedGuard::new(seed, "send_recv_storm");
        let fabric = Fabric::new_realtime(FabricConfig {
            rnr_timeout: Duration::from_secs(30),
            ..FabricConfig::adversarial(seed)
        });
        let hosts = 4;
        let per_pair: u32 = if cfg!(debug_assertions) { 150 } else { 2000 };
        let engines: Vec<TransferEngine> = (0..hosts)
            .map(|_| engine(&fabric, fabric.add_host(2), 2, threaded_config(seed), false))
            .collect();
        let got: Vec<Arc<Mutex<BTreeSet<(u8, u32)>>>> =
            (0..hosts).map(|_| Arc::default()).collect();
        let errors: Log = Arc::default();
        let recvd = Arc::new(AtomicU64::new(0));
        for (r, e) in engines.iter().enumerate() {
            let (g, errs, n) = (got[r].clone(), errors.clone(), recvd.clone());
            e.submit_recvs(16 * 1024, 32, move |m| {
                match m {
                    Ok(b) if b.len() >= 9 => {
                        let sender = b[0];
                        let seq = u32::from_le_bytes([b[1], b[2], b[3], b[4]]);
                        let len = u32::from_le_bytes([b[5], b[6], b[7], b[8]]) as usize;
                        let ok = b.len() == len
                            && b[9..].iter().enumerate().all(|(i, &x)| {
                                x == pattern_byte(u64::from(seq) ^ u64::from(sender), i as u64)
                            });
                        if !ok {
                            errs.lock().push(format!("bad message {sender}/{seq}"));
                        }
                        if !g.lock().insert((sender, seq)) {
                            errs.lock()
                                .push(format!("duplicate message {sender}/{seq}"));
                        }
                    }
                    Ok(b) => errs
                        .lock()
                        .push(format!("short message of {} bytes", b.len())),
                    Err(e) => errs.lock().push(format!("receive error {e}")),
                }
                n.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        }
        let sent = Arc::new(DoneCounter::new());
        let mut rng = weft_testkit::seed::rng(seed);
        let addrs: Vec<_> = engines.iter().map(|e| e.main_address()).collect();
        for seq in 0..per_pair {
            for (s, e) in engines.iter().enumerate() {
                for (r, a) in addrs.iter().enumerate() {
                    if r == s {
                        continue;
                    }
                    let len: usize = if rng.gen_bool(0.05) {
                        rng.gen_range(5000..12000)
                    } else {
                        rng.gen_range(9..600)
                    };
                    let mut m = vec![0u8; len];
                    m[0] = s as u8;
                    m[1..5].copy_from_slice(&seq.to_le_bytes());
                    m[5..9].copy_from_slice(&(len as u32).to_le_bytes());
                    for (i, x) in m[9..].iter_mut().enumerate() {
                        *x = pattern_byte(u64::from(seq) ^ s as u64, i as u64);
                    }
                    e.submit_send(a, &m, OnDone::counter(&sent)).unwrap();
                }
            }
        }
        let total = u64::from(per_pair) * (hosts * (hosts - 1)) as u64;
        wait_until("all messages", HANG, || {
            recvd.load(Ordering::SeqCst) == total && sent.total() == total
        });
        assert_eq!(sent.failed(), 0, "{:?}", sent.first_error());
        assert!(
            errors.lock().is_empty(),
            "{:?}",
            &errors.lock()[..errors.lock().len().min(5)]
        );
        for g in &got {
            assert_eq!(
                g.lock().len() as u64,
                u64::from(per_pair) * (hosts as u64 - 1)
            );
        }
        for e in &engines {
            e.shutdown();
        }
    }
}

/// Callbacks that re-submit into a tiny request queue (Block policy) do
/// not deadlock, and a peer killed in the middle fails exactly its work.
#[test]
fn resubmitting_callbacks_and_peer_death() {
    for seed in seeds_or([81]) {
        let _g = SeedGuard::new(seed, "resubmitting_callbacks_and_peer_death");
        let fabric = Fabric::new_realtime(FabricConfig::adversarial(seed));
        let cfg = {
            let mut c = threaded_config(seed);
            c.queue_capacity = 2;
            c.queue_full = QueueFullPolicy::Block;
            c
        };
        let (a, b, c) = (fabric.add_host(2), fabric.add_host(2), fabric.add_host(2));
        let ea = engine(&fabric, a, 2, cfg.clone(), false);
        let eb = engine(&fabric, b, 2, cfg.clone(), false);
        let ec = engine(&fabric, c, 2, cfg, false);
        let src = Arc::new(mem::patterned(seed, 1 << 18));
        let db = Arc::new(mem::zeroed(1 << 18));
        let dc = Arc::new(mem::zeroed(1 << 18));
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, ddb) = eb.reg_mr(db.region()).unwrap();
        let (_, ddc) = ec.reg_mr(dc.region()).unwrap();
        let chain_len: u64 = if cfg!(debug_assertions) { 300 } else { 3000 };
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let submitted = Arc::new(AtomicU64::new(0));
        // Each chain: on_done submits the next write of the chain.
        fn step(
            e: TransferEngine,
            sh: weft_engine::MrHandle,
            d: weft_engine::MrDesc,
            left: u64,
            ok: Arc<AtomicU64>,
            failed: Arc<AtomicU64>,
            sub: Arc<AtomicU64>,
        ) {
            if left == 0 {
                return;
            }
            let e2 = e.clone();
            let d2 = d.clone();
            let (ok2, f2, s2) = (ok.clone(), failed.clone(), sub.clone());
            sub.fetch_add(1, Ordering::SeqCst);
            let r = e.submit_single_write(
                1 + left * 97 % 60_000,
                Some(9),
                (&sh, 0),
                (&d, 0),
                OnDone::callback(move |r| {
                    if r.is_ok() {
                        ok2.fetch_add(1, Ordering::SeqCst);
                    } else {
                        f2.fetch_add(1, Ordering::SeqCst);
                    }
                    step(e2, sh, d2, left - 1, ok2, f2, s2);
                }),
            );
            if r.is_err() {
                sub.fetch_sub(1, Ordering::SeqCst);
            }
        }
        for chain in 0..8u32 {
            let d = if chain.is_multiple_of(2) {
                ddb.clone()
            } else {
                ddc.clone()
            };
            step(
                ea.clone(),
                sh,
                d,
                chain_len,
                ok.clone(),
                failed.clone(),
                submitted.clone(),
            );
        }
        wait_until("chains under way", HANG, || {
            ok.load(Ordering::SeqCst) > chain_len
        });
        fabric.kill_host(b);
        wait_until("all chains finished", HANG, || {
            let s = submitted.load(Ordering::SeqCst);
            s == ok.load(Ordering::SeqCst) + failed.load(Ordering::SeqCst) && s == 8 * chain_len
        });
        assert!(
            failed.load(Ordering::SeqCst) > 0,
            "writes to the dead peer failed"
        );
        assert!(
            failed.load(Ordering::SeqCst) <= 4 * chain_len,
            "only writes to the dead peer failed"
        );
        for e in [&ea, &eb, &ec] {
            e.shutdown();
        }
    }
}

/// Shutdown with lots of work queued and in flight resolves every on_done
/// and fails armed immediate rounds; submits afterwards fail.
#[test]
fn shutdown_resolves_everything() {
    for seed in seeds_or([91]) {
        let _g = SeedGuard::new(seed, "shutdown_resolves_everything");
        let fabric = Fabric::new_realtime(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(2), fabric.add_host(2));
        let ea = engine(&fabric, a, 2, threaded_config(seed), false);
        let eb = engine(&fabric, b, 2, threaded_config(seed), false);
        let src = mem::patterned(seed, 1 << 20);
        let dst = mem::zeroed(1 << 20);
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, dd) = eb.reg_mr(dst.region()).unwrap();
        let done = Arc::new(DoneCounter::new());
        let n = 2000u64;
        for i in 0..n {
            ea.submit_single_write(
                1000 + i % 5000 * 100,
                Some(1),
                (&sh, 0),
                (&dd, 0),
                OnDone::counter(&done),
            )
            .unwrap();
        }
        let imm_res: Arc<Mutex<Vec<Result<(), EngineError>>>> = Arc::default();
        let r2 = imm_res.clone();
        eb.expect_imm_count(2, 5, move |r| r2.lock().push(r))
            .unwrap();
        ea.shutdown();
        assert_eq!(done.total(), n, "every on_done resolved by shutdown");
        eb.shutdown();
        assert_eq!(imm_res.lock().as_slice(), &[Err(EngineError::ShutDown)]);
        let (od, _f) = OnDone::flag();
        assert_eq!(
            ea.submit_single_write(1, None, (&sh, 0), (&dd, 0), od),
            Err(EngineError::ShutDown)
        );
    }
}

/// The same immediate re-armed for many rounds while its arrivals race the
/// arm calls: each round fires once, with all its data in place.
#[test]
fn rearm_rounds_race_arrivals() {
    for seed in seeds_or([101]) {
        let _g = SeedGuard::new(seed, "rearm_rounds_race_arrivals");
        let fabric = Fabric::new_realtime(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(3), fabric.add_host(3));
        let ea = engine(&fabric, a, 3, threaded_config(seed), false);
        let eb = engine(&fabric, b, 3, threaded_config(seed), false);
        let src = Arc::new(mem::patterned(seed, 1 << 20));
        let dst = Arc::new(mem::zeroed(1 << 20));
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, dd) = eb.reg_mr(dst.region()).unwrap();
        let imm = eb.alloc_imm().unwrap();
        let counts = eb.imm_counts(0).unwrap();
        let rounds = if cfg!(debug_assertions) { 100 } else { 1000 };
        let mut rng = weft_testkit::seed::rng(seed);
        let errors: Log = Arc::default();
        for round in 0..rounds {
            let len = rng.gen_range(1..300_000u64);
            let so = rng.gen_range(0..(1u64 << 20) - len);
            let (od, flag) = OnDone::flag();
            let fired = Arc::new(AtomicU64::new(0));
            let arm = {
                let (s, d, f, e) = (src.clone(), dst.clone(), fired.clone(), errors.clone());
                move |r: Result<(), EngineError>| {
                    if r.is_err() || s.bytes(so as usize, len as usize) != d.bytes(0, len as usize)
                    {
                        e.lock().push(format!("round {round}: data not in place"));
                    }
                    f.fetch_add(1, Ordering::SeqCst);
                }
            };
            let n = counts.single_write(len) as u32;
            let early = rng.gen_bool(0.5);
            if !early {
                eb.expect_imm_count(imm, u64::from(n), arm.clone()).unwrap();
            }
            ea.submit_single_write(len, Some(imm), (&sh, so), (&dd, 0), od)
                .unwrap();
            if early {
                // Arm while the arrivals are landing.
                std::thread::yield_now();
                eb.expect_imm_count(imm, u64::from(n), arm).unwrap();
            }
            wait_until("round", HANG, || {
                flag.is_done() && fired.load(Ordering::SeqCst) >= 1
            });
            assert_eq!(flag.result(), Some(Ok(())));
            assert_eq!(fired.load(Ordering::SeqCst), 1, "fires exactly once");
        }
        assert!(errors.lock().is_empty(), "{:?}", errors.lock());
        assert_eq!(eb.imm_pending(imm), 0);
        ea.shutdown();
        eb.shutdown();
    }
}

/// A receive callback that blocks does not grow the receiver's memory
/// without bound: once a pool's copied-out messages reach
/// `recv_backlog_bytes`, its finished buffers are held back and peers'
/// SENDs wait for a buffer; once the callback catches up, the buffers are
/// re-posted and every message arrives exactly once, none failed.
#[test]
fn blocked_recv_callback_bounds_the_backlog() {
    for seed in seeds_or([81]) {
        let _g = SeedGuard::new(seed, "blocked_recv_callback_bounds_the_backlog");
        let fabric = Fabric::new_realtime(FabricConfig {
            rnr_timeout: Duration::from_secs(60),
            ..FabricConfig::ideal(seed)
        });
        let mut cfg = test_config();
        // Three 64-byte messages.
        cfg.recv_backlog_bytes = 3 * 64;
        let rx = engine(&fabric, fabric.add_host(1), 1, cfg, false);
        let tx = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
        let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let got: Arc<Mutex<Vec<u32>>> = Arc::default();
        let (g2, got2) = (gate.clone(), got.clone());
        rx.submit_recvs(64, 2, move |m| {
            let (open, cv) = &*g2;
            let mut o = open.lock().unwrap();
            while !*o {
                o = cv.wait(o).unwrap();
            }
            drop(o);
            if let Ok(b) = m {
                got2.lock()
                    .push(u32::from_le_bytes(b[..4].try_into().unwrap()));
            }
        })
        .unwrap();
        let sent = Arc::new(DoneCounter::new());
        let to = rx.main_address();
        let n = 12u32;
        for seq in 0..n {
            tx.submit_send(&to, &seq.to_le_bytes(), OnDone::counter(&sent))
                .unwrap();
        }
        // Two buffers, a bound of three: messages 1 and 2 have their
        // buffer re-posted, 3 and 4 are held; the other SENDs wait.
        wait_until("four SENDs delivered", HANG, || sent.total() >= 4);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            sent.total(),
            4,
            "seed {seed}: SENDs kept landing with the callback blocked"
        );
        {
            let (open, cv) = &*gate;
            *open.lock().unwrap() = true;
            cv.notify_all();
        }
        wait_until("all messages", HANG, || {
            got.lock().len() == n as usize && sent.total() == u64::from(n)
        });
        assert_eq!(sent.failed(), 0, "{:?}", sent.first_error());
        let mut seqs = got.lock().clone();
        seqs.sort_unstable();
        assert_eq!(seqs, (0..n).collect::<Vec<_>>(), "seed {seed}");
        tx.shutdown();
        rx.shutdown();
    }
}

/// `EngineConfig::caller_posts`: with it, sequential writes from one
/// thread to an otherwise idle group are (at least sometimes) posted by the
/// submitting thread itself, and every byte lands; without it, never.
#[test]
fn caller_posts_takes_idle_groups_and_can_be_turned_off() {
    for on in [true, false] {
        let fabric = Fabric::new_realtime(FabricConfig::ideal(21));
        let mut cfg = test_config();
        cfg.caller_posts = on;
        let ea = engine(&fabric, fabric.add_host(1), 1, cfg.clone(), false);
        let eb = engine(&fabric, fabric.add_host(1), 1, cfg, false);
        let src = mem::patterned(4, 1 << 16);
        let dst = mem::zeroed(1 << 16);
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, dd) = eb.reg_mr(dst.region()).unwrap();
        for i in 0..200u64 {
            let (od, flag) = OnDone::flag();
            let off = (i % 16) * 4096;
            ea.submit_single_write(4096, None, (&sh, off), (&dd, off), od)
                .unwrap();
            assert_eq!(flag.wait_timeout(Duration::from_secs(30)), Some(Ok(())));
            if i % 50 == 0 {
                // Let the worker go idle (and park) between some writes.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        assert_eq!(dst.bytes(0, 1 << 16), src.bytes(0, 1 << 16));
        let s = ea.stats().groups[0].clone();
        assert_eq!(s.transfers_ok, 200);
        if on {
            assert!(s.caller_posted > 0, "the fast path never ran: {s:?}");
        } else {
            assert_eq!(s.caller_posted, 0);
        }
        ea.shutdown();
        eb.shutdown();
    }
}
