//! The integration tests of `weft-rendezvous`: one test binary, one module per area.

/// Counts each thread's allocations, so the record fuzz properties can
/// bound what a decode allocates.
#[global_allocator]
static ALLOC: weft_testkit::fuzz::TrackingAlloc = weft_testkit::fuzz::TrackingAlloc;

#[macro_use]
mod suite;
mod dir;
mod etcd;
mod etcd_restart;
mod hostile;
mod mem;
mod record_fuzz;
