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
}

impl ExpertTokens {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.source_rank.len()
    }

    /// Row `i` (empty when out of range).
    pub fn row(&self, i: usize) -> &[u8] {
        let tb = self.token_bytes as usize;
        self.data.get(i * tb..(i + 1) * tb).unwrap_or(&[])
    }
}

/// The expert id of a (token, k) pair that goes to no expert (DeepEP's
/// `-1`): the pair is neither sent nor summed.
pub const NO_EXPERT: u32 = u32::MAX;

/// One rank's inputs of a step: `T_r` tokens of `token_bytes` bytes, and
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
        let want = t * u64::from(dims.token_bytes);
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
