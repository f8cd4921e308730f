//! The protocol over many ranks in one process, deterministically: every
//! rank is a manual engine on one step-mode loopback fabric with the
//! adversarial profile (writes cut into chunks that leave in random order,
//! up to 20 µs of jitter so writes overtake each other, 2 % of
//! transmissions lost and retransmitted), all driven on one thread by
//! [`SimCluster`]. Every step is checked byte for byte against the naive
//! reference, and after every step no immediate is pending or in excess.
//! `WEFT_SEED=<n>` replays one seed.

use crate::common::{expert_outputs, inputs, Routing};
use std::time::Duration;
use weft::loopback::{Action, FabricConfig, NicModel, OpKind, Rule};
use weft_moe::sim::{HostModel, RunOpts, SimCluster, SimConfig};
use weft_moe::{reference, MoeConfig};
use weft_testkit::{seeds_or, SeedGuard};

fn cfg(n: u32, l: u32, r: u32, t: u32, p: u32) -> MoeConfig {
    let mut c = MoeConfig::new(n, n * l, r, t, 40, 12);
    c.private_tokens = Some(p.min(t * r));
    c
}

fn sim(seed: u64, max_write_len: u64, host: HostModel) -> SimConfig {
    SimConfig {
        fabric: FabricConfig {
            max_write_len,
            chunk_min: 64,
            chunk_max: 512,
            ..FabricConfig::adversarial(seed)
        },
        nics: 2,
        nic: NicModel::default(),
        host,
        tick: Duration::from_nanos(100),
    }
}

/// `steps` steps of `routing` on a fresh cluster, each rank running ahead
/// to its next layer as soon as it can; rank `delayed` (if any) starts each
/// of its phases 500 µs (simulated) late, so the others block on its routes
/// and barriers while their faster peers already write the next layer.
fn run(c: &MoeConfig, routing: Routing, seed: u64, steps: u64, mwl: u64, delayed: Option<u32>) {
    run_with(c, routing, seed, steps, mwl, delayed, HostModel::zero())
}

fn run_with(
    c: &MoeConfig,
    routing: Routing,
    seed: u64,
    steps: u64,
    mwl: u64,
    delayed: Option<u32>,
    host: HostModel,
) {
    run_rules(c, routing, seed, steps, mwl, delayed, host, |_| {})
}

#[allow(clippy::too_many_arguments)]
fn run_rules(
    c: &MoeConfig,
    routing: Routing,
    seed: u64,
    steps: u64,
    mwl: u64,
    delayed: Option<u32>,
    host: HostModel,
    rules: impl FnOnce(&SimCluster),
) {
    let _g = SeedGuard::new(seed, "weft-moe sim");
    let d = c.validate().unwrap();
    let mut cl = SimCluster::new(c, &sim(seed, mwl, host)).expect("cluster");
    rules(&cl);
    let mut opts = RunOpts {
        delays: vec![Duration::ZERO; d.ranks as usize],
        synchronized: false,
    };
    if let Some(x) = delayed {
        opts.delays[x as usize] = Duration::from_micros(500);
    }
    let imms = cl.imms().expect("ranks");
    let ins: Vec<_> = (0..steps)
        .map(|k| inputs(&d, routing, seed * 1000 + k, k % 2 == 1))
        .collect();
    let views: Vec<Vec<_>> = ins
        .iter()
        .map(|s| s.iter().map(|i| i.input()).collect())
        .collect();
    let got = cl
        .run_steps(&views, &opts, |r, _, t| expert_outputs(&d, r, t))
        .unwrap_or_else(|e| panic!("seed {seed} N={}: {e}", d.ranks));
    for (k, (got, views)) in got.iter().zip(&views).enumerate() {
        let want = reference::dispatch(&d, views).unwrap();
        for (r, (g, w)) in got.tokens.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "seed {seed} step {k} rank {r}: dispatch");
        }
        let outs: Vec<Vec<u8>> = want
            .iter()
            .enumerate()
            .map(|(x, w)| expert_outputs(&d, x as u32, w))
            .collect();
        let want = reference::combine(&d, views, &outs).unwrap();
        assert_eq!(got.combined, want, "seed {seed} step {k}: combine");
    }
    for e in cl.engines() {
        for v in [imms.route, imms.dispatch, imms.combine, imms.bar_d] {
            assert_eq!(e.imm_pending(v), 0, "seed {seed}: imm {v} pending");
        }
    }
    let engines = cl.engines().to_vec();
    cl.shutdown().expect("shutdown");
    for e in &engines {
        assert_eq!(e.imm_pending(imms.bar_c), 0);
        assert_eq!(e.stats().imm_excess, 0, "seed {seed}: excess immediates");
    }
}

/// ≥ 50 seeds at EP4 and EP8, random routings (some ranks ragged), three
/// steps each, P = 2 (speculative and overflow paths both used).
#[test]
#[ignore = "slow: 50 adversarial seeds"]
fn ep4_ep8_fifty_seeds() {
    for seed in seeds_or(0..50) {
        run(&cfg(4, 2, 3, 6, 2), Routing::Random, seed, 3, 1 << 40, None);
        run(&cfg(8, 2, 3, 6, 2), Routing::Random, seed, 3, 1 << 40, None);
    }
}

/// EP 2, 3, 16, 32 and 64 (E/N = 2; at EP64 T=8, R=4).
#[test]
#[ignore = "slow: up to 64 ranks"]
fn ep2_to_64() {
    for seed in seeds_or(0..4) {
        run(&cfg(2, 3, 3, 6, 2), Routing::Random, seed, 3, 1 << 40, None);
        run(&cfg(3, 2, 3, 6, 1), Routing::Skewed, seed, 3, 1 << 40, None);
        run(
            &cfg(16, 2, 4, 8, 2),
            Routing::Random,
            seed,
            2,
            1 << 40,
            None,
        );
    }
    for seed in seeds_or(0..2) {
        run(
            &cfg(32, 2, 4, 8, 1),
            Routing::Random,
            seed,
            2,
            1 << 40,
            None,
        );
        run(
            &cfg(64, 2, 4, 8, 1),
            Routing::Random,
            seed,
            2,
            1 << 40,
            None,
        );
    }
}

/// Every named edge case (a rank that sends nothing, all pairs to one
/// expert, all to local experts, duplicate experts on one rank, skew) at
/// P = 0, 1, T and T·R (P ≥ T), EP4 and EP8, with small WRITE limits so
/// entries are cut into several WRs.
#[test]
#[ignore = "slow: every edge case over many seeds"]
fn edge_cases() {
    for seed in seeds_or(0..3) {
        for (n, mwl) in [(4u32, 1u64 << 40), (8, 100)] {
            for p in [0, 1, 6, 18] {
                let c = cfg(n, 2, 3, 6, p);
                let d = c.validate().unwrap();
                for routing in crate::common::routings(&d) {
                    run(&c, routing, seed, 3, mwl, None);
                }
            }
        }
    }
}

/// A rank that starts every phase 500 µs (simulated) late, and slow
/// readers (unpack and weighted sum read their buffers only after 30 µs):
/// the others block on the late rank's routes and barriers, faster ranks
/// run ahead into the next layer while slower ones still read, and
/// nothing is overwritten before it was read (dropping the BAR_D wait
/// makes this fail; `delayed_combine_and_routes` is the one for BAR_C).
/// Five layers in a row reuse the buffers.
#[test]
fn late_rank_slow_readers_many_layers() {
    let slow = HostModel {
        pack: Duration::from_micros(5),
        unpack: Duration::from_micros(30),
        combine_sum: Duration::from_micros(30),
        ..HostModel::zero()
    };
    for seed in seeds_or(0..6) {
        run(
            &cfg(4, 2, 3, 6, 2),
            Routing::Random,
            seed,
            5,
            1 << 40,
            Some(1),
        );
        run(&cfg(8, 1, 2, 8, 0), Routing::Skewed, seed, 5, 300, Some(7));
        run_with(
            &cfg(4, 2, 3, 6, 2),
            Routing::Random,
            seed,
            5,
            1 << 40,
            None,
            slow,
        );
        run_with(
            &cfg(8, 2, 3, 6, 6),
            Routing::Random,
            seed,
            5,
            1 << 40,
            Some(3),
            slow,
        );
    }
}

/// E/N = 1 (the bound uses R) and a single rank (no network at all).
#[test]
fn one_expert_per_rank_and_single_rank() {
    for seed in seeds_or(0..3) {
        run(&cfg(4, 1, 3, 5, 2), Routing::Random, seed, 3, 1 << 40, None);
        run(&cfg(1, 4, 2, 4, 2), Routing::Random, seed, 3, 1 << 40, None);
    }
}

/// Fabric rules that hold back one kind of traffic: every COMBINE write to
/// rank 0 arrives 200 µs late (its peers finish the layer and write the
/// next one's routes and private rows while rank 0 still waits for, then
/// reads, its combine rows: only BAR_C keeps them apart), and every ROUTE
/// write arrives 200 µs late (private rows are there long before the
/// routes say how to read them).
#[test]
fn delayed_combine_and_routes() {
    for seed in seeds_or(0..6) {
        for p in [2, 18] {
            let c = cfg(4, 2, 3, 6, p);
            run_rules(
                &c,
                Routing::Random,
                seed,
                4,
                1 << 40,
                None,
                HostModel::zero(),
                |cl| {
                    let imms = cl.imms().expect("ranks");
                    cl.fabric().add_rule(
                        Rule::new(Action::Delay(Duration::from_micros(200)))
                            .kind(OpKind::Write)
                            .to_host(cl.hosts()[0])
                            .imm(imms.combine),
                    );
                },
            );
            run_rules(
                &c,
                Routing::Skewed,
                seed,
                4,
                1 << 40,
                None,
                HostModel::zero(),
                |cl| {
                    let imms = cl.imms().expect("ranks");
                    cl.fabric().add_rule(
                        Rule::new(Action::Delay(Duration::from_micros(200)))
                            .kind(OpKind::Write)
                            .imm(imms.route),
                    );
                },
            );
        }
    }
}
