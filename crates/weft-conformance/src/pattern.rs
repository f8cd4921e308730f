//! Payload patterns and byte comparison with useful messages (both from
//! `weft-testkit`), and a tiny deterministic RNG for the cases' random
//! choices.

use crate::CaseFailure;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `len` pseudo-random bytes determined by `tag` (splitmix64 words of the
/// seed `tag`: see [`weft_testkit::pattern`]).
pub(crate) use weft_testkit::pattern;

/// Fails with the first differing offset and the number of differing bytes.
pub(crate) fn check_bytes(what: &str, got: &[u8], want: &[u8]) -> Result<(), CaseFailure> {
    weft_testkit::pattern::compare(got, want)
        .map_err(|m| CaseFailure::Failed(format!("{what}: {m}")))
}

/// A small deterministic RNG (splitmix64): the cases' and the engine
/// scenarios' random choices.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        splitmix(&mut self.0)
    }

    /// Uniform in `[0, n)`; 0 when `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo).saturating_add(1))
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_bytes_reports_first_difference() {
        assert!(check_bytes("x", b"abc", b"abc").is_ok());
        let e = check_bytes("x", b"abd", b"abc").unwrap_err();
        assert!(e.to_string().contains("offset 2"), "{e}");
        assert!(check_bytes("x", b"ab", b"abc").is_err());
    }

    #[test]
    fn rng_bounds() {
        let mut r = Rng::new(3);
        for _ in 0..1000 {
            assert!(r.below(7) < 7);
            let x = r.range(5, 9);
            assert!((5..=9).contains(&x));
        }
        assert_eq!(r.below(0), 0);
    }
}
