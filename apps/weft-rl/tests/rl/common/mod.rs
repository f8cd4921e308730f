//! Shared test helpers: random layouts, deterministic weights, and an
//! independent reference of what every inference tensor must hold.
#![allow(dead_code)]

use weft_rl::meta::{
    Box2, Concat, InferTensor, Layout, ModelLayout, Placement, Quant, Segment, TrainParam,
};
use weft_rl::DType;

/// A random layout with `block`-aligned fp8 segments (a third of the fp8
/// tensors with a smaller block of their own).
pub fn random_layout(seed: u64, block: u64) -> ModelLayout {
    let mut g = Rng(seed);
    let trainers = g.range(1, 6) as u32;
    let nparams = g.range(1, 5) as usize;
    let mut params = Vec::new();
    for i in 0..nparams {
        let rows = g.range(1, 40);
        let cols = g.range(1, 24);
        let mut ranks: Vec<u32> = (0..trainers).collect();
        // random subset, random order
        for k in (1..ranks.len()).rev() {
            let j = g.below(k as u64 + 1) as usize;
            ranks.swap(k, j);
        }
        ranks.truncate(g.range(1, trainers as u64) as usize);
        let layout = match g.below(5) {
            0 => Layout::Replicate { ranks },
            1 => Layout::fsdp(0, ranks, rows),
            4 => {
                // A DTensor mesh: 1-D or 2-D, any placements (FSDP x TP
                // grids, HSDP replicas, nested shards of one dimension).
                let n = ranks.len() as u64;
                let divisors: Vec<u64> = (1..=n).filter(|d| n.is_multiple_of(*d)).collect();
                let a = divisors[g.below(divisors.len() as u64) as usize];
                let shape: Vec<u32> = if g.below(3) == 0 {
                    vec![n as u32]
                } else {
                    vec![a as u32, (n / a) as u32]
                };
                let placements = shape
                    .iter()
                    .map(|_| match g.below(3) {
                        0 => Placement::Replicate,
                        1 => Placement::Shard(0),
                        _ => Placement::Shard(1),
                    })
                    .collect();
                Layout::Mesh {
                    shape,
                    ranks,
                    placements,
                }
            }
            _ => {
                let dim = g.below(2) as u8;
                let ext = if dim == 0 { rows } else { cols };
                let mut sizes = vec![0u64; ranks.len()];
                for _ in 0..ext {
                    let k = g.below(ranks.len() as u64) as usize;
                    sizes[k] += 1;
                }
                Layout::Shard { dim, ranks, sizes }
            }
        };
        params.push(TrainParam {
            name: format!("p{i}"),
            rows,
            cols,
            dtype: DType::Bf16,
            mesh_group: g.below(3) as u32,
            layout,
        });
    }
    let ninf = g.range(1, 3);
    let mut inference = Vec::new();
    for i in 0..ninf {
        let mut ts = Vec::new();
        for k in 0..g.range(1, 3) {
            let fp8 = g.below(2) == 0;
            // A third of the fp8 tensors have their own (smaller) block.
            let own = (fp8 && g.below(3) == 0).then(|| g.range(1, block.max(2) - 1));
            let block = own.unwrap_or(block);
            let first = g.below(nparams as u64) as usize;
            // A third are joined side by side: the roles of rows and
            // columns swap (one height, fp8 widths whole tiles).
            let cols_joined = g.below(3) == 0;
            let extent = |p: usize, across: bool| {
                if across != cols_joined {
                    params[p].cols
                } else {
                    params[p].rows
                }
            };
            let width = g.range(1, extent(first, true));
            let mut segs = Vec::new();
            let nseg = g.range(1, 3);
            for s in 0..nseg {
                let cands: Vec<usize> =
                    (0..nparams).filter(|&p| extent(p, true) >= width).collect();
                let p = if s == 0 {
                    first
                } else {
                    cands[g.below(cands.len() as u64) as usize]
                };
                let rows = extent(p, false);
                // fp8: every segment but the last is whole tiles
                let last = s + 1 == nseg || (fp8 && rows < block);
                let c0 = g.range(0, extent(p, true) - width);
                let h = if fp8 && !last {
                    g.range(1, rows / block) * block
                } else {
                    g.range(1, rows)
                };
                let r0 = g.range(0, rows - h);
                let (rows, cols) = if cols_joined {
                    (c0..c0 + width, r0..r0 + h)
                } else {
                    (r0..r0 + h, c0..c0 + width)
                };
                segs.push(Segment {
                    param: p,
                    src: Box2 { rows, cols },
                });
                if last {
                    break;
                }
            }
            ts.push(InferTensor {
                name: format!("i{i}.t{k}"),
                segments: segs,
                concat: if cols_joined {
                    Concat::Cols
                } else {
                    Concat::Rows
                },
                quant: if fp8 { Quant::Fp8Block } else { Quant::None },
                block: own,
            });
        }
        // replicas: the same tensor on several ranks (TP groups, instances)
        if let Some(prev) = inference.first().cloned() {
            if g.below(2) == 0 {
                let prev: Vec<InferTensor> = prev;
                let k = g.below(prev.len() as u64) as usize;
                ts.push(prev[k].clone());
            }
        }
        inference.push(ts);
    }
    ModelLayout {
        trainers,
        params,
        inference,
    }
}

pub use crate::demo::*;

/// The GPU tests' layouts: FSDP 2 × EP 2 trainers (`pp` stages) → two
/// inference ranks, attention TP 2, one instance.
pub fn tiny_gpu_layouts(pp: u32) -> (weft_rl::models::TrainLayout, weft_rl::models::InferLayout) {
    let t = weft_rl::models::TrainLayout {
        fsdp: 2,
        pp,
        ep: 2,
        tp: 1,
        replicas: 1,
    };
    let i = weft_rl::models::InferLayout {
        ranks: 2,
        instance: 2,
        attn_tp: 2,
        pp: 1,
    };
    (t, i)
}

/// Checks an inference region against [`reference_region`]'s bytes (every
/// byte it names, at least one) and returns how many it checked; `what`
/// names the region in a failure.
pub fn check_region(got: &[u8], want: &[Option<u8>], what: &str) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: region length");
    let mut checked = 0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if let Some(w) = w {
            assert_eq!(g, w, "{what}: byte {i}");
            checked += 1;
        }
    }
    assert!(checked > 0, "{what}: nothing to check");
    checked
}
