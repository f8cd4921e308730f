use super::*;
use crate::config::MoeConfig;
use crate::imm::{COMBINE_MODE, DISPATCH_MODE};
use crate::routes::count_pairs;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, VecDeque};
use weft::ShardConfig;

fn ic(max_write_len: u64) -> ImmCounts {
    ImmCounts {
        nics: 2,
        max_write_len,
        shard: ShardConfig::default(),
    }
}

/// Every core of a group against an ideal in-memory "network" that only
/// counts immediates: each submit adds the pieces the engine would make
/// (`ImmCounts`) at each destination, each round consumes its count. Runs
/// `steps` steps and checks that no immediate is left over.
#[allow(clippy::too_many_arguments)]
fn lockstep(n: u32, l: u32, r: u32, t: u32, p: u32, mwl: u64, seed: u64, steps: u32) {
    let mut c = MoeConfig::new(n, n * l, r, t, 40, 12);
    c.private_tokens = Some(p.min(t * r));
    let d = c.validate().unwrap();
    let ic = ic(mwl);
    let imms = ImmValues::for_instance(0, 1 << 16).unwrap();
    let mut cores: Vec<RankCore> = (0..n)
        .map(|x| RankCore::new(d.clone(), x, imms, ic))
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut arrived: BTreeMap<(u32, Imm), u64> = BTreeMap::new();
    for step in 0..steps {
        let rows: Vec<Vec<u32>> = (0..n)
            .map(|_| {
                let tr = rng.gen_range(0..=t);
                let ids: Vec<u32> = (0..tr * r).map(|_| rng.gen_range(0..n * l)).collect();
                count_pairs(&d, &ids).unwrap().row
            })
            .collect();
        let m = RouteMatrix::from_rows(&d, &rows).unwrap();
        let mut queues: Vec<VecDeque<Action>> = vec![VecDeque::new(); n as usize];
        for (x, core) in cores.iter_mut().enumerate() {
            let a = core
                .on(Event::Dispatch {
                    row: rows[x].clone(),
                })
                .unwrap();
            queues[x].extend(a);
        }
        // Dispatch then combine on every rank.
        let mut phase = vec![0u8; n as usize];
        let mut idle = 0;
        while phase.iter().any(|&f| f < 2) {
            let mut moved = false;
            for x in 0..n as usize {
                while let Some(a) = queues[x].front().cloned() {
                    let me = x as u32;
                    let to = |j: usize| member_rank(n, me, j);
                    let ev = match a {
                        Action::Wait(Wait::Submits(_)) => Some(Event::SubmitsDone),
                        Action::Wait(Wait::Round { phase, imm, count }) => {
                            let got = arrived.entry((me, imm)).or_default();
                            if *got < count {
                                break;
                            }
                            *got -= count;
                            Some(Event::RoundFired(phase))
                        }
                        Action::RouteScatter { imm, entries }
                        | Action::PrivateScatter { imm, entries } => {
                            assert_eq!(entries.len(), n as usize - 1, "an entry per member");
                            for e in entries {
                                *arrived.entry((to(e.member), imm)).or_default() +=
                                    ic.scatter_dst(e.len, DISPATCH_MODE);
                            }
                            None
                        }
                        Action::CombineScatter { imm, entries } => {
                            assert_eq!(entries.len(), n as usize - 1, "an entry per member");
                            for e in entries {
                                *arrived.entry((to(e.member), imm)).or_default() +=
                                    ic.scatter_dst(e.len, COMBINE_MODE);
                            }
                            None
                        }
                        Action::OverflowWrite { imm, entry } => {
                            *arrived.entry((to(entry.member), imm)).or_default() +=
                                ic.single_write(entry.len);
                            None
                        }
                        Action::Barrier { imm, .. } => {
                            for j in 0..n as usize - 1 {
                                *arrived.entry((to(j), imm)).or_default() += ic.barrier();
                            }
                            None
                        }
                        Action::ReadRoutes => Some(Event::Routes(m.clone())),
                        Action::Finished(_) => {
                            phase[x] += 1;
                            if phase[x] == 1 {
                                Some(Event::Combine)
                            } else {
                                None
                            }
                        }
                        _ => None,
                    };
                    queues[x].pop_front();
                    moved = true;
                    if let Some(ev) = ev {
                        let more = cores[x].on(ev).unwrap();
                        queues[x].extend(more);
                    }
                }
            }
            if !moved {
                idle += 1;
                assert!(
                    idle < 3,
                    "seed {seed} step {step}: deadlock, phases {phase:?}"
                );
            } else {
                idle = 0;
            }
        }
        for core in &cores {
            assert_eq!(core.step(), u64::from(step) + 1);
            assert!(core.idle());
        }
    }
    // Only the last BAR_C round is still open (shutdown waits for it).
    for core in &cores {
        if let Some(Wait::Round { imm, count, .. }) = core.shutdown_wait() {
            let got = arrived.entry((core.rank(), imm)).or_default();
            assert_eq!(*got, count, "seed {seed}: last BAR_C");
            *got = 0;
        }
    }
    assert!(
        arrived.values().all(|&v| v == 0),
        "seed {seed}: immediates left over: {arrived:?}"
    );
}

/// The counts each core expects are exactly what its peers' actions send,
/// over random routings, several steps, with and without WR splitting and
/// private slots.
#[test]
fn counts_close_in_lockstep() {
    for seed in 0..20 {
        for (n, p, mwl) in [
            (1, 2, 1 << 40),
            (2, 0, 1 << 40),
            (4, 2, 100),
            (8, 3, 1 << 40),
            (5, 18, 64),
        ] {
            lockstep(n, 2, 3, 6, p, mwl, seed, 3);
        }
    }
}

/// An event the core does not expect is a typed error and changes nothing.
#[test]
fn out_of_order_events_are_rejected() {
    let d = MoeConfig::new(2, 4, 2, 4, 16, 4).validate().unwrap();
    let imms = ImmValues::for_instance(0, 1024).unwrap();
    let mut c = RankCore::new(d.clone(), 0, imms, ic(1 << 40));
    assert!(matches!(
        c.on(Event::Combine),
        Err(MoeError::OutOfOrder { .. })
    ));
    assert!(matches!(
        c.on(Event::SubmitsDone),
        Err(MoeError::OutOfOrder { .. })
    ));
    assert!(matches!(
        c.on(Event::Dispatch { row: vec![0; 3] }),
        Err(MoeError::Shape { .. })
    ));
    assert!(c.idle());
    let a = c
        .on(Event::Dispatch {
            row: vec![1, 0, 2, 0],
        })
        .unwrap();
    assert!(matches!(
        a.first(),
        Some(Action::Arm {
            phase: Phase::Route,
            ..
        })
    ));
    assert!(matches!(a.last(), Some(Action::Wait(Wait::Submits(_)))));
    assert!(matches!(
        c.on(Event::RoundFired(Phase::Route)),
        Err(MoeError::OutOfOrder { .. })
    ));
    let a = c.on(Event::SubmitsDone).unwrap();
    // Route row, route scatter, pack, private scatter, then the ROUTE wait
    // (no BAR_C in the first step).
    assert!(matches!(a[0], Action::WriteRouteRow { offset: 0 }));
    assert!(matches!(a[1], Action::RouteScatter { .. }));
    assert!(matches!(a[2], Action::PackDispatch));
    assert!(matches!(a[3], Action::PrivateScatter { .. }));
    assert!(matches!(
        a[4],
        Action::Wait(Wait::Round {
            phase: Phase::Route,
            ..
        })
    ));
}
