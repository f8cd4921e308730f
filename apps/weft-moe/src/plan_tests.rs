use super::*;
use crate::config::MoeConfig;
use crate::imm::{ExpectedCounts, COMBINE_MODE, DISPATCH_MODE};
use crate::routes::count_pairs;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeSet;
use weft::{shard, ImmCounts, ShardConfig};

/// Dims and the route matrix of random top-k ids (duplicates allowed,
/// some ranks with fewer tokens, some with none).
fn setup(n: u32, l: u32, r: u32, t: u32, p: u32, seed: u64) -> (Dims, RouteMatrix) {
    let mut c = MoeConfig::new(n, n * l, r, t, 24, 4);
    c.private_tokens = Some(p.min(t * r));
    let d = c.validate().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let skew: u32 = rng.gen_range(0..3);
    let rows: Vec<Vec<u32>> = (0..n)
        .map(|_| {
            let tokens = rng.gen_range(0..=t);
            let ids: Vec<u32> = (0..tokens * r)
                .map(|_| match skew {
                    0 => rng.gen_range(0..n * l),
                    1 => rng.gen_range(0..l.max(2).min(n * l)), // hot experts
                    _ => 0,                                     // one expert
                })
                .collect();
            count_pairs(&d, &ids).unwrap().row
        })
        .collect();
    let m = RouteMatrix::from_rows(&d, &rows).unwrap();
    (d, m)
}

fn plans(d: &Dims, m: &RouteMatrix) -> Vec<StepPlan> {
    (0..d.ranks)
        .map(|r| StepPlan::new(d, r, m).unwrap())
        .collect()
}

/// Every structural property of the plans of all ranks for one matrix.
fn check_plans(d: &Dims, m: &RouteMatrix) {
    let ps = plans(d, m);
    let n = d.ranks;
    let p = d.private;
    for (r, plan) in ps.iter().enumerate() {
        let r = r as u32;
        assert_eq!(plan, &StepPlan::new(d, r, m).unwrap(), "deterministic");
        let total: u64 = plan.recv_pairs().iter().map(|&x| u64::from(x)).sum();
        assert_eq!(plan.unpack().len() as u64, total);
        assert!(plan.contig_used() <= d.contig_slots);
        assert!(total <= d.contig_slots, "receive bound");
        // Send side: segments tile 0..T_r·R, private + overflow = pairs.
        let mut next = 0;
        for (dd, dest) in plan.dests().iter().enumerate() {
            assert_eq!(dest.seg, next);
            next += dest.pairs;
            let o = dest.overflow.map_or(0, |o| o.len);
            if dd as u32 == r {
                assert_eq!((dest.private, o), (0, 0));
            } else {
                assert_eq!(dest.private + o, dest.pairs);
                assert!(dest.private <= p);
                if let Some(o) = dest.overflow {
                    assert_eq!(o.src_slot, dest.seg + p);
                }
            }
        }
        // Unpack map: a bijection onto the received pairs.
        let mut local = BTreeSet::new();
        let mut private = BTreeSet::new();
        let mut contig = BTreeSet::new();
        let mut contig_by_src = vec![BTreeSet::new(); n as usize];
        for (src, &s) in plan.unpack().iter().zip(plan.source_rank()) {
            match *src {
                SrcSlot::Local(x) => {
                    assert_eq!(s, r);
                    assert!(local.insert(x));
                }
                SrcSlot::Private(x) => {
                    assert_ne!(s, r);
                    assert_eq!(x / p, s, "private slot outside the source's region");
                    assert!(private.insert(x));
                }
                SrcSlot::Contig(x) => {
                    assert_ne!(s, r);
                    assert!(u64::from(x) < plan.contig_used());
                    assert!(contig.insert(x));
                    contig_by_src[s as usize].insert(x);
                }
            }
        }
        assert_eq!(
            contig.len() as u64,
            plan.contig_used(),
            "contiguous region has holes"
        );
        let own = plan.dests()[r as usize];
        assert_eq!(local, (own.seg..own.seg + own.pairs).collect());
        for s in (0..n).filter(|&s| s != r) {
            let k = plan.recv_pairs()[s as usize].min(p);
            let want: BTreeSet<u32> = (s * p..s * p + k).collect();
            let got: BTreeSet<u32> = private
                .iter()
                .copied()
                .filter(|&x| x / p.max(1) == s)
                .collect();
            assert_eq!(got, want);
            // The sender's overflow write lands exactly where r reads.
            let sent = ps[s as usize].dests()[r as usize];
            let want: BTreeSet<u32> = sent.overflow.map_or(BTreeSet::new(), |o| {
                (o.dst_slot..o.dst_slot + o.len).collect()
            });
            assert_eq!(contig_by_src[s as usize], want);
            assert_eq!(sent.pairs, plan.recv_pairs()[s as usize]);
        }
        // Expert offsets.
        assert_eq!(plan.expert_offsets().len(), d.local as usize + 1);
        assert_eq!(*plan.expert_offsets().last().unwrap() as u64, total);
        // Combine: send slots tile 0..Σ_{s≠r} n(s→r); every source's rows
        // lie inside its scatter entry, which lands on the source's segment.
        let mut send = BTreeSet::new();
        let mut recv = BTreeSet::new();
        for (c, &s) in plan.combine().iter().zip(plan.source_rank()) {
            match *c {
                CombineSlot::Send(x) => {
                    let e = plan.combine_sends().iter().find(|e| e.rank == s).unwrap();
                    assert!(x >= e.src_slot && x < e.src_slot + e.len);
                    assert!(send.insert(x));
                }
                CombineSlot::Recv(x) => {
                    assert_eq!(s, r);
                    assert!(recv.insert(x));
                }
            }
        }
        assert_eq!(send.len() as u64, total - u64::from(own.pairs));
        assert_eq!(recv, local);
        assert_eq!(plan.combine_sends().len(), n as usize - 1);
        for (j, cs) in plan.combine_sends().iter().enumerate() {
            assert_eq!(member_index(n, r, cs.rank), Some(j));
            let back = ps[cs.rank as usize].dests()[r as usize];
            assert_eq!((cs.dst_slot, cs.len), (back.seg, back.pairs));
        }
    }
}

/// Expected counts at every receiver equal the pieces the senders' plans
/// produce through the engine's own sharding functions.
fn check_counts(d: &Dims, m: &RouteMatrix, ic: &ImmCounts) {
    let ps = plans(d, m);
    let n = d.ranks;
    let mut dispatch = vec![0u64; n as usize];
    let mut combine = vec![0u64; n as usize];
    let mut route = vec![0u64; n as usize];
    for (s, plan) in ps.iter().enumerate() {
        let s = s as u32;
        for j in 0..n.saturating_sub(1) as usize {
            let dst = member_rank(n, s, j);
            let dest = plan.dests()[dst as usize];
            let pieces = |len: u64, mode| {
                shard::plan_scatter_dst(j, len, ic.nics, ic.max_write_len, mode, &ic.shard).len()
                    as u64
            };
            route[dst as usize] += pieces(d.route_row_len(), DISPATCH_MODE);
            if d.private > 0 {
                dispatch[dst as usize] += pieces(u64::from(dest.private) * d.b_in, DISPATCH_MODE);
            }
            if let Some(o) = dest.overflow {
                let len = u64::from(o.len) * d.b_in;
                dispatch[dst as usize] +=
                    shard::plan_single_write(len, ic.nics, ic.max_write_len, 0, &ic.shard).len()
                        as u64;
            }
        }
        for (j, cs) in plan.combine_sends().iter().enumerate() {
            let len = u64::from(cs.len) * d.b_out;
            combine[cs.rank as usize] +=
                shard::plan_scatter_dst(j, len, ic.nics, ic.max_write_len, COMBINE_MODE, &ic.shard)
                    .len() as u64;
        }
    }
    for (r, plan) in ps.iter().enumerate() {
        let e = ExpectedCounts::for_step(d, plan, ic);
        assert_eq!(e.route, route[r]);
        assert_eq!(e.dispatch, dispatch[r], "dispatch count at rank {r}");
        assert_eq!(e.combine, combine[r], "combine count at rank {r}");
        assert_eq!(e.barrier, u64::from(n - 1));
    }
}

#[test]
fn ep4_by_hand() {
    // N=4, L=1, R=2, T=3, P=1.
    let mut c = MoeConfig::new(4, 4, 2, 3, 8, 4);
    c.private_tokens = Some(1);
    let d = c.validate().unwrap();
    let rows = vec![
        vec![0, 3, 0, 0],
        vec![2, 2, 1, 1],
        vec![0, 0, 0, 0],
        vec![1, 4, 0, 1],
    ];
    let m = RouteMatrix::from_rows(&d, &rows).unwrap();
    let p1 = StepPlan::new(&d, 1, &m).unwrap();
    // Rank 1 receives 3 from 0, 2 from itself, 0 from 2, 4 from 3.
    assert_eq!(p1.recv_pairs(), &[3, 2, 0, 4]);
    assert_eq!(p1.contig_used(), 2 + 3);
    assert_eq!(
        p1.unpack(),
        &[
            SrcSlot::Private(0),
            SrcSlot::Contig(0),
            SrcSlot::Contig(1),
            SrcSlot::Local(2),
            SrcSlot::Local(3),
            SrcSlot::Private(3),
            SrcSlot::Contig(2),
            SrcSlot::Contig(3),
            SrcSlot::Contig(4),
        ]
    );
    // Rank 3 sends rank 1 one private pair and three overflow pairs at
    // off(3→1) = max(0, 3−1) + 0 (rank 2 sends none) = 2.
    let p3 = StepPlan::new(&d, 3, &m).unwrap();
    assert_eq!(
        p3.dests()[1].overflow,
        Some(Overflow {
            src_slot: 2,
            dst_slot: 2,
            len: 3
        })
    );
    assert_eq!(member_rank(4, 3, 0), 0);
    assert_eq!(member_index(4, 3, 0), Some(0));
    assert_eq!(member_index(4, 3, 3), None);
    check_plans(&d, &m);
}

#[test]
fn edge_cases() {
    for (n, l, r, t, p) in [
        (1, 2, 2, 4, 3),
        (2, 1, 3, 2, 0),
        (3, 2, 2, 5, 10),
        (8, 1, 4, 4, 16),
    ] {
        for seed in 0..8 {
            let (d, m) = setup(n, l, r, t, p, seed);
            check_plans(&d, &m);
        }
    }
}

#[test]
fn all_pairs_to_one_expert_is_the_tight_bound() {
    let (n, t, r) = (4u32, 5u32, 3u32);
    let mut c = MoeConfig::new(n, n, r, t, 8, 4);
    c.private_tokens = Some(0);
    let d = c.validate().unwrap();
    let mut row = vec![0; n as usize];
    row[2] = t * r;
    let m = RouteMatrix::from_rows(&d, &vec![row; n as usize]).unwrap();
    let p = StepPlan::new(&d, 2, &m).unwrap();
    assert_eq!(p.unpack().len() as u64, d.contig_slots);
    assert_eq!(p.contig_used(), u64::from((n - 1) * t * r));
    check_plans(&d, &m);
}

#[test]
fn bad_arguments() {
    let (d, m) = setup(2, 1, 1, 1, 0, 0);
    assert!(matches!(
        StepPlan::new(&d, 2, &m),
        Err(MoeError::NoSuchRank { .. })
    ));
    let (d3, _) = setup(3, 1, 1, 1, 0, 0);
    assert!(matches!(
        StepPlan::new(&d3, 0, &m),
        Err(MoeError::Shape { .. })
    ));
}

proptest! {
    #[test]
    fn plans_are_consistent(n in 1u32..=8, l in 1u32..=4, r in 1u32..=4, t in 1u32..=8,
                            p in 0u32..=40, seed: u64) {
        let (d, m) = setup(n, l, r, t, p, seed);
        check_plans(&d, &m);
    }

    #[test]
    fn counts_match_sender_pieces(n in 1u32..=6, l in 1u32..=3, r in 1u32..=4, t in 1u32..=8,
                                  p in 0u32..=16, seed: u64, nics in 1usize..=4,
                                  mwl in prop::sample::select(vec![16u64, 100, 1500, 4096, 1 << 40]),
                                  min_shard in prop::sample::select(vec![0u64, 64, 1 << 16])) {
        let (d, m) = setup(n, l, r, t, p, seed);
        let ic = ImmCounts {
            nics,
            max_write_len: mwl,
            shard: ShardConfig { min_shard_len: min_shard, align: 64 },
        };
        check_counts(&d, &m, &ic);
    }
}
