//! Engine errors.

use thiserror::Error;
use weft_transport::{Incarnation, NetAddr, TransportError};

/// Identifies one submitted transfer (unique per engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Everything the engine can report. Transport failures carry the group,
/// NIC, peer and transfer they belong to.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A work request of a transfer failed in the transport.
    #[error("transfer {transfer}: group {group} NIC {nic} to peer {peer:?}: {source}")]
    Transport {
        /// The transfer the failed WR belonged to.
        transfer: TransferId,
        /// Domain group index.
        group: usize,
        /// NIC index inside the group.
        nic: usize,
        /// Remote NIC address, when the WR had one.
        peer: Option<NetAddr>,
        /// What the backend said.
        #[source]
        source: Box<TransportError>,
    },
    /// A NIC of a group is dead (its domain returned an error from `poll` or
    /// a fatal post error); work on it fails with this.
    #[error("group {group} NIC {nic} is down: {source}")]
    NicDown {
        /// Domain group index.
        group: usize,
        /// NIC index inside the group.
        nic: usize,
        /// The error that took it down.
        #[source]
        source: Box<TransportError>,
    },
    /// The request queue of a group is full and the engine is configured to
    /// fail rather than wait ([`crate::QueueFullPolicy::Fail`]). The
    /// `on_done` of the rejected submit is never called.
    #[error("request queue of group {group} is full")]
    QueueFull {
        /// Domain group index.
        group: usize,
    },
    /// The engine is shut down (or shutting down).
    #[error("engine is shut down")]
    ShutDown,
    /// A caller error: bad length, wrong group, mismatched page counts...
    #[error("invalid argument: {what}")]
    InvalidArgument {
        /// What is wrong.
        what: String,
    },
    /// A span does not fit its memory region.
    #[error("{what}: [{offset}, +{len}) outside region of {region_len} bytes")]
    OutOfBounds {
        /// Which side (source, destination, page i...).
        what: String,
        /// Offset of the span.
        offset: u64,
        /// Length of the span.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The memory handle is unknown (never registered or deregistered).
    #[error("unknown memory region {0}")]
    UnknownMr(u64),
    /// The memory handle refers to a registration that was deregistered;
    /// its slot now holds a newer registration (generation mismatch).
    #[error("stale memory handle {id} (generation {gen}, slot now at generation {current})")]
    StaleMr {
        /// The handle's slot id.
        id: u64,
        /// The handle's generation.
        gen: u32,
        /// The slot's current generation.
        current: u32,
    },
    /// Every receive pool id has been used (ids are never reused, so a live
    /// pool is never replaced).
    #[error("receive pool ids exhausted ({limit} pools)")]
    RecvPoolsExhausted {
        /// How many pools an engine can create.
        limit: u32,
    },
    /// The destination descriptor has a different NIC count than the
    /// sending group: the receiver's immediate counts assume equal counts.
    #[error("group {group} has {local} NICs but the destination has {remote} rkeys")]
    NicCountMismatch {
        /// Sending domain group index.
        group: usize,
        /// NICs of the sending group.
        local: usize,
        /// rkeys in the destination descriptor.
        remote: usize,
    },
    /// A peer group was used after one of its members was removed with
    /// [`TransferEngine::remove_peer`](crate::TransferEngine::remove_peer):
    /// the group is invalid for good (make a new one with the member's new
    /// address).
    #[error("group {group}: peer group {peer_group} member {member} ({peer}) was removed")]
    PeerRemoved {
        /// Domain group index.
        group: usize,
        /// The peer group.
        peer_group: u32,
        /// The removed member's index in the group.
        member: usize,
        /// The removed address.
        peer: NetAddr,
    },
    /// A round armed with
    /// [`expect_imm_count_from`](crate::TransferEngine::expect_imm_count_from)
    /// waited on a peer that was removed: its immediates will not come.
    #[error("immediate {imm}: the round waited on peer {peer} (incarnation {incarnation}), which was removed")]
    PeerGone {
        /// The round's immediate value.
        imm: u32,
        /// The removed peer's first NIC address.
        peer: NetAddr,
        /// The removed peer's incarnation.
        incarnation: weft_transport::Incarnation,
    },
    /// A descriptor, group address or SEND destination names incarnation
    /// `named` of the peer at NIC address `peer`, newer than the
    /// incarnation `live` this engine knows there, and nothing has shown
    /// that `live` ended: it was not removed
    /// ([`TransferEngine::remove_peer`](crate::TransferEngine::remove_peer))
    /// and the transport has not reported it unreachable. Incarnation
    /// numbers in descriptors come from outside the transport (a file, a
    /// store, a socket) and are not believed on their own: this
    /// transfer (or peer group) is refused, nothing is sent, and `live`
    /// keeps working. Once `live` is removed or reported unreachable, the
    /// same descriptor is accepted and replaces it (docs/engine.md, "Peer
    /// lifecycle").
    ///
    /// (No group index: the rule is engine-wide, the same on every group.)
    #[error("{t}NIC {nic}: peer {peer} is incarnation {live}; incarnation {named} is not proven (the live one was neither removed nor reported unreachable)",
        t = .transfer.map(|t| format!("transfer {t}: ")).unwrap_or_default())]
    IncarnationUnproven {
        /// The refused transfer (`None` for a peer group).
        transfer: Option<TransferId>,
        /// NIC index inside the group (the peer's NIC of that index).
        nic: usize,
        /// The remote NIC address.
        peer: NetAddr,
        /// The incarnation the descriptor or address names.
        named: Incarnation,
        /// The incarnation live at `peer`.
        live: Incarnation,
    },
    /// The group's worker panicked; its in-flight work failed with this and
    /// later submits to the group fail with it too.
    #[error("group {group}: worker failed: {what}")]
    WorkerFailed {
        /// Domain group index.
        group: usize,
        /// The panic message.
        what: String,
    },
    /// The immediate already has an armed round that has not fired.
    #[error("immediate {imm} is already armed")]
    ImmAlreadyArmed {
        /// The immediate.
        imm: u32,
    },
    /// `reserve_imm` of a value that is allocated or reserved.
    #[error("immediate {imm} is already in use on this engine")]
    ImmInUse {
        /// The immediate.
        imm: u32,
    },
    /// An `expect_imm_count` count over what one round can hold.
    #[error("immediate {imm}: a round of {count} arrivals exceeds the limit of {max}")]
    ImmCountTooLarge {
        /// The immediate.
        imm: u32,
        /// The count asked for.
        count: u64,
        /// The largest count a round holds.
        max: u32,
    },
    /// `alloc_imm` found no free value.
    #[error("no free immediate values (capacity {capacity})")]
    ImmExhausted {
        /// Size of the allocator.
        capacity: u32,
    },
    /// Building the engine or opening a domain failed.
    #[error("group {group}: setup failed: {what}")]
    Setup {
        /// Domain group index.
        group: usize,
        /// What failed.
        what: String,
        /// The backend error, if any.
        #[source]
        source: Option<Box<TransportError>>,
    },
    /// A transport call on behalf of a control operation (register, add
    /// peer) failed.
    #[error("group {group} NIC {nic}: {op} failed: {source}")]
    Control {
        /// Domain group index.
        group: usize,
        /// NIC index inside the group.
        nic: usize,
        /// The operation.
        op: &'static str,
        /// What the backend said.
        #[source]
        source: Box<TransportError>,
    },
    /// Direct device-memory access was required
    /// ([`crate::TransferEngine::reg_mr_direct`]) but a NIC of the group
    /// would stage the memory or cannot register it at all.
    #[error("group {group} NIC {nic} ({name}): {device} memory is not reachable directly: GPU memory path is {path}")]
    NotDirect {
        /// Domain group index.
        group: usize,
        /// NIC index inside the group.
        nic: usize,
        /// The NIC's name.
        name: String,
        /// The device of the region.
        device: weft_transport::Device,
        /// The NIC's device-memory path.
        path: weft_transport::DeviceMemoryPath,
    },
}

// Every `Result` of a submit carries an `EngineError`, and the apps' error
// types embed it: it stays at 72 bytes (64-bit), the size of its largest
// variants.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<EngineError>() <= 72);

/// The bounds check of a span `[offset, offset + len)` in a region of
/// `region_len` bytes: [`EngineError::OutOfBounds`] (naming the span
/// `what`, formatted only on failure) when it overflows or does not fit.
pub(crate) fn check_range(
    what: impl std::fmt::Display,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<(), EngineError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(EngineError::OutOfBounds {
            what: what.to_string(),
            offset,
            len,
            region_len,
        }),
    }
}

impl EngineError {
    /// A short, stable, snake_case name of the failure: the transport
    /// error's [`TransportError::kind`] where one caused it (a failed WR,
    /// a dead NIC, a refused control operation), else the variant's name
    /// (`"queue_full"`, `"out_of_bounds"`, `"peer_gone"`, ...). Metrics
    /// count failures by it.
    pub fn kind(&self) -> &'static str {
        if let Some(t) = self.transport() {
            return t.kind();
        }
        match self {
            EngineError::Transport { .. } | EngineError::Control { .. } => "transport",
            EngineError::NicDown { .. } => "nic_down",
            EngineError::QueueFull { .. } => "queue_full",
            EngineError::ShutDown => "shut_down",
            EngineError::InvalidArgument { .. } => "invalid_argument",
            EngineError::OutOfBounds { .. } => "out_of_bounds",
            EngineError::UnknownMr(_) => "unknown_mr",
            EngineError::StaleMr { .. } => "stale_mr",
            EngineError::RecvPoolsExhausted { .. } => "recv_pools_exhausted",
            EngineError::NicCountMismatch { .. } => "nic_count_mismatch",
            EngineError::PeerRemoved { .. } => "peer_removed",
            EngineError::PeerGone { .. } => "peer_gone",
            EngineError::IncarnationUnproven { .. } => "incarnation_unproven",
            EngineError::WorkerFailed { .. } => "worker_failed",
            EngineError::ImmAlreadyArmed { .. } => "imm_already_armed",
            EngineError::ImmInUse { .. } => "imm_in_use",
            EngineError::ImmCountTooLarge { .. } => "imm_count_too_large",
            EngineError::ImmExhausted { .. } => "imm_exhausted",
            EngineError::Setup { .. } => "setup",
            EngineError::NotDirect { .. } => "not_direct",
        }
    }

    /// The underlying transport error, if there is one.
    pub fn transport(&self) -> Option<&TransportError> {
        match self {
            EngineError::Transport { source, .. }
            | EngineError::NicDown { source, .. }
            | EngineError::Control { source, .. } => Some(source),
            EngineError::Setup { source, .. } => source.as_deref(),
            _ => None,
        }
    }

    /// Whether the error comes from a removed peer: a transfer to it that
    /// was pending when it was removed or submitted afterwards (a transport
    /// error [`TransportError::PeerRemoved`]), or a peer group it was a
    /// member of ([`EngineError::PeerRemoved`]).
    pub fn is_peer_removed(&self) -> bool {
        matches!(self, EngineError::PeerRemoved { .. })
            || matches!(self.transport(), Some(TransportError::PeerRemoved { .. }))
    }

    /// Whether a descriptor or address was refused because it names an
    /// incarnation newer than the live one at its address without proof
    /// ([`EngineError::IncarnationUnproven`]).
    pub fn is_unproven_incarnation(&self) -> bool {
        matches!(self, EngineError::IncarnationUnproven { .. })
    }
}
