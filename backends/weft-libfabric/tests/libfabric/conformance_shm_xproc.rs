//! The conformance suite, unchanged, over libfabric `shm` with every host in its own child process (this binary re-executed; domains are proxies).
//! Cases the provider cannot satisfy are ignored with the reason.

lf_conformance!(|seed| crate::common::CrossProcess::new("shm", seed);
    pass: capabilities_sane, send_recv_sizes, recv_buffer_pool, write_sizes, write_large, imm_only_writes,
    batch_writes_queue_full, imm_exactly_once, payload_visible_at_imm, concurrent_writes, multi_nic,
    local_access_errors, message_too_long, receiver_not_ready, unknown_peer, peer_removal, peer_death,
    remote_access_violations, usable_after_remote_error, deregistered_memory;
    known_failures:
);
