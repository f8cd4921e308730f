//! Shared by the `reader` and `writer` examples: their arguments and the
//! backend they select through the registry.

use std::sync::Arc;

use weft::rendezvous::{self, Namespace, RendezvousSpec, Session};
use weft::{Domain, LibfabricOptions, ProviderConfig, ProviderError, ProviderSpec};

/// The namespace the examples publish in.
pub const NAMESPACE: &str = "weft-examples";

/// The store `--rendezvous` names (`dir:/path`, `etcd:http://host:2379`),
/// with its namespace; `None` without the option. (The in-process store,
/// `mem`, is the library's default but cannot join two processes.)
pub fn rendezvous(args: &[String]) -> Result<Option<Namespace>, Box<dyn std::error::Error>> {
    let Some(spec) = arg(args, "--rendezvous") else {
        return Ok(None);
    };
    let spec: RendezvousSpec = spec.parse()?;
    if spec == RendezvousSpec::Mem {
        return Err(
            "--rendezvous mem only works inside one process; use dir:/path or etcd:URL".into(),
        );
    }
    let store = rendezvous::open(&spec)?;
    Ok(Some(Namespace::new(store, NAMESPACE)))
}

/// A session (lease) in `ns`'s store, kept alive while the example runs.
#[allow(dead_code)] // the writer publishes nothing
pub fn session(ns: &Namespace) -> Result<Session, Box<dyn std::error::Error>> {
    Ok(Session::new(
        Arc::clone(ns.store()),
        std::time::Duration::from_secs(10),
    )?)
}

/// The value after `name`, if given.
pub fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The spec `--provider` selects: a full weft spec (`libfabric:efa`,
/// `verbs:mlx5_0`, ...) or a bare libfabric provider name (`tcp`, `shm`,
/// `efa`). Default `libfabric:tcp`.
fn spec(args: &[String]) -> Result<ProviderSpec, ProviderError> {
    let p = arg(args, "--provider").unwrap_or_else(|| "tcp".into());
    match p.parse::<ProviderSpec>() {
        Err(ProviderError::Unknown { .. }) => format!("libfabric:{p}").parse(),
        other => other,
    }
}

/// Opens the first NIC of a host of the selected backend (`--domain`: the
/// libfabric domain, e.g. the network interface for tcp).
pub fn open_domain(args: &[String]) -> Result<Box<dyn Domain>, Box<dyn std::error::Error>> {
    let mut config = ProviderConfig::default();
    if let Some(d) = arg(args, "--domain") {
        config = config.with_libfabric(LibfabricOptions::default().with_domain(d));
    }
    let backend = weft::provider_with(&spec(args)?, &config)?;
    Ok(backend.host()?.open(0)?)
}
