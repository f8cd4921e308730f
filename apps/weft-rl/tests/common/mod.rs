//! Shared test helpers: random layouts, deterministic weights, and an
//! independent reference of what every inference tensor must hold.
#![allow(dead_code)]

use weft_rl::meta::{Box2, InferTensor, Layout, ModelLayout, Quant, Segment, TrainParam};
use weft_rl::DType;

/// splitmix64.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// A random layout with `block`-aligned fp8 segments.
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
        let layout = match g.below(4) {
            0 => Layout::Replicate { ranks },
            1 => Layout::fsdp(0, ranks, rows),
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
            let first = g.below(nparams as u64) as usize;
            let width = g.range(1, params[first].cols);
            let mut segs = Vec::new();
            let nseg = g.range(1, 3);
            for s in 0..nseg {
                let cands: Vec<usize> = (0..nparams).filter(|&p| params[p].cols >= width).collect();
                let p = if s == 0 {
                    first
                } else {
                    cands[g.below(cands.len() as u64) as usize]
                };
                let rows = params[p].rows;
                // fp8: every segment but the last is whole tiles
                let last = s + 1 == nseg || (fp8 && rows < block);
                let c0 = g.range(0, params[p].cols - width);
                let h = if fp8 && !last {
                    g.range(1, rows / block) * block
                } else {
                    g.range(1, rows)
                };
                let r0 = g.range(0, rows - h);
                segs.push(Segment {
                    param: p,
                    src: Box2 {
                        rows: r0..r0 + h,
                        cols: c0..c0 + width,
                    },
                });
                if last {
                    break;
                }
            }
            ts.push(InferTensor {
                name: format!("i{i}.t{k}"),
                segments: segs,
                quant: if fp8 { Quant::Fp8Block } else { Quant::None },
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

/// The deterministic bf16 weight of element `(r, c)` of parameter `p` at
/// training step `step`: finite, varied exponents and signs.
pub fn weight(step: u64, p: usize, r: u64, c: u64) -> u16 {
    let mut g = Rng(step.wrapping_mul(0x1234_5678_9abc) ^ ((p as u64) << 40) ^ (r << 20) ^ c);
    let x = g.next();
    let sign = ((x >> 63) as u16) << 15;
    let exp = 100 + (x % 40) as u16;
    let mant = ((x >> 8) & 0x7F) as u16;
    sign | (exp << 7) | mant
}

/// e4m3fn by exhaustive nearest search (ties to the even code), independent
/// of the library's bit-twiddling conversion.
pub fn ref_e4m3(x: f32) -> u8 {
    let dec = |b: u8| -> f32 {
        let s = if b & 0x80 != 0 { -1.0f64 } else { 1.0 };
        let e = ((b >> 3) & 0xF) as i32;
        let m = (b & 7) as f64;
        (if e == 0 {
            s * m / 512.0
        } else {
            s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }) as f32
    };
    let x = x.clamp(-448.0, 448.0);
    let mut best: Option<(f64, u8)> = None;
    for b in 0u8..=255 {
        if b & 0x7F == 0x7F {
            continue;
        }
        if b == 0x80 {
            continue; // prefer +0 for zero; -0 handled below
        }
        let d = (dec(b) as f64 - x as f64).abs();
        match best {
            None => best = Some((d, b)),
            Some((bd, bb)) => {
                if d < bd || (d == bd && (b & 1) == 0 && (bb & 1) == 1) {
                    best = Some((d, b));
                }
            }
        }
    }
    let b = best.map_or(0, |x| x.1);
    if b == 0 && x.is_sign_negative() {
        0x80
    } else {
        b
    }
}

/// What inference rank `i`'s region must hold after step `step`: every
/// tensor's bytes (and scales) at their plan offsets; other bytes `None`.
pub fn reference_region(
    m: &ModelLayout,
    plan: &weft_rl::Plan,
    i: usize,
    step: u64,
) -> Vec<Option<u8>> {
    let reg = &plan.inference[i];
    let block = plan.config.block;
    let mut out = vec![None; reg.len as usize];
    for (t, slot) in m.inference[i].iter().zip(&reg.tensors) {
        let (rows, cols) = (t.rows(), t.cols());
        let mut vals = Vec::with_capacity((rows * cols) as usize);
        for s in &t.segments {
            for r in s.src.rows.clone() {
                for c in s.src.cols.clone() {
                    vals.push(weight(step, s.param, r, c));
                }
            }
        }
        match t.quant {
            Quant::None | _ if t.quant != Quant::Fp8Block => {
                for (k, v) in vals.iter().enumerate() {
                    let o = slot.data.0 as usize + 2 * k;
                    out[o] = Some(v.to_le_bytes()[0]);
                    out[o + 1] = Some(v.to_le_bytes()[1]);
                }
            }
            _ => {
                let f = |b: u16| f32::from_bits((b as u32) << 16);
                let (br, bc) = (rows.div_ceil(block), cols.div_ceil(block));
                let (so, _) = slot.scales.expect("fp8 has scales");
                for ti in 0..br {
                    for tj in 0..bc {
                        let mut amax = 0f32;
                        for r in ti * block..((ti + 1) * block).min(rows) {
                            for c in tj * block..((tj + 1) * block).min(cols) {
                                amax = amax.max(f(vals[(r * cols + c) as usize]).abs());
                            }
                        }
                        let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                        let k = (so + (ti * bc + tj) * 4) as usize;
                        for (j, b) in scale.to_le_bytes().iter().enumerate() {
                            out[k + j] = Some(*b);
                        }
                        for r in ti * block..((ti + 1) * block).min(rows) {
                            for c in tj * block..((tj + 1) * block).min(cols) {
                                let x = f(vals[(r * cols + c) as usize]) / scale;
                                out[(slot.data.0 + r * cols + c) as usize] = Some(ref_e4m3(x));
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Fills trainer `t`'s region image for step `step` per the plan.
pub fn trainer_image(plan: &weft_rl::Plan, t: usize, step: u64) -> Vec<u8> {
    let reg = &plan.trainers[t];
    let mut v = vec![0u8; reg.len as usize];
    for (p, b, off) in &reg.pieces {
        let mut o = *off as usize;
        for r in b.rows.clone() {
            for c in b.cols.clone() {
                let w = weight(step, *p, r, c).to_le_bytes();
                v[o] = w[0];
                v[o + 1] = w[1];
                o += 2;
            }
        }
    }
    v
}
