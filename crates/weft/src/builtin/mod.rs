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
#[cfg(feature = "verbs")]
pub(crate) mod verbs;

use crate::error::ProviderError;
use crate::registry::{Factory, Registry};

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

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Registers every built-in backend: one line per backend.
pub(crate) fn register_all(r: &mut Registry) {
    #[cfg(feature = "loopback")]
    let (lo, lo_null) = (loopback::factory(), loopback::factory());
    #[cfg(not(feature = "loopback"))]
    let (lo, lo_null) = (disabled("loopback"), disabled("loopback"));
    #[cfg(feature = "libfabric")]
    let lf = libfabric::factory();
    #[cfg(not(feature = "libfabric"))]
    let lf = disabled("libfabric");
    #[cfg(feature = "verbs")]
    let vb = verbs::factory();
    #[cfg(not(feature = "verbs"))]
    let vb = disabled("verbs");

    r.insert("loopback", strings(&["loopback"]), Vec::new(), lo);
    r.insert(
        "loopback-null",
        strings(&["loopback-null"]),
        Vec::new(),
        lo_null,
    );
    r.insert(
        "libfabric",
        strings(&["libfabric:tcp", "libfabric:shm", "libfabric:efa"]),
        strings(&["libfabric:<provider>"]),
        lf,
    );
    r.insert(
        "verbs",
        strings(&["verbs"]),
        strings(&["verbs:<device>"]),
        vb,
    );
}
