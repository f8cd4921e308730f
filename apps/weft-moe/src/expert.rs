//! The data types of a step: [`RankInput`] (what a rank dispatches) and
//! [`ExpertTokens`] (what dispatch hands a rank's experts).

use crate::config::Dims;
use crate::error::MoeError;

/// The tokens a rank received for its local experts, expert-major: rows of
/// local expert `e` are `expert_offsets[e] .. expert_offsets[e + 1]`; inside
/// an expert, rows are ordered by source rank, then by the source's (t, k)
/// order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExpertTokens {
    /// Rows of `token_bytes` bytes each, packed.
    pub data: Vec<u8>,
    /// Bytes per row.
    pub token_bytes: u32,
    /// Row offsets per local expert (L + 1 entries).
    pub expert_offsets: Vec<u32>,
    /// Source rank of every row.
    pub source_rank: Vec<u32>,
    /// Pair index `t · topk + k` of every row at its source rank, as the
    /// source wrote it into the row's slot: [`ExpertTokens::origin`]
    /// decodes and checks it.
    pub source_pair: Vec<u32>,
    /// Experts per token (`topk`) of the step's configuration.
    pub topk: u32,
    /// Tokens per rank at most (`max_tokens`) of the step's configuration.
    pub max_tokens: u32,
}

/// Where one received row came from: the `k`-th expert choice of token
/// `token` of rank `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowOrigin {
    /// The source rank.
    pub rank: u32,
    /// The token's index in the source's input.
    pub token: u32,
    /// The position of this expert in the token's top-k list.
    pub k: u32,
}

impl ExpertTokens {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.source_rank.len()
    }

    /// Row `i`'s origin. `None` when `i` is out of range, or when the pair
    /// index its source wrote names a token at or beyond `max_tokens` (the
    /// index travels with the row: a faulty or hostile peer can write any
    /// value, so it is checked here before anyone uses it).
    pub fn origin(&self, i: usize) -> Option<RowOrigin> {
        let rank = *self.source_rank.get(i)?;
        let pair = *self.source_pair.get(i)?;
        let k = pair.checked_rem(self.topk)?;
        let token = pair / self.topk;
        (token < self.max_tokens).then_some(RowOrigin { rank, token, k })
    }

    /// Row `i` (empty when out of range).
    pub fn row(&self, i: usize) -> &[u8] {
        let tb = self.token_bytes as usize;
        self.data.get(i * tb..(i + 1) * tb).unwrap_or(&[])
    }
}

pub use crate::mask::NO_EXPERT;

/// One rank's inputs of a step: `T_r` tokens of
/// [`Dims::in_row_bytes`] bytes (`token_bytes`, or bf16 of `hidden` with
/// fp8 dispatch), and
/// `T_r · R` expert ids and weights, token-major. An id of [`NO_EXPERT`]
/// leaves that pair out.
#[derive(Debug, Clone, Copy)]
pub struct RankInput<'a> {
    /// Token rows, packed.
    pub tokens: &'a [u8],
    /// Top-k expert ids (`t·R + k`).
    pub topk_ids: &'a [u32],
    /// Top-k weights (`t·R + k`).
    pub topk_weights: &'a [f32],
}

impl RankInput<'_> {
    /// Checks the shapes and the ids against `dims`; returns `T_r`.
    pub fn check(&self, dims: &Dims) -> Result<u32, MoeError> {
        let r = u64::from(dims.topk);
        let ids = self.topk_ids.len() as u64;
        let t = ids / r;
        if !ids.is_multiple_of(r) {
            return Err(MoeError::Shape {
                what: "topk_ids",
                got: ids,
                want: t * r,
            });
        }
        if t > u64::from(dims.max_tokens) {
            return Err(MoeError::TooManyTokens {
                got: t,
                max: dims.max_tokens,
            });
        }
        let want = t * dims.in_row_bytes();
        if self.tokens.len() as u64 != want {
            return Err(MoeError::Shape {
                what: "tokens",
                got: self.tokens.len() as u64,
                want,
            });
        }
        if self.topk_weights.len() as u64 != ids {
            return Err(MoeError::Shape {
                what: "topk_weights",
                got: self.topk_weights.len() as u64,
                want: ids,
            });
        }
        if let Some(i) = self
            .topk_ids
            .iter()
            .position(|&id| id >= dims.experts && id != NO_EXPERT)
        {
            return Err(MoeError::ExpertOutOfRange {
                t: (i as u64 / r) as u32,
                k: (i as u64 % r) as u32,
                id: self.topk_ids[i],
            });
        }
        Ok(t as u32)
    }
}

/// A step's top-k weights as the caller holds them (`T_r · R`,
/// token-major): f32, or bf16 bits (what a torch `bfloat16` tensor holds).
/// bf16 → f32 is exact, so both give the same combine, bit for bit, as the
/// f32 values of the bf16 weights. `&[f32]` and `&Vec<f32>` convert into
/// it, so the f32 calls read as before.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum TopkWeights<'a> {
    /// f32 weights.
    F32(&'a [f32]),
    /// bf16 weights, as their bits.
    Bf16(&'a [u16]),
}

impl TopkWeights<'_> {
    /// Number of weights.
    pub fn len(&self) -> usize {
        match self {
            TopkWeights::F32(w) => w.len(),
            TopkWeights::Bf16(w) => w.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The weights as f32: borrowed as they are, or converted (exactly)
    /// into `scratch`, which is reused.
    pub fn as_f32<'s>(&'s self, scratch: &'s mut Vec<f32>) -> &'s [f32] {
        match self {
            TopkWeights::F32(w) => w,
            TopkWeights::Bf16(w) => {
                scratch.clear();
                scratch.extend(w.iter().map(|&b| crate::num::bf16_to_f32(b)));
                scratch
            }
        }
    }
}

impl<'a> From<&'a [f32]> for TopkWeights<'a> {
    fn from(w: &'a [f32]) -> Self {
        TopkWeights::F32(w)
    }
}

impl<'a> From<&'a Vec<f32>> for TopkWeights<'a> {
    fn from(w: &'a Vec<f32>) -> Self {
        TopkWeights::F32(w)
    }
}

impl<'a> From<&'a [u16]> for TopkWeights<'a> {
    /// bf16 bits.
    fn from(w: &'a [u16]) -> Self {
        TopkWeights::Bf16(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(pairs: &[u32]) -> ExpertTokens {
        ExpertTokens {
            source_rank: vec![3; pairs.len()],
            source_pair: pairs.to_vec(),
            topk: 4,
            max_tokens: 10,
            ..ExpertTokens::default()
        }
    }

    #[test]
    fn origin_decodes_the_pair_index() {
        let x = tokens(&[0, 5, 39]);
        let o = |rank, token, k| Some(RowOrigin { rank, token, k });
        assert_eq!(x.origin(0), o(3, 0, 0));
        assert_eq!(x.origin(1), o(3, 1, 1));
        assert_eq!(x.origin(2), o(3, 9, 3));
        assert_eq!(x.origin(3), None);
    }

    #[test]
    fn origin_refuses_what_an_honest_peer_cannot_write() {
        // Token 10 of at most 10, and the largest u32.
        let x = tokens(&[40, u32::MAX]);
        assert_eq!(x.origin(0), None);
        assert_eq!(x.origin(1), None);
        // A default (never filled) value has no origins and does not
        // divide by zero.
        let mut y = tokens(&[1]);
        y.topk = 0;
        assert_eq!(y.origin(0), None);
        // Vectors of different lengths (a caller's edit): no panic.
        let mut z = tokens(&[1, 2]);
        z.source_rank.truncate(1);
        assert_eq!(z.origin(1), None);
    }
}
