//! A naive, single-process dispatch/combine over every rank's inputs at
//! once: each pair is copied straight to its expert's rank, with no
//! buffers, slots or counts. It defines the layout the protocol must
//! produce, and serves as the baseline a benchmark compares against.

use crate::config::{Dims, DispatchFormat};
use crate::error::MoeError;
use crate::expert::{ExpertTokens, RankInput, NO_EXPERT};
use crate::num::{push_elem, read_elem};
use crate::quant;

/// Dispatch: for every rank d, the rows of its local experts (expert
/// ascending, then source rank, then the source's (t, k) order), quantised
/// by [`crate::quant`] with fp8 dispatch.
pub fn dispatch(dims: &Dims, inputs: &[RankInput<'_>]) -> Result<Vec<ExpertTokens>, MoeError> {
    check_all(dims, inputs)?;
    let tb = dims.token_bytes as usize;
    let ib = dims.in_row_bytes() as usize;
    let r = dims.topk as usize;
    let mut out = Vec::with_capacity(inputs.len());
    for d in 0..dims.ranks {
        let mut x = ExpertTokens {
            token_bytes: dims.token_bytes,
            topk: dims.topk,
            max_tokens: dims.max_tokens,
            expert_offsets: vec![0],
            ..ExpertTokens::default()
        };
        for e in d * dims.local..(d + 1) * dims.local {
            for (s, inp) in inputs.iter().enumerate() {
                for (i, _) in inp.topk_ids.iter().enumerate().filter(|&(_, &id)| id == e) {
                    let t = i / r;
                    let at = x.data.len();
                    x.data.resize(at + tb, 0);
                    let row = &inp.tokens[t * ib..(t + 1) * ib];
                    match dims.dispatch {
                        DispatchFormat::Raw => x.data[at..].copy_from_slice(row),
                        DispatchFormat::Fp8 { round_scale } => {
                            if !quant::quantize_token(row, round_scale, &mut x.data[at..]) {
                                return Err(MoeError::Shape {
                                    what: "fp8 token",
                                    got: tb as u64,
                                    want: u64::from(dims.hidden) + u64::from(dims.hidden) / 32,
                                });
                            }
                        }
                    }
                    x.source_rank.push(s as u32);
                    x.source_pair.push(i as u32);
                }
            }
            x.expert_offsets.push(x.source_rank.len() as u32);
        }
        out.push(x);
    }
    Ok(out)
}

/// Combine: `outputs[d]` holds rank d's expert outputs, one row of
/// `hidden` elements of `out_dtype` per row of `dispatch`'s result for d.
/// Returns, per source rank s, its `T_s` combined tokens:
/// `Σ_k w[t,k] · y(t,k)` over the pairs with an expert, accumulated in f32
/// with a fused multiply-add in k order, then converted to `out_dtype`.
pub fn combine(
    dims: &Dims,
    inputs: &[RankInput<'_>],
    outputs: &[Vec<u8>],
) -> Result<Vec<Vec<u8>>, MoeError> {
    check_all(dims, inputs)?;
    let ob = dims.out_row_bytes() as usize;
    if outputs.len() != inputs.len() {
        return Err(MoeError::Shape {
            what: "expert outputs (ranks)",
            got: outputs.len() as u64,
            want: inputs.len() as u64,
        });
    }
    // where[s][t·R+k] = (d, row) in the order `dispatch` uses.
    let mut at: Vec<Vec<(usize, usize)>> = inputs
        .iter()
        .map(|i| vec![(0, 0); i.topk_ids.len()])
        .collect();
    for (d, out) in outputs.iter().enumerate() {
        let mut row = 0usize;
        for e in d as u32 * dims.local..(d as u32 + 1) * dims.local {
            for (s, inp) in inputs.iter().enumerate() {
                for (i, _) in inp.topk_ids.iter().enumerate().filter(|&(_, &id)| id == e) {
                    at[s][i] = (d, row);
                    row += 1;
                }
            }
        }
        if out.len() != row * ob {
            return Err(MoeError::Shape {
                what: "expert outputs",
                got: out.len() as u64,
                want: (row * ob) as u64,
            });
        }
    }
    let r = dims.topk as usize;
    let mut res = Vec::with_capacity(inputs.len());
    for (s, inp) in inputs.iter().enumerate() {
        let tokens = inp.topk_ids.len() / r;
        let mut y = Vec::with_capacity(tokens * ob);
        for t in 0..tokens {
            for h in 0..dims.hidden as usize {
                let mut acc = 0f32;
                for k in 0..r {
                    if inp.topk_ids[t * r + k] == NO_EXPERT {
                        continue;
                    }
                    let (d, row) = at[s][t * r + k];
                    let v = read_elem(dims.out_dtype, &outputs[d][row * ob..(row + 1) * ob], h);
                    acc = inp.topk_weights[t * r + k].mul_add(v, acc);
                }
                push_elem(dims.out_dtype, &mut y, acc);
            }
        }
        res.push(y);
    }
    Ok(res)
}

fn check_all(dims: &Dims, inputs: &[RankInput<'_>]) -> Result<(), MoeError> {
    if inputs.len() != dims.ranks as usize {
        return Err(MoeError::Shape {
            what: "inputs (ranks)",
            got: inputs.len() as u64,
            want: u64::from(dims.ranks),
        });
    }
    for i in inputs {
        i.check(dims)?;
    }
    Ok(())
}
