//! Seeds for randomized tests, with replay.
//!
//! A randomized test runs a list of seeds ([`seeds`], [`seeds_or`]); setting
//! `WEFT_SEED=N` ([`SEED_ENV`]) runs only seed `N`. When the body panics,
//! [`run_seeded`], [`with_seed`], [`for_seeds`] (or a live [`SeedGuard`])
//! print
//! `seed=N (replay with WEFT_SEED=N)` to stderr before the panic propagates.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The environment variable that replays one seed.
pub const SEED_ENV: &str = "WEFT_SEED";

/// The seed in [`SEED_ENV`], if set to a number.
pub fn replay_seed() -> Option<u64> {
    std::env::var(SEED_ENV).ok()?.trim().parse().ok()
}

/// Seeds `0..n`, or only the seed in [`SEED_ENV`] when set.
pub fn seeds(n: u64) -> Vec<u64> {
    match replay_seed() {
        Some(s) => vec![s],
        None => (0..n).collect(),
    }
}

/// The given seeds, or only the seed in [`SEED_ENV`] when set.
pub fn seeds_or(default: impl IntoIterator<Item = u64>) -> Vec<u64> {
    match replay_seed() {
        Some(s) => vec![s],
        None => default.into_iter().collect(),
    }
}

/// The test RNG for `seed` (ChaCha8: fast, and the same stream everywhere).
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Prints the replay line for its seed if dropped while the thread panics.
///
/// ```
/// let _guard = weft_testkit::SeedGuard::new(7, "my test");
/// // ... a panic from here on prints "my test: seed=7 (replay with WEFT_SEED=7)"
/// ```
#[derive(Debug)]
pub struct SeedGuard {
    seed: u64,
    what: &'static str,
}

impl SeedGuard {
    /// Guards `seed` of the test (or case) `what`.
    pub fn new(seed: u64, what: &'static str) -> Self {
        Self { seed, what }
    }

    /// The guarded seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}: {}", self.what, replay_line(self.seed));
        }
    }
}

/// `seed=N (replay with WEFT_SEED=N)`.
pub fn replay_line(seed: u64) -> String {
    format!("seed={seed} (replay with {SEED_ENV}={seed})")
}

/// Runs `body` with a ChaCha RNG seeded from `seed`, printing the replay line
/// if it panics (the panic then propagates unchanged).
pub fn run_seeded<R>(seed: u64, body: impl FnOnce(&mut ChaCha8Rng) -> R) -> R {
    let _guard = SeedGuard::new(seed, "seeded test failed");
    body(&mut rng(seed))
}

/// Runs `body`, printing the replay line for `seed` if it panics (the panic
/// then propagates unchanged).
pub fn with_seed<R>(seed: u64, body: impl FnOnce() -> R) -> R {
    let _guard = SeedGuard::new(seed, "seeded test failed");
    body()
}

/// Runs `body` for each seed (only the one in [`SEED_ENV`] when set),
/// printing the replay line of the seed that panics.
pub fn for_seeds(seeds: impl IntoIterator<Item = u64>, mut body: impl FnMut(u64)) {
    for seed in seeds_or(seeds) {
        with_seed(seed, || body(seed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn seeds_count_from_zero() {
        if replay_seed().is_none() {
            assert_eq!(seeds(3), vec![0, 1, 2]);
            assert_eq!(seeds_or([5, 9]), vec![5, 9]);
        }
    }

    #[test]
    fn rng_is_deterministic() {
        let a: u64 = run_seeded(4, |r| r.gen());
        let b: u64 = run_seeded(4, |r| r.gen());
        let c: u64 = run_seeded(5, |r| r.gen());
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn for_seeds_runs_each() {
        if replay_seed().is_none() {
            let mut seen = Vec::new();
            for_seeds([4, 2], |s| seen.push(s));
            assert_eq!(seen, vec![4, 2]);
        }
        assert_eq!(with_seed(1, || 5), 5);
    }

    #[test]
    fn panics_propagate() {
        let r = std::panic::catch_unwind(|| run_seeded(11, |_| panic!("boom")));
        assert!(r.is_err());
        assert_eq!(replay_line(11), "seed=11 (replay with WEFT_SEED=11)");
    }
}
