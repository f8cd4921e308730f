//! The conformance suite, unchanged, over libfabric `tcp` with every host in its own child process (this binary re-executed; domains are proxies).
//! Cases the provider cannot satisfy are ignored with the reason.

lf_conformance!(|seed| crate::common::CrossProcess::new("tcp", seed);
    pass: capabilities_sane, send_recv_sizes, recv_buffer_pool, write_sizes, write_large, imm_only_writes,
    batch_writes_queue_full, imm_exactly_once, payload_visible_at_imm, concurrent_writes, multi_nic,
    local_access_errors, message_too_long, receiver_not_ready, unknown_peer, peer_death, peer_removal,
    usable_after_remote_error, deregistered_memory;
    known_failures:
    remote_access_violations = "tcp;ofi_rxm across processes: the target closes the connection on a violation and the rejection's status (provider errno ENOENT) is often lost in the reset, so every write in flight fails ENOTCONN/EPIPE, which cannot be told from the peer's death (in one process the status arrives and the case passes)",
);
