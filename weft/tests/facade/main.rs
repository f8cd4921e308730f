//! The integration tests of `weft`: one test binary, one module per area.

mod example_backend;
mod readme;
mod registry;
mod topology;
mod two_fabrics;
