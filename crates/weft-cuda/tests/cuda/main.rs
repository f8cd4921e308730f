//! The integration tests of `weft-cuda`: one test binary, one module per area.

#[cfg(feature = "cuda")]
#[macro_use]
mod common;
mod gpu_basics;
mod gpu_engine;
mod gpu_ipc;
mod gpu_libfabric;
mod gpu_xproc_engine;
