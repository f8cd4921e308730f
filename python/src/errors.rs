//! Rust errors → the Python exception hierarchy of `weft/_errors.py`.
//!
//! The classes live in pure Python (multiple inheritance with `ValueError`,
//! `TimeoutError`, ...); they are looked up by name when an error is raised,
//! which is never on a hot path.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use weft::{EngineError, ProviderError, TransportError};

/// An instance of `weft._errors.<class>` with `message` and `kind` (a
/// short snake_case string: every weft error carries one).
pub(crate) fn new_err(py: Python<'_>, class: &str, kind: &str, message: String) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let cls = py.import("weft._errors")?.getattr(class)?;
        let exc = cls.call1((message.clone(),))?;
        exc.setattr("kind", kind)?;
        Ok(PyErr::from_value(exc))
    })();
    // The errors module is part of the package; if it cannot be imported the
    // install is broken: still raise something carrying the message.
    made.unwrap_or_else(|e| PyRuntimeError::new_err(format!("{message} (and weft._errors: {e})")))
}

/// The class and kind for a transport error.
fn transport_class(e: &TransportError) -> (&'static str, &'static str) {
    match e {
        TransportError::PeerUnreachable { .. } => ("PeerUnreachableError", "peer_unreachable"),
        TransportError::RemoteAccess { .. } => ("RemoteAccessError", "remote_access"),
        TransportError::LocalAccess { .. } => ("LocalAccessError", "local_access"),
        TransportError::ReceiverNotReady { .. } => ("ReceiverNotReadyError", "receiver_not_ready"),
        TransportError::MessageTooLong { .. } => ("MessageTooLongError", "message_too_long"),
        TransportError::InvalidArgument { .. } => ("InvalidArgumentError", "invalid_argument"),
        TransportError::Unsupported { .. } => ("UnsupportedError", "unsupported"),
        TransportError::NicDown { .. } => ("NicDownError", "nic_down"),
        TransportError::Canceled { .. } => ("CanceledError", "canceled"),
        TransportError::PeerRemoved { .. } => ("PeerRemovedError", "peer_removed"),
        TransportError::LibraryUnavailable { .. } => {
            ("ProviderUnavailableError", "library_unavailable")
        }
        TransportError::NoDevice { .. } => ("ProviderUnavailableError", "no_device"),
        _ => ("TransportError", "transport"),
    }
}

/// The Python exception for an engine error.
pub(crate) fn engine_err(py: Python<'_>, e: &EngineError) -> PyErr {
    let (class, kind) = match e {
        EngineError::Transport { source, .. }
        | EngineError::Control { source, .. }
        | EngineError::NicDown { source, .. } => transport_class(source),
        EngineError::Setup {
            source: Some(s), ..
        } => transport_class(s),
        EngineError::Setup { source: None, .. } => ("SetupError", "setup"),
        EngineError::QueueFull { .. } => ("QueueFullError", "queue_full"),
        EngineError::ShutDown => ("ShutDownError", "shut_down"),
        EngineError::InvalidArgument { .. } => ("InvalidArgumentError", "invalid_argument"),
        EngineError::OutOfBounds { .. } => ("OutOfBoundsError", "out_of_bounds"),
        EngineError::UnknownMr(_) => ("StaleRegistrationError", "unknown_mr"),
        EngineError::StaleMr { .. } => ("StaleRegistrationError", "stale_mr"),
        EngineError::RecvPoolsExhausted { .. } => ("ExhaustedError", "recv_pools_exhausted"),
        EngineError::NicCountMismatch { .. } => ("NicCountMismatchError", "nic_count_mismatch"),
        EngineError::WorkerFailed { .. } => ("WorkerFailedError", "worker_failed"),
        EngineError::PeerRemoved { .. } => ("PeerRemovedError", "peer_removed"),
        EngineError::PeerGone { .. } => ("PeerGoneError", "peer_gone"),
        EngineError::IncarnationUnproven { .. } => {
            ("IncarnationUnprovenError", "incarnation_unproven")
        }
        EngineError::ImmAlreadyArmed { .. } => ("ImmAlreadyArmedError", "imm_already_armed"),
        EngineError::ImmInUse { .. } => ("ImmInUseError", "imm_in_use"),
        EngineError::ImmCountTooLarge { .. } => ("InvalidArgumentError", "imm_count_too_large"),
        EngineError::ImmExhausted { .. } => ("ExhaustedError", "imm_exhausted"),
        _ => ("WeftError", "other"),
    };
    new_err(py, class, kind, e.to_string())
}

/// The Python exception for a provider error.
pub(crate) fn provider_err(py: Python<'_>, e: &ProviderError) -> PyErr {
    let (class, kind) = match e {
        ProviderError::Unknown { .. } => ("UnknownProviderError", "unknown"),
        ProviderError::Invalid { .. } => ("UnknownProviderError", "invalid"),
        ProviderError::FeatureDisabled { .. } => ("ProviderUnavailableError", "feature_disabled"),
        ProviderError::TooFewNics { .. } => ("ProviderUnavailableError", "too_few_nics"),
        ProviderError::Transport { source, .. } => match source {
            TransportError::InvalidArgument { .. } => ("InvalidArgumentError", "invalid_argument"),
            _ => ("ProviderUnavailableError", transport_class(source).1),
        },
        _ => ("ProviderError", "other"),
    };
    new_err(py, class, kind, e.to_string())
}

/// `InvalidArgumentError` raised by the binding itself (kind
/// `"invalid_argument"`).
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    refused(py, "invalid_argument", message)
}

/// `InvalidArgumentError` with a kind that says more than
/// `"invalid_argument"` (`"not_contiguous"`, `"unsupported_dtype"`, ...).
pub(crate) fn refused(py: Python<'_>, kind: &str, message: impl Into<String>) -> PyErr {
    new_err(py, "InvalidArgumentError", kind, message.into())
}

/// `ShutDownError`, as the engine reports it.
pub(crate) fn shut_down(py: Python<'_>) -> PyErr {
    engine_err(py, &EngineError::ShutDown)
}
