//! The integration tests of `weft-moe`: one test binary, one module per area.

#[macro_use]
mod common;
mod dataflow;
mod gpu_moe;
mod loopback;
mod sim_adversarial;
mod xproc_libfabric;
