//! Bounded waits for the engine tests (no speed assertion: only a hang
//! fails). Shared by `engine_tcp.rs` and `engine_xproc.rs`.

use std::sync::Arc;
use std::time::Duration;
use weft_engine::{DoneFlag, EngineError};

/// Generous bound on every wait.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `f` until it holds; panics after [`DEADLINE`].
pub fn wait_until(what: &str, f: impl FnMut() -> bool) {
    weft_testkit::wait_until(what, DEADLINE, f);
}

/// Waits for `f` to be resolved and returns its result.
pub fn wait_flag(what: &str, f: &Arc<DoneFlag>) -> Result<(), EngineError> {
    wait_until(what, || f.is_done());
    f.result().expect("done flag has a result")
}
