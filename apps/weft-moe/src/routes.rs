//! Routing counts: the per-expert counts of one source ([`CountedPairs`],
//! computed locally from `topk_ids`) and the N×E [`RouteMatrix`] of every
//! source's counts (rows arrive from peers, so they are validated).

use crate::config::Dims;
use crate::error::MoeError;
use crate::expert::NO_EXPERT;

/// The pairs of one rank's step, counted and placed: what the send side
/// computes before anything goes on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountedPairs {
    /// Tokens of the step (T_r ≤ T).
    pub tokens: u32,
    /// n(r→e) for every expert e: this rank's route row.
    pub row: Vec<u32>,
    /// Send-order slot of pair (t, k) at index `t·R + k`. Send order is
    /// expert ascending (hence destination rank ascending), then t, then k.
    /// A pair with no expert ([`NO_EXPERT`]) has slot [`NO_EXPERT`].
    pub slots: Vec<u32>,
}

/// Counts the (token, k) pairs of `topk_ids` (`T_r · R` ids, token-major)
/// per expert and gives every pair its send-order slot. Deterministic: the
/// slot of a pair depends only on the ids. Ids of [`NO_EXPERT`] are not
/// counted.
pub fn count_pairs(dims: &Dims, topk_ids: &[u32]) -> Result<CountedPairs, MoeError> {
    let r = dims.topk as usize;
    if !topk_ids.len().is_multiple_of(r) {
        return Err(MoeError::Shape {
            what: "topk_ids",
            got: topk_ids.len() as u64,
            want: (topk_ids.len() / r * r) as u64,
        });
    }
    let tokens = topk_ids.len() / r;
    if tokens > dims.max_tokens as usize {
        return Err(MoeError::TooManyTokens {
            got: tokens as u64,
            max: dims.max_tokens,
        });
    }
    let mut row = vec![0u32; dims.experts as usize];
    for (i, &id) in topk_ids.iter().enumerate() {
        if id == NO_EXPERT {
            continue;
        }
        let Some(c) = row.get_mut(id as usize) else {
            return Err(MoeError::ExpertOutOfRange {
                t: (i / r) as u32,
                k: (i % r) as u32,
                id,
            });
        };
        *c += 1; // at most T·R ≤ u32::MAX pairs (validated)
    }
    let mut cursor = Vec::with_capacity(row.len());
    let mut acc = 0u32;
    for &c in &row {
        cursor.push(acc);
        acc += c;
    }
    let mut slots = Vec::with_capacity(topk_ids.len());
    for &id in topk_ids {
        if id == NO_EXPERT {
            slots.push(NO_EXPERT);
            continue;
        }
        let c = &mut cursor[id as usize]; // checked above
        slots.push(*c);
        *c += 1;
    }
    Ok(CountedPairs {
        tokens: tokens as u32,
        row,
        slots,
    })
}

/// Writes a route row as little-endian `u32`s into `out` (`row.len() · 4`
/// bytes; shorter `out` takes a prefix).
pub fn row_to_le_bytes(row: &[u32], out: &mut [u8]) {
    for (c, o) in row.iter().zip(out.chunks_exact_mut(4)) {
        o.copy_from_slice(&c.to_le_bytes());
    }
}

/// Every source's per-expert counts n(s→e), N rows of E.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteMatrix {
    ranks: u32,
    experts: u32,
    counts: Vec<u32>,
}

impl RouteMatrix {
    /// An all-zero matrix for `dims`.
    pub fn new(dims: &Dims) -> Self {
        Self {
            ranks: dims.ranks,
            experts: dims.experts,
            counts: vec![0; dims.ranks as usize * dims.experts as usize],
        }
    }

    /// A matrix from all rows at once (row s = source s), validated.
    pub fn from_rows(dims: &Dims, rows: &[Vec<u32>]) -> Result<Self, MoeError> {
        if rows.len() != dims.ranks as usize {
            return Err(MoeError::Shape {
                what: "route rows",
                got: rows.len() as u64,
                want: u64::from(dims.ranks),
            });
        }
        let mut m = Self::new(dims);
        for (s, row) in rows.iter().enumerate() {
            m.set_row(dims, s as u32, row)?;
        }
        Ok(m)
    }

    /// Sets row `s`, rejecting a row of the wrong length or one that claims
    /// more than T·R pairs.
    pub fn set_row(&mut self, dims: &Dims, s: u32, row: &[u32]) -> Result<(), MoeError> {
        let range = self.row_range(s)?;
        if row.len() != self.experts as usize {
            return Err(MoeError::BadRoutes {
                rank: s,
                what: format!("{} counts, expected {}", row.len(), self.experts),
            });
        }
        let sum: u64 = row.iter().map(|&c| u64::from(c)).sum();
        if sum > dims.max_pairs() {
            return Err(MoeError::BadRoutes {
                rank: s,
                what: format!(
                    "{sum} pairs, at most {} (max_tokens·topk)",
                    dims.max_pairs()
                ),
            });
        }
        self.counts[range].copy_from_slice(row);
        Ok(())
    }

    /// Sets row `s` from its little-endian wire form (E · 4 bytes), as
    /// [`set_row`](Self::set_row) does.
    pub fn set_row_le_bytes(&mut self, dims: &Dims, s: u32, bytes: &[u8]) -> Result<(), MoeError> {
        if bytes.len() as u64 != dims.route_row_len() {
            return Err(MoeError::BadRoutes {
                rank: s,
                what: format!("{} bytes, expected {}", bytes.len(), dims.route_row_len()),
            });
        }
        let row: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        self.set_row(dims, s, &row)
    }

    fn row_range(&self, s: u32) -> Result<std::ops::Range<usize>, MoeError> {
        if s >= self.ranks {
            return Err(MoeError::NoSuchRank {
                rank: s,
                ranks: self.ranks,
            });
        }
        let e = self.experts as usize;
        Ok(s as usize * e..(s as usize + 1) * e)
    }

    /// Row `s` (empty for a rank out of range).
    pub fn row(&self, s: u32) -> &[u32] {
        self.row_range(s).map_or(&[], |r| &self.counts[r])
    }

    /// n(s→e): pairs of source `s` routed to expert `e` (0 out of range).
    pub fn n_expert(&self, s: u32, e: u32) -> u32 {
        self.row(s).get(e as usize).copied().unwrap_or(0)
    }

    /// n(s→d): pairs of source `s` routed to experts hosted by rank `d`.
    pub fn n_rank(&self, dims: &Dims, s: u32, d: u32) -> u32 {
        let l = dims.local as usize;
        let start = d as usize * l;
        self.row(s)
            .get(start..start + l)
            .map_or(0, |c| c.iter().sum())
    }

    /// Ranks (rows).
    pub fn ranks(&self) -> u32 {
        self.ranks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MoeConfig;

    fn dims() -> Dims {
        MoeConfig::new(2, 4, 2, 3, 8, 4).validate().unwrap()
    }

    #[test]
    fn counts_and_send_order() {
        let d = dims();
        // token 0 → experts 3, 0; token 1 → 0, 0 (duplicate); token 2 → 2, 1.
        let c = count_pairs(&d, &[3, 0, 0, 0, 2, 1]).unwrap();
        assert_eq!(c.tokens, 3);
        assert_eq!(c.row, vec![3, 1, 1, 1]);
        // expert 0: (0,1),(1,0),(1,1) → 0,1,2; expert 1: (2,1) → 3; 2: (2,0) → 4; 3: (0,0) → 5.
        assert_eq!(c.slots, vec![5, 0, 1, 2, 4, 3]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let d = dims();
        assert!(matches!(
            count_pairs(&d, &[0, 4]),
            Err(MoeError::ExpertOutOfRange { t: 0, k: 1, id: 4 })
        ));
        assert!(matches!(count_pairs(&d, &[0]), Err(MoeError::Shape { .. })));
        assert!(matches!(
            count_pairs(&d, &[0; 8]),
            Err(MoeError::TooManyTokens { got: 4, max: 3 })
        ));
        assert_eq!(count_pairs(&d, &[]).unwrap().row, vec![0; 4]);
    }

    #[test]
    fn peer_rows_are_validated() {
        let d = dims();
        let mut m = RouteMatrix::new(&d);
        assert!(m.set_row(&d, 1, &[6, 0, 0, 0]).is_ok());
        assert!(matches!(
            m.set_row(&d, 1, &[6, 0, 0, 1]),
            Err(MoeError::BadRoutes { rank: 1, .. })
        ));
        assert!(matches!(
            m.set_row(&d, 0, &[u32::MAX; 4]),
            Err(MoeError::BadRoutes { .. })
        ));
        assert!(matches!(
            m.set_row(&d, 0, &[0; 3]),
            Err(MoeError::BadRoutes { .. })
        ));
        assert!(matches!(
            m.set_row(&d, 2, &[0; 4]),
            Err(MoeError::NoSuchRank { .. })
        ));
        let mut b = [0u8; 16];
        row_to_le_bytes(&[1, 2, 0, 3], &mut b);
        m.set_row_le_bytes(&d, 0, &b).unwrap();
        assert_eq!(m.row(0), &[1, 2, 0, 3]);
        assert_eq!(m.n_rank(&d, 0, 0), 3);
        assert_eq!(m.n_rank(&d, 0, 1), 3);
        assert_eq!(m.n_rank(&d, 1, 0), 6);
        assert!(m.set_row_le_bytes(&d, 0, &b[..15]).is_err());
        assert_eq!(m.row(9), &[] as &[u32]);
    }
}
