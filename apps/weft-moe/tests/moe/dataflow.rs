//! The whole data path of a step in one process, with the transport
//! replaced by plain copies that follow the plans (what the engine's
//! scatters and writes do), checked byte for byte against the naive
//! reference. Every receive slot is written at most once per phase and
//! every slot read was written.

use crate::common::{expert_outputs, inputs, routings, Owned, Routing, DTYPES};
use proptest::prelude::*;
use weft_moe::{
    count_pairs, pack, reference, CombineSlot, Dims, MoeConfig, RouteMatrix, SrcSlot, StepPlan,
    NO_EXPERT,
};

struct RankState {
    send: Vec<u8>,
    recv: Vec<u8>,
    slots: Vec<u32>,
    plan: Option<StepPlan>,
}

fn copy(src: &[u8], so: u64, dst: &mut [u8], dof: u64, len: u64) {
    let (so, dof, len) = (so as usize, dof as usize, len as usize);
    dst[dof..dof + len].copy_from_slice(&src[so..so + len]);
}

fn mark(seen: &mut [bool], from: u64, len: u64) {
    for s in from..from + len {
        assert!(!seen[s as usize], "slot {s} written twice");
        seen[s as usize] = true;
    }
}

/// Runs one step over `ranks` (their buffers are reused across steps).
fn step(d: &Dims, ranks: &mut [RankState], ins: &[Owned]) {
    let n = d.ranks as usize;
    let views: Vec<_> = ins.iter().map(Owned::input).collect();
    // Count and pack.
    let mut rows = Vec::new();
    for (r, st) in ranks.iter_mut().enumerate() {
        let pairs = count_pairs(d, &ins[r].ids).unwrap();
        pack::pack_dispatch(d, &views[r], &pairs, &mut st.send).unwrap();
        rows.push(pairs.row.clone());
        st.slots = pairs.slots;
    }
    let m = RouteMatrix::from_rows(d, &rows).unwrap();
    for (r, st) in ranks.iter_mut().enumerate() {
        st.plan = Some(StepPlan::new(d, r as u32, &m).unwrap());
    }
    // "Transport": private entries and overflow writes.
    let dispatch_slots = (d.contig_offset() / d.b_in + d.contig_slots) as usize;
    let mut seen = vec![vec![false; dispatch_slots]; n];
    for s in 0..n {
        let plan = ranks[s].plan.clone().unwrap();
        for (dst, dest) in plan.dests().iter().enumerate() {
            if dst == s {
                continue;
            }
            let (send, recv) = two(ranks, s, dst);
            let from = u64::from(dest.seg) * d.b_in;
            copy(
                send,
                from,
                recv,
                d.private_offset(s as u32),
                u64::from(dest.private) * d.b_in,
            );
            mark(
                &mut seen[dst],
                u64::from(s as u32 * d.private),
                u64::from(dest.private),
            );
            if let Some(o) = dest.overflow {
                copy(
                    send,
                    u64::from(o.src_slot) * d.b_in,
                    recv,
                    d.contig_offset() + u64::from(o.dst_slot) * d.b_in,
                    u64::from(o.len) * d.b_in,
                );
                let base = d.contig_offset() / d.b_in;
                mark(
                    &mut seen[dst],
                    base + u64::from(o.dst_slot),
                    u64::from(o.len),
                );
            }
        }
    }
    // Unpack, compare with the reference.
    let want = reference::dispatch(d, &views).unwrap();
    let mut got = Vec::new();
    for (r, st) in ranks.iter().enumerate() {
        let plan = st.plan.as_ref().unwrap();
        for src in plan.unpack() {
            let slot = match *src {
                SrcSlot::Local(_) => continue,
                SrcSlot::Private(x) => u64::from(x),
                SrcSlot::Contig(x) => d.contig_offset() / d.b_in + u64::from(x),
            };
            assert!(
                seen[r][slot as usize],
                "rank {r} reads unwritten slot {slot}"
            );
        }
        got.push(pack::unpack(d, plan, &st.send, &st.recv).unwrap());
    }
    assert_eq!(got, want, "dispatch differs from the reference");
    // Experts, combine pack, combine scatter.
    let outs: Vec<Vec<u8>> = (0..n)
        .map(|r| expert_outputs(d, r as u32, &got[r]))
        .collect();
    // One combine slot per pair with an expert.
    let mut cseen: Vec<Vec<bool>> = ranks
        .iter()
        .map(|st| vec![false; st.slots.iter().filter(|&&s| s != NO_EXPERT).count()])
        .collect();
    for (r, st) in ranks.iter_mut().enumerate() {
        let plan = st.plan.clone().unwrap();
        pack::pack_combine(d, &plan, &outs[r], &mut st.send, &mut st.recv).unwrap();
        for c in plan.combine() {
            if let CombineSlot::Recv(x) = *c {
                mark(&mut cseen[r], u64::from(x), 1);
            }
        }
    }
    for s in 0..n {
        let plan = ranks[s].plan.clone().unwrap();
        for cs in plan.combine_sends() {
            let (send, recv) = two(ranks, s, cs.rank as usize);
            copy(
                send,
                u64::from(cs.src_slot) * d.b_out,
                recv,
                u64::from(cs.dst_slot) * d.b_out,
                u64::from(cs.len) * d.b_out,
            );
            mark(
                &mut cseen[cs.rank as usize],
                u64::from(cs.dst_slot),
                u64::from(cs.len),
            );
        }
    }
    for (r, c) in cseen.iter().enumerate() {
        assert!(
            c.iter().all(|&x| x),
            "rank {r}: a combine slot was never written"
        );
    }
    let want = reference::combine(d, &views, &outs).unwrap();
    for (r, st) in ranks.iter().enumerate() {
        let y = pack::weighted_sum(d, &st.slots, &ins[r].weights, &st.recv).unwrap();
        assert_eq!(y, want[r], "rank {r}: combine differs from the reference");
    }
}

/// Send buffer of `a` and receive buffer of `b` (a ≠ b).
fn two(ranks: &mut [RankState], a: usize, b: usize) -> (&[u8], &mut [u8]) {
    assert_ne!(a, b);
    if a < b {
        let (x, y) = ranks.split_at_mut(b);
        (&x[a].send, &mut y[0].recv)
    } else {
        let (x, y) = ranks.split_at_mut(a);
        (&y[0].send, &mut x[b].recv)
    }
}

fn run(c: &MoeConfig, routing: Routing, seed: u64, steps: u64) {
    let d = c.validate().unwrap();
    let mut ranks: Vec<RankState> = (0..d.ranks)
        .map(|_| RankState {
            send: vec![0xee; d.send_buf_len as usize],
            recv: vec![0xdd; d.recv_buf_len as usize],
            slots: Vec::new(),
            plan: None,
        })
        .collect();
    for k in 0..steps {
        let ins = inputs(
            &d,
            routing,
            seed.wrapping_mul(31).wrapping_add(k),
            k % 2 == 1,
        );
        step(&d, &mut ranks, &ins);
    }
}

fn cfg(n: u32, l: u32, r: u32, t: u32, p: u32) -> MoeConfig {
    let mut c = MoeConfig::new(n, n * l, r, t, 20, 6);
    c.private_tokens = Some(p.min(t * r));
    c
}

#[test]
fn edge_cases_all_routings() {
    for (n, l, r, t) in [
        (1, 2, 2, 4),
        (2, 1, 3, 3),
        (3, 2, 2, 5),
        (4, 3, 4, 4),
        (8, 1, 2, 3),
    ] {
        for p in [0, 1, 3, t, t * r] {
            let d = cfg(n, l, r, t, p).validate().unwrap();
            for routing in routings(&d) {
                for dtype in DTYPES {
                    let mut c = cfg(n, l, r, t, p);
                    c.out_dtype = dtype;
                    run(&c, routing, u64::from(n * 100 + p), 3);
                }
            }
        }
    }
}

#[test]
fn ep16_random() {
    run(&cfg(16, 2, 4, 8, 2), Routing::Random, 7, 2);
    run(&cfg(16, 2, 4, 8, 2), Routing::OneExpert(5), 8, 2);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_shapes_match_reference(n in 1u32..=6, l in 1u32..=3, r in 1u32..=4, t in 1u32..=6,
                                     p in 0u32..=12, seed: u64, which in 0usize..6) {
        let c = cfg(n, l, r, t, p);
        let d = c.validate().unwrap();
        let routing = routings(&d)[which];
        run(&c, routing, seed, 2);
    }
}
