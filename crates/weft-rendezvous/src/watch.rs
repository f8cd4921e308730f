//! Watch events and the receiving end of a watch.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use crate::StoreError;

/// A change under a watched prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A key appeared (or existed when the watch started).
    Join {
        /// The key.
        key: String,
        /// Its value.
        value: Vec<u8>,
    },
    /// An existing key got a different value.
    Update {
        /// The key.
        key: String,
        /// The new value.
        value: Vec<u8>,
    },
    /// A key was deleted or its lease ended.
    Leave {
        /// The key.
        key: String,
    },
}

impl Event {
    /// The key the event is about.
    pub fn key(&self) -> &str {
        match self {
            Event::Join { key, .. } | Event::Update { key, .. } | Event::Leave { key } => key,
        }
    }
}

/// The receiving end of [`crate::Store::watch`]. Dropping it stops the
/// watch (its background thread, where the backend has one, ends).
pub struct Watch {
    rx: Receiver<Event>,
    endpoint: String,
    prefix: String,
    _guard: Box<dyn Send>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("endpoint", &self.endpoint)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Watch {
    pub(crate) fn new(
        rx: Receiver<Event>,
        endpoint: &str,
        prefix: &str,
        guard: Box<dyn Send>,
    ) -> Self {
        Watch {
            rx,
            endpoint: endpoint.to_string(),
            prefix: prefix.to_string(),
            _guard: guard,
        }
    }

    /// The watched prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn closed(&self) -> StoreError {
        StoreError::WatchClosed {
            endpoint: self.endpoint.clone(),
            prefix: self.prefix.clone(),
        }
    }

    /// The next event, waiting up to `timeout`; `Ok(None)` when none came.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Event>, StoreError> {
        match self.rx.recv_timeout(timeout) {
            Ok(e) => Ok(Some(e)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.closed()),
        }
    }

    /// The next event `f` maps to `Some`, waiting up to `timeout` in all;
    /// events it maps to `None` are dropped. `Ok(None)` when none came.
    pub(crate) fn recv_map_timeout<E>(
        &self,
        timeout: Duration,
        mut f: impl FnMut(Event) -> Option<E>,
    ) -> Result<Option<E>, StoreError> {
        let deadline = std::time::Instant::now().checked_add(timeout);
        loop {
            let left = deadline.map_or(timeout, |d| {
                d.saturating_duration_since(std::time::Instant::now())
            });
            let Some(ev) = self.recv_timeout(left)? else {
                return Ok(None);
            };
            if let Some(e) = f(ev) {
                return Ok(Some(e));
            }
        }
    }

    /// The next event if one is queued.
    pub fn try_recv(&self) -> Result<Option<Event>, StoreError> {
        match self.rx.try_recv() {
            Ok(e) => Ok(Some(e)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(self.closed()),
        }
    }

    /// Waits up to `timeout` for an event `pred` accepts, discarding the
    /// others; [`StoreError::Timeout`] if none came.
    pub fn wait_for(
        &self,
        timeout: Duration,
        what: &str,
        mut pred: impl FnMut(&Event) -> bool,
    ) -> Result<Event, StoreError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.recv_timeout(left)? {
                Some(e) if pred(&e) => return Ok(e),
                Some(_) => {}
                None => {
                    return Err(StoreError::Timeout {
                        endpoint: self.endpoint.clone(),
                        what: what.to_string(),
                        waited_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                    })
                }
            }
        }
    }
}

/// The events that turn snapshot `old` into `new` (joins and updates in key
/// order, then leaves in key order). Identical values give no event.
pub(crate) fn diff(old: &BTreeMap<String, Vec<u8>>, new: &BTreeMap<String, Vec<u8>>) -> Vec<Event> {
    let mut out = Vec::new();
    for (k, v) in new {
        match old.get(k) {
            None => out.push(Event::Join {
                key: k.clone(),
                value: v.clone(),
            }),
            Some(o) if o != v => out.push(Event::Update {
                key: k.clone(),
                value: v.clone(),
            }),
            Some(_) => {}
        }
    }
    for k in old.keys() {
        if !new.contains_key(k) {
            out.push(Event::Leave { key: k.clone() });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_reports_joins_updates_leaves() {
        let old: BTreeMap<String, Vec<u8>> = [
            ("a".into(), vec![1]),
            ("b".into(), vec![2]),
            ("c".into(), vec![3]),
        ]
        .into();
        let new: BTreeMap<String, Vec<u8>> = [
            ("a".into(), vec![1]),
            ("b".into(), vec![9]),
            ("d".into(), vec![4]),
        ]
        .into();
        assert_eq!(
            diff(&old, &new),
            vec![
                Event::Update {
                    key: "b".into(),
                    value: vec![9]
                },
                Event::Join {
                    key: "d".into(),
                    value: vec![4]
                },
                Event::Leave { key: "c".into() },
            ]
        );
        assert!(diff(&new, &new).is_empty());
    }
}
