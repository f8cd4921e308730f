//! The records weft publishes: a peer's engine address and generation, and
//! its named memory descriptors, under a namespace.
//!
//! Keys: `weft/<namespace>/peers/<name>` holds a [`PeerRecord`],
//! `weft/<namespace>/mrs/<name>/<mr>` a [`MrRecord`]. Values are postcard,
//! prefixed with the record format version ([`FORMAT_VERSION`]); a record
//! of another version is refused with [`StoreError::Record`].
//!
//! Bytes a store hands back are not trusted: a value may be damaged,
//! written by another version, or planted by anyone who can write the
//! store. A [`PeerRecord`] must carry the name of the key it is stored
//! under. A record that fails either check is refused for itself only:
//! listings and watches skip it and count it
//! ([`Namespace::skipped_records`]), so one bad record never hides the
//! others, and a record is never reported under a name its key does not
//! give it.

use std::sync::atomic::{AtomicU64, Ordering};
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

/// Decodes a record of any type from `bytes` stored under `key`: the
/// format version, then the value, with no trailing bytes. Never panics,
/// and never allocates more than `bytes` can hold (postcard checks every
/// length prefix against the bytes left before it allocates).
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

/// Decodes the [`PeerRecord`] stored under `key`, whose name in the
/// namespace is `name`: refused unless the record says the same name.
pub(crate) fn decode_peer(key: &str, name: &str, bytes: &[u8]) -> Result<PeerRecord, StoreError> {
    let rec: PeerRecord = decode(key, bytes)?;
    if rec.name != name {
        return Err(StoreError::Record {
            key: key.to_string(),
            reason: format!(
                "the record names peer {:?}, its key names {name:?}",
                rec.name
            ),
        });
    }
    Ok(rec)
}

/// The count of records skipped because they did not decode or their name
/// disagreed with their key, shared by a [`Namespace`], its clones and
/// everything made from them ([`PeerWatch`], [`crate::Records`],
/// [`crate::RecordWatch`]).
#[derive(Debug, Default)]
pub(crate) struct SkippedRecords(AtomicU64);

impl SkippedRecords {
    /// Counts one bad record and logs it: a warning for the 1st, 2nd, 4th,
    /// 8th, ... one (so a store full of garbage cannot flood the log), the
    /// others at debug level.
    pub(crate) fn note(&self, key: &str, error: &StoreError) {
        let n = self.0.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        if n.is_power_of_two() {
            tracing::warn!(%key, %error, skipped = n,
                "skipping a bad record (warned at the 1st, 2nd, 4th, ... one; the rest at debug level)");
        } else {
            tracing::debug!(%key, %error, skipped = n, "skipping a bad record");
        }
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The weft records of one namespace in a store.
#[derive(Clone)]
pub struct Namespace {
    store: Arc<dyn Store>,
    ns: String,
    skipped: Arc<SkippedRecords>,
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
            skipped: Arc::default(),
        }
    }

    /// Records skipped so far because they did not decode (damaged bytes,
    /// another format version or type) or because a [`PeerRecord`]'s name
    /// disagreed with its key: by listings ([`Namespace::peers`],
    /// [`crate::Records::list`]), watches ([`PeerWatch`],
    /// [`crate::RecordWatch`]) and look-ups of this namespace value, its
    /// clones and what was made from them. Each one is also logged (a
    /// warning for the 1st, 2nd, 4th, ... one, the rest at debug level).
    pub fn skipped_records(&self) -> u64 {
        self.skipped.get()
    }

    /// The shared skip counter (see [`Namespace::skipped_records`]).
    pub(crate) fn skipped(&self) -> &Arc<SkippedRecords> {
        &self.skipped
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

    /// Peer `name`, if present. A record under its key that does not
    /// decode or names another peer is [`StoreError::Record`] (and
    /// counted in [`Namespace::skipped_records`]).
    pub fn peer(&self, name: &str) -> Result<Option<PeerRecord>, StoreError> {
        let key = self.peer_key(name)?;
        self.store
            .get(&key)?
            .map(|v| self.counted(&key, decode_peer(&key, name, &v)))
            .transpose()
    }

    /// Every peer of the namespace, by name. A record that does not
    /// decode, or whose name is not the one its key gives it, is skipped
    /// and counted ([`Namespace::skipped_records`]): one bad record never
    /// hides the others.
    pub fn peers(&self) -> Result<Vec<PeerRecord>, StoreError> {
        let prefix = self.peers_prefix();
        Ok(self
            .store
            .list(&prefix)?
            .iter()
            .filter_map(|(k, v)| {
                let name = k.strip_prefix(prefix.as_str()).unwrap_or(k);
                self.counted(k, decode_peer(k, name, v)).ok()
            })
            .collect())
    }

    /// `r`, with an error counted as a skipped record.
    pub(crate) fn counted<T>(&self, key: &str, r: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(e) = &r {
            self.skipped.note(key, e);
        }
        r
    }

    /// Memory region `mr` of peer `name`, if present. A record that does
    /// not decode is [`StoreError::Record`] (and counted).
    pub fn mr(&self, name: &str, mr: &str) -> Result<Option<MrRecord>, StoreError> {
        let key = self.mr_key(name, mr)?;
        self.store
            .get(&key)?
            .map(|v| self.counted(&key, decode(&key, &v)))
            .transpose()
    }

    /// Watches the namespace's peers (see [`PeerWatch`]).
    pub fn watch_peers(&self) -> Result<PeerWatch, StoreError> {
        Ok(PeerWatch {
            prefix: self.peers_prefix(),
            inner: self.store.watch(&self.peers_prefix())?,
            skipped: Arc::clone(&self.skipped),
        })
    }

    /// Waits up to `timeout` for peer `name` to be published. A record
    /// under its key that does not decode or names another peer is
    /// [`StoreError::Record`] (and counted).
    pub fn wait_peer(&self, name: &str, timeout: Duration) -> Result<PeerRecord, StoreError> {
        let key = self.peer_key(name)?;
        let v = self.wait_key(&key, timeout)?;
        self.counted(&key, decode_peer(&key, name, &v))
    }

    /// Waits up to `timeout` for region `mr` of peer `name` to be published.
    /// A record that does not decode is [`StoreError::Record`] (and
    /// counted).
    pub fn wait_mr(&self, name: &str, mr: &str, timeout: Duration) -> Result<MrRecord, StoreError> {
        let key = self.mr_key(name, mr)?;
        let v = self.wait_key(&key, timeout)?;
        self.counted(&key, decode(&key, &v))
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

/// Peer events of a namespace: decoded [`Watch`] events. A join or update
/// whose record does not decode, or names another peer than its key, is
/// skipped and counted ([`Namespace::skipped_records`]): watchers keep the
/// last good record of that name (a later leave is still reported).
#[derive(Debug)]
pub struct PeerWatch {
    prefix: String,
    inner: Watch,
    skipped: Arc<SkippedRecords>,
}

impl PeerWatch {
    /// The next peer event, waiting up to `timeout`; `Ok(None)` if none
    /// came. Bad records are skipped (see [`PeerWatch`]); errors are the
    /// store's (a closed watch).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<PeerEvent>, StoreError> {
        self.inner.recv_map_timeout(timeout, |ev| self.convert(ev))
    }

    /// The event decoded; `None` (counted) for a bad record.
    fn convert(&self, ev: Event) -> Option<PeerEvent> {
        let name = |k: &str| {
            k.strip_prefix(self.prefix.as_str())
                .unwrap_or(k)
                .to_string()
        };
        let decoded = |key: &str, value: &[u8]| match decode_peer(key, &name(key), value) {
            Ok(r) => Some(r),
            Err(e) => {
                self.skipped.note(key, &e);
                None
            }
        };
        Some(match ev {
            Event::Join { key, value } => PeerEvent::Joined(decoded(&key, &value)?),
            Event::Update { key, value } => PeerEvent::Updated(decoded(&key, &value)?),
            Event::Leave { key } => PeerEvent::Left { name: name(&key) },
        })
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
