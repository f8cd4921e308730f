//! The deterministic event trace and the fabric's counters.

use crate::{OpKind, SimTime};

/// One recorded fabric event (see [`crate::Fabric::trace`]). Operation ids
/// are fabric-wide post sequence numbers, so traces of two runs compare
/// with `==`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    /// Simulated time of the event.
    pub at: SimTime,
    /// What happened.
    pub what: TraceKind,
}

/// What a [`TraceEvent`] records.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TraceKind {
    /// An operation was accepted by `post_*`.
    Posted {
        /// Operation id.
        op: u64,
        /// Its kind.
        kind: OpKind,
        /// Initiator (host, NIC).
        src: (u32, u32),
        /// Target (host, NIC), `None` when the address names no NIC.
        dst: Option<(u32, u32)>,
        /// Payload length.
        len: u64,
        /// Immediate.
        imm: Option<u32>,
        /// Number of chunks it travels as.
        chunks: u32,
    },
    /// A rule matched the operation.
    RuleMatched {
        /// Operation id.
        op: u64,
        /// Index of the rule in installation order.
        rule: usize,
    },
    /// One transmission of a chunk (or of a SEND, chunk 0) was lost.
    Dropped {
        /// Operation id.
        op: u64,
        /// Chunk index.
        chunk: u32,
        /// Transmission attempt that was lost (0 = first).
        attempt: u32,
    },
    /// A payload chunk was written into target memory.
    ChunkLanded {
        /// Operation id.
        op: u64,
        /// Chunk index.
        chunk: u32,
        /// Byte offset inside the WRITE.
        offset: u64,
        /// Chunk length.
        len: u64,
    },
    /// The immediate of a WRITE was reported at the target.
    ImmDelivered {
        /// Operation id.
        op: u64,
        /// The immediate.
        imm: u32,
    },
    /// A SEND was placed into a receive buffer.
    RecvMatched {
        /// Operation id.
        op: u64,
        /// The receive's WrId.
        recv_wr: u64,
        /// Bytes received.
        len: u64,
    },
    /// A SEND found no receive buffer and waits.
    RnrWait {
        /// Operation id.
        op: u64,
    },
    /// The initiator's completion was generated.
    Completed {
        /// Operation id.
        op: u64,
        /// `None` on success, otherwise the error kind and reason (without
        /// memory addresses, so traces of two runs compare equal).
        error: Option<String>,
    },
    /// A NIC died or was closed.
    NicDown {
        /// Host.
        host: u32,
        /// NIC index.
        nic: u32,
        /// `true` for kill, `false` for a domain being closed.
        killed: bool,
    },
}

/// Counters of what the fabric did (see [`crate::Fabric::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FabricStats {
    /// Events processed.
    pub events: u64,
    /// WRITEs accepted.
    pub writes_posted: u64,
    /// SENDs accepted.
    pub sends_posted: u64,
    /// Receive buffers posted.
    pub recvs_posted: u64,
    /// Payload chunks written into target memory.
    pub chunks_delivered: u64,
    /// Payload bytes written (or, in null mode, that would have been).
    pub bytes_delivered: u64,
    /// Lost transmissions (random or by rule).
    pub drops: u64,
    /// Retransmissions.
    pub retransmits: u64,
    /// Immediates reported at targets.
    pub imms_delivered: u64,
    /// SENDs placed into receive buffers.
    pub recvs_matched: u64,
    /// SENDs that had to wait for a receive buffer.
    pub rnr_waits: u64,
    /// SENDs that failed with `ReceiverNotReady`.
    pub rnr_timeouts: u64,
    /// WRITEs that finished landing after a WRITE posted later on the same
    /// (initiator NIC, target NIC) pair had finished landing.
    pub inversions_across: u64,
    /// Chunks that landed after a later chunk of the same WRITE.
    pub inversions_within: u64,
    /// Operations matched by a rule.
    pub rule_matches: u64,
    /// Operations that completed successfully.
    pub completed_ok: u64,
    /// Operations that completed with an error.
    pub completed_err: u64,
}
