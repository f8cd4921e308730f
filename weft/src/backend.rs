//! [`Backend`]: an opened backend that hands out one provider per host.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use weft_transport::{NicInfo, Provider, TransportError};

use crate::error::ProviderError;
use crate::spec::ProviderSpec;

/// What a backend factory returns: a source of hosts.
///
/// Each call to [`HostSource::host`] is a new "host": for the simulated
/// fabric a new simulated host on the shared fabric, for real NICs a new
/// provider instance (whose domains are new endpoints on the same NICs).
/// Closures `Fn(usize) -> Result<Arc<dyn Provider>, TransportError>`
/// implement it.
pub trait HostSource: Send + Sync + 'static {
    /// A fresh host with `nics` NICs.
    fn host(&self, nics: usize) -> Result<Arc<dyn Provider>, TransportError>;

    /// `self`, for [`Backend::source`].
    fn as_any(&self) -> &dyn Any;
}

impl<F> HostSource for F
where
    F: Fn(usize) -> Result<Arc<dyn Provider>, TransportError> + Send + Sync + 'static,
{
    fn host(&self, nics: usize) -> Result<Arc<dyn Provider>, TransportError> {
        self(nics)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A backend selected by a [`ProviderSpec`], opened with a
/// [`crate::ProviderConfig`]: get one [`Provider`] per host from it.
///
/// ```
/// let backend = weft::provider("loopback").unwrap();
/// let (a, b) = (backend.host().unwrap(), backend.host().unwrap());
/// assert_eq!(a.nics().unwrap().len(), 1);
/// assert_ne!(a.nics().unwrap()[0].addr, b.nics().unwrap()[0].addr);
/// ```
pub struct Backend {
    spec: ProviderSpec,
    nics: usize,
    source: Box<dyn HostSource>,
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("spec", &self.spec)
            .field("nics", &self.nics)
            .finish()
    }
}

impl Backend {
    /// A backend for `spec` whose hosts come from `source`, `nics` NICs each.
    pub fn new(spec: ProviderSpec, nics: usize, source: Box<dyn HostSource>) -> Self {
        Backend { spec, nics, source }
    }

    /// The spec it was selected by.
    pub fn spec(&self) -> &ProviderSpec {
        &self.spec
    }

    /// NICs per host ([`crate::ProviderConfig::nics`]).
    pub fn nics(&self) -> usize {
        self.nics
    }

    /// A fresh host with [`Backend::nics`] NICs.
    pub fn host(&self) -> Result<Arc<dyn Provider>, ProviderError> {
        self.host_with(self.nics)
    }

    /// A fresh host with `nics` NICs.
    pub fn host_with(&self, nics: usize) -> Result<Arc<dyn Provider>, ProviderError> {
        self.source
            .host(nics)
            .map_err(|e| ProviderError::transport(&self.spec, e))
    }

    /// Opens a host and lists its NICs, failing if the backend is not
    /// usable here or offers fewer than [`Backend::nics`]. (On the simulated
    /// fabric this adds a host.)
    pub fn probe(&self) -> Result<Vec<NicInfo>, ProviderError> {
        let nics = self
            .host()?
            .nics()
            .map_err(|e| ProviderError::transport(&self.spec, e))?;
        if nics.is_empty() {
            return Err(ProviderError::transport(
                &self.spec,
                TransportError::NoDevice {
                    what: self.spec.to_string(),
                },
            ));
        }
        if nics.len() < self.nics {
            return Err(ProviderError::TooFewNics {
                spec: self.spec.to_string(),
                have: nics.len(),
                want: self.nics,
            });
        }
        Ok(nics)
    }

    /// The host source as its concrete type, if it is a `T`.
    pub fn source<T: 'static>(&self) -> Option<&T> {
        self.source.as_any().downcast_ref()
    }

    /// The shared simulated fabric, for the loopback backends (its
    /// statistics, fault rules, NIC models).
    #[cfg(feature = "loopback")]
    pub fn loopback_fabric(&self) -> Option<&weft_loopback::Fabric> {
        self.source::<crate::builtin::loopback::LoopbackHosts>()
            .map(|h| &h.fabric)
    }
}
