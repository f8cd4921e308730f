//! The built-in backends, one module each, and their registry lines.
//!
//! A backend compiled out by its cargo feature stays registered (so specs
//! naming it parse and `providers()` lists it) with a factory that reports
//! [`ProviderError::FeatureDisabled`].

use std::sync::Arc;

#[cfg(feature = "libfabric")]
pub(crate) mod libfabric;
#[cfg(feature = "loopback")]
pub(crate) mod loopback;
#[cfg(feature = "nvlink")]
pub(crate) mod nvlink;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;

use weft_transport::{Provider, TransportError};

use crate::config::ProviderConfig;
use crate::error::ProviderError;
use crate::registry::{Factory, Registry};
use crate::spec::ProviderSpec;

/// The factory `$factory` when cargo feature `$feature` is on, else one that
/// reports the feature off.
macro_rules! gated {
    ($feature:literal, $factory:expr) => {{
        #[cfg(feature = $feature)]
        let f = $factory;
        #[cfg(not(feature = $feature))]
        let f = disabled($feature);
        f
    }};
}

/// A factory for a backend whose cargo feature is off.
#[allow(dead_code)] // unused when every feature is on
fn disabled(feature: &'static str) -> Arc<Factory> {
    Arc::new(move |spec, _| {
        Err(ProviderError::FeatureDisabled {
            spec: spec.to_string(),
            feature,
        })
    })
}

/// A factory for a backend whose every host is a new provider instance,
/// made by `make(spec, config, nics)`: all most backends need.
#[allow(dead_code)] // unused when every feature is off
fn per_host<F>(make: F) -> Arc<Factory>
where
    F: Fn(&ProviderSpec, &ProviderConfig, usize) -> Result<Arc<dyn Provider>, TransportError>
        + Send
        + Sync
        + Clone
        + 'static,
{
    Arc::new(move |spec, config| {
        let (make, spec, config) = (make.clone(), spec.clone(), config.clone());
        Ok(Box::new(move |nics: usize| make(&spec, &config, nics)))
    })
}

/// Registers every built-in backend: one line (statement) per backend,
/// naming its specs, its cargo feature and its factory.
pub(crate) fn register_all(r: &mut Registry) {
    r.insert(
        "loopback",
        &["loopback"],
        &[],
        gated!("loopback", loopback::factory()),
    );
    r.insert(
        "loopback-null",
        &["loopback-null"],
        &[],
        gated!("loopback", loopback::factory()),
    );
    r.insert(
        "libfabric",
        &["libfabric:tcp", "libfabric:shm", "libfabric:efa"],
        &["libfabric:<provider>"],
        gated!("libfabric", per_host(libfabric::host)),
    );
    r.insert(
        "nvlink",
        &["nvlink"],
        &[],
        gated!("nvlink", per_host(nvlink::host)),
    );
    r.insert(
        "verbs",
        &["verbs"],
        &["verbs:<device>"],
        gated!("verbs", per_host(verbs::host)),
    );
}
