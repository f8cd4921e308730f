//! Step-mode drive loops: make progress until a condition holds.
//!
//! A step-mode test owns every source of progress (domains it polls, engines
//! it progresses, a simulated fabric it steps). These loops run such a test
//! until its condition holds, and fail instead of spinning forever when
//! nothing can move any more.

/// Calls `step` until `done()` holds; panics once `step` reported no progress
/// `idle_limit` times in a row (the simulation went idle first).
///
/// `step` makes one round of progress and says whether anything moved, e.g.
/// `|| engines.iter().any(|e| e.progress()) || fabric.step()`.
pub fn drive_until(
    what: &str,
    idle_limit: u32,
    mut step: impl FnMut() -> bool,
    mut done: impl FnMut() -> bool,
) {
    let mut idle = 0u32;
    while !done() {
        if step() {
            idle = 0;
        } else {
            idle += 1;
            assert!(
                idle < idle_limit,
                "{what}: simulation idle before the condition held"
            );
        }
    }
}

/// Runs at most `max` rounds of `round` on `state` until `done(state)`
/// holds; returns whether it held. For loops bounded by a round budget
/// instead of by idleness (a simulated clock that always advances). `state`
/// is what both closures need mutably (the simulation and its completions).
pub fn poll_rounds<S: ?Sized>(
    max: u64,
    state: &mut S,
    mut round: impl FnMut(&mut S),
    mut done: impl FnMut(&mut S) -> bool,
) -> bool {
    for _ in 0..max {
        if done(state) {
            return true;
        }
        round(state);
    }
    done(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drives_until_done() {
        let mut n = 0;
        let mut moved = 0;
        drive_until(
            "count",
            3,
            || {
                moved += 1;
                true
            },
            || {
                n += 1;
                n > 5
            },
        );
        assert_eq!(moved, 5);
    }

    #[test]
    #[should_panic(expected = "idle before the condition held")]
    fn idle_fails() {
        drive_until("never", 3, || false, || false);
    }

    #[test]
    fn rounds_are_bounded() {
        let mut r = 0;
        assert!(!poll_rounds(10, &mut r, |r| *r += 1, |_| false));
        assert_eq!(r, 10);
        let mut r = 0;
        assert!(poll_rounds(10, &mut r, |r| *r += 1, |r| *r == 4));
    }
}
