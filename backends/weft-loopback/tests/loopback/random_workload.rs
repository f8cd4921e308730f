//! Randomized workloads: every invariant of the contract, over many seeds.

use crate::common::*;
use rand::Rng;
use std::collections::BTreeMap;
use weft_loopback::{Action, Fabric, FabricConfig, OpKind, Rule, TraceEvent};
use weft_transport::{
    Access, Completion, Domain, RemoteSlice, Rkey, TransportError, WrId, WriteWr,
};

const SLOT: usize = 4096;

/// What the workload expects of one WRITE.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Expect {
    from: usize,
    to: usize,
    slot: usize,
    src_off: usize,
    len: usize,
    imm: Option<u32>,
    /// A remote-access violation: must fail with RemoteAccess.
    rejected: bool,
    /// A rule may fail it (Failed / PeerUnreachable) instead.
    ruled: bool,
}

/// Runs a random mix of writes (some invalid) and sends between three hosts
/// and checks the contract. Returns the trace for replay comparison.
fn workload(seed: u64, cfg: FabricConfig, with_rules: bool) -> Vec<TraceEvent> {
    let fabric = Fabric::new(cfg.with_trace(true));
    let hosts: Vec<_> = (0..3).map(|_| fabric.add_host(2)).collect();
    let mut doms: Vec<_> = hosts.iter().map(|&h| fabric.open(h, 0).unwrap()).collect();
    let mut rng = weft_testkit::seed::rng(seed ^ 0xabcdef);
    if with_rules {
        fabric.add_rule(Rule::new(Action::Fail).kind(OpKind::Write).imm(13));
        fabric.add_rule(Rule::new(Action::Drop).kind(OpKind::Send).first(3));
        fabric.add_rule(Rule::new(Action::DropAll).imm(17).first(1));
    }
    let nslots = 64;
    let srcs: Vec<HostBuffer> = (0..3)
        .map(|i| mem::patterned(u64::from(i as u8 + 1), nslots * SLOT))
        .collect();
    let dsts: Vec<HostBuffer> = (0..3).map(|_| mem::filled(nslots * SLOT, 0)).collect();
    let recv_pools: Vec<HostBuffer> = (0..3).map(|_| mem::filled(16 * 256, 0)).collect();
    let ms: Vec<_> = (0..3)
        .map(|i| {
            doms[i]
                .register(&srcs[i].region(), Access::LocalOnly)
                .unwrap()
        })
        .collect();
    let md: Vec<_> = (0..3)
        .map(|i| {
            doms[i]
                .register(&dsts[i].region(), Access::RemoteWrite)
                .unwrap()
        })
        .collect();
    let mr: Vec<_> = (0..3)
        .map(|i| {
            doms[i]
                .register(&recv_pools[i].region(), Access::LocalOnly)
                .unwrap()
        })
        .collect();
    let addrs: Vec<_> = doms.iter().map(|d| d.local_addr().clone()).collect();
    let peers: Vec<Vec<_>> = (0..3)
        .map(|i| addrs.iter().map(|a| doms[i].add_peer(a).unwrap()).collect())
        .collect();

    // Each destination slot (target host, slot) is written by at most one WRITE.
    let mut expect: BTreeMap<u64, Expect> = BTreeMap::new();
    let mut next_slot = [0usize; 3];
    let mut collected: Vec<Vec<Completion>> = vec![Vec::new(); 3];
    let mut wr_id = 0u64;
    let mut sends = 0u64;
    for i in 0..3 {
        for k in 0..16 {
            doms[i]
                .post_recv(WrId(1_000_000 + k), mr[i].slice(k * 256, 256).unwrap())
                .unwrap();
        }
    }
    for _ in 0..120 {
        let from = rng.gen_range(0..3);
        let to = rng.gen_range(0..3);
        if rng.gen_bool(0.15) && sends < 12 {
            let len = rng.gen_range(0..=256u64);
            loop {
                let slice = ms[from].slice(0, len).unwrap();
                match doms[from].post_send(WrId(2_000_000 + sends), peers[from][to], slice) {
                    Ok(()) => break,
                    Err(TransportError::QueueFull { .. }) => {
                        fabric.step();
                        collected[from].extend(poll_all(&mut doms[from]));
                    }
                    Err(e) => panic!("seed {seed}: {e}"),
                }
            }
            sends += 1;
            continue;
        }
        let slot = next_slot[to];
        if slot >= nslots {
            continue;
        }
        next_slot[to] += 1;
        let len = match rng.gen_range(0..4) {
            0 => 0,
            1 => rng.gen_range(1..64),
            _ => rng.gen_range(64..=SLOT),
        };
        let src_off = rng.gen_range(0..nslots) * SLOT;
        let imm = rng.gen_bool(0.8).then(|| rng.gen_range(0..20u32));
        let (dst, rejected) = match rng.gen_range(0..10) {
            0 => (
                RemoteSlice {
                    rkey: Rkey(rng.gen()),
                    ..remote(&md[to], (slot * SLOT) as u64)
                },
                true,
            ),
            // Past the end for every len (len 0 included: end + 1).
            1 => (
                remote(&md[to], (nslots * SLOT) as u64 - len as u64 / 2 + 1),
                true,
            ),
            _ => (remote(&md[to], (slot * SLOT) as u64), false),
        };
        let ruled = with_rules && matches!(imm, Some(13) | Some(17));
        let wr = WriteWr {
            wr: WrId(wr_id),
            peer: peers[from][to],
            src: ms[from].slice(src_off as u64, len as u64).unwrap(),
            dst,
            imm,
        };
        let mut posted = false;
        while !posted {
            posted = doms[from].post_writes(&[wr]).unwrap() == 1;
            if !posted {
                fabric.step();
                collected[from].extend(poll_all(&mut doms[from]));
            }
        }
        expect.insert(
            wr_id,
            Expect {
                from,
                to,
                slot,
                src_off,
                len,
                imm,
                rejected,
                ruled,
            },
        );
        wr_id += 1;
        if rng.gen_bool(0.3) {
            fabric.step();
        }
    }
    fabric.run_until_idle();
    let mut results = BTreeMap::new();
    let mut imm_counts: Vec<BTreeMap<u32, u32>> = vec![BTreeMap::new(); 3];
    let mut send_done = 0;
    let mut recv_done = 0;
    for (i, d) in doms.iter_mut().enumerate() {
        collected[i].extend(poll_all(d));
        for c in std::mem::take(&mut collected[i]) {
            match c {
                Completion::Write { wr, result } => {
                    assert!(
                        results.insert(wr.0, result).is_none(),
                        "seed {seed}: wr {wr:?} twice"
                    );
                }
                Completion::Imm { imm } => *imm_counts[i].entry(imm).or_default() += 1,
                Completion::Send { result, .. } => {
                    assert_eq!(result, Ok(()), "seed {seed}");
                    send_done += 1;
                }
                Completion::Recv { result, .. } => {
                    assert!(result.is_ok(), "seed {seed}");
                    recv_done += 1;
                }
            }
        }
    }
    assert_eq!(send_done, sends, "seed {seed}");
    assert_eq!(recv_done, sends, "seed {seed}");
    assert_eq!(
        results.len(),
        expect.len(),
        "seed {seed}: every WRITE completes once"
    );
    let mut want_imms: Vec<BTreeMap<u32, u32>> = vec![BTreeMap::new(); 3];
    let dst_bytes: Vec<Vec<u8>> = dsts.iter().map(|b| b.snapshot()).collect();
    for (id, e) in &expect {
        let r = &results[id];
        let got = &dst_bytes[e.to][e.slot * SLOT..(e.slot + 1) * SLOT];
        let ok = match r {
            Ok(()) => !e.rejected,
            Err(TransportError::RemoteAccess { .. }) => e.rejected,
            Err(TransportError::Failed { .. }) | Err(TransportError::PeerUnreachable { .. }) => {
                e.ruled
            }
            Err(_) => false,
        };
        assert!(ok, "seed {seed}: wr {id} {e:?} got {r:?}");
        if r.is_ok() {
            if let Some(imm) = e.imm {
                *want_imms[e.to].entry(imm).or_default() += 1;
            }
            let src = srcs[e.from].snapshot();
            assert_eq!(
                &got[..e.len],
                &src[e.src_off..e.src_off + e.len],
                "seed {seed}: wr {id}"
            );
            assert!(
                got[e.len..].iter().all(|&x| x == 0),
                "seed {seed}: wr {id} overran"
            );
        } else {
            assert!(
                got.iter().all(|&x| x == 0),
                "seed {seed}: failed wr {id} wrote"
            );
        }
    }
    assert_eq!(imm_counts, want_imms, "seed {seed}: immediates");
    let trace = fabric.trace();
    drop(doms);
    trace
}

#[test]
fn random_workloads_keep_the_contract() {
    // WEFT_SEEDS=N runs N seeds (default 30), for soak runs.
    let n = std::env::var("WEFT_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30u64);
    for_seeds(0..n, |seed| {
        workload(seed, FabricConfig::adversarial(seed), seed % 2 == 0);
    });
}

#[test]
fn random_workloads_ideal_and_lossy() {
    for_seeds(0..10, |seed| {
        workload(seed, FabricConfig::ideal(seed), true);
        let mut cfg = FabricConfig::adversarial(seed);
        cfg.drop_prob = 0.3;
        cfg.max_inflight = 4;
        workload(seed, cfg, true);
    });
}

#[test]
fn mixed_workload_replays_exactly() {
    for_seeds([3, 4], |seed| {
        let a = workload(seed, FabricConfig::adversarial(seed), true);
        let b = workload(seed, FabricConfig::adversarial(seed), true);
        assert_eq!(a, b, "seed {seed}");
    });
}

#[test]
fn random_kills_every_surviving_op_completes_once() {
    for_seeds(0..20, |seed| {
        let mut cfg = FabricConfig::adversarial(seed);
        cfg.max_inflight = 16;
        let fabric = Fabric::new(cfg);
        let hosts: Vec<_> = (0..3).map(|_| fabric.add_host(1)).collect();
        let mut doms: Vec<_> = hosts.iter().map(|&h| fabric.open(h, 0).unwrap()).collect();
        let mut rng = weft_testkit::seed::rng(seed);
        let bufs: Vec<HostBuffer> = (0..3u64).map(|i| mem::patterned(i, 1 << 16)).collect();
        let ms: Vec<_> = (0..3)
            .map(|i| {
                doms[i]
                    .register(&bufs[i].region(), Access::RemoteWrite)
                    .unwrap()
            })
            .collect();
        let addrs: Vec<_> = doms.iter().map(|d| d.local_addr().clone()).collect();
        let peers: Vec<Vec<_>> = (0..3)
            .map(|i| addrs.iter().map(|a| doms[i].add_peer(a).unwrap()).collect())
            .collect();
        for i in 0..3 {
            for k in 0..8 {
                doms[i]
                    .post_recv(WrId(900 + k), ms[i].slice(k * 1024, 1024).unwrap())
                    .unwrap();
            }
        }
        let kill_at = rng.gen_range(0..150);
        let mut posted: Vec<BTreeMap<u64, usize>> = vec![BTreeMap::new(); 2];
        let mut results: Vec<BTreeMap<u64, Result<(), TransportError>>> = vec![BTreeMap::new(); 2];
        let mut imms_seen = 0u64;
        for step in 0..200u64 {
            if step == kill_at {
                fabric.kill_host(hosts[2]);
            }
            let from = rng.gen_range(0..2);
            let to = rng.gen_range(0..3);
            let len = rng.gen_range(0..4096u64);
            let r = if rng.gen_bool(0.1) {
                doms[from].post_send(
                    WrId(step),
                    peers[from][to],
                    ms[from].slice(0, len.min(1024)).unwrap(),
                )
            } else {
                doms[from].post_write(&WriteWr {
                    wr: WrId(step),
                    peer: peers[from][to],
                    src: ms[from].slice(0, len).unwrap(),
                    dst: remote(&ms[to], 1 << 15),
                    imm: Some(1),
                })
            };
            match r {
                Ok(()) => {
                    posted[from].insert(step, to);
                }
                Err(TransportError::QueueFull { .. }) => {}
                Err(e) => panic!("seed {seed}: {e}"),
            }
            fabric.step();
            for i in 0..2 {
                for c in poll_all(&mut doms[i]) {
                    match c {
                        Completion::Write { wr, result } | Completion::Send { wr, result } => {
                            assert!(
                                results[i].insert(wr.0, result).is_none(),
                                "seed {seed}: {wr:?} twice"
                            );
                        }
                        Completion::Imm { .. } => imms_seen += 1,
                        Completion::Recv { .. } => {}
                    }
                }
            }
        }
        fabric.run_until_idle();
        for i in 0..2 {
            for c in poll_all(&mut doms[i]) {
                if let Completion::Write { wr, result } | Completion::Send { wr, result } = c {
                    assert!(
                        results[i].insert(wr.0, result).is_none(),
                        "seed {seed}: {wr:?} twice"
                    );
                }
            }
            let ids: Vec<_> = posted[i].keys().copied().collect();
            let done: Vec<_> = results[i].keys().copied().collect();
            assert_eq!(ids, done, "seed {seed}: host {i} ops completed != posted");
            for (id, r) in &results[i] {
                if let Err(e) = r {
                    let to_dead = posted[i][id] == 2;
                    let ok = match e {
                        TransportError::PeerUnreachable { .. } => to_dead,
                        TransportError::ReceiverNotReady { .. } => true,
                        _ => false,
                    };
                    assert!(ok, "seed {seed}: op {id} from host {i}: {e}");
                }
            }
        }
        assert!(imms_seen > 0 || kill_at < 5, "seed {seed}");
        let mut out = Vec::new();
        assert!(matches!(
            doms[2].poll(&mut out),
            Err(TransportError::NicDown { .. })
        ));
        drop(doms);
    });
}
