//! Masked ranks: a group that goes on without some of its ranks (a rank
//! that died, or one taken out), as DeepEP's `mask_buffer` and Mooncake
//! EP's `active_ranks` do. The protocol runs over the *active* ranks only,
//! renumbered densely in rank order; the caller keeps the global numbers:
//! top-k ids name global experts, and a pair whose expert sits on a masked
//! rank is dropped (neither sent nor summed, as a [`NO_EXPERT`] id), while
//! every other id is renumbered to the active group's expert.

use crate::error::MoeError;

/// The expert id of a (token, k) pair that goes to no expert (DeepEP's
/// `-1`): the pair is neither sent nor summed.
pub const NO_EXPERT: u32 = u32::MAX;

/// Which ranks of a group of `ranks` are masked.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct RankMask {
    /// Ranks of the whole group (N, masked ones included).
    ranks: u32,
    /// Masked ranks, ascending, distinct, each `< ranks`.
    masked: Vec<u32>,
}

impl RankMask {
    /// The mask of `masked` (ascending, distinct, each below `ranks`,
    /// checked by [`crate::MoeConfig::validate`]) in a group of `ranks`.
    pub(crate) fn new(ranks: u32, masked: Vec<u32>) -> RankMask {
        RankMask { ranks, masked }
    }

    /// Ranks of the whole group, masked ones included.
    pub fn global_ranks(&self) -> u32 {
        self.ranks
    }

    /// The masked ranks, ascending.
    pub fn masked(&self) -> &[u32] {
        &self.masked
    }

    /// Whether no rank is masked.
    pub fn is_empty(&self) -> bool {
        self.masked.is_empty()
    }

    /// Active ranks (`global_ranks - masked`).
    pub fn active(&self) -> u32 {
        self.ranks - self.masked.len() as u32
    }

    /// The active index of global rank `g`; `None` when it is masked or
    /// out of range.
    pub fn active_index(&self, g: u32) -> Option<u32> {
        if g >= self.ranks {
            return None;
        }
        match self.masked.binary_search(&g) {
            Ok(_) => None,
            Err(below) => Some(g - below as u32),
        }
    }

    /// The global rank of active index `a` (`a < active()`; beyond that,
    /// `a` plus the masked ranks, which no caller of this crate asks).
    pub fn global_rank(&self, a: u32) -> u32 {
        let mut g = a;
        for &m in &self.masked {
            if m <= g {
                g += 1;
            } else {
                break;
            }
        }
        g
    }

    /// `e` with the peer it names given by its whole-group rank: the
    /// protocol numbers active ranks only, callers know whole-group ranks.
    /// Errors that name no peer pass unchanged; so does everything when
    /// no rank is masked.
    pub fn globalise(&self, e: MoeError) -> MoeError {
        if self.is_empty() {
            return e;
        }
        match e {
            MoeError::BadOrigin {
                rank,
                row,
                pair,
                max,
            } => MoeError::BadOrigin {
                rank: self.global_rank(rank),
                row,
                pair,
                max,
            },
            MoeError::BadRoutes { rank, what } => MoeError::BadRoutes {
                rank: self.global_rank(rank),
                what,
            },
            MoeError::PeerInfo { rank, what } => MoeError::PeerInfo {
                rank: self.global_rank(rank),
                what: format!("{what} (active rank {rank})"),
            },
            other => other,
        }
    }

    /// Turns the active ranks in `ranks` (rows' source ranks) into
    /// whole-group ranks in place.
    pub fn globalise_ranks(&self, ranks: &mut [u32]) {
        if self.is_empty() {
            return;
        }
        for s in ranks {
            *s = self.global_rank(*s);
        }
    }

    /// Renumbers global top-k ids (`t·R + k`) for the active group of
    /// `local` experts per rank into `out`: an id on a masked rank becomes
    /// [`NO_EXPERT`]. An id beyond the whole group's experts is
    /// [`MoeError::ExpertOutOfRange`].
    pub fn map_ids(
        &self,
        local: u32,
        topk: u32,
        ids: &[u32],
        out: &mut Vec<u32>,
    ) -> Result<(), MoeError> {
        out.clear();
        let experts = u64::from(self.ranks) * u64::from(local);
        for (i, &id) in ids.iter().enumerate() {
            if id == NO_EXPERT {
                out.push(NO_EXPERT);
                continue;
            }
            if u64::from(id) >= experts || local == 0 {
                let r = topk.max(1) as usize;
                return Err(MoeError::ExpertOutOfRange {
                    t: (i / r) as u32,
                    k: (i % r) as u32,
                    id,
                });
            }
            out.push(match self.active_index(id / local) {
                Some(a) => a * local + id % local,
                None => NO_EXPERT,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_round_trip_around_the_holes() {
        let m = RankMask::new(6, vec![0, 3, 4]);
        assert_eq!(m.active(), 3);
        let act: Vec<_> = (0..7).map(|g| m.active_index(g)).collect();
        assert_eq!(act, [None, Some(0), Some(1), None, None, Some(2), None]);
        for a in 0..3 {
            assert_eq!(m.active_index(m.global_rank(a)), Some(a));
        }
        assert_eq!(m.global_rank(2), 5);
    }

    #[test]
    fn ids_on_masked_ranks_are_dropped_and_the_rest_renumbered() {
        // 4 ranks of 2 experts, rank 1 masked: experts 2 and 3 go.
        let m = RankMask::new(4, vec![1]);
        let mut out = Vec::new();
        m.map_ids(2, 3, &[0, 2, 3, 5, NO_EXPERT, 7], &mut out)
            .unwrap();
        assert_eq!(out, [0, NO_EXPERT, NO_EXPERT, 3, NO_EXPERT, 5]);
        let e = m.map_ids(2, 3, &[0, 1, 2, 8], &mut out).unwrap_err();
        assert!(
            matches!(e, MoeError::ExpertOutOfRange { t: 1, k: 0, id: 8 }),
            "{e:?}"
        );
    }
}
