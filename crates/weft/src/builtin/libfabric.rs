//! `libfabric:<provider>`: each host is its own provider instance.

use std::sync::Arc;

use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::Provider;

use crate::config::LibfabricOptions;
use crate::error::ProviderError;
use crate::registry::Factory;
use crate::spec::ProviderSpec;

/// The backend configuration for a host with `nics` NICs.
fn libfabric_config(provider: &str, opts: &LibfabricOptions, nics: usize) -> LibfabricConfig {
    let mut cfg = LibfabricConfig::new(provider);
    if let Some(d) = &opts.domain {
        cfg = cfg.with_domains(vec![d.clone(); nics]);
    }
    if let Some(n) = opts.max_inflight {
        cfg = cfg.with_max_inflight(n);
    }
    if let Some(t) = opts.connect_timeout {
        cfg = cfg.with_connect_timeout(t);
    }
    cfg
}

pub(crate) fn factory() -> Arc<Factory> {
    Arc::new(|spec, config| {
        let ProviderSpec::Libfabric(provider) = spec else {
            return Err(ProviderError::Invalid {
                spec: spec.to_string(),
                reason: "the libfabric factory serves libfabric:<provider> only".into(),
            });
        };
        let (provider, opts) = (provider.clone(), config.libfabric.clone());
        Ok(Box::new(move |nics: usize| {
            let p = LibfabricProvider::with_config(libfabric_config(&provider, &opts, nics))?;
            Ok(Arc::new(p) as Arc<dyn Provider>)
        }))
    })
}
