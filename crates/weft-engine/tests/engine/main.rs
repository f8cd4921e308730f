//! The integration tests of `weft-engine`: one test binary, one module per area.

#[macro_use]
mod common;
mod hostile_peers;
mod hostile_use;
mod keys_and_limits;
mod observability;
mod owned;
mod paged_windows;
mod peer_lifecycle;
mod regressions_faults_and_refusals;
mod scatter_targets;
mod step;
mod threaded;
