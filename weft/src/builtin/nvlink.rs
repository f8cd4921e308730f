//! The `nvlink` spec: the same-host backend.

use std::sync::Arc;

use weft_nvlink::{NvlinkConfig, NvlinkProvider};
use weft_transport::{Provider, TransportError};

use crate::config::ProviderConfig;
use crate::spec::ProviderSpec;

/// A host: a provider with [`ProviderConfig::nics`] lanes and the
/// configured peer memory.
pub(crate) fn host(
    _spec: &ProviderSpec,
    config: &ProviderConfig,
    nics: usize,
) -> Result<Arc<dyn Provider>, TransportError> {
    let mut c = NvlinkConfig::default().with_lanes(nics.max(1));
    if let Some(pm) = &config.nvlink.peer_memory {
        c = c.with_peer_memory(pm.clone());
    }
    if let Some(t) = config.nvlink.rnr_timeout {
        c = c.with_rnr_timeout(t);
    }
    if let Some(h) = config.nvlink.host {
        c = c.with_host(h);
    }
    Ok(Arc::new(NvlinkProvider::new(c)))
}
