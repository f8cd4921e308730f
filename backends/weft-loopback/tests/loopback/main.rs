//! The integration tests of `weft-loopback`: one test binary, one module per area.

#[macro_use]
mod common;
mod conformance;
mod data_path;
mod delivery;
mod engine_suite;
mod faults;
mod random_workload;
mod timing;
