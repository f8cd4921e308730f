//! Demo data and its check (used by `weft-rl run` and the tests): weights
//! generated deterministically per step, and an independent reference of
//! what every inference tensor must hold (bf16 copies, fp8 values found by
//! exhaustive nearest search, block scales).
#![allow(dead_code)]

use weft_rl::ModelLayout;
use weft_rl::Quant;

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
    let mut out = vec![None; reg.len as usize];
    for (t, slot) in m.inference[i].iter().zip(&reg.tensors) {
        let block = slot.block;
        let (rows, cols) = (t.rows(), t.cols());
        let mut vals = vec![0u16; (rows * cols) as usize];
        for (s, (r0, c0)) in t.segments.iter().zip(t.offsets()) {
            for (i, r) in s.src.rows.clone().enumerate() {
                for (j, c) in s.src.cols.clone().enumerate() {
                    vals[((r0 + i as u64) * cols + c0 + j as u64) as usize] =
                        weight(step, s.param, r, c);
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
