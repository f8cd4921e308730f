//! The integration tests of `weft-libfabric`: one test binary, one module per area.

#[macro_use]
mod common;
mod conformance_shm;
mod conformance_shm_xproc;
mod conformance_tcp;
mod conformance_tcp_xproc;
mod data_path;
mod engine_shm;
mod engine_tcp;
mod engine_xproc;
mod kill_loop;
mod lifecycle;
mod missing_library;
mod shm_restart_xproc;
mod signals;
mod smoke;
mod spin_then_park;
mod stale_shm;
mod wait_fd;

/// Entry point of the peer processes every cross-process test here spawns
/// (`weft_conformance::xproc`: this binary re-executed to run only this
/// test); run directly, it checks the proxy codec.
#[test]
fn peer_process_entry() {
    common::child_entry();
}
mod shm_same_process;
