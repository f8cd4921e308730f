//! The unshard of one wave in the fabric simulation: which gathers cross
//! nodes (posted on the fabric as WRITEs, competing with the weight WRITEs
//! for the NICs) and what stays inside a node (NVLink, which the fabric
//! does not have: modelled as a duration).
//!
//! The plan's gathers are strided boxes (Kimi-K2: 1.1 M transfers of
//! ~7.9 M pages), too many events to post one by one; a source's
//! cross-node gathers into one writer in one wave are posted as WRITEs of
//! their summed bytes, cut into chunks of at most [`CHUNK`] (the bytes and
//! their timing on both links are kept; the host cost is charged as
//! submits on the source's proxy lane, one per submit the trainer makes:
//! [`crate::plan::gather_posts`]).

use std::collections::BTreeMap;

use super::{ns, SimConfig};
use crate::plan::Plan;

/// Largest gather WRITE the simulation posts.
pub(super) const CHUNK: u64 = 8 << 20;

/// Immediate of the cross-node gathers of wave `k` of group `gi`: the
/// wave's number across groups with the top bit set (apart from the
/// barrier and acknowledgement immediates; a plan has far fewer than 2^31
/// waves).
pub(super) fn imm(plan: &Plan, gi: usize, k: usize) -> u32 {
    let before: usize = plan.groups.iter().take(gi).map(|g| g.waves.len()).sum();
    (1 << 31) | ((before + k) as u32 & 0x7fff_ffff)
}

/// One wave's unshard.
#[derive(Default)]
pub(super) struct WaveGather {
    /// Per writer: when its NVLink gathers are in (ns after its barrier).
    pub nvlink_done: BTreeMap<u32, u64>,
    /// Per source: gather submits (host cost; [`crate::plan::gather_posts`]).
    pub submits: BTreeMap<u32, u64>,
    /// Per source: `(writer, bytes, chunk)` it sends across nodes, in
    /// WRITEs of at most `chunk` bytes.
    pub cross: BTreeMap<u32, Vec<(u32, u64, u64)>>,
    /// Per writer: chunked WRITEs it receives across nodes.
    pub cross_in: BTreeMap<u32, u64>,
}

impl WaveGather {
    /// The gathers of wave `k` of group `gi`.
    pub(super) fn new(plan: &Plan, cfg: &SimConfig, gi: usize, k: usize) -> WaveGather {
        let node = |r: u32| r / cfg.gpus_per_node.max(1);
        let nvl_bs = cfg.nvlink_gbs * 1e9;
        // Per rank NVLink bytes (in, out); per (source, writer) cross bytes.
        let mut nvl: BTreeMap<u32, [u64; 2]> = BTreeMap::new();
        let mut cross: BTreeMap<(u32, u32), u64> = BTreeMap::new();
        let mut sources: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let mut out = WaveGather::default();
        for u in &plan.units[plan.groups[gi].waves[k].clone()] {
            for g in &u.gathers {
                let b = g.xfer.src.bytes();
                if node(g.from) == node(u.writer) {
                    nvl.entry(u.writer).or_default()[0] += b;
                    nvl.entry(g.from).or_default()[1] += b;
                    sources.entry(u.writer).or_default().push(g.from);
                } else {
                    *cross.entry((g.from, u.writer)).or_default() += b;
                }
            }
        }
        // Host cost: one submit per post (a source's small pieces into one
        // writer share a paged submit, as the trainer posts them).
        for p in plan.gather_posts(gi, k) {
            *out.submits.entry(p.from()).or_default() += 1;
        }
        let t = |b: u64| (b as f64 / nvl_bs * 1e9) as u64;
        // A source sends once it submitted its gathers, then at its rate.
        let sent = |s: &u32| {
            out.submits.get(s).copied().unwrap_or(0) * ns(cfg.submit_us)
                + t(nvl.get(s).map_or(0, |v| v[1]))
        };
        let mut done = BTreeMap::new();
        for (w, srcs) in &sources {
            let recv = t(nvl.get(w).map_or(0, |v| v[0]));
            let send = srcs.iter().map(sent).max().unwrap_or(0);
            done.insert(*w, recv.max(send) + ns(cfg.latency_us));
        }
        out.nvlink_done = done;
        for ((s, w), b) in cross {
            // Within the source's shards and the writer's arena half (the
            // registrations the WRITEs name; no bytes behind them).
            let chunk = CHUNK
                .min(plan.trainers[s as usize].len)
                .min(plan.arena_len)
                .max(1);
            out.cross.entry(s).or_default().push((w, b, chunk));
            *out.cross_in.entry(w).or_default() += b.div_ceil(chunk);
        }
        out
    }
}
