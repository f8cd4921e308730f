//! `loopback` and `loopback-null`: hosts on one shared simulated fabric.

use std::any::Any;
use std::sync::Arc;

use weft_loopback::{Fabric, FabricConfig};
use weft_transport::{Provider, TransportError};

use crate::backend::HostSource;
use crate::config::{LoopbackOptions, LoopbackProfile};
use crate::registry::Factory;
use crate::spec::ProviderSpec;

/// Every host of a loopback backend lives on this one realtime fabric.
pub(crate) struct LoopbackHosts {
    pub(crate) fabric: Fabric,
}

impl HostSource for LoopbackHosts {
    fn host(&self, nics: usize) -> Result<Arc<dyn Provider>, TransportError> {
        let h = self.fabric.add_host(nics);
        Ok(Arc::new(self.fabric.provider(h)))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The fabric configuration `spec` and `opts` select.
fn fabric_config(spec: &ProviderSpec, opts: &LoopbackOptions) -> FabricConfig {
    let mut cfg = match (spec, opts.profile) {
        (ProviderSpec::LoopbackNull, _) => FabricConfig::null(),
        (_, LoopbackProfile::Ideal) => FabricConfig::ideal(opts.seed),
        (_, LoopbackProfile::Adversarial) => FabricConfig::adversarial(opts.seed),
    };
    if let Some(n) = opts.max_write_len {
        cfg.max_write_len = n;
    }
    cfg
}

pub(crate) fn factory() -> Arc<Factory> {
    Arc::new(|spec, config| {
        let fabric = Fabric::new_realtime(fabric_config(spec, &config.loopback));
        Ok(Box::new(LoopbackHosts { fabric }))
    })
}
