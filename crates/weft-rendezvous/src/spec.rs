//! Rendezvous spec strings: `mem`, `dir:/path`, `etcd:http://host:2379`.

use std::str::FromStr;
use std::sync::Arc;

use crate::{DirOptions, DirStore, EtcdOptions, EtcdStore, MemStore, Store, StoreError};

/// Which store to use, parsed from a spec string.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RendezvousSpec {
    /// `mem` (or empty): in this process only.
    Mem,
    /// `dir:/path`: a directory shared by the processes of one host.
    Dir(std::path::PathBuf),
    /// `etcd:http://host:port[,http://...]`: an etcd cluster.
    Etcd(String),
}

impl FromStr for RendezvousSpec {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let bad = |reason: &str| StoreError::Spec {
            spec: s.to_string(),
            reason: reason.to_string(),
        };
        if s.is_empty() || s == "mem" {
            Ok(RendezvousSpec::Mem)
        } else if let Some(p) = s.strip_prefix("dir:") {
            if p.is_empty() {
                return Err(bad("dir: needs a path"));
            }
            Ok(RendezvousSpec::Dir(p.into()))
        } else if let Some(u) = s.strip_prefix("etcd:") {
            EtcdStore::new(u, EtcdOptions::default())?;
            Ok(RendezvousSpec::Etcd(u.to_string()))
        } else {
            Err(bad("expected mem, dir:/path or etcd:http://host:port"))
        }
    }
}

/// Opens the store `spec` names, with default options.
pub fn open(spec: &RendezvousSpec) -> Result<Arc<dyn Store>, StoreError> {
    Ok(match spec {
        RendezvousSpec::Mem => Arc::new(MemStore::new()),
        RendezvousSpec::Dir(p) => Arc::new(DirStore::open(p, DirOptions::default())?),
        RendezvousSpec::Etcd(u) => Arc::new(EtcdStore::new(u, EtcdOptions::default())?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!("".parse::<RendezvousSpec>().unwrap(), RendezvousSpec::Mem);
        assert_eq!(
            "mem".parse::<RendezvousSpec>().unwrap(),
            RendezvousSpec::Mem
        );
        assert_eq!(
            "dir:/tmp/x".parse::<RendezvousSpec>().unwrap(),
            RendezvousSpec::Dir("/tmp/x".into())
        );
        assert_eq!(
            "etcd:http://127.0.0.1:2379"
                .parse::<RendezvousSpec>()
                .unwrap(),
            RendezvousSpec::Etcd("http://127.0.0.1:2379".into())
        );
        assert!("dir:".parse::<RendezvousSpec>().is_err());
        assert!("etcd:https://x".parse::<RendezvousSpec>().is_err());
        assert!("redis://x".parse::<RendezvousSpec>().is_err());
    }
}
