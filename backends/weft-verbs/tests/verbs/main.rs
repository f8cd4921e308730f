//! The integration tests of `weft-verbs`: one test binary, one module per area.

#[macro_use]
mod common;
mod conformance;
mod data_path;
mod engine;
mod layout;
mod lifecycle;
mod verbs;
