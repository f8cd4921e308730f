//! The **event-level cost model** (the cross-check of the fabric-driven
//! simulation): the same [`Plan`] (same units, writers, gathers, waves,
//! mesh group order) costed wave by wave from its byte counts, no fabric.
//!
//! - a wave of group `g` starts when every rank of `g` is free (its
//!   previous wave / group done) plus one barrier (`barrier_us`);
//! - **unshard**: each rank's gather bytes out and in, over NVLink when
//!   both ranks sit on one node (`gpus_per_node`), else over its NICs;
//!   the rank's gather time is `max(out, in) / bandwidth + latency`;
//! - **quantise**: bf16 bytes of the units it writes / `quant_gbps`, plus
//!   `kernel_us` per unit;
//! - **write**: per rank `submit_us` per WRITE and its egress over
//!   `nics × nic_gbps`; every inference rank drains its ingress in FIFO
//!   order across all concurrently running waves (a per-rank "busy until"
//!   clock), and a wave's writers finish when the inference ranks they
//!   wrote to have drained the wave;
//! - a rank's wave ends after `gather + quantise + write`: stages of one
//!   rank do not overlap across waves here (the real pipeline overlaps a
//!   wave's writes with the next wave's barrier, gathers and quantisation;
//!   the fabric-driven simulation models that), so this is the serial
//!   cross-check; groups with disjoint ranks run concurrently.
//!
//! Waves are list-scheduled: each rank runs its groups' waves in plan
//! order, and of the waves at the head of all their ranks' queues the one
//! that can start earliest runs next. Not modelled: congestion inside the
//! fabric, trainer NVLink/NIC sharing between concurrent waves, the
//! paper's H2D copy, the final acknowledgements. The Rank0 prediction runs
//! the same cost model over the Rank0 data flow (everything through
//! trainer 0's and inference 0's NICs, one GPU quantising).

use crate::meta::ModelLayout;
use crate::plan::Plan;

use super::SimConfig;

/// What the cost model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ModelReport {
    /// P2P update time, seconds.
    pub p2p_s: f64,
    /// Sum over ranks' critical path of unshard / quantise / write / wait
    /// time, seconds (of the slowest rank).
    pub unshard_s: f64,
    /// Quantisation on the slowest rank.
    pub quant_s: f64,
    /// Writing on the slowest rank.
    pub write_s: f64,
    /// Waiting at barriers on the slowest rank.
    pub wait_s: f64,
    /// Bytes into inference ÷ aggregate bandwidth (the tighter of the two
    /// sides), seconds.
    pub bound_s: f64,
    /// Rank0 baseline, seconds.
    pub rank0_s: f64,
    /// Bytes into inference memory.
    pub bytes: u64,
}

/// Runs the cost model.
pub fn cost_model(m: &ModelLayout, plan: &Plan, cfg: &SimConfig) -> ModelReport {
    let nt = plan.trainers.len();
    let ni = plan.inference.len();
    let nic_bs = cfg.nic_gbps * 1e9 / 8.0 * f64::from(cfg.nics.max(1));
    let nvl_bs = cfg.nvlink_gbs * 1e9;
    let q_bs = cfg.quant_gbs * 1e9;
    let us = 1e-6;
    let node = |r: u32| r / cfg.gpus_per_node.max(1);
    let mut clock = vec![0f64; nt];
    // Per inference rank: when its ingress is free again (FIFO fluid).
    let mut busy = vec![0f64; ni];
    // Per rank: (unshard, quant, write, wait) accumulated.
    let mut parts = vec![[0f64; 4]; nt];
    // Each rank runs its groups' waves in plan order; a wave starts when it
    // is at the head of every member's queue. List scheduling: always run
    // the ready wave that can start earliest.
    let waves: Vec<(usize, usize)> = plan
        .groups
        .iter()
        .enumerate()
        .flat_map(|(gi, g)| (0..g.waves.len()).map(move |k| (gi, k)))
        .collect();
    let mut queue: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); nt];
    for (wi, &(gi, _)) in waves.iter().enumerate() {
        for &r in &plan.groups[gi].ranks {
            queue[r as usize].push_back(wi);
        }
    }
    let mut done = vec![false; waves.len()];
    for _ in 0..waves.len() {
        let mut best: Option<(f64, usize)> = None;
        for (wi, &(gi, _)) in waves.iter().enumerate() {
            if done[wi] {
                continue;
            }
            let g = &plan.groups[gi];
            if !g
                .ranks
                .iter()
                .all(|&r| queue[r as usize].front() == Some(&wi))
            {
                continue;
            }
            let s = g
                .ranks
                .iter()
                .map(|&r| clock[r as usize])
                .fold(0f64, f64::max);
            if best.is_none_or(|(bs, _)| s < bs) {
                best = Some((s, wi));
            }
            // Waves of one group are consecutive: the first ready one is
            // enough for this group.
        }
        let Some((s, wi)) = best else { break };
        done[wi] = true;
        let (gi, k) = waves[wi];
        let g = &plan.groups[gi];
        for &r in &g.ranks {
            queue[r as usize].pop_front();
        }
        let start = s + cfg.barrier_us * us;
        let units = &plan.units[g.waves[k].clone()];
        let mut g_out_nic = vec![0u64; nt];
        let mut g_in_nic = vec![0u64; nt];
        let mut g_out_nvl = vec![0u64; nt];
        let mut g_in_nvl = vec![0u64; nt];
        let mut qbytes = vec![0u64; nt];
        let mut kernels = vec![0u64; nt];
        let mut egress = vec![0u64; nt];
        let mut writes = vec![0u64; nt];
        let mut ingress = vec![0u64; ni];
        for u in units {
            let wr = u.writer as usize;
            for x in &u.gathers {
                let b = x.xfer.src.bytes();
                if node(x.from) == node(u.writer) {
                    g_out_nvl[x.from as usize] += b;
                    g_in_nvl[wr] += b;
                } else {
                    g_out_nic[x.from as usize] += b;
                    g_in_nic[wr] += b;
                }
            }
            if u.arena.is_some() {
                qbytes[wr] += u.src.elems() * m.params[u.param].dtype.size();
                kernels[wr] += 1;
            }
            for d in &u.dests {
                for x in d.xfers() {
                    egress[wr] += x.dst.bytes();
                    writes[wr] += 1;
                    ingress[d.inf as usize] += x.dst.bytes();
                }
            }
        }
        // Prepare (unshard + quantise) per rank, then the writes: each
        // inference rank drains its ingress after it is free and the
        // earliest writer of the wave is ready.
        let mut ready = vec![0f64; nt];
        let mut first = f64::INFINITY;
        for &r in &g.ranks {
            let r = r as usize;
            let gather = if g_out_nic[r] + g_in_nic[r] + g_out_nvl[r] + g_in_nvl[r] > 0 {
                (g_out_nic[r].max(g_in_nic[r]) as f64 / nic_bs)
                    .max(g_out_nvl[r].max(g_in_nvl[r]) as f64 / nvl_bs)
                    + cfg.latency_us * us
            } else {
                0.0
            };
            let quant = qbytes[r] as f64 / q_bs + kernels[r] as f64 * cfg.kernel_us * us;
            parts[r][0] += gather;
            parts[r][1] += quant;
            parts[r][3] += start - clock[r];
            ready[r] = start + gather + quant;
            if writes[r] > 0 {
                first = first.min(ready[r]);
            }
        }
        let mut drained = 0f64;
        for (i, &b) in ingress.iter().enumerate() {
            if b > 0 {
                busy[i] = busy[i].max(first) + b as f64 / nic_bs;
                drained = drained.max(busy[i]);
            }
        }
        for &r in &g.ranks {
            let r = r as usize;
            let end = if writes[r] > 0 {
                let own = ready[r]
                    + egress[r] as f64 / nic_bs
                    + writes[r] as f64 * cfg.submit_us * us
                    + cfg.latency_us * us;
                own.max(drained + cfg.latency_us * us)
            } else {
                ready[r]
            };
            parts[r][2] += end - ready[r];
            clock[r] = end;
        }
    }
    let (slow, p2p) = clock
        .iter()
        .enumerate()
        .fold((0, 0f64), |a, (i, &c)| if c > a.1 { (i, c) } else { a });
    let bytes = plan.inference_bytes();
    let bound = (bytes as f64 / (ni as f64 * nic_bs)).max(bytes as f64 / (nt as f64 * nic_bs));
    // Rank0: gather everything into trainer 0 (its NICs, or NVLink for its
    // node mates), quantise on one GPU, one link, scatter from inference 0.
    let train_bytes: u64 = m
        .params
        .iter()
        .map(|p| p.rows * p.cols * p.dtype.size())
        .sum();
    let node_share = (cfg.gpus_per_node.max(1) as f64 / nt.max(1) as f64).min(1.0);
    let gather0 =
        train_bytes as f64 * (1.0 - node_share) / nic_bs + train_bytes as f64 * node_share / nvl_bs;
    let quant0 = train_bytes as f64 / q_bs;
    let link = bytes as f64 / nic_bs;
    let own = plan.inference.first().map_or(0, |r| r.len);
    let scatter = bytes.saturating_sub(own) as f64 / nic_bs;
    let rank0 = gather0 + quant0 + link + scatter;
    let p = parts.get(slow).copied().unwrap_or_default();
    ModelReport {
        p2p_s: p2p,
        unshard_s: p[0],
        quant_s: p[1],
        write_s: p[2],
        wait_s: p[3],
        bound_s: bound,
        rank0_s: rank0,
        bytes,
    }
}
