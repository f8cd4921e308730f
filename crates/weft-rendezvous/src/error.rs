//! The store's error type.

use thiserror::Error;

/// Why a store operation failed. Every variant names the backend's endpoint
/// (`mem`, a directory path, an etcd URL) and, where one is involved, the key
/// or lease.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached (etcd down, connection refused or
    /// reset, a timeout). Retrying later may succeed.
    #[error("store {endpoint} unavailable during {op}: {reason}")]
    Unavailable {
        /// The store.
        endpoint: String,
        /// What was being done (`put weft/x`, `lease grant`, ...).
        op: String,
        /// The underlying failure.
        reason: String,
    },
    /// The lease does not exist (expired, revoked, or the store lost it).
    #[error("store {endpoint}: lease {lease:#x} not found (expired or revoked)")]
    LeaseNotFound {
        /// The store.
        endpoint: String,
        /// The lease.
        lease: u64,
    },
    /// The store answered, but with something this client does not accept
    /// (an HTTP error status, malformed JSON, a missing field).
    #[error("store {endpoint}: bad response to {op}: {reason}")]
    Protocol {
        /// The store.
        endpoint: String,
        /// The request.
        op: String,
        /// What was wrong.
        reason: String,
    },
    /// A local file-system operation of the directory store failed.
    #[error("store {endpoint}: {op} {path}: {source}")]
    Io {
        /// The store.
        endpoint: String,
        /// The operation.
        op: &'static str,
        /// The file involved.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A key the store cannot hold (empty, or with bytes the backend rejects).
    #[error("store {endpoint}: invalid key {key:?}: {reason}")]
    InvalidKey {
        /// The store.
        endpoint: String,
        /// The key.
        key: String,
        /// Why.
        reason: &'static str,
    },
    /// A stored record could not be decoded (a corrupt value, or a record
    /// written by an incompatible weft version).
    #[error("record {key}: {reason}")]
    Record {
        /// The record's key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A rendezvous spec string (`dir:/path`, `etcd:http://...`) is not valid.
    #[error("invalid rendezvous spec {spec:?}: {reason}")]
    Spec {
        /// The rejected spec.
        spec: String,
        /// Why.
        reason: String,
    },
    /// A wait for a key or an event ended without it.
    #[error("store {endpoint}: timed out after {waited_ms} ms waiting for {what}")]
    Timeout {
        /// The store.
        endpoint: String,
        /// What was awaited.
        what: String,
        /// How long the wait was.
        waited_ms: u64,
    },
    /// The watch's background thread ended (the store was dropped).
    #[error("store {endpoint}: watch on {prefix:?} closed")]
    WatchClosed {
        /// The store.
        endpoint: String,
        /// The watched prefix.
        prefix: String,
    },
}

impl StoreError {
    /// Whether retrying the operation later may succeed (the store was
    /// unreachable, not wrong).
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }
}
