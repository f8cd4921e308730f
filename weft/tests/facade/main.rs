//! The integration tests of `weft`: one test binary, one module per area.

mod example_backend;
mod registry;
mod topology;
