//! The CPU driver ([`MoeRank`]) over the engine on the adversarial loopback
//! fabric (realtime: real worker threads, chunks reordered within and across
//! writes, drops and retransmits), one engine and one thread per rank, in
//! one process; several consecutive steps (buffer reuse and barriers),
//! checked byte for byte against the naive reference. Steps 2 and 3 of
//! every four go through the caller-buffer calls (`dispatch_into`,
//! `combine_into`) with buffers kept across steps.

use crate::common::{
    check_origins, engine_on, expert_outputs, inputs, survivors_fail, Routing, NICS,
};
use std::sync::Arc;
use std::time::Duration;
use weft::loopback::{Fabric, FabricConfig, HostId};
use weft::TransferEngine;
use weft_moe::num::{bf16_to_f32, f32_to_bf16};
use weft_moe::{
    reference, ConfigError, Dims, DispatchFormat, ExpertTokens, MoeConfig, MoeError, MoeRank,
    RankInput, TopkWeights,
};
use weft_testkit::seeds_or;

fn engine(fabric: &Fabric) -> Arc<TransferEngine> {
    engine_on(fabric, fabric.add_host(NICS))
}

fn run(c: &MoeConfig, routing: Routing, seed: u64, steps: u64, max_write_len: u64) {
    let d = c.validate().unwrap();
    let fabric = Fabric::new_realtime(FabricConfig {
        max_write_len,
        ..FabricConfig::adversarial(seed)
    });
    let engines: Vec<_> = (0..d.ranks).map(|_| engine(&fabric)).collect();
    let ranks = run_steps(group(&engines, c), &d, routing, seed, steps);
    let imms = ranks[0].imms();
    for rank in ranks {
        rank.shutdown().expect("shutdown");
    }
    for e in &engines {
        for v in imms.all() {
            assert_eq!(e.imm_pending(v), 0);
        }
        assert_eq!(e.stats().imm_excess, 0, "seed {seed}: excess immediates");
        e.shutdown();
    }
}

/// One MoE group, rank `r` on `engines[r]`: prepared, then connected to
/// every rank's info.
fn group(engines: &[Arc<TransferEngine>], c: &MoeConfig) -> Vec<MoeRank> {
    let (mut ranks, infos): (Vec<_>, Vec<_>) = engines
        .iter()
        .enumerate()
        .map(|(r, e)| MoeRank::prepare(e.clone(), c, r as u32).expect("prepare"))
        .unzip();
    for rank in &mut ranks {
        rank.connect(&infos).expect("connect");
    }
    ranks
}

/// Runs `steps` steps on every rank (one thread each) and checks each
/// rank's expert tokens and combined tokens against the reference; steps
/// 2 and 3 of every four go through the caller-buffer calls. Returns the
/// ranks.
fn run_steps(
    ranks: Vec<MoeRank>,
    d: &Dims,
    routing: Routing,
    seed: u64,
    steps: u64,
) -> Vec<MoeRank> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, mut rank)| {
                sc.spawn(move || {
                    // Kept across steps by the caller-buffer calls.
                    let mut kept = ExpertTokens::default();
                    let mut kept_out = Vec::new();
                    for k in 0..steps {
                        let into = k % 4 >= 2;
                        let ins = inputs(d, routing, seed * 1000 + k, k % 2 == 1);
                        let views: Vec<_> = ins.iter().map(|i| i.input()).collect();
                        let want = reference::dispatch(d, &views).unwrap();
                        let (got, layout) = if into {
                            let layout =
                                rank.dispatch_into(&views[r], &mut kept).expect("dispatch");
                            (kept.clone(), layout)
                        } else {
                            rank.dispatch(&views[r]).expect("dispatch")
                        };
                        assert_eq!(got, want[r], "seed {seed} step {k} rank {r}: dispatch");
                        check_origins(d, r as u32, &got, &views);
                        let outs: Vec<Vec<u8>> = want
                            .iter()
                            .enumerate()
                            .map(|(x, w)| expert_outputs(d, x as u32, w))
                            .collect();
                        // Odd steps: the weights come with combine
                        // (DeepEP's order), different from dispatch's, and
                        // bf16 values (given as bf16 bits to
                        // `combine_into`, as f32 to `combine_with_weights`).
                        let late_bf16: Vec<Vec<u16>> = ins
                            .iter()
                            .map(|i| i.weights.iter().map(|w| f32_to_bf16(0.5 - w)).collect())
                            .collect();
                        let late: Vec<Vec<f32>> = late_bf16
                            .iter()
                            .map(|w| w.iter().map(|&b| bf16_to_f32(b)).collect())
                            .collect();
                        let views2: Vec<_> = views
                            .iter()
                            .zip(&late)
                            .map(|(v, w)| RankInput {
                                topk_weights: w,
                                ..*v
                            })
                            .collect();
                        let (y, want) = if into {
                            let w = if k % 2 == 1 {
                                TopkWeights::Bf16(&late_bf16[r])
                            } else {
                                TopkWeights::F32(&ins[r].weights)
                            };
                            // A wrong-sized output is refused before
                            // anything is sent, and harms nothing.
                            let mut short = [0u8; 1];
                            assert!(matches!(
                                rank.combine_into(&outs[r], &layout, w, &mut short),
                                Err(MoeError::Shape {
                                    what: "combine output",
                                    ..
                                })
                            ));
                            kept_out.resize(rank.combined_len(&layout), 0xee);
                            let y = rank
                                .combine_into(&outs[r], &layout, w, &mut kept_out)
                                .map(|()| kept_out.clone());
                            let v = if k % 2 == 1 { &views2 } else { &views };
                            (y, reference::combine(d, v, &outs))
                        } else if k % 2 == 1 {
                            let y = rank.combine_with_weights(&outs[r], &layout, &late[r]);
                            (y, reference::combine(d, &views2, &outs))
                        } else {
                            let y = rank.combine(&outs[r], &layout);
                            (y, reference::combine(d, &views, &outs))
                        };
                        let (y, want) = (y.expect("combine"), want.unwrap());
                        assert_eq!(y, want[r], "seed {seed} step {k} rank {r}: combine");
                    }
                    rank
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

fn cfg(n: u32, l: u32, r: u32, t: u32, p: u32) -> MoeConfig {
    let mut c = MoeConfig::new(n, n * l, r, t, 40, 12);
    c.private_tokens = Some(p.min(t * r));
    c.step_timeout = Duration::from_secs(30);
    c
}

#[test]
fn ep2_to_8_random() {
    for seed in seeds_or(0..12) {
        for n in [2, 3, 4, 8] {
            run(&cfg(n, 2, 3, 6, 2), Routing::Random, seed, 4, 1 << 40);
        }
    }
}

#[test]
fn fp8_dispatch_ep4() {
    // bf16 tokens of 256 values in, e4m3 + 2 scales out, both scale rules.
    for seed in seeds_or(0..2) {
        for round_scale in [false, true] {
            let mut c = MoeConfig::new(4, 8, 3, 6, 256 + 8, 256);
            c.private_tokens = Some(2);
            c.step_timeout = Duration::from_secs(30);
            c.dispatch = DispatchFormat::Fp8 { round_scale };
            let d = c.validate().unwrap();
            for routing in [Routing::Random, Routing::DupExperts, Routing::SomeNone] {
                run(&c, routing, seed, 4, 1 << 40);
            }
            assert_eq!(d.in_row_bytes(), 512);
        }
    }
}

#[test]
fn fp8_dispatch_refuses_shapes_it_cannot_carry() {
    let mut c = MoeConfig::new(4, 8, 3, 6, 256 + 8, 256);
    c.dispatch = DispatchFormat::Fp8 { round_scale: false };
    c.token_bytes = 256;
    assert!(matches!(
        c.validate(),
        Err(ConfigError::Fp8Shape {
            hidden: 256,
            token_bytes: 256
        })
    ));
    c.hidden = 200;
    c.token_bytes = 200 + 200 / 32;
    assert!(matches!(c.validate(), Err(ConfigError::Fp8Shape { .. })));
}

#[test]
fn edge_cases_ep4() {
    for seed in seeds_or(0..2) {
        for p in [0, 1, 6, 18] {
            let c = cfg(4, 2, 3, 6, p);
            let d = c.validate().unwrap();
            for routing in crate::common::routings(&d) {
                run(&c, routing, seed, 3, 1 << 40);
            }
        }
    }
}

#[test]
fn small_max_write_len_and_single_rank() {
    run(&cfg(4, 1, 2, 8, 3), Routing::Skewed, 5, 3, 64);
    run(&cfg(1, 4, 2, 4, 2), Routing::Random, 6, 2, 1 << 40);
}

/// A rank whose host dies before the step: the others get a typed error
/// (after `step_timeout` at the latest), never a hang, and are poisoned;
/// then a replacement rank joins and the group runs on, bit-exact.
#[test]
fn dead_peer_gives_typed_error_and_poisons_then_a_replacement_continues() {
    let mut c = cfg(4, 2, 3, 6, 2);
    c.step_timeout = Duration::from_secs(2);
    let d = c.validate().unwrap();
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(11));
    let hosts: Vec<HostId> = (0..d.ranks).map(|_| fabric.add_host(NICS)).collect();
    let engines: Vec<_> = hosts.iter().map(|&h| engine_on(&fabric, h)).collect();
    let mut ranks = group(&engines, &c);
    let dead = ranks.pop().expect("four ranks");
    fabric.kill_host(hosts[3]);
    let ins = inputs(&d, Routing::Random, 11, false);
    survivors_fail(&mut ranks, &[0, 1, 2], &ins);
    drop(dead);
    for rank in ranks {
        let _ = rank.shutdown();
    }
    // The group continues with a replacement for rank 3: a process (here
    // a host) of its own, and a new group on the survivors' engines under
    // the next instance (fresh immediates: nothing of the failed step can
    // count in it). Every byte checked, as in `run`.
    let mut c2 = c.clone();
    c2.instance = 1;
    let mut engines2: Vec<_> = engines[..3].to_vec();
    engines2.push(engine_on(&fabric, fabric.add_host(NICS)));
    for rank in run_steps(group(&engines2, &c2), &d, Routing::Random, 12, 4) {
        rank.shutdown().expect("shutdown");
    }
    for e in &engines2 {
        e.shutdown();
    }
    engines[3].shutdown();
}

/// Misuse is a typed error that does not poison the rank: bad inputs,
/// calls out of order, a layout of an earlier step, peer infos that do not
/// match.
#[test]
fn misuse_is_typed_and_harmless() {
    let c = cfg(2, 2, 2, 4, 2);
    let d = c.validate().unwrap();
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(3));
    let engines: Vec<_> = (0..2).map(|_| engine(&fabric)).collect();
    let (mut a, ia) = MoeRank::prepare(engines[0].clone(), &c, 0).unwrap();
    let (mut b, ib) = MoeRank::prepare(engines[1].clone(), &c, 1).unwrap();
    assert!(matches!(
        MoeRank::prepare(engines[0].clone(), &c, 2),
        Err(MoeError::NoSuchRank { .. })
    ));
    let ins = inputs(&d, Routing::Random, 3, false);
    assert!(matches!(
        a.dispatch(&ins[0].input()),
        Err(MoeError::NotConnected)
    ));
    let mut other = ib.clone();
    other.config_hash ^= 1;
    assert!(matches!(
        a.connect(&[ia.clone(), other]),
        Err(MoeError::PeerInfo { rank: 1, .. })
    ));
    assert!(matches!(
        a.connect(&[ib.clone(), ia.clone()]),
        Err(MoeError::PeerInfo { .. })
    ));
    a.connect(&[ia.clone(), ib.clone()]).unwrap();
    assert!(matches!(
        a.connect(&[ia.clone(), ib.clone()]),
        Err(MoeError::OutOfOrder { .. })
    ));
    b.connect(&[ia, ib]).unwrap();
    let mut bad = ins[0].clone();
    bad.ids[0] = d.experts;
    assert!(matches!(
        a.dispatch(&bad.input()),
        Err(MoeError::ExpertOutOfRange { t: 0, k: 0, .. })
    ));
    bad.weights.pop();
    assert!(matches!(
        a.dispatch(&bad.input()),
        Err(MoeError::Shape { .. })
    ));
    std::thread::scope(|sc| {
        let ins = &ins;
        let d = &d;
        for (r, rank) in [&mut a, &mut b].into_iter().enumerate() {
            sc.spawn(move || {
                let views: Vec<_> = ins.iter().map(|i| i.input()).collect();
                let want = reference::dispatch(d, &views).unwrap();
                let outs: Vec<Vec<u8>> = want
                    .iter()
                    .enumerate()
                    .map(|(x, w)| expert_outputs(d, x as u32, w))
                    .collect();
                let (_, l0) = rank.dispatch(&views[r]).unwrap();
                assert!(matches!(
                    rank.dispatch(&views[r]),
                    Err(MoeError::OutOfOrder { .. })
                ));
                rank.combine(&outs[r], &l0).unwrap();
                assert!(matches!(
                    rank.combine(&outs[r], &l0),
                    Err(MoeError::OutOfOrder { .. })
                ));
                let (_, l1) = rank.dispatch(&views[r]).unwrap();
                assert!(matches!(
                    rank.combine(&outs[r], &l0),
                    Err(MoeError::StaleLayout {
                        layout_step: 0,
                        step: 1
                    })
                ));
                assert!(matches!(
                    rank.combine(&outs[r][1..], &l1),
                    Err(MoeError::Shape { .. })
                ));
                let y = rank.combine(&outs[r], &l1).unwrap();
                assert_eq!(y, reference::combine(d, &views, &outs).unwrap()[r]);
            });
        }
    });
    a.shutdown().unwrap();
    b.shutdown().unwrap();
    for e in &engines {
        assert_eq!(e.stats().imm_excess, 0);
        e.shutdown();
    }
}

/// A layout is accepted only by the rank that made it: another group's
/// rank on the same engines, at the same step and rank number, refuses it.
#[test]
fn a_layout_of_another_group_is_refused() {
    let c0 = cfg(2, 2, 2, 4, 2);
    let mut c1 = c0.clone();
    c1.instance = 1;
    let d = c0.validate().unwrap();
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(9));
    let engines: Vec<_> = (0..2).map(|_| engine(&fabric)).collect();
    let group = |c: &MoeConfig| {
        let (mut a, ia) = MoeRank::prepare(engines[0].clone(), c, 0).unwrap();
        let (mut b, ib) = MoeRank::prepare(engines[1].clone(), c, 1).unwrap();
        a.connect(&[ia.clone(), ib.clone()]).unwrap();
        b.connect(&[ia, ib]).unwrap();
        [a, b]
    };
    let (g0, g1) = (group(&c0), group(&c1));
    let ins = inputs(&d, Routing::Random, 5, false);
    std::thread::scope(|sc| {
        for (r, (mut x, mut y)) in g0.into_iter().zip(g1).enumerate() {
            let (ins, d) = (&ins, &d);
            sc.spawn(move || {
                let views: Vec<_> = ins.iter().map(|i| i.input()).collect();
                let want = reference::dispatch(d, &views).unwrap();
                let outs: Vec<Vec<u8>> = want
                    .iter()
                    .enumerate()
                    .map(|(k, w)| expert_outputs(d, k as u32, w))
                    .collect();
                let (_, lx) = x.dispatch(&views[r]).unwrap();
                let (_, ly) = y.dispatch(&views[r]).unwrap();
                assert_eq!((lx.step(), ly.step()), (ly.step(), lx.step()));
                assert!(matches!(
                    y.combine(&outs[r], &lx),
                    Err(MoeError::StaleLayout { .. })
                ));
                let want = reference::combine(d, &views, &outs).unwrap();
                assert_eq!(x.combine(&outs[r], &lx).unwrap(), want[r]);
                assert_eq!(y.combine(&outs[r], &ly).unwrap(), want[r]);
                x.shutdown().unwrap();
                y.shutdown().unwrap();
            });
        }
    });
    for e in &engines {
        e.shutdown();
    }
}
