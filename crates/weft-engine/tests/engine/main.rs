//! The integration tests of `weft-engine`: one test binary, one module per area.

/// Counts each thread's allocations (a thread-local add per call), so the
/// wire decoders' fuzz properties can bound what a decode allocates.
#[global_allocator]
static ALLOC: weft_testkit::fuzz::TrackingAlloc = weft_testkit::fuzz::TrackingAlloc;

#[macro_use]
mod common;
mod hostile_peers;
mod hostile_use;
mod keys_and_limits;
mod observability;
mod owned;
mod paged_windows;
mod peer_lifecycle;
mod recv_queue;
mod regressions_faults_and_refusals;
mod scatter_targets;
mod step;
mod threaded;
mod watched_rounds;
mod wire_fuzz;
