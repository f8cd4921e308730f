//! The integration tests of `weft-rl`: one test binary, one module per area.

// The demo model and the worker processes of the `weft-rl` binary, shared
// with the cross-process tests.
#[path = "../../src/demo.rs"]
mod demo;
#[path = "../../src/worker.rs"]
mod worker;

#[macro_use]
mod common;
mod gpu_rl;
mod gpu_xproc;
mod hf_configs;
mod loopback_e2e;
mod plan_props;
mod sim;
mod xproc;
