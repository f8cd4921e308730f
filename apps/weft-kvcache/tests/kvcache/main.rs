//! The integration tests of `weft-kvcache`: one test binary, one module per area.

#[macro_use]
mod common;
mod cores;
mod e2e;
mod procs;
mod rendezvous;
mod tp;
