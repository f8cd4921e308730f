//! An example out-of-tree backend, added through the registry without
//! editing weft, selected by spec string, and driven by the engine.
//!
//! The backend, `mirror`, is the smallest real one: a [`Provider`] that
//! serves the simulated fabric's NICs under its own name. A backend crate
//! would do the same with its own `Provider`/`Domain` and one
//! `weft::register` call at start-up.

#![cfg(feature = "loopback")]

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use weft::loopback::{Fabric, FabricConfig};
use weft::{
    Availability, Device, Domain, DomainGroupSpec, HostSource, MemRegion, NicInfo, OnDone,
    Provider, ProviderConfig, ProviderError, ProviderSpec, Registry, TransferEngine,
    TransportError,
};

/// One host of the `mirror` backend.
struct MirrorProvider {
    name: String,
    inner: Arc<dyn Provider>,
}

impl Provider for MirrorProvider {
    fn name(&self) -> &str {
        &self.name
    }

    fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
        self.inner.nics()
    }

    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
        self.inner.open(nic)
    }
}

/// The hosts of one `mirror` backend: all on one fabric seeded by the
/// spec's argument (`mirror:SEED`).
struct MirrorHosts {
    fabric: Fabric,
    name: String,
}

impl HostSource for MirrorHosts {
    fn host(&self, nics: usize) -> Result<Arc<dyn Provider>, TransportError> {
        let host = self.fabric.add_host(nics);
        Ok(Arc::new(MirrorProvider {
            name: self.name.clone(),
            inner: Arc::new(self.fabric.provider(host)),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The factory: what a backend crate hands to `register`.
fn mirror(spec: &ProviderSpec, _: &ProviderConfig) -> Result<Box<dyn HostSource>, ProviderError> {
    let seed = match spec.arg() {
        None => 0,
        Some(a) => a.parse().map_err(|_| ProviderError::Invalid {
            spec: spec.to_string(),
            reason: "mirror:SEED takes a number".into(),
        })?,
    };
    Ok(Box::new(MirrorHosts {
        fabric: Fabric::new_realtime(FabricConfig::adversarial(seed)),
        name: spec.to_string(),
    }))
}

#[test]
fn registered_backend_is_selected_by_spec_and_moves_bytes() {
    let mut reg = Registry::default();
    assert!(matches!(
        reg.parse("mirror:7"),
        Err(ProviderError::Unknown { .. })
    ));
    reg.register("mirror", mirror);

    let spec = reg.parse("mirror:7").unwrap();
    assert_eq!(
        spec,
        ProviderSpec::Custom {
            name: "mirror".into(),
            arg: Some("7".into())
        }
    );
    assert_eq!(spec.to_string(), "mirror:7");
    assert!(reg.known().contains(&"mirror".to_string()));
    assert!(matches!(
        reg.open("mirror:x"),
        Err(ProviderError::Invalid { .. })
    ));

    let backend = reg
        .open_with(&spec, &ProviderConfig::default().with_nics(2))
        .unwrap();
    assert_eq!(backend.nics(), 2);
    assert!(backend.source::<MirrorHosts>().is_some());
    assert!(backend.loopback_fabric().is_none());
    let engines: Vec<TransferEngine> = (0..2)
        .map(|_| {
            let host = backend.host().unwrap();
            assert_eq!(host.name(), "mirror:7");
            TransferEngine::builder()
                .group(DomainGroupSpec::new(host, vec![0, 1]))
                .build()
                .unwrap()
        })
        .collect();

    let len = 256 * 1024;
    let mut src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; len];
    // SAFETY: both buffers outlive the engines (shut down below, before the
    // buffers are read or dropped) and are not accessed while registered.
    let (rs, rd) = unsafe {
        (
            MemRegion::new(NonNull::new(src.as_mut_ptr()).unwrap(), len, Device::Host),
            MemRegion::new(NonNull::new(dst.as_mut_ptr()).unwrap(), len, Device::Host),
        )
    };
    let (src_mr, _) = engines[0].reg_mr(rs).unwrap();
    let (_, dst_desc) = engines[1].reg_mr(rd).unwrap();
    let (on_done, flag) = OnDone::flag();
    engines[0]
        .submit_single_write(len as u64, None, (&src_mr, 0), (&dst_desc, 0), on_done)
        .unwrap();
    flag.wait().unwrap();
    for e in &engines {
        e.shutdown();
    }
    assert_eq!(src, dst);
}

#[test]
fn registered_backend_is_listed_by_the_process_wide_registry() {
    weft::register("mirror-global", mirror);
    let spec: ProviderSpec = "mirror-global:3".parse().unwrap();
    assert_eq!(spec.name(), "mirror-global");
    let backend = weft::provider("mirror-global").unwrap();
    assert_eq!(backend.host().unwrap().nics().unwrap().len(), 1);
    let listed = weft::providers();
    let mine = listed
        .iter()
        .find(|s| s.spec == "mirror-global")
        .expect("listed");
    assert!(
        matches!(&mine.availability, Availability::Available { nics } if nics.len() == 1),
        "{}",
        mine.availability
    );
}
