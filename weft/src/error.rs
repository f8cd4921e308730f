//! [`ProviderError`]: why a backend could not be selected or opened.

use weft_transport::TransportError;

/// Why a provider spec could not be parsed, or its backend not opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// The spec names no known backend.
    #[error("unknown provider {spec:?} (known: {})", known.join(", "))]
    Unknown {
        /// The spec as given.
        spec: String,
        /// Every spec the registry knows (examples and patterns such as
        /// `libfabric:<provider>`).
        known: Vec<String>,
    },
    /// The spec names a known backend but is malformed.
    #[error("invalid provider spec {spec:?}: {reason}")]
    Invalid {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The backend was compiled out.
    #[error(
        "provider {spec} is not built in: weft was compiled without its cargo feature `{feature}`"
    )]
    FeatureDisabled {
        /// The spec.
        spec: String,
        /// The cargo feature of the `weft` crate that enables it.
        feature: &'static str,
    },
    /// The backend could not be opened on this host (native library not
    /// loadable, no device, ...).
    #[error("provider {spec}: {source}")]
    Transport {
        /// The spec.
        spec: String,
        /// The backend's error.
        #[source]
        source: TransportError,
    },
    /// The backend offers fewer NICs per host than configured.
    #[error("provider {spec} offers {have} NIC(s) on this host, {want} requested")]
    TooFewNics {
        /// The spec.
        spec: String,
        /// NICs found.
        have: usize,
        /// NICs requested ([`crate::ProviderConfig::nics`]).
        want: usize,
    },
}

impl ProviderError {
    /// Wraps a backend error with the spec it came from.
    pub fn transport(spec: impl ToString, source: TransportError) -> Self {
        ProviderError::Transport {
            spec: spec.to_string(),
            source,
        }
    }
}
