//! Typed errors for everything a backend, a peer or the network can cause.

use crate::types::{NetAddr, WrId};
use std::fmt;
use thiserror::Error;

/// Why a remote access was rejected by the target NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RemoteAccessReason {
    /// The rkey is not registered on the target NIC (or belongs to another NIC).
    UnknownKey,
    /// The registration does not allow remote writes.
    NotWritable,
    /// `[offset, offset+len)` is outside the registration.
    OutOfBounds,
    /// The target NIC rejected the access without saying which check failed
    /// (verbs `IBV_WC_REM_ACCESS_ERR` covers all of the above).
    Unspecified,
}

impl fmt::Display for RemoteAccessReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RemoteAccessReason::UnknownKey => "unknown rkey",
            RemoteAccessReason::NotWritable => "region not remotely writable",
            RemoteAccessReason::OutOfBounds => "access out of bounds",
            RemoteAccessReason::Unspecified => "reason not reported by the NIC",
        })
    }
}

/// An error from a backend. Every variant names the NIC it happened on, and
/// the peer or transfer where there is one.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer cannot be reached: dead host, dead NIC, unknown address, or a
    /// connection that never came up.
    #[error("{nic}: peer {peer} unreachable: {reason}")]
    PeerUnreachable {
        /// Local NIC.
        nic: String,
        /// The peer.
        peer: NetAddr,
        /// What happened.
        reason: String,
    },
    /// The peer was removed with [`crate::Domain::remove_peer`] (or, in the
    /// engine, `TransferEngine::remove_peer`): work addressed to it that had
    /// not completed, and every later post naming its old handle, fails
    /// with this.
    #[error("{nic}: peer {peer} was removed")]
    PeerRemoved {
        /// Local NIC.
        nic: String,
        /// The removed peer.
        peer: NetAddr,
    },
    /// The target NIC rejected a remote access; nothing was written.
    #[error("{nic}: remote write to {peer} rejected ({reason}): rkey {rkey:#x}, addr {addr:#x}, len {len}")]
    RemoteAccess {
        /// Local NIC.
        nic: String,
        /// The target peer.
        peer: NetAddr,
        /// The rkey that was presented.
        rkey: u64,
        /// Target address (or offset, for offset-addressed backends).
        addr: u64,
        /// Length of the access.
        len: u64,
        /// Why it was rejected.
        reason: RemoteAccessReason,
    },
    /// A local key or address was invalid (unknown, deregistered, out of the
    /// registration, or memory of the wrong kind).
    #[error("{nic}: local memory error: {what}")]
    LocalAccess {
        /// Local NIC.
        nic: String,
        /// What was wrong.
        what: String,
    },
    /// A SEND found no posted receive buffer at the peer within the timeout.
    #[error("{nic}: receiver {peer} not ready (no receive buffer posted)")]
    ReceiverNotReady {
        /// Local NIC.
        nic: String,
        /// The peer.
        peer: NetAddr,
    },
    /// A SEND was larger than the receive buffer that took it.
    #[error("{nic}: message of {len} bytes to {peer} exceeds receive buffer of {capacity} bytes")]
    MessageTooLong {
        /// Local NIC.
        nic: String,
        /// The peer.
        peer: NetAddr,
        /// Message length.
        len: u64,
        /// Receive buffer size.
        capacity: u64,
    },
    /// The send queue is full; poll and retry. Never a lost operation.
    #[error("{nic}: send queue full")]
    QueueFull {
        /// Local NIC.
        nic: String,
    },
    /// A caller error: bad argument, unknown peer handle, oversize message.
    #[error("{nic}: invalid argument: {what}")]
    InvalidArgument {
        /// Local NIC.
        nic: String,
        /// What was wrong.
        what: String,
    },
    /// The backend or NIC does not support this.
    #[error("{nic}: unsupported: {what}")]
    Unsupported {
        /// Local NIC.
        nic: String,
        /// What is not supported.
        what: String,
    },
    /// The native library of the backend could not be loaded or lacks a symbol.
    #[error("backend library {library} unavailable: {reason}")]
    LibraryUnavailable {
        /// The library, e.g. `libfabric.so.1`.
        library: String,
        /// Loader message.
        reason: String,
    },
    /// No matching device was found.
    #[error("no {what} device found")]
    NoDevice {
        /// What was searched for.
        what: String,
    },
    /// A native call returned an error code.
    #[error("{nic}: {op} failed: {message} (code {code})")]
    Provider {
        /// Local NIC.
        nic: String,
        /// The native call, e.g. `fi_writedata`.
        op: &'static str,
        /// Native code (negative errno, provider errno, ibv_wc_status, ...).
        code: i64,
        /// Human-readable text (fi_strerror, ibv_wc_status_str, ...).
        message: String,
    },
    /// A fault injected by a test rule (loopback) or a transport-level error
    /// completion without a more specific kind.
    #[error("{nic}: operation {wr:?} failed: {what}")]
    Failed {
        /// Local NIC.
        nic: String,
        /// The failed work request, where known.
        wr: Option<WrId>,
        /// What happened.
        what: String,
    },
    /// The local NIC is dead; the domain can no longer be used.
    #[error("{nic}: NIC is down")]
    NicDown {
        /// Local NIC.
        nic: String,
    },
    /// The operation was canceled because the domain was closed.
    #[error("{nic}: operation canceled: domain closed")]
    Canceled {
        /// Local NIC.
        nic: String,
    },
}

impl TransportError {
    /// A short, stable, snake_case name of the variant (`"peer_unreachable"`,
    /// `"remote_access"`, ...): the label metrics count failures by.
    pub fn kind(&self) -> &'static str {
        match self {
            TransportError::PeerUnreachable { .. } => "peer_unreachable",
            TransportError::PeerRemoved { .. } => "peer_removed",
            TransportError::RemoteAccess { .. } => "remote_access",
            TransportError::LocalAccess { .. } => "local_access",
            TransportError::ReceiverNotReady { .. } => "receiver_not_ready",
            TransportError::MessageTooLong { .. } => "message_too_long",
            TransportError::QueueFull { .. } => "queue_full",
            TransportError::InvalidArgument { .. } => "invalid_argument",
            TransportError::Unsupported { .. } => "unsupported",
            TransportError::LibraryUnavailable { .. } => "library_unavailable",
            TransportError::NoDevice { .. } => "no_device",
            TransportError::Provider { .. } => "provider",
            TransportError::Failed { .. } => "failed",
            TransportError::NicDown { .. } => "nic_down",
            TransportError::Canceled { .. } => "canceled",
        }
    }

    /// The NIC the error happened on, where the variant names one.
    pub fn nic(&self) -> Option<&str> {
        match self {
            TransportError::PeerUnreachable { nic, .. }
            | TransportError::PeerRemoved { nic, .. }
            | TransportError::RemoteAccess { nic, .. }
            | TransportError::LocalAccess { nic, .. }
            | TransportError::ReceiverNotReady { nic, .. }
            | TransportError::MessageTooLong { nic, .. }
            | TransportError::QueueFull { nic }
            | TransportError::InvalidArgument { nic, .. }
            | TransportError::Unsupported { nic, .. }
            | TransportError::Provider { nic, .. }
            | TransportError::Failed { nic, .. }
            | TransportError::NicDown { nic }
            | TransportError::Canceled { nic } => Some(nic),
            TransportError::LibraryUnavailable { .. } | TransportError::NoDevice { .. } => None,
        }
    }

    /// Whether retrying later may succeed (queue full).
    pub fn is_retryable(&self) -> bool {
        matches!(self, TransportError::QueueFull { .. })
    }
}

/// A batch post that stopped at a rejected work request.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("batch post stopped after {posted} WRs: {error}")]
pub struct PostError {
    /// How many WRs from the front of the batch were accepted.
    pub posted: usize,
    /// Why the WR at index `posted` was rejected.
    pub error: TransportError,
}

/// Decoding a wire message failed. Never a panic, whatever the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    /// The bytes are not a valid encoding of the expected type.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// The type being decoded.
        what: &'static str,
        /// Decoder message.
        reason: String,
    },
    /// The value could not be encoded.
    #[error("cannot encode {what}: {reason}")]
    Encode {
        /// The type being encoded.
        what: &'static str,
        /// Encoder message.
        reason: String,
    },
}
