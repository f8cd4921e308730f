//! The device operations of the CPU path, on byte slices: pack the
//! dispatch, unpack into the expert layout, pack the combine, and the
//! weighted sum. The GPU kernels implement the same functions with the same
//! formulas (and must be bit-identical).
//!
//! Every access is bounds-checked: a buffer that is too short is a
//! [`MoeError::Shape`], never a panic.

use crate::config::{Dims, DispatchFormat, ORIGIN_BYTES};
use crate::error::MoeError;
use crate::expert::{ExpertTokens, RankInput, NO_EXPERT};
use crate::num::{put_elem, read_elem};
use crate::plan::{CombineSlot, SrcSlot, StepPlan};
use crate::quant;
use crate::routes::CountedPairs;

fn slice<'a>(buf: &'a [u8], off: u64, len: u64, what: &'static str) -> Result<&'a [u8], MoeError> {
    let end = off.saturating_add(len);
    usize::try_from(off)
        .ok()
        .zip(usize::try_from(end).ok())
        .and_then(|(a, b)| buf.get(a..b))
        .ok_or(MoeError::Shape {
            what,
            got: buf.len() as u64,
            want: end,
        })
}

fn slice_mut<'a>(
    buf: &'a mut [u8],
    off: u64,
    len: u64,
    what: &'static str,
) -> Result<&'a mut [u8], MoeError> {
    let end = off.saturating_add(len);
    let have = buf.len() as u64;
    usize::try_from(off)
        .ok()
        .zip(usize::try_from(end).ok())
        .and_then(|(a, b)| buf.get_mut(a..b))
        .ok_or(MoeError::Shape {
            what,
            got: have,
            want: end,
        })
}

/// Copies every pair's token into its send-order slot of `send_buf`
/// (`pairs` from [`count_pairs`](crate::count_pairs) of the same ids),
/// quantised once per token with fp8 dispatch, followed by the pair's
/// index (its origin).
pub fn pack_dispatch(
    dims: &Dims,
    input: &RankInput<'_>,
    pairs: &CountedPairs,
    send_buf: &mut [u8],
) -> Result<(), MoeError> {
    let tb = u64::from(dims.token_bytes);
    let ib = dims.in_row_bytes();
    let r = dims.topk as usize;
    // The token's first slot, once written: later pairs of the same token
    // copy it (fp8 quantises each token once).
    let mut first: Option<(u64, u64)> = None;
    for (i, &slot) in pairs.slots.iter().enumerate() {
        if slot == NO_EXPERT {
            continue;
        }
        let t = (i / r) as u64;
        let at = u64::from(slot) * dims.b_in;
        match first {
            Some((ft, from)) if ft == t => {
                // Both ranges checked: `from` when it was written.
                slice(send_buf, at, tb, "send buffer")?;
                let (from, to) = (from as usize, at as usize);
                send_buf.copy_within(from..from + tb as usize, to);
            }
            _ => {
                let src = slice(input.tokens, t * ib, ib, "tokens")?;
                let row = slice_mut(send_buf, at, tb, "send buffer")?;
                match dims.dispatch {
                    DispatchFormat::Raw => row.copy_from_slice(src),
                    DispatchFormat::Fp8 { round_scale } => {
                        if !quant::quantize_token(src, round_scale, row) {
                            return Err(MoeError::Shape {
                                what: "fp8 token",
                                got: tb,
                                want: u64::from(dims.hidden) + u64::from(dims.hidden) / 32,
                            });
                        }
                    }
                }
                first = Some((t, at));
            }
        }
        let origin = slice_mut(send_buf, at + tb, ORIGIN_BYTES, "send buffer")?;
        // i < T·R < 2^32 (Dims::validate)
        origin.copy_from_slice(&(i as u32).to_le_bytes());
    }
    Ok(())
}

/// Gathers the received rows into the expert layout, following the plan's
/// unpack map (own rows from `send_buf`, the rest from `recv_buf`).
pub fn unpack(
    dims: &Dims,
    plan: &StepPlan,
    send_buf: &[u8],
    recv_buf: &[u8],
) -> Result<ExpertTokens, MoeError> {
    let mut out = ExpertTokens::default();
    unpack_into(dims, plan, send_buf, recv_buf, &mut out)?;
    Ok(out)
}

/// [`unpack`] into `out`, whose vectors are cleared and refilled (their
/// capacity reused: no allocation once they are large enough). A row whose
/// slot carries a pair index no source can send is a
/// [`MoeError::BadOrigin`].
pub fn unpack_into(
    dims: &Dims,
    plan: &StepPlan,
    send_buf: &[u8],
    recv_buf: &[u8],
    out: &mut ExpertTokens,
) -> Result<(), MoeError> {
    let tb = u64::from(dims.token_bytes);
    let slot = tb + ORIGIN_BYTES;
    let data = &mut out.data;
    data.clear();
    data.reserve(plan.unpack().len() * tb as usize);
    out.source_pair.clear();
    let max = dims.max_pairs();
    for (i, (src, &rank)) in plan.unpack().iter().zip(plan.source_rank()).enumerate() {
        let row = match *src {
            SrcSlot::Local(s) => slice(send_buf, u64::from(s) * dims.b_in, slot, "send buffer")?,
            SrcSlot::Private(s) => {
                slice(recv_buf, u64::from(s) * dims.b_in, slot, "receive buffer")?
            }
            SrcSlot::Contig(s) => slice(
                recv_buf,
                dims.contig_offset() + u64::from(s) * dims.b_in,
                slot,
                "receive buffer",
            )?,
        };
        let (token, origin) = row.split_at(tb as usize);
        let pair = u32::from_le_bytes([origin[0], origin[1], origin[2], origin[3]]);
        if u64::from(pair) >= max {
            return Err(MoeError::BadOrigin {
                rank,
                row: i as u32,
                pair,
                max,
            });
        }
        data.extend_from_slice(token);
        out.source_pair.push(pair);
    }
    out.token_bytes = dims.token_bytes;
    out.topk = dims.topk;
    out.max_tokens = dims.max_tokens;
    out.expert_offsets.clear();
    out.expert_offsets.extend_from_slice(plan.expert_offsets());
    out.source_rank.clear();
    out.source_rank.extend_from_slice(plan.source_rank());
    Ok(())
}

/// Places the expert outputs (one `hidden`-element row per expert-layout
/// row) into their combine slots: remote sources' rows into `send_buf`,
/// own rows straight into the own combine region of `recv_buf`.
pub fn pack_combine(
    dims: &Dims,
    plan: &StepPlan,
    expert_outputs: &[u8],
    send_buf: &mut [u8],
    recv_buf: &mut [u8],
) -> Result<(), MoeError> {
    let ob = dims.out_row_bytes();
    let want = plan.combine().len() as u64 * ob;
    if expert_outputs.len() as u64 != want {
        return Err(MoeError::Shape {
            what: "expert outputs",
            got: expert_outputs.len() as u64,
            want,
        });
    }
    for (i, dst) in plan.combine().iter().enumerate() {
        let row = slice(expert_outputs, i as u64 * ob, ob, "expert outputs")?;
        let (buf, slot, what) = match *dst {
            CombineSlot::Send(s) => (&mut *send_buf, s, "send buffer"),
            CombineSlot::Recv(s) => (&mut *recv_buf, s, "receive buffer"),
        };
        slice_mut(buf, u64::from(slot) * dims.b_out, ob, what)?.copy_from_slice(row);
    }
    Ok(())
}

/// The weighted sum of a rank's own tokens from its combine region:
/// `out[t] = Σ_k w[t,k] · y(slot(t,k))`, f32 fused multiply-add in k order
/// over the pairs that have an expert, converted to `out_dtype`. `slots` are the send-order slots of the
/// step's pairs ([`CountedPairs::slots`]).
pub fn weighted_sum(
    dims: &Dims,
    slots: &[u32],
    weights: &[f32],
    recv_buf: &[u8],
) -> Result<Vec<u8>, MoeError> {
    let mut out = vec![0u8; combined_len(dims, slots.len())];
    weighted_sum_into(dims, slots, weights, recv_buf, &mut out)?;
    Ok(out)
}

/// Bytes of the combined tokens of a step with `pairs` (token, k) pairs.
pub fn combined_len(dims: &Dims, pairs: usize) -> usize {
    pairs / (dims.topk as usize).max(1) * dims.out_row_bytes() as usize
}

/// [`weighted_sum`] into `out`, which must be exactly
/// [`combined_len`] bytes.
pub fn weighted_sum_into(
    dims: &Dims,
    slots: &[u32],
    weights: &[f32],
    recv_buf: &[u8],
    out: &mut [u8],
) -> Result<(), MoeError> {
    let want = combined_len(dims, slots.len());
    if out.len() != want {
        return Err(MoeError::Shape {
            what: "combine output",
            got: out.len() as u64,
            want: want as u64,
        });
    }
    if slots.len() != weights.len() {
        return Err(MoeError::Shape {
            what: "topk_weights",
            got: weights.len() as u64,
            want: slots.len() as u64,
        });
    }
    let r = dims.topk as usize;
    let ob = dims.out_row_bytes();
    let tokens = slots.len() / r;
    let mut rows = Vec::with_capacity(r);
    let size = dims.out_dtype.size() as usize;
    let mut at = 0;
    for t in 0..tokens {
        rows.clear();
        for (k, &s) in slots[t * r..(t + 1) * r].iter().enumerate() {
            if s == NO_EXPERT {
                continue;
            }
            let row = slice(recv_buf, u64::from(s) * dims.b_out, ob, "receive buffer")?;
            rows.push((weights[t * r + k], row));
        }
        for h in 0..dims.hidden as usize {
            let mut acc = 0f32;
            for &(w, row) in &rows {
                acc = w.mul_add(read_elem(dims.out_dtype, row, h), acc);
            }
            put_elem(dims.out_dtype, &mut out[at..at + size], acc);
            at += size;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MoeConfig;
    use crate::routes::{count_pairs, RouteMatrix};

    /// One rank, two experts, top-2, two tokens of 3 bytes: every pair
    /// routed to itself, so unpack reads the rows from the send buffer.
    fn packed() -> (Dims, StepPlan, Vec<u8>) {
        let d = MoeConfig::new(1, 2, 2, 2, 3, 1).validate().unwrap();
        let ids = [1, 0, 0, 1];
        let tokens = [10, 11, 12, 20, 21, 22];
        let pairs = count_pairs(&d, &ids).unwrap();
        let mut send = vec![0u8; d.send_buf_len as usize];
        let input = RankInput {
            tokens: &tokens,
            topk_ids: &ids,
            topk_weights: &[0.0; 4],
        };
        pack_dispatch(&d, &input, &pairs, &mut send).unwrap();
        let m = RouteMatrix::from_rows(&d, &[pairs.row]).unwrap();
        (d.clone(), StepPlan::new(&d, 0, &m).unwrap(), send)
    }

    #[test]
    fn rows_carry_their_origin() {
        let (d, plan, send) = packed();
        let x = unpack(&d, &plan, &send, &[]).unwrap();
        // Expert 0: (t0, k1), (t1, k0); expert 1: (t0, k0), (t1, k1).
        assert_eq!(x.source_pair, [1, 2, 0, 3]);
        assert_eq!(x.data, [10, 11, 12, 20, 21, 22, 10, 11, 12, 20, 21, 22]);
        let o = x.origin(1).unwrap();
        assert_eq!((o.rank, o.token, o.k), (0, 1, 0));
    }

    #[test]
    fn a_forged_origin_is_a_typed_error() {
        let (d, plan, mut send) = packed();
        // Slot 1 (expert 0's second row): pair index 4 = T·R.
        let at = d.b_in as usize + d.token_bytes as usize;
        send[at..at + 4].copy_from_slice(&4u32.to_le_bytes());
        let e = unpack(&d, &plan, &send, &[]).unwrap_err();
        assert!(
            matches!(
                e,
                MoeError::BadOrigin {
                    rank: 0,
                    row: 1,
                    pair: 4,
                    max: 4
                }
            ),
            "{e:?}"
        );
    }
}
