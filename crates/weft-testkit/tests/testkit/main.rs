//! The integration tests of `weft-testkit`: one test binary, one module per area.

mod child;
