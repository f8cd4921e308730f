//! The records weft publishes: a peer's engine address and generation, and
//! its named memory descriptors, under a namespace.
//!
//! Keys: `weft/<namespace>/peers/<name>` holds a [`PeerRecord`],
//! `weft/<namespace>/mrs/<name>/<mr>` a [`MrRecord`]. Values are postcard,
//! prefixed with the record format version ([`FORMAT_VERSION`]); a record
//! of another version is refused with [`StoreError::Record`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use weft_transport::{MrDesc, NetAddr};

use crate::watch::Event;
use crate::{Session, Store, StoreError, Watch};

/// The format version written in front of every record (2: descriptors
/// carry their owner's incarnation).
pub const FORMAT_VERSION: u16 = 2;

/// One process's engine, as others find it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRecord {
    /// The process's name in the namespace (`prefill-0`, `rank3`).
    pub name: String,
    /// Bumped by the process each time it restarts, so peers can tell a new
    /// incarnation from the old one. weft's `publish_engine` publishes the
    /// engine's incarnation here (`TransferEngine::incarnation`), the
    /// value its addresses and descriptors carry.
    pub generation: u64,
    /// The engine's addresses: one entry per domain group, one address per
    /// NIC of the group (the engine's `group_address(g).nics`).
    pub groups: Vec<Vec<NetAddr>>,
}

/// A named memory region of a process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MrRecord {
    /// The owner's generation when it published the region.
    pub generation: u64,
    /// The descriptor peers WRITE with.
    pub desc: MrDesc,
}

/// A change to the peers of a namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerEvent {
    /// A peer appeared (or was there when the watch started).
    Joined(PeerRecord),
    /// A peer republished (a new generation or new addresses).
    Updated(PeerRecord),
    /// A peer left or its lease ended.
    Left {
        /// Its name.
        name: String,
    },
}

pub(crate) fn encode<T: Serialize>(key: &str, rec: &T) -> Result<Vec<u8>, StoreError> {
    postcard::to_stdvec(&(FORMAT_VERSION, rec)).map_err(|e| StoreError::Record {
        key: key.to_string(),
        reason: format!("encode: {e}"),
    })
}

pub(crate) fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    let err = |reason: String| StoreError::Record {
        key: key.to_string(),
        reason,
    };
    let (version, rest) = postcard::take_from_bytes::<u16>(bytes)
        .map_err(|e| err(format!("no format version: {e}")))?;
    if version != FORMAT_VERSION {
        return Err(err(format!(
            "format version {version}, this build reads {FORMAT_VERSION}"
        )));
    }
    let (rec, tail) =
        postcard::take_from_bytes::<T>(rest).map_err(|e| err(format!("decode: {e}")))?;
    if !tail.is_empty() {
        return Err(err(format!("{} trailing bytes", tail.len())));
    }
    Ok(rec)
}

/// The weft records of one namespace in a store.
#[derive(Clone)]
pub struct Namespace {
    store: Arc<dyn Store>,
    ns: String,
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Namespace")
            .field("store", &self.store.endpoint())
            .field("ns", &self.ns)
            .finish()
    }
}

impl Namespace {
    /// The namespace `ns` of `store`.
    pub fn new(store: Arc<dyn Store>, ns: &str) -> Self {
        Namespace {
            store,
            ns: ns.to_string(),
        }
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.ns
    }

    pub(crate) fn check(&self, what: &str) -> Result<(), StoreError> {
        for part in [self.ns.as_str(), what] {
            if part.is_empty() || part.contains('/') {
                return Err(StoreError::InvalidKey {
                    endpoint: self.store.endpoint().to_string(),
                    key: format!("{}/{what}", self.ns),
                    reason: "namespace and names must be non-empty and contain no '/'",
                });
            }
        }
        Ok(())
    }

    fn peers_prefix(&self) -> String {
        format!("weft/{}/peers/", self.ns)
    }

    fn peer_key(&self, name: &str) -> Result<String, StoreError> {
        self.check(name)?;
        Ok(format!("{}{name}", self.peers_prefix()))
    }

    fn mr_key(&self, name: &str, mr: &str) -> Result<String, StoreError> {
        self.check(name)?;
        self.check(mr)?;
        Ok(format!("weft/{}/mrs/{name}/{mr}", self.ns))
    }

    /// Publishes this process's engine as `name` under `session`'s lease.
    pub fn publish_peer(
        &self,
        session: &Session,
        name: &str,
        generation: u64,
        groups: &[Vec<NetAddr>],
    ) -> Result<(), StoreError> {
        let key = self.peer_key(name)?;
        let rec = PeerRecord {
            name: name.to_string(),
            generation,
            groups: groups.to_vec(),
        };
        session.put(&key, &encode(&key, &rec)?)
    }

    /// Publishes memory region `mr` of peer `name` under `session`'s lease.
    pub fn publish_mr(
        &self,
        session: &Session,
        name: &str,
        mr: &str,
        generation: u64,
        desc: &MrDesc,
    ) -> Result<(), StoreError> {
        let key = self.mr_key(name, mr)?;
        let rec = MrRecord {
            generation,
            desc: desc.clone(),
        };
        session.put(&key, &encode(&key, &rec)?)
    }

    /// Peer `name`, if present.
    pub fn peer(&self, name: &str) -> Result<Option<PeerRecord>, StoreError> {
        let key = self.peer_key(name)?;
        self.store.get(&key)?.map(|v| decode(&key, &v)).transpose()
    }

    /// Every peer of the namespace, by name.
    pub fn peers(&self) -> Result<Vec<PeerRecord>, StoreError> {
        self.store
            .list(&self.peers_prefix())?
            .iter()
            .map(|(k, v)| decode(k, v))
            .collect()
    }

    /// Memory region `mr` of peer `name`, if present.
    pub fn mr(&self, name: &str, mr: &str) -> Result<Option<MrRecord>, StoreError> {
        let key = self.mr_key(name, mr)?;
        self.store.get(&key)?.map(|v| decode(&key, &v)).transpose()
    }

    /// Watches the namespace's peers (see [`PeerWatch`]).
    pub fn watch_peers(&self) -> Result<PeerWatch, StoreError> {
        Ok(PeerWatch {
            prefix: self.peers_prefix(),
            inner: self.store.watch(&self.peers_prefix())?,
        })
    }

    /// Waits up to `timeout` for peer `name` to be published.
    pub fn wait_peer(&self, name: &str, timeout: Duration) -> Result<PeerRecord, StoreError> {
        let key = self.peer_key(name)?;
        let v = self.wait_key(&key, timeout)?;
        decode(&key, &v)
    }

    /// Waits up to `timeout` for region `mr` of peer `name` to be published.
    pub fn wait_mr(&self, name: &str, mr: &str, timeout: Duration) -> Result<MrRecord, StoreError> {
        let key = self.mr_key(name, mr)?;
        let v = self.wait_key(&key, timeout)?;
        decode(&key, &v)
    }

    pub(crate) fn wait_key(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let start = Instant::now();
        let w = self.store.watch(key)?;
        let ev = w.wait_for(
            timeout.saturating_sub(start.elapsed()),
            key,
            |e| matches!(e, Event::Join { key: k, .. } | Event::Update { key: k, .. } if k == key),
        )?;
        match ev {
            Event::Join { value, .. } | Event::Update { value, .. } => Ok(value),
            Event::Leave { .. } => Err(StoreError::Record {
                key: key.to_string(),
                reason: "left while awaited".into(),
            }),
        }
    }
}

/// Peer events of a namespace: decoded [`Watch`] events.
#[derive(Debug)]
pub struct PeerWatch {
    prefix: String,
    inner: Watch,
}

impl PeerWatch {
    /// The next peer event, waiting up to `timeout`; `Ok(None)` if none came.
    /// A record that does not decode is an error (the watch goes on).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<PeerEvent>, StoreError> {
        let Some(ev) = self.inner.recv_timeout(timeout)? else {
            return Ok(None);
        };
        let name = |k: &str| {
            k.strip_prefix(self.prefix.as_str())
                .unwrap_or(k)
                .to_string()
        };
        Ok(Some(match ev {
            Event::Join { key, value } => PeerEvent::Joined(decode(&key, &value)?),
            Event::Update { key, value } => PeerEvent::Updated(decode(&key, &value)?),
            Event::Leave { key } => PeerEvent::Left { name: name(&key) },
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_roundtrip_and_version_check() {
        let rec = PeerRecord {
            name: "a".into(),
            generation: 7,
            groups: vec![vec![NetAddr(vec![1, 2, 3])]],
        };
        let bytes = encode("k", &rec).unwrap();
        assert_eq!(decode::<PeerRecord>("k", &bytes).unwrap(), rec);
        let mut other = bytes.clone();
        other[0] = 1; // the format before descriptors carried incarnations
        let e = decode::<PeerRecord>("k", &other).unwrap_err();
        assert!(e.to_string().contains("format version 1"), "{e}");
        let mut long = bytes;
        long.push(0);
        assert!(decode::<PeerRecord>("k", &long).is_err());
        assert!(decode::<PeerRecord>("k", &[]).is_err());
    }
}
