//! Bounded waits for threaded engines (no speed assertion: only a hang
//! fails).

use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_engine::{DoneFlag, EngineError};

/// Generous bound on every wall-clock wait.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `f` every millisecond until it holds; panics after [`DEADLINE`].
pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < DEADLINE,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits for `f` to be resolved and returns its result.
pub fn wait_flag(what: &str, f: &Arc<DoneFlag>) -> Result<(), EngineError> {
    wait_until(what, || f.is_done());
    match f.result() {
        Some(r) => r,
        None => panic!("{what}: done flag without a result"),
    }
}
