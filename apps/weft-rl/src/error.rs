//! [`RlError`]: everything that can go wrong, with the rank, parameter and
//! phase it happened in.

use weft::EngineError;

/// Errors of planning and of a weight-update step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RlError {
    /// The model/layout description is inconsistent (a segment outside its
    /// parameter, shards that do not tile a tensor, ...).
    #[error("invalid layout: {0}")]
    Layout(String),
    /// A plan limit was hit (a unit larger than the watermark, too many
    /// immediates, ...).
    #[error("plan: {0}")]
    Plan(String),
    /// An engine call failed.
    #[error("{role} rank {rank}, {phase}: {source}")]
    Engine {
        /// `trainer` or `inference`.
        role: &'static str,
        /// The rank it happened on.
        rank: u32,
        /// What the rank was doing.
        phase: String,
        /// The engine's error.
        #[source]
        source: EngineError,
    },
    /// A wait of the step ran past its deadline (a peer died or stalled).
    #[error("{role} rank {rank}, {phase}: no completion within {waited_ms} ms")]
    Timeout {
        /// `trainer` or `inference`.
        role: &'static str,
        /// The rank it happened on.
        rank: u32,
        /// What the rank was waiting for.
        phase: String,
        /// How long it waited.
        waited_ms: u64,
    },
    /// A buffer could not be allocated.
    #[error("buffer: {0}")]
    Buffer(String),
    /// The scale simulation failed: the simulated fabric refused an
    /// operation of the plan (a transfer outside a registration, ...) or
    /// the simulated update stalled.
    #[error("simulation: {what}")]
    Sim {
        /// What failed.
        what: String,
        /// The fabric's error, if it reported one.
        #[source]
        source: Option<weft::TransportError>,
    },
    /// A configuration number out of its range (a zero bandwidth, no NICs,
    /// a negative or non-finite time, an alignment that is not a power of
    /// two, ...).
    #[error("{field} = {value}: {expected}")]
    Config {
        /// The field (or command-line option) at fault.
        field: &'static str,
        /// The value given.
        value: String,
        /// What it must be.
        expected: &'static str,
    },
    /// A model `config.json` or layout file the planner cannot take: a
    /// missing or out-of-range field, an unknown `model_type`, a layout
    /// feature it does not express.
    #[error("model config: {field}: {reason}")]
    ModelConfig {
        /// The field at fault (`config.json` or `layout` for the whole file).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A rank that is not part of the plan, or a directory without it.
    #[error("unknown {role} rank {rank}")]
    UnknownRank {
        /// `trainer` or `inference`.
        role: &'static str,
        /// The rank.
        rank: u32,
    },
}

impl RlError {
    /// `Err(Config)` unless `ok`.
    pub(crate) fn check(
        ok: bool,
        field: &'static str,
        value: impl std::fmt::Display,
        expected: &'static str,
    ) -> Result<(), RlError> {
        if ok {
            Ok(())
        } else {
            Err(RlError::Config {
                field,
                value: value.to_string(),
                expected,
            })
        }
    }
}
