//! The integration tests of `weft-moe`: one test binary, one module per area.

/// Counts each thread's allocations, so the wire fuzz properties can bound
/// what a decode allocates.
#[global_allocator]
static ALLOC: weft_testkit::fuzz::TrackingAlloc = weft_testkit::fuzz::TrackingAlloc;

#[macro_use]
mod common;
mod dataflow;
mod gpu_moe;
mod gpu_xproc;
mod loopback;
mod masked;
mod sim_adversarial;
mod wire_fuzz;
mod xproc_libfabric;
