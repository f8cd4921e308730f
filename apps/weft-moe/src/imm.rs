//! The five immediate values of a MoE instance ([`ImmValues`]) and the
//! number of immediates each round expects ([`ExpectedCounts`]), computed
//! from the route matrix and the engine's [`ImmCounts`], never assumed.
//!
//! Receiver r, sums over sources s ≠ r (B = slot bytes):
//!
//! ```text
//! route     = Σ_s scatter_dst(E·4, ByPeer)
//! dispatch  = [P>0] · Σ_s scatter_dst(min(P, n(s→r))·B_in, ByPeer)   (zero-length → 1)
//!           +         Σ_{s: n(s→r)>P} single_write((n(s→r)−P)·B_in)
//! barrier   = (N−1) · barrier()                                      (BAR_D and BAR_C)
//! combine   = Σ_{d≠r} scatter_dst(n(r→d)·B_out, ByBytes)              (zero-length → 1)
//! ```

use crate::config::Dims;
use crate::error::ConfigError;
use crate::plan::StepPlan;
use weft::{Imm, ImmCounts, ScatterMode};

/// Scatter mode of the route and private scatters (many small entries).
pub const DISPATCH_MODE: ScatterMode = ScatterMode::ByPeer;
/// Scatter mode of the combine scatter (few large entries).
pub const COMBINE_MODE: ScatterMode = ScatterMode::ByBytes;

/// The five immediate values one MoE instance reserves, the same on every
/// rank: `base = imm_capacity − 1 − 5·instance` and the four below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImmValues {
    /// Route (counts) scatter.
    pub route: Imm,
    /// Private scatter and overflow writes.
    pub dispatch: Imm,
    /// Barrier after unpacking.
    pub bar_d: Imm,
    /// Combine scatter.
    pub combine: Imm,
    /// Barrier after the weighted sum.
    pub bar_c: Imm,
}

impl ImmValues {
    /// The values of `instance` for an engine with `capacity` immediates.
    pub fn for_instance(instance: u32, capacity: u32) -> Result<ImmValues, ConfigError> {
        let need = (u64::from(instance) + 1) * 5;
        if need > u64::from(capacity) {
            return Err(ConfigError::ImmSpace { need, capacity });
        }
        let base = capacity - 1 - 5 * instance; // need ≤ capacity: no underflow
        Ok(ImmValues {
            route: base,
            dispatch: base - 1,
            bar_d: base - 2,
            combine: base - 3,
            bar_c: base - 4,
        })
    }

    /// All five values, in the order route, dispatch, bar_d, combine, bar_c.
    pub fn all(&self) -> [Imm; 5] {
        [
            self.route,
            self.dispatch,
            self.bar_d,
            self.combine,
            self.bar_c,
        ]
    }
}

/// Immediates each round of one step expects at one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedCounts {
    /// ROUTE round.
    pub route: u64,
    /// DISPATCH round (private entries and overflow writes).
    pub dispatch: u64,
    /// BAR_D and BAR_C rounds (each).
    pub barrier: u64,
    /// COMBINE round.
    pub combine: u64,
}

impl ExpectedCounts {
    /// The ROUTE count, known before the routes are: every peer sends one
    /// E·4-byte entry.
    pub fn route(dims: &Dims, ic: &ImmCounts) -> u64 {
        u64::from(dims.ranks.saturating_sub(1))
            * ic.scatter_dst(dims.route_row_len(), DISPATCH_MODE)
    }

    /// Every count of the step `plan` describes (at `plan.rank()`).
    pub fn for_step(dims: &Dims, plan: &StepPlan, ic: &ImmCounts) -> ExpectedCounts {
        let r = plan.rank() as usize;
        let p = dims.private;
        let mut dispatch = 0u64;
        for (s, &n) in plan.recv_pairs().iter().enumerate() {
            if s == r {
                continue;
            }
            if p > 0 {
                dispatch += ic.scatter_dst(u64::from(n.min(p)) * dims.b_in, DISPATCH_MODE);
            }
            if n > p {
                dispatch += ic.single_write(u64::from(n - p) * dims.b_in);
            }
        }
        let combine = plan
            .dests()
            .iter()
            .enumerate()
            .filter(|&(d, _)| d != r)
            .map(|(_, dd)| ic.scatter_dst(u64::from(dd.pairs) * dims.b_out, COMBINE_MODE))
            .sum();
        ExpectedCounts {
            route: Self::route(dims, ic),
            dispatch,
            barrier: u64::from(dims.ranks.saturating_sub(1)) * ic.barrier(),
            combine,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MoeConfig;
    use crate::routes::RouteMatrix;
    use weft::ShardConfig;

    fn ic(max_write_len: u64) -> ImmCounts {
        ImmCounts {
            nics: 2,
            max_write_len,
            shard: ShardConfig::default(),
        }
    }

    #[test]
    fn values_from_the_top() {
        let v = ImmValues::for_instance(0, 1024).unwrap();
        assert_eq!(v.all(), [1023, 1022, 1021, 1020, 1019]);
        let v = ImmValues::for_instance(1, 1024).unwrap();
        assert_eq!(v.route, 1018);
        assert_eq!(v.bar_c, 1014);
        assert!(ImmValues::for_instance(0, 5).is_ok());
        assert_eq!(
            ImmValues::for_instance(1, 9),
            Err(ConfigError::ImmSpace {
                need: 10,
                capacity: 9
            })
        );
        assert!(ImmValues::for_instance(u32::MAX, u32::MAX).is_err());
    }

    /// The design note's worked example: EP4 at r = 0, P = 2, B_in = 100
    /// (rounded to 112), large `max_write_len`.
    #[test]
    fn worked_example() {
        let mut c = MoeConfig::new(4, 4, 2, 4, 100, 8);
        c.private_tokens = Some(2);
        let d = c.validate().unwrap();
        // n(1→0) = 5, n(2→0) = 0, n(3→0) = 2; rank 0 sends one pair to rank 1.
        let rows = vec![
            vec![0, 1, 0, 0],
            vec![5, 0, 0, 0],
            vec![0, 0, 0, 0],
            vec![2, 0, 0, 0],
        ];
        let m = RouteMatrix::from_rows(&d, &rows).unwrap();
        let plan = StepPlan::new(&d, 0, &m).unwrap();
        let e = ExpectedCounts::for_step(&d, &plan, &ic(1 << 30));
        assert_eq!(e.dispatch, 4);
        assert_eq!(e.route, 3);
        assert_eq!(e.barrier, 3);
        // r = 0 sends one pair to rank 1, nothing to 2 and 3: three entries.
        assert_eq!(e.combine, 3);
        // Pieces of at most 100 bytes: s=1 private 224 B → 3, overflow 336 B → 4;
        // s=2 zero-length → 1; s=3 private 224 B → 3.
        let e = ExpectedCounts::for_step(&d, &plan, &ic(100));
        assert_eq!(e.dispatch, 11);
    }

    #[test]
    fn single_rank_needs_nothing() {
        let d = MoeConfig::new(1, 4, 2, 4, 16, 8).validate().unwrap();
        let m = RouteMatrix::from_rows(&d, &[vec![2, 2, 2, 2]]).unwrap();
        let plan = StepPlan::new(&d, 0, &m).unwrap();
        let e = ExpectedCounts::for_step(&d, &plan, &ic(4096));
        assert_eq!(
            e,
            ExpectedCounts {
                route: 0,
                dispatch: 0,
                barrier: 0,
                combine: 0
            }
        );
    }
}
