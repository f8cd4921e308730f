//! How weft processes find each other: everything of `weft-rendezvous`
//! (the [`Store`] trait, the in-process, directory and etcd stores,
//! [`Session`], [`Namespace`] and its records), plus [`publish_engine`],
//! which publishes a [`TransferEngine`]'s addresses with its incarnation as
//! the record's generation, and [`group_address`], which turns a record
//! back into the [`GroupAddress`] of one of its groups.
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
//! rendezvous::publish_engine(&ns, &session, "me", &engine)?;
//! let rec = ns.peer("me")?.unwrap();
//! assert_eq!(rec.generation, engine.incarnation().0);
//! assert_eq!(rendezvous::group_address(&rec, 0), Some(engine.main_address()));
//! engine.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub use weft_rendezvous::*;

use weft_engine::{GroupAddress, TransferEngine};
use weft_transport::{Incarnation, NetAddr};

/// The addresses of every domain group of `engine`, in group order (one
/// address per NIC), as a [`PeerRecord`] holds them.
pub fn engine_groups(engine: &TransferEngine) -> Vec<Vec<NetAddr>> {
    (0..engine.groups())
        .filter_map(|g| engine.group_address(g).ok().map(|a| a.nics))
        .collect()
}

/// Publishes `engine` as peer `name` in `ns` under `session`'s lease, with
/// the engine's [incarnation](TransferEngine::incarnation) as the record's
/// generation (a restarted process publishes a larger one, and peers that
/// build addresses from the record with [`group_address`] tell the two
/// apart even at the same NIC addresses).
pub fn publish_engine(
    ns: &Namespace,
    session: &Session,
    name: &str,
    engine: &TransferEngine,
) -> Result<(), StoreError> {
    ns.publish_peer(
        session,
        name,
        engine.incarnation().0,
        &engine_groups(engine),
    )
}

/// The address of group `g` of the peer `rec` describes, with the record's
/// generation as its incarnation (what [`publish_engine`] publishes);
/// `None` when the record has no group `g`.
pub fn group_address(rec: &PeerRecord, g: usize) -> Option<GroupAddress> {
    rec.groups.get(g).map(|nics| GroupAddress {
        nics: nics.clone(),
        incarnation: Incarnation(rec.generation),
    })
}
