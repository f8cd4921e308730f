//! What the GPU examples share: the DeepSeek-V3 decode shape (7168 fp8
//! bytes and 56 f32 scales per token, top-8 of 256 experts, 128 tokens per
//! rank, bf16 outputs of 7168), its inputs and percentiles.
#![allow(dead_code)]

use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::time::Duration;
use weft_moe::num::f32_to_bf16;
use weft_moe::{Dims, DispatchFormat, MoeConfig, RankInput};

/// Bytes per dispatched token: 7168 fp8 and 56 f32 scales.
pub const TOKEN_BYTES: u32 = 7168 + 56 * 4;
/// Elements per output row.
pub const HIDDEN: u32 = 7168;

/// One rank's inputs of a step.
pub struct Input {
    pub tokens: Vec<u8>,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Input {
    pub fn view(&self) -> RankInput<'_> {
        RankInput {
            tokens: &self.tokens,
            topk_ids: &self.ids,
            topk_weights: &self.weights,
        }
    }
}

/// The shape at EP `ranks` with `p` private slots.
pub fn dims(ranks: u32, p: u32) -> Dims {
    dims_with(ranks, p, DispatchFormat::Raw)
}

/// [`dims`] with the given dispatch format (fp8: bf16 tokens in, the
/// send kernel quantises them to the same 7392-byte rows).
pub fn dims_with(ranks: u32, p: u32, dispatch: DispatchFormat) -> Dims {
    let mut c = MoeConfig::new(ranks, 256, 8, 128, TOKEN_BYTES, HIDDEN);
    c.private_tokens = Some(p);
    c.max_buffer_bytes = 8 << 30;
    c.dispatch = dispatch;
    c.validate().expect("DeepSeek-V3 shape")
}

/// Top-8 distinct experts per token, uniform (as a load-balanced router).
pub fn input(d: &Dims, rng: &mut ChaCha8Rng) -> Input {
    let experts: Vec<u32> = (0..d.experts).collect();
    let t = d.max_tokens as usize;
    let mut ids = Vec::with_capacity(t * d.topk as usize);
    for _ in 0..t {
        ids.extend(experts.choose_multiple(rng, d.topk as usize).copied());
    }
    let tokens = match d.dispatch {
        DispatchFormat::Raw => (0..t * d.token_bytes as usize).map(|_| rng.gen()).collect(),
        _ => (0..t * d.hidden as usize)
            .flat_map(|_| f32_to_bf16(rng.gen_range(-4.0f32..4.0)).to_le_bytes())
            .collect(),
    };
    Input {
        tokens,
        weights: (0..ids.len()).map(|_| rng.gen_range(0.0f32..1.0)).collect(),
        ids,
    }
}

/// The `p` quantile of `v` (sorted in place; NaN when empty).
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Microseconds.
pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
