//! The integration tests of `weft-nvlink`: one test binary, one module per
//! area. The conformance suite and the engine scenario suite run unchanged,
//! with hosts in this process and with every host in its own child process.

mod common;
mod conformance;
mod engine_xproc;
mod hostile;

/// Entry point of the peer processes every cross-process test here spawns
/// (`weft_conformance::xproc`: this binary re-executed to run only this
/// test); run directly, it checks the proxy codec.
#[test]
fn peer_process_entry() {
    weft_conformance::xproc::child_entry::<common::NvXproc>();
}
