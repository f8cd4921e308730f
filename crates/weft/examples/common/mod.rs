//! Shared by the `reader` and `writer` examples: their arguments and the
//! backend they select through the registry.

use weft::{Domain, LibfabricOptions, ProviderConfig, ProviderError, ProviderSpec};

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
