//! An application's own records in a namespace: typed, versioned values
//! under `weft/<namespace>/app/<kind>/<name>`.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::{de::DeserializeOwned, Serialize};

use crate::record::{decode, encode, SkippedRecords};
use crate::watch::Event;
use crate::{Namespace, Session, StoreError, Watch};

/// The records of one kind (`decoders`, `ranks`, ...) an application keeps
/// in a [`Namespace`], each a `T` under a name. Values are encoded like the
/// weft records (postcard behind the [`crate::FORMAT_VERSION`]), so a record
/// of another format or type is refused with [`StoreError::Record`].
///
/// Put the engine's own values in `T` (a `GroupAddress` from
/// `engine.main_address()`, the `MrDesc`s `reg_mr` returned) and read them
/// back whole: peers never rebuild them from parts.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use weft_rendezvous::{MemStore, Namespace, RecordEvent, Records, Session, Store};
///
/// let store: Arc<dyn Store> = Arc::new(MemStore::new());
/// let ns = Namespace::new(store.clone(), "demo");
/// let workers: Records<(u32, String)> = Records::new(&ns, "workers");
/// let watch = workers.watch()?;
/// let session = Session::new(store, Duration::from_secs(5))?;
/// workers.publish(&session, "w0", &(7, "ready".into()))?;
/// let ev = watch.recv_timeout(Duration::from_secs(5))?;
/// assert_eq!(ev, Some(RecordEvent::Joined { name: "w0".into(), rec: (7, "ready".into()) }));
/// session.close()?; // a clean leave
/// let ev = watch.recv_timeout(Duration::from_secs(5))?;
/// assert_eq!(ev, Some(RecordEvent::Left { name: "w0".into() }));
/// # Ok::<(), weft_rendezvous::StoreError>(())
/// ```
pub struct Records<T> {
    ns: Namespace,
    kind: String,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Records<T> {
    fn clone(&self) -> Self {
        Records {
            ns: self.ns.clone(),
            kind: self.kind.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for Records<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("ns", &self.ns)
            .field("kind", &self.kind)
            .finish()
    }
}

/// A change to the records of one kind.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordEvent<T> {
    /// A record appeared (or was there when the watch started).
    Joined {
        /// Its name.
        name: String,
        /// Its value.
        rec: T,
    },
    /// A record got a new value.
    Updated {
        /// Its name.
        name: String,
        /// The new value.
        rec: T,
    },
    /// A record was withdrawn or its lease ended.
    Left {
        /// Its name.
        name: String,
    },
}

impl<T> RecordEvent<T> {
    /// The record's name.
    pub fn name(&self) -> &str {
        match self {
            RecordEvent::Joined { name, .. }
            | RecordEvent::Updated { name, .. }
            | RecordEvent::Left { name } => name,
        }
    }
}

impl<T: Serialize + DeserializeOwned> Records<T> {
    /// The records of kind `kind` in `ns`.
    pub fn new(ns: &Namespace, kind: &str) -> Self {
        Records {
            ns: ns.clone(),
            kind: kind.to_string(),
            _t: PhantomData,
        }
    }

    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    fn prefix(&self) -> String {
        format!("weft/{}/app/{}/", self.ns.name(), self.kind)
    }

    fn key(&self, name: &str) -> Result<String, StoreError> {
        self.ns.check(&self.kind)?;
        self.ns.check(name)?;
        Ok(format!("{}{name}", self.prefix()))
    }

    /// Publishes `rec` as `name` under `session`'s lease (it disappears when
    /// the session closes or its lease runs out).
    pub fn publish(&self, session: &Session, name: &str, rec: &T) -> Result<(), StoreError> {
        let key = self.key(name)?;
        session.put(&key, &encode(&key, rec)?)
    }

    /// Withdraws record `name` of `session` (a clean leave of that record
    /// alone); whether it existed.
    pub fn withdraw(&self, session: &Session, name: &str) -> Result<bool, StoreError> {
        session.delete(&self.key(name)?)
    }

    /// Record `name`, if present. A record that does not decode is
    /// [`StoreError::Record`] (and counted in
    /// [`Namespace::skipped_records`]).
    pub fn get(&self, name: &str) -> Result<Option<T>, StoreError> {
        let key = self.key(name)?;
        self.ns
            .store()
            .get(&key)?
            .map(|v| self.ns.counted(&key, decode(&key, &v)))
            .transpose()
    }

    /// Every record of this kind, by name. A record that does not decode
    /// (damaged bytes, another format version, another type under the
    /// same kind) is skipped and counted ([`Namespace::skipped_records`]),
    /// as [`RecordWatch`] does, so one foreign record cannot hide every
    /// other one.
    pub fn list(&self) -> Result<Vec<(String, T)>, StoreError> {
        let prefix = self.prefix();
        Ok(self
            .ns
            .store()
            .list(&prefix)?
            .into_iter()
            .filter_map(|(k, v)| {
                let r = self.ns.counted(&k, decode(&k, &v)).ok()?;
                Some((name_of(&prefix, &k), r))
            })
            .collect())
    }

    /// Waits up to `timeout` for record `name` to be published. A record
    /// that does not decode is [`StoreError::Record`] (and counted).
    pub fn wait(&self, name: &str, timeout: Duration) -> Result<T, StoreError> {
        let key = self.key(name)?;
        let v = self.ns.wait_key(&key, timeout)?;
        self.ns.counted(&key, decode(&key, &v))
    }

    /// Watches the records of this kind: one [`RecordEvent::Joined`] per
    /// record already there, then every change.
    pub fn watch(&self) -> Result<RecordWatch<T>, StoreError> {
        self.ns.check(&self.kind)?;
        let prefix = self.prefix();
        Ok(RecordWatch {
            inner: self.ns.store().watch(&prefix)?,
            prefix,
            skipped: Arc::clone(self.ns.skipped()),
            _t: PhantomData,
        })
    }
}

fn name_of(prefix: &str, key: &str) -> String {
    key.strip_prefix(prefix).unwrap_or(key).to_string()
}

/// Decoded events of one kind of records (see [`Records::watch`]). A join
/// or update whose record does not decode is skipped and counted
/// ([`Namespace::skipped_records`]): watchers keep the last good value of
/// that name (a later leave is still reported).
pub struct RecordWatch<T> {
    inner: Watch,
    prefix: String,
    skipped: Arc<SkippedRecords>,
    _t: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for RecordWatch<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordWatch")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl<T: DeserializeOwned> RecordWatch<T> {
    /// The event decoded; `None` (counted) for a record that does not
    /// decode.
    fn convert(&self, ev: Event) -> Option<RecordEvent<T>> {
        let decoded = |key: &str, value: &[u8]| match decode(key, value) {
            Ok(r) => Some(r),
            Err(e) => {
                self.skipped.note(key, &e);
                None
            }
        };
        Some(match ev {
            Event::Join { key, value } => RecordEvent::Joined {
                rec: decoded(&key, &value)?,
                name: name_of(&self.prefix, &key),
            },
            Event::Update { key, value } => RecordEvent::Updated {
                rec: decoded(&key, &value)?,
                name: name_of(&self.prefix, &key),
            },
            Event::Leave { key } => RecordEvent::Left {
                name: name_of(&self.prefix, &key),
            },
        })
    }

    /// The next event, waiting up to `timeout`; `Ok(None)` if none came.
    /// Records that do not decode are skipped (see [`RecordWatch`]);
    /// errors are the store's (a closed watch).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<RecordEvent<T>>, StoreError> {
        self.inner.recv_map_timeout(timeout, |ev| self.convert(ev))
    }

    /// The next event if one is queued (bad records skipped).
    pub fn try_recv(&self) -> Result<Option<RecordEvent<T>>, StoreError> {
        while let Some(ev) = self.inner.try_recv()? {
            if let Some(ev) = self.convert(ev) {
                return Ok(Some(ev));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemStore, Store};
    use std::sync::Arc;

    #[test]
    fn records_publish_list_watch_and_expire() {
        let store = Arc::new(MemStore::with_manual_clock());
        let dynstore: Arc<dyn Store> = store.clone();
        let ns = Namespace::new(dynstore.clone(), "t");
        let a: Records<Vec<u8>> = Records::new(&ns, "a");
        let b: Records<u64> = Records::new(&ns, "b");
        let w = a.watch().unwrap();
        let lease = dynstore.grant(Duration::from_secs(1)).unwrap();
        // A record put under a bare lease that nobody keeps alive.
        let key = a.key("x").unwrap();
        dynstore
            .put(&key, &encode(&key, &vec![1u8, 2]).unwrap(), Some(lease))
            .unwrap();
        assert_eq!(a.get("x").unwrap(), Some(vec![1, 2]));
        assert_eq!(a.list().unwrap(), vec![("x".to_string(), vec![1, 2])]);
        assert!(b.list().unwrap().is_empty(), "kinds are separate");
        // A record of another type does not decode.
        let bad: Records<(u64, u64, u64, u64)> = Records::new(&ns, "a");
        assert!(matches!(bad.get("x"), Err(StoreError::Record { .. })));
        assert!(a.get("y/z").is_err(), "names contain no '/'");
        assert_eq!(
            w.try_recv().unwrap(),
            Some(RecordEvent::Joined {
                name: "x".into(),
                rec: vec![1, 2]
            })
        );
        store.advance(Duration::from_secs(2));
        assert_eq!(
            w.try_recv().unwrap(),
            Some(RecordEvent::Left { name: "x".into() })
        );
        assert_eq!(a.get("x").unwrap(), None);
    }
}
