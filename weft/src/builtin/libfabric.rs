//! `libfabric:<provider>`: each host is its own provider instance.

use std::sync::Arc;

use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::{Provider, TransportError};

use crate::config::{LibfabricOptions, ProviderConfig};
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
    if let Some(t) = opts.write_timeout {
        cfg = cfg.with_write_timeout(t);
    }
    if opts.hmem {
        cfg = cfg.with_hmem(true);
    }
    if opts.hmem_ipc {
        cfg = cfg.with_hmem_ipc(true);
    }
    cfg
}

/// A host: a new provider instance with `nics` NICs.
pub(crate) fn host(
    spec: &ProviderSpec,
    config: &ProviderConfig,
    nics: usize,
) -> Result<Arc<dyn Provider>, TransportError> {
    let ProviderSpec::Libfabric(provider) = spec else {
        return Err(TransportError::InvalidArgument {
            nic: spec.to_string(),
            what: "not a libfabric:<provider> spec".into(),
        });
    };
    let p = LibfabricProvider::with_config(libfabric_config(provider, &config.libfabric, nics))?;
    Ok(Arc::new(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_option_reaches_the_backend_config() {
        let opts = LibfabricOptions::same_machine("shm")
            .with_hmem(true)
            .with_hmem_ipc(true)
            .with_write_timeout(Duration::from_secs(3))
            .with_connect_timeout(Duration::from_secs(4))
            .with_max_inflight(77);
        let cfg = libfabric_config("shm", &opts, 2);
        assert!(cfg.hmem && cfg.hmem_ipc);
        assert_eq!(cfg.write_timeout, Duration::from_secs(3));
        assert_eq!(cfg.connect_timeout, Duration::from_secs(4));
        assert_eq!(cfg.max_inflight, 77);
        assert_eq!(cfg.domains, Some(vec!["shm".to_string(); 2]));
        let plain = libfabric_config("shm", &LibfabricOptions::same_machine("shm"), 1);
        assert!(
            !plain.hmem,
            "GPU memory registration stays off unless asked for"
        );
    }
}
