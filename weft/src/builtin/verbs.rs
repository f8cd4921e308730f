//! `verbs` and `verbs:DEVICE`: libibverbs, all devices or one.

use std::sync::Arc;

use weft_transport::{Domain, NicInfo, Provider, TransportError};
use weft_verbs::{VerbsConfig, VerbsProvider};

use crate::config::ProviderConfig;
use crate::spec::ProviderSpec;

/// The NICs of one verbs device (`verbs:mlx5_0`): the provider's NICs whose
/// name is `DEVICE:<port>`, renumbered from 0.
struct OneDevice<P = VerbsProvider> {
    inner: P,
    device: String,
    name: String,
}

impl<P: Provider> OneDevice<P> {
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

impl<P: Provider> Provider for OneDevice<P> {
    fn name(&self) -> &str {
        &self.name
    }

    fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
        let nics: Vec<NicInfo> = self.matching()?.into_iter().map(|(_, n)| n).collect();
        if nics.is_empty() {
            return Err(TransportError::NoDevice {
                what: format!("verbs {:?}", self.device),
            });
        }
        Ok(nics)
    }

    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
        let matching = self.matching()?;
        let &(i, _) = matching
            .get(nic)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: self.name.clone(),
                what: format!("NIC index {nic} out of range ({} NICs)", matching.len()),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two devices with two ports and one with one; `open` says which
    /// index it was asked for.
    struct Devices;

    impl Provider for Devices {
        fn name(&self) -> &str {
            "verbs"
        }

        fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
            Ok(["mlx5_0:1", "mlx5_1:1", "mlx5_1:2", "mlx5_10:1"]
                .into_iter()
                .map(|name| NicInfo {
                    name: name.into(),
                    addr: weft_transport::NetAddr(Vec::new()),
                    numa_node: None,
                    link_gbps: None,
                })
                .collect())
        }

        fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
            Err(TransportError::InvalidArgument {
                nic: "fake".into(),
                what: format!("opened {nic}"),
            })
        }
    }

    fn one(device: &str) -> OneDevice<Devices> {
        OneDevice {
            inner: Devices,
            device: device.into(),
            name: format!("verbs:{device}"),
        }
    }

    fn opened(p: &OneDevice<Devices>, nic: usize) -> String {
        match p.open(nic) {
            Err(TransportError::InvalidArgument { what, .. }) => what,
            Err(e) => e.to_string(),
            Ok(_) => "a domain".into(),
        }
    }

    #[test]
    fn one_device_lists_and_opens_only_its_ports() {
        let p = one("mlx5_1");
        assert_eq!(p.name(), "verbs:mlx5_1");
        let names: Vec<String> = p.nics().unwrap().into_iter().map(|n| n.name).collect();
        assert_eq!(names, ["mlx5_1:1", "mlx5_1:2"]);
        assert_eq!(opened(&p, 0), "opened 1");
        assert_eq!(opened(&p, 1), "opened 2");
        assert!(opened(&p, 2).contains("out of range"), "{}", opened(&p, 2));
        // A prefix of another device's name is not that device.
        assert_eq!(opened(&one("mlx5_1"), 0), "opened 1");
        assert_eq!(opened(&one("mlx5_10"), 0), "opened 3");
        assert!(matches!(
            one("mlx5_9").nics(),
            Err(TransportError::NoDevice { .. })
        ));
    }
}
