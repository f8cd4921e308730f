//! Errors of KvCache transfers.

use weft_engine::{EngineError, GroupAddress};

/// Errors of KvCache transfers.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// Engine failure.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// The peer stopped answering (heartbeat timeout or failed SEND).
    #[error("peer {peer:?} is dead: {why}")]
    PeerDead {
        /// The peer.
        peer: GroupAddress,
        /// How it was detected.
        why: String,
    },
    /// Not enough free pages or tail slots.
    #[error("need {need} pages, {free} free")]
    NoPages {
        /// Requested.
        need: u32,
        /// Available.
        free: u32,
    },
    /// The request was cancelled (and the prefiller confirmed it).
    #[error("request {0} cancelled")]
    Cancelled(u64),
    /// The prefiller reported a failure.
    #[error("request {id} failed at the prefiller: {reason}")]
    Remote {
        /// Request id.
        id: u64,
        /// Its reason.
        reason: String,
    },
    /// Received bytes differ from the expected content.
    #[error("request {id}: {what}")]
    Corrupt {
        /// Request id.
        id: u64,
        /// First mismatch.
        what: String,
    },
    /// A size computation overflowed or did not fit.
    #[error("invalid size: {0}")]
    Size(String),
    /// A message could not be encoded or decoded.
    #[error("codec: {0}")]
    Codec(String),
}
