//! # weft-rendezvous: how weft processes find each other
//!
//! A process publishes its engine address, named [`weft_transport::MrDesc`]s
//! and a generation number under a namespace; others look them up or watch
//! them come and go. Underneath is one small key-value trait, [`Store`]:
//!
//! - **put** with an optional lease, **get**, **list** by prefix, **delete**;
//! - **leases** ([`Store::grant`], [`Store::keep_alive`], [`Store::revoke`]):
//!   an entry put under a lease disappears when the lease is not kept alive
//!   for its TTL, so a killed process's entries expire by themselves;
//! - **watch** a prefix ([`Store::watch`]): a [`Watch`] reports the entries
//!   already there as [`Event::Join`], then every change as
//!   [`Event::Join`] / [`Event::Update`] / [`Event::Leave`].
//!
//! Values are opaque bytes. Three backends:
//!
//! | backend | spec | for |
//! |---|---|---|
//! | [`MemStore`] | `mem` (default) | one process (loopback); deterministic with a manual clock |
//! | [`DirStore`] | `dir:/path` | several processes on one host, no service |
//! | [`EtcdStore`] | `etcd:http://host:2379` | several hosts; etcd v3's JSON gateway |
//!
//! [`open`] turns a spec string into a store. [`Session`] owns a lease,
//! keeps it alive on a background thread and, when the store lost it (etcd
//! restarted without its data, the lease expired during an outage),
//! grants a new one and puts the session's entries again. [`Namespace`]
//! holds the weft records ([`PeerRecord`], [`MrRecord`]) on top, and
//! [`Records`] an application's own typed records (a KvCache role with its
//! engine address, an MoE rank's descriptors) next to them.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use weft_rendezvous::{MemStore, Namespace, Session, Store};
//!
//! let store: Arc<dyn Store> = Arc::new(MemStore::new());
//! let session = Session::new(store.clone(), Duration::from_secs(5))?;
//! let ns = Namespace::new(store.clone(), "demo");
//! ns.publish_peer(&session, "writer", 1, &[vec![weft_transport::NetAddr(vec![1, 2])]])?;
//! assert_eq!(ns.peer("writer")?.unwrap().generation, 1);
//! # Ok::<(), weft_rendezvous::StoreError>(())
//! ```

#![deny(unsafe_code)]

mod app;
mod dir;
mod error;
mod etcd;
mod mem;
mod record;
mod session;
mod spec;
mod watch;

pub use app::{RecordEvent, RecordWatch, Records};
pub use dir::{DirOptions, DirStore};
pub use error::StoreError;
pub use etcd::{EtcdOptions, EtcdStore};
pub use mem::MemStore;
pub use record::{MrRecord, Namespace, PeerEvent, PeerRecord, PeerWatch, FORMAT_VERSION};
pub use session::Session;
pub use spec::{open, RendezvousSpec};
pub use watch::{Event, Watch};

use std::time::Duration;

/// A lease: entries put under it live while it is kept alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

/// A key-value store with leases and prefix watches (see the crate docs).
///
/// Keys are non-empty UTF-8 strings; `/` separates levels by convention
/// (prefixes are plain string prefixes). All methods block for at most the
/// backend's request timeout.
pub trait Store: Send + Sync {
    /// Where the store is (`mem`, the directory, the etcd URL), for errors
    /// and logs.
    fn endpoint(&self) -> &str;

    /// Sets `key` to `value`, attached to `lease` if given (the entry then
    /// disappears when the lease ends).
    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), StoreError>;

    /// The value of `key`, if it exists.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;

    /// Every entry whose key starts with `prefix`, sorted by key.
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError>;

    /// Removes `key`; whether it existed.
    fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// A new lease that ends `ttl` after its last keep-alive.
    fn grant(&self, ttl: Duration) -> Result<LeaseId, StoreError>;

    /// Renews `lease` for another TTL; [`StoreError::LeaseNotFound`] if it
    /// already ended.
    fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError>;

    /// Ends `lease` now, removing its entries (a clean leave).
    fn revoke(&self, lease: LeaseId) -> Result<(), StoreError>;

    /// Watches every key under `prefix`: first one [`Event::Join`] per
    /// existing entry (in key order), then the changes as they happen.
    fn watch(&self, prefix: &str) -> Result<Watch, StoreError>;
}

pub(crate) fn check_key(endpoint: &str, key: &str) -> Result<(), StoreError> {
    let reason = if key.is_empty() {
        "empty"
    } else if key.contains('\0') {
        "contains NUL"
    } else {
        return Ok(());
    };
    Err(StoreError::InvalidKey {
        endpoint: endpoint.to_string(),
        key: key.to_string(),
        reason,
    })
}
