//! The integration tests of `weft-bench`: one test binary, one module per area.

mod kvcache_smoke;
mod smoke;
