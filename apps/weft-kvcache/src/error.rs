//! Errors of KvCache transfers: one variant per failure kind, each with the
//! request, peer or layer it concerns.

use std::time::Duration;
use weft::{EngineError, GroupAddress};

/// How a peer was found dead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerLoss {
    /// Nothing (no heartbeat, no message) heard for longer than the timeout.
    #[error("no message for {silent:?}")]
    HeartbeatTimeout {
        /// How long it had been silent.
        silent: Duration,
    },
    /// A SEND to it failed.
    #[error("a send to it failed: {error}")]
    SendFailed {
        /// The engine's error, rendered.
        error: String,
    },
    /// Its record left the rendezvous store: it left cleanly, or its lease
    /// ran out (the process died).
    #[error("it left the rendezvous store {store}")]
    Left {
        /// The store's endpoint.
        store: String,
    },
    /// The application removed it (it knows the peer is gone).
    #[error("the application removed it")]
    Removed,
}

/// Why a prefiller refused a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// Layers, page size or tail size differ between the two sides.
    #[error("layout mismatch: {what}")]
    LayoutMismatch {
        /// What differs.
        what: String,
    },
    /// A head index is out of range on one side.
    #[error("head {head} out of range ({heads} heads on the {side} side)")]
    HeadOutOfRange {
        /// The head index.
        head: u32,
        /// Heads on that side.
        heads: u32,
        /// `prefill` or `decode`.
        side: String,
    },
    /// A page index or tail slot is out of range, or page lists differ in length.
    #[error("pages: {what}")]
    BadPages {
        /// What is wrong.
        what: String,
    },
    /// The same request id is already being served for this decoder.
    #[error("duplicate request id")]
    Duplicate,
    /// The serving application rejected it.
    #[error("rejected by the prefill application: {reason}")]
    Rejected {
        /// The application's reason.
        reason: String,
    },
    /// The prefiller is shutting down.
    #[error("prefiller shutting down")]
    ShuttingDown,
    /// Two head maps of the request write the same decoder head.
    #[error("decoder head {head} is written twice")]
    DuplicateHead {
        /// The decoder head.
        head: u32,
    },
    /// The request id is at or below the oldest id the prefiller still
    /// remembers for this decoder (over a window of newer requests
    /// overtook it on the way): it is not served, as it could be a replay.
    #[error("request id {id} is older than the ids remembered (those above {floor})")]
    Stale {
        /// The request id.
        id: u64,
        /// Ids at or below it are not served.
        floor: u64,
    },
    /// The prefiller holds as many requests as it may
    /// ([`KvConfig::max_pending_requests`](crate::KvConfig)); retry later or
    /// elsewhere.
    #[error("prefiller busy: {max} requests pending")]
    Busy {
        /// The prefiller's bound.
        max: u64,
    },
}

use serde::{Deserialize, Serialize};

/// Errors of KvCache transfers.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// An engine call failed.
    #[error("engine ({phase}): {source}")]
    Engine {
        /// What was being done.
        phase: &'static str,
        /// The engine's error.
        source: EngineError,
    },
    /// A prefiller serving the request died; no write of it can land any more.
    #[error("request {request}: prefiller {peer:?} is dead: {loss}")]
    PrefillerDead {
        /// Request id.
        request: u64,
        /// The prefiller.
        peer: GroupAddress,
        /// How its death was detected.
        loss: PeerLoss,
    },
    /// The decoder a request was served for died; the prefiller dropped it.
    #[error("request {request}: decoder {peer:?} is dead: {loss}")]
    DecoderDead {
        /// Request id.
        request: u64,
        /// The decoder.
        peer: GroupAddress,
        /// How its death was detected.
        loss: PeerLoss,
    },
    /// A prefiller is already known dead; no new request goes to it.
    #[error("prefiller {peer:?} is dead: {loss}")]
    PeerDead {
        /// The prefiller.
        peer: GroupAddress,
        /// How its death was detected.
        loss: PeerLoss,
    },
    /// Not enough free pages.
    #[error("need {need} pages, {free} free")]
    NoPages {
        /// Requested.
        need: u32,
        /// Available.
        free: u32,
    },
    /// Pages asked for by index that cannot be taken: out of range,
    /// repeated, or held by another lease (a request that may still write
    /// them).
    #[error("page {page} cannot be taken: {why}")]
    PageTaken {
        /// The page.
        page: u32,
        /// Why.
        why: String,
    },
    /// Something held for a peer timed out unused (an offered prompt no
    /// decoder asked for).
    #[error("expired: {what}")]
    Expired {
        /// What expired.
        what: String,
    },
    /// No free tail slot.
    #[error("no free tail slot ({slots} in all)")]
    NoTailSlot {
        /// Tail slots of the cache.
        slots: u32,
    },
    /// The lease is unknown (already freed) or belongs to another decoder.
    #[error("unknown page lease {lease}")]
    UnknownLease {
        /// Lease id.
        lease: u64,
    },
    /// The lease already has a request in flight.
    #[error("page lease {lease} already has request {request} in flight")]
    LeaseBusy {
        /// Lease id.
        lease: u64,
        /// The request in flight.
        request: u64,
    },
    /// The request was cancelled, and every prefiller confirmed that no write
    /// of it can land any more.
    #[error("request {request} cancelled")]
    Cancelled {
        /// Request id.
        request: u64,
    },
    /// A prefiller refused the request.
    #[error("request {request} refused by {peer:?}: {refusal}")]
    Refused {
        /// Request id.
        request: u64,
        /// The prefiller.
        peer: GroupAddress,
        /// Why.
        refusal: Refusal,
    },
    /// A prefiller's write failed (it confirmed nothing more will land).
    #[error("request {request}: write of {step} failed at {peer:?}: {error}")]
    TransferFailed {
        /// Request id.
        request: u64,
        /// The prefiller.
        peer: GroupAddress,
        /// `layer N` or `tail`.
        step: String,
        /// The engine's error, rendered.
        error: String,
    },
    /// A route is malformed (no source, unknown prefiller, a destination
    /// head twice or missing, not exactly one tail source).
    #[error("invalid route: {what}")]
    InvalidRoute {
        /// What is wrong.
        what: String,
    },
    /// A layout or tensor-parallel shape is invalid or a size overflows.
    #[error("invalid layout: {what}")]
    Layout {
        /// What is wrong.
        what: String,
    },
    /// The pages or tail slot the prefill application gave for a request do
    /// not fit it (count, range).
    #[error("request {request}: source pages: {what}")]
    InvalidSourcePages {
        /// Request id.
        request: u64,
        /// What is wrong.
        what: String,
    },
    /// A layer index past the last step was reported ready.
    #[error("request {request}: step {step} out of range ({steps} steps)")]
    StepOutOfRange {
        /// Request id.
        request: u64,
        /// The step reported.
        step: u64,
        /// Steps of the request (layers, plus one for the tail).
        steps: u64,
    },
    /// The incoming request is unknown to the prefiller (finished, dropped or
    /// already accepted).
    #[error("request {request} of {peer:?} is not waiting to be accepted")]
    NotIncoming {
        /// Request id.
        request: u64,
        /// Its decoder.
        peer: GroupAddress,
    },
    /// A message could not be decoded.
    #[error("wire: {0}")]
    Wire(#[from] crate::wire::WireError),
    /// The decoder or prefiller was shut down.
    #[error("shut down")]
    ShutDown,
    /// A thread could not be started.
    #[error("spawning thread {name}: {error}")]
    Spawn {
        /// Thread name.
        name: &'static str,
        /// The OS error.
        error: String,
    },
    /// A rendezvous store operation failed (publishing, watching).
    #[error("rendezvous store {store}: {what}: {error}")]
    Rendezvous {
        /// What was being done.
        what: &'static str,
        /// The store's endpoint.
        store: String,
        /// The store's error, rendered.
        error: String,
    },
}

impl KvError {
    /// The variant's name, stable for logs, metrics and CLIs.
    pub fn kind(&self) -> &'static str {
        match self {
            KvError::Engine { .. } => "Engine",
            KvError::PrefillerDead { .. } => "PrefillerDead",
            KvError::DecoderDead { .. } => "DecoderDead",
            KvError::PeerDead { .. } => "PeerDead",
            KvError::NoPages { .. } => "NoPages",
            KvError::NoTailSlot { .. } => "NoTailSlot",
            KvError::PageTaken { .. } => "PageTaken",
            KvError::Expired { .. } => "Expired",
            KvError::UnknownLease { .. } => "UnknownLease",
            KvError::LeaseBusy { .. } => "LeaseBusy",
            KvError::Cancelled { .. } => "Cancelled",
            KvError::Refused { .. } => "Refused",
            KvError::TransferFailed { .. } => "TransferFailed",
            KvError::InvalidRoute { .. } => "InvalidRoute",
            KvError::Layout { .. } => "Layout",
            KvError::InvalidSourcePages { .. } => "InvalidSourcePages",
            KvError::StepOutOfRange { .. } => "StepOutOfRange",
            KvError::NotIncoming { .. } => "NotIncoming",
            KvError::Wire(_) => "Wire",
            KvError::ShutDown => "ShutDown",
            KvError::Spawn { .. } => "Spawn",
            KvError::Rendezvous { .. } => "Rendezvous",
        }
    }

    /// Wraps an engine error with the phase it happened in.
    pub(crate) fn engine(phase: &'static str) -> impl FnOnce(EngineError) -> KvError {
        move |source| KvError::Engine { phase, source }
    }
}
