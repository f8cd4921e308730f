//! Masked ranks: a group goes on without some of its ranks. Checked
//! against the reference run over the active ranks, with the mask applied
//! to the inputs here (independently of `weft_moe::mask`): a pair whose
//! expert sits on a masked rank is dropped, every other expert id is
//! renumbered densely, and rows report whole-group source ranks.

use crate::common::{
    engine_on, expert_outputs, inputs, masked_inputs, survivors_fail, Owned, Routing, NICS,
};
use std::sync::Arc;
use std::time::Duration;
use weft::loopback::{Fabric, FabricConfig, HostId};
use weft::TransferEngine;
use weft_moe::{reference, ConfigError, MoeConfig, MoeError, MoeRank};
use weft_testkit::seeds_or;

fn cfg(n: u32, masked: &[u32]) -> MoeConfig {
    let mut c = MoeConfig::new(n, n * 2, 3, 6, 40, 12);
    c.private_tokens = Some(2);
    c.step_timeout = Duration::from_secs(30);
    c.masked = masked.to_vec();
    c
}

/// Prepares and connects the active ranks of `c` on `engines` (one per
/// active rank, in rank order), then runs `steps` steps bit-exact against
/// the reference.
fn run_masked(c: &MoeConfig, engines: &[Arc<TransferEngine>], routing: Routing, seed: u64) {
    let full = MoeConfig {
        masked: Vec::new(),
        ..c.clone()
    }
    .validate()
    .unwrap();
    let d = c.validate().unwrap();
    let active: Vec<u32> = (0..c.ranks).filter(|r| !c.masked.contains(r)).collect();
    assert_eq!(d.ranks as usize, active.len());
    let (mut ranks, infos): (Vec<_>, Vec<_>) = active
        .iter()
        .zip(engines)
        .map(|(&g, e)| MoeRank::prepare(e.clone(), c, g).expect("prepare"))
        .unzip();
    for r in &mut ranks {
        r.connect(&infos).expect("connect");
    }
    for k in 0..3u64 {
        let ins = inputs(&full, routing, seed * 100 + k, k == 1);
        let act = masked_inputs(&full, &c.masked, &ins);
        let views: Vec<_> = act.iter().map(Owned::input).collect();
        let mut want = reference::dispatch(&d, &views).unwrap();
        for w in &mut want {
            for s in &mut w.source_rank {
                *s = active[*s as usize];
            }
        }
        let got: Vec<_> = std::thread::scope(|sc| {
            let hs: Vec<_> = ranks
                .iter_mut()
                .zip(&active)
                .map(|(r, &g)| {
                    let ins = &ins;
                    sc.spawn(move || r.dispatch(&ins[g as usize].input()).expect("dispatch"))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (a, ((x, _), w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(x, w, "seed {seed} step {k} active rank {a}: dispatch");
        }
        let outs: Vec<Vec<u8>> = got
            .iter()
            .enumerate()
            .map(|(a, (x, _))| expert_outputs(&d, a as u32, x))
            .collect();
        let want = reference::combine(&d, &views, &outs).unwrap();
        let ys: Vec<_> = std::thread::scope(|sc| {
            let hs: Vec<_> = ranks
                .iter_mut()
                .zip(&got)
                .zip(&outs)
                .map(|((r, (_, layout)), y)| {
                    sc.spawn(move || r.combine(y, layout).expect("combine"))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ys, want, "seed {seed} step {k}: combine");
    }
    for r in ranks {
        r.shutdown().expect("shutdown");
    }
}

#[test]
fn masked_ranks_drop_their_pairs_and_the_rest_is_exact() {
    for seed in seeds_or(0..2) {
        for masked in [&[1u32][..], &[0, 3], &[2, 3, 4]] {
            let c = cfg(6, masked);
            let d = c.validate().unwrap();
            let fabric = Fabric::new_realtime(FabricConfig::adversarial(seed));
            let engines: Vec<_> = (0..d.ranks)
                .map(|_| engine_on(&fabric, fabric.add_host(NICS)))
                .collect();
            // Every pair to a masked rank's expert: nothing moves.
            let on_masked = Routing::OneExpert(masked[0] * 2 + 1);
            for routing in [Routing::Random, Routing::SomeNone, on_masked] {
                run_masked(&c, &engines, routing, seed);
            }
            for e in &engines {
                e.shutdown();
            }
        }
    }
}

#[test]
fn a_dead_rank_is_masked_and_the_survivors_go_on() {
    let mut c = cfg(4, &[]);
    c.step_timeout = Duration::from_secs(2);
    let d = c.validate().unwrap();
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(21));
    let hosts: Vec<HostId> = (0..d.ranks).map(|_| fabric.add_host(NICS)).collect();
    let engines: Vec<_> = hosts.iter().map(|&h| engine_on(&fabric, h)).collect();
    let (mut ranks, infos): (Vec<_>, Vec<_>) = engines
        .iter()
        .enumerate()
        .map(|(r, e)| MoeRank::prepare(e.clone(), &c, r as u32).expect("prepare"))
        .unzip();
    for r in &mut ranks {
        r.connect(&infos).expect("connect");
    }
    // Rank 1 dies before the step: the others fail with a typed error.
    let dead = ranks.remove(1);
    fabric.kill_host(hosts[1]);
    let ins = inputs(&d, Routing::Random, 21, false);
    survivors_fail(&mut ranks, &[0, 2, 3], &ins);
    drop(dead);
    for r in ranks {
        let _ = r.shutdown();
    }
    // No replacement: the survivors go on as a group with rank 1 masked,
    // under the next instance (fresh immediates: nothing of the failed
    // step counts in it).
    let mut c2 = cfg(4, &[1]);
    c2.instance = 1;
    let survivors = [engines[0].clone(), engines[2].clone(), engines[3].clone()];
    run_masked(&c2, &survivors, Routing::Random, 22);
    for e in &engines {
        e.shutdown();
    }
}

#[test]
fn masks_that_cannot_be_are_refused() {
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(1));
    let e = engine_on(&fabric, fabric.add_host(NICS));
    for (masked, rank, why) in [
        (vec![1, 1], 1, "masked twice"),
        (vec![4], 4, "not a rank of the group"),
        (vec![0, 1, 2, 3], 3, "no rank would be left"),
    ] {
        let got = cfg(4, &masked).validate().unwrap_err();
        assert_eq!(got, ConfigError::BadMask { rank, why }, "{masked:?}");
    }
    // A masked rank takes no part; one past the group does not exist.
    let c = cfg(4, &[2]);
    assert!(matches!(
        MoeRank::prepare(e.clone(), &c, 2),
        Err(MoeError::Masked { rank: 2 })
    ));
    assert!(matches!(
        MoeRank::prepare(e.clone(), &c, 4),
        Err(MoeError::NoSuchRank { rank: 4, ranks: 4 })
    ));
    // Ids name the whole group's experts: 8 is beyond them.
    let (mut r0, i0) = MoeRank::prepare(e.clone(), &cfg(4, &[1, 2, 3]), 0).unwrap();
    r0.connect(&[i0]).unwrap();
    let d = cfg(4, &[]).validate().unwrap();
    let mut ins = inputs(&d, Routing::Random, 1, false).swap_remove(0);
    ins.ids[4] = 8;
    assert!(matches!(
        r0.dispatch(&ins.input()),
        Err(MoeError::ExpertOutOfRange { t: 1, k: 1, id: 8 })
    ));
    // Not poisoned by that; and alone, rank 0 keeps only its own pairs.
    ins.ids[4] = 0;
    let (x, layout) = r0.dispatch(&ins.input()).expect("dispatch");
    let own = ins.ids.iter().filter(|&&id| id < 2).count();
    assert_eq!(x.rows(), own);
    assert!(x.source_rank.iter().all(|&s| s == 0));
    r0.combine(&vec![0u8; own * 12 * 2], &layout)
        .expect("combine");
    r0.shutdown().unwrap();
    e.shutdown();
}
