//! `verbs` and `verbs:DEVICE`: libibverbs, all devices or one.

use std::sync::Arc;

use weft_transport::{Domain, NicInfo, Provider, TransportError};
use weft_verbs::{VerbsConfig, VerbsProvider};

use crate::config::ProviderConfig;
use crate::spec::ProviderSpec;

/// The NICs of one verbs device (`verbs:mlx5_0`): the provider's NICs whose
/// name is `DEVICE:<port>`, renumbered from 0.
struct OneDevice {
    inner: VerbsProvider,
    device: String,
    name: String,
}

impl OneDevice {
    /// Indices (in the inner provider) of this device's NICs, with their info.
    fn matching(&self) -> Result<Vec<(usize, NicInfo)>, TransportError> {
        let prefix = format!("{}:", self.device);
        Ok(self
            .inner
            .nics()?
            .into_iter()
            .enumerate()
            .filter(|(_, n)| n.name.starts_with(&prefix))
            .collect())
    }
}

impl Provider for OneDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
        let nics: Vec<NicInfo> = self.matching()?.into_iter().map(|(_, n)| n).collect();
        if nics.is_empty() {
            return Err(TransportError::NoDevice {
                what: format!("verbs device {:?}", self.device),
            });
        }
        Ok(nics)
    }

    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
        let (i, _) =
            self.matching()?
                .into_iter()
                .nth(nic)
                .ok_or_else(|| TransportError::NoDevice {
                    what: format!("verbs device {:?} NIC index {nic}", self.device),
                })?;
        self.inner.open(i)
    }
}

/// A host: a new provider over every device, or over the one `verbs:DEVICE`
/// names.
pub(crate) fn host(
    spec: &ProviderSpec,
    _config: &ProviderConfig,
    _nics: usize,
) -> Result<Arc<dyn Provider>, TransportError> {
    let inner = VerbsProvider::new(VerbsConfig::default());
    Ok(match spec {
        ProviderSpec::Verbs(Some(device)) => Arc::new(OneDevice {
            inner,
            device: device.clone(),
            name: spec.to_string(),
        }),
        _ => Arc::new(inner),
    })
}
