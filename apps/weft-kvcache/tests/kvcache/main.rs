//! The integration tests of `weft-kvcache`: one test binary, one module per area.

#[macro_use]
mod common;
// Sans-IO helpers of the protocol tests (`hostile`, `model`).
mod cores;
mod e2e;
mod hostile;
mod model;
mod offers;
mod procs;
mod rendezvous;
mod sans_io;
mod tp;
