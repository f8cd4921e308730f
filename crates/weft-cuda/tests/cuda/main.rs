//! The integration tests of `weft-cuda`: one test binary, one module per area.
//!
//! On a GPU, run them one at a time (`-- --test-threads=1`, as `cargo xtask
//! gpu-run` does): some kernels spin on a host flag that their test raises
//! later, and a context-wide synchronisation by another test meanwhile (a
//! buffer freed, a registration) waits for such a kernel while holding the
//! context, so the raising test stalls until the kernel's timeout.

#[cfg(feature = "cuda")]
#[macro_use]
mod common;
mod gpu_basics;
mod gpu_engine;
mod gpu_ipc;
mod gpu_libfabric;
mod gpu_suites;
mod gpu_xproc_engine;
