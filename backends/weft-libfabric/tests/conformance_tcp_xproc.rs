//! The conformance suite, unchanged, over libfabric `tcp` with every host in
//! its own child process (this binary re-executed; domains are proxies).

mod common;

/// Entry point of the peer processes spawned by `common::CrossProcess`.
#[test]
fn peer_process_entry() {
    common::child_entry();
}

weft_conformance::conformance_tests!(|seed| common::CrossProcess::new("tcp", seed));
