//! The conformance suite, unchanged, over libfabric `tcp` with every host
//! (endpoint) in this test process.

mod common;

/// Entry point of peer processes (unused here; keeps the codec checked).
#[test]
fn peer_process_entry() {
    common::child_entry();
}

weft_conformance::conformance_tests!(|seed| common::LfInProcess::harness("tcp", seed));
