//! Typed errors: [`ConfigError`] for shapes rejected up front, [`MoeError`]
//! for everything a step can report.

/// A configuration that cannot work, rejected by
/// [`MoeConfig::validate`](crate::MoeConfig::validate) before any memory is
/// allocated or registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A dimension that must be positive is zero.
    #[error("MoE config: `{0}` must be > 0")]
    Zero(&'static str),
    /// The experts cannot be split evenly over the ranks.
    #[error("MoE config: {experts} experts do not split evenly over {ranks} ranks")]
    ExpertsNotDivisible {
        /// Experts (E).
        experts: u32,
        /// Ranks (N).
        ranks: u32,
    },
    /// More private slots per (source, destination) than one source can ever
    /// send one destination (`max_tokens · topk`).
    #[error("MoE config: private_tokens {p} exceeds max_tokens·topk = {max}")]
    PrivateTooLarge {
        /// The configured `private_tokens`.
        p: u32,
        /// The largest useful value, `max_tokens · topk`.
        max: u64,
    },
    /// A buffer (or a slot count) is larger than allowed; `bytes` is
    /// `u64::MAX` when the size does not even fit in a `u64`.
    #[error("MoE config: the {what} needs {bytes} bytes, above the limit of {max}")]
    BufferTooLarge {
        /// Which buffer.
        what: &'static str,
        /// Its size in bytes.
        bytes: u64,
        /// The limit (`max_buffer_bytes`, or the addressable maximum).
        max: u64,
    },
    /// fp8 dispatch needs `hidden % 128 == 0` and `token_bytes ==
    /// hidden + hidden / 32` (the e4m3 bytes and one f32 scale per 128).
    #[error("MoE config: fp8 dispatch of hidden {hidden} needs hidden % 128 == 0 and token_bytes = hidden + hidden/32, not {token_bytes}")]
    Fp8Shape {
        /// `hidden`.
        hidden: u32,
        /// `token_bytes`.
        token_bytes: u32,
    },
    /// A `masked` list that cannot describe the group.
    #[error("MoE config: masked rank {rank}: {why}")]
    BadMask {
        /// The rank in question.
        rank: u32,
        /// What is wrong.
        why: &'static str,
    },
    /// Slot indices would not fit in a `u32`.
    #[error("MoE config: {slots} receive slots do not fit in 32-bit slot indices")]
    TooManySlots {
        /// Slots needed (private plus contiguous region).
        slots: u64,
    },
    /// The engine's immediate space is too small for this `instance`.
    #[error("MoE config: instance needs the top {need} immediates, the engine has {capacity}")]
    ImmSpace {
        /// Immediates needed from the top of the range (`5 · (instance + 1)`).
        need: u64,
        /// The engine's `imm_capacity`.
        capacity: u32,
    },
}

/// The phase of a step an error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Phase {
    /// Registration, immediate reservation, connecting peers.
    Setup,
    /// The route (counts) scatter.
    Route,
    /// Private and overflow token data.
    Dispatch,
    /// The barrier after unpacking the dispatch.
    BarrierD,
    /// The combine scatter.
    Combine,
    /// The barrier after the weighted sum.
    BarrierC,
}

/// Errors of dispatch/combine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MoeError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An input slice has the wrong length.
    #[error("MoE input `{what}`: length {got}, expected {want}")]
    Shape {
        /// Which input.
        what: &'static str,
        /// Its length (or, for an index, the index found).
        got: u64,
        /// The length expected (or the index, or the bound, expected).
        want: u64,
    },
    /// More tokens than `max_tokens`.
    #[error("MoE input: {got} tokens, at most {max}")]
    TooManyTokens {
        /// Tokens given.
        got: u64,
        /// `max_tokens`.
        max: u32,
    },
    /// A top-k entry names an expert that does not exist.
    #[error("MoE input: topk_ids[{t}·R+{k}] = {id} is not an expert id")]
    ExpertOutOfRange {
        /// Token.
        t: u32,
        /// Position in the token's top-k.
        k: u32,
        /// The id given.
        id: u32,
    },
    /// A peer's route row is impossible (it claims more pairs than a source
    /// can send, or has the wrong length). Routes come from the network, so
    /// this is reported, never trusted.
    #[error("MoE routes from rank {rank}: {what}")]
    BadRoutes {
        /// The source rank of the row.
        rank: u32,
        /// What is wrong with it.
        what: String,
    },
    /// A received row names an origin no honest source can write: its pair
    /// index (`t · topk + k`, carried in the row's slot) is at or beyond
    /// `max_tokens · topk`.
    #[error("MoE dispatch: row {row} from rank {rank} claims pair {pair}, beyond the {max} a rank sends")]
    BadOrigin {
        /// The source rank of the row.
        rank: u32,
        /// The row in the expert layout.
        row: u32,
        /// The pair index it carried.
        pair: u32,
        /// `max_tokens · topk`.
        max: u64,
    },
    /// The receive side would need more contiguous slots than the buffer
    /// has (only reachable with peer rows that passed no validation).
    #[error("MoE routes: rank {rank} would receive {need} overflow slots, the buffer has {cap}")]
    RecvOverflow {
        /// The receiving rank.
        rank: u32,
        /// Overflow slots needed.
        need: u64,
        /// Contiguous slots available (C).
        cap: u64,
    },
    /// The rank itself is masked in its config: it takes no part.
    #[error("MoE: rank {rank} is masked")]
    Masked {
        /// The rank.
        rank: u32,
    },
    /// A rank id outside `0..ranks`.
    #[error("MoE: rank {rank} is not in 0..{ranks}")]
    NoSuchRank {
        /// The rank given.
        rank: u32,
        /// Ranks of the group.
        ranks: u32,
    },
    /// An engine call or transfer failed; the rank is poisoned.
    #[error("MoE {phase:?}: engine error: {source}")]
    Engine {
        /// Where it happened.
        phase: Phase,
        /// The engine's error.
        #[source]
        source: weft::EngineError,
    },
    /// A round did not complete within `step_timeout`; the rank is poisoned.
    /// `pending` arrivals of `imm` were counted out of `expected`.
    #[error("MoE {phase:?}: round of immediate {imm} timed out ({pending} of {expected} arrived)")]
    Timeout {
        /// The phase waiting.
        phase: Phase,
        /// The immediate value of the round.
        imm: u32,
        /// Immediates the round expects.
        expected: u64,
        /// Arrivals counted and not consumed.
        pending: u64,
    },
    /// This rank's own transfers did not all finish within `step_timeout`
    /// (their source buffers cannot be reused); the rank is poisoned.
    #[error("MoE {phase:?}: {done} of {submitted} own transfers finished in time")]
    SubmitTimeout {
        /// The phase waiting.
        phase: Phase,
        /// Transfers submitted so far.
        submitted: u64,
        /// Transfers finished.
        done: u64,
    },
    /// A buffer could not be allocated.
    #[error("MoE setup: allocating {bytes} bytes failed: {reason}")]
    Alloc {
        /// Bytes requested.
        bytes: u64,
        /// The allocator's error.
        reason: String,
    },
    /// An earlier error left peers in an unknown state; the rank cannot be
    /// used again.
    #[error("MoE rank is poisoned by an earlier error")]
    Poisoned,
    /// `dispatch` or `combine` before `connect`.
    #[error("MoE rank is not connected")]
    NotConnected,
    /// Publishing or reading a rank's [`RankInfo`](crate::RankInfo) in a
    /// rendezvous store failed (the store unreachable, the rank not there
    /// in time, an undecodable record).
    #[error("MoE rendezvous {store}, rank {rank}: {what}")]
    Rendezvous {
        /// The store's endpoint.
        store: String,
        /// The rank concerned.
        rank: u32,
        /// What failed.
        what: String,
    },
    /// A peer's [`RankInfo`](crate::RankInfo) does not fit this rank.
    #[error("MoE peer info of rank {rank}: {what}")]
    PeerInfo {
        /// The peer's rank.
        rank: u32,
        /// What is wrong.
        what: String,
    },
    /// `combine` with a layout of another step, rank or `MoeRank`.
    #[error("MoE combine: layout of step {layout_step}, this rank is at step {step}")]
    StaleLayout {
        /// The step of the layout.
        layout_step: u64,
        /// The rank's current step.
        step: u64,
    },
    /// `dispatch` twice without `combine`, or `combine` without `dispatch`.
    #[error("MoE: call out of order, expected {expected}")]
    OutOfOrder {
        /// The call expected next.
        expected: &'static str,
    },
}
