//! Bounded waits for threaded engines (no speed assertion: only a hang
//! fails).

use std::sync::Arc;
use std::time::Duration;
use weft_engine::{DoneFlag, EngineError};

/// Generous bound on every wall-clock wait.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `f` until it holds; panics after [`DEADLINE`].
pub fn wait_until(what: &str, f: impl FnMut() -> bool) {
    weft_testkit::wait_until(what, DEADLINE, f);
}

/// Waits for `f` to be resolved and returns its result.
pub fn wait_flag(what: &str, f: &Arc<DoneFlag>) -> Result<(), EngineError> {
    wait_until(what, || f.is_done());
    match f.result() {
        Some(r) => r,
        None => panic!("{what}: done flag without a result"),
    }
}
