//! How weft processes find each other: everything of `weft-rendezvous`
//! (the [`Store`] trait, the in-process, directory and etcd stores,
//! [`Session`], [`Namespace`] and its records), plus [`publish_engine`],
//! which publishes a [`TransferEngine`]'s addresses.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use weft::rendezvous::{self, Namespace, Session};
//!
//! let backend = weft::provider("loopback")?;
//! let engine = weft::TransferEngine::builder()
//!     .group(weft::DomainGroupSpec::new(backend.host()?, vec![0]))
//!     .build()?;
//! let store = rendezvous::open(&"mem".parse()?)?;
//! let session = Session::new(store.clone(), Duration::from_secs(10))?;
//! let ns = Namespace::new(store, "doc");
//! rendezvous::publish_engine(&ns, &session, "me", 1, &engine)?;
//! assert_eq!(ns.peer("me")?.unwrap().groups.len(), 1);
//! engine.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub use weft_rendezvous::*;

use weft_engine::TransferEngine;
use weft_transport::NetAddr;

/// The addresses of every domain group of `engine`, in group order (one
/// address per NIC), as a [`PeerRecord`] holds them.
pub fn engine_groups(engine: &TransferEngine) -> Vec<Vec<NetAddr>> {
    (0..engine.groups())
        .filter_map(|g| engine.group_address(g).ok().map(|a| a.nics))
        .collect()
}

/// Publishes `engine` as peer `name` (generation `generation`) in `ns`
/// under `session`'s lease.
pub fn publish_engine(
    ns: &Namespace,
    session: &Session,
    name: &str,
    generation: u64,
    engine: &TransferEngine,
) -> Result<(), StoreError> {
    ns.publish_peer(session, name, generation, &engine_groups(engine))
}
