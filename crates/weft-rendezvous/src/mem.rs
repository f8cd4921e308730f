//! The in-process store: one process (loopback deployments, tests).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

use crate::watch::Event;
use crate::{check_key, LeaseId, Store, StoreError, Watch};

const ENDPOINT: &str = "mem";

/// A store inside this process. Deterministic: lease ids count up from 1,
/// events are delivered synchronously, in operation order.
///
/// Leases expire on the real clock ([`MemStore::new`]; a background thread
/// ends them on time) or on a manual one ([`MemStore::with_manual_clock`]:
/// time moves only through [`MemStore::advance`], for deterministic tests).
pub struct MemStore {
    inner: Arc<Inner>,
    reaper: Option<JoinHandle<()>>,
}

struct Inner {
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    kv: BTreeMap<String, (Vec<u8>, Option<u64>)>,
    leases: BTreeMap<u64, Lease>,
    next_lease: u64,
    watchers: Vec<(String, Sender<Event>)>,
    clock: Clock,
    stop: bool,
}

struct Lease {
    ttl: Duration,
    deadline: Duration,
    keys: BTreeSet<String>,
}

enum Clock {
    Real(Instant),
    Manual(Duration),
}

impl std::fmt::Debug for MemStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.inner.state.lock();
        f.debug_struct("MemStore")
            .field("entries", &s.kv.len())
            .field("leases", &s.leases.len())
            .finish()
    }
}

impl Default for MemStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemStore {
    /// A store whose leases expire on the real clock.
    pub fn new() -> Self {
        let inner = Arc::new(Inner::new(Clock::Real(Instant::now())));
        let weak = Arc::downgrade(&inner);
        let reaper = std::thread::Builder::new()
            .name("weft-rendezvous-mem".into())
            .spawn(move || reap(weak))
            .map_err(|e| tracing::warn!(error = %e, "no lease reaper thread; leases expire on the next operation"))
            .ok();
        MemStore { inner, reaper }
    }

    /// A store whose time moves only through [`MemStore::advance`].
    pub fn with_manual_clock() -> Self {
        MemStore {
            inner: Arc::new(Inner::new(Clock::Manual(Duration::ZERO))),
            reaper: None,
        }
    }

    /// Moves a manual clock forward by `by`, ending the leases that run out
    /// (their entries leave, watchers are told). No effect on a real clock.
    pub fn advance(&self, by: Duration) {
        let mut s = self.inner.state.lock();
        if let Clock::Manual(t) = &mut s.clock {
            *t += by;
        }
        s.expire();
    }
}

impl Drop for MemStore {
    fn drop(&mut self) {
        self.inner.state.lock().stop = true;
        self.inner.cv.notify_all();
        if let Some(t) = self.reaper.take() {
            let _ = t.join();
        }
    }
}

fn reap(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let mut s = inner.state.lock();
        if s.stop {
            return;
        }
        s.expire();
        let now = s.now();
        let next = s.leases.values().map(|l| l.deadline).min();
        let wait = next.map_or(Duration::from_secs(3600), |d| {
            d.saturating_sub(now) + Duration::from_millis(1)
        });
        inner.cv.wait_for(&mut s, wait);
    }
}

impl Inner {
    fn new(clock: Clock) -> Self {
        Inner {
            state: Mutex::new(State {
                kv: BTreeMap::new(),
                leases: BTreeMap::new(),
                next_lease: 1,
                watchers: Vec::new(),
                clock,
                stop: false,
            }),
            cv: Condvar::new(),
        }
    }
}

impl State {
    fn now(&self) -> Duration {
        match self.clock {
            Clock::Real(origin) => origin.elapsed(),
            Clock::Manual(t) => t,
        }
    }

    fn notify(&mut self, ev: &Event) {
        self.watchers.retain(|(prefix, tx)| {
            !ev.key().starts_with(prefix.as_str()) || tx.send(ev.clone()).is_ok()
        });
    }

    fn expire(&mut self) {
        let now = self.now();
        let dead: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            self.end_lease(id);
        }
    }

    fn end_lease(&mut self, id: u64) -> bool {
        let Some(lease) = self.leases.remove(&id) else {
            return false;
        };
        for key in lease.keys {
            if self.kv.remove(&key).is_some() {
                self.notify(&Event::Leave { key });
            }
        }
        true
    }

    fn remove(&mut self, key: &str) -> bool {
        let Some((_, lease)) = self.kv.remove(key) else {
            return false;
        };
        if let Some(l) = lease.and_then(|id| self.leases.get_mut(&id)) {
            l.keys.remove(key);
        }
        self.notify(&Event::Leave {
            key: key.to_string(),
        });
        true
    }
}

fn lease_not_found(lease: LeaseId) -> StoreError {
    StoreError::LeaseNotFound {
        endpoint: ENDPOINT.into(),
        lease: lease.0,
    }
}

impl Store for MemStore {
    fn endpoint(&self) -> &str {
        ENDPOINT
    }

    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), StoreError> {
        check_key(ENDPOINT, key)?;
        let mut s = self.inner.state.lock();
        s.expire();
        if let Some(l) = lease {
            s.leases
                .get_mut(&l.0)
                .ok_or_else(|| lease_not_found(l))?
                .keys
                .insert(key.to_string());
        }
        let old =
            s.kv.insert(key.to_string(), (value.to_vec(), lease.map(|l| l.0)));
        if let Some((_, Some(old_lease))) = &old {
            if Some(*old_lease) != lease.map(|l| l.0) {
                if let Some(ol) = s.leases.get_mut(old_lease) {
                    ol.keys.remove(key);
                }
            }
        }
        let ev = match old {
            None => Some(Event::Join {
                key: key.to_string(),
                value: value.to_vec(),
            }),
            Some((v, _)) if v != value => Some(Event::Update {
                key: key.to_string(),
                value: value.to_vec(),
            }),
            Some(_) => None,
        };
        if let Some(ev) = ev {
            s.notify(&ev);
        }
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut s = self.inner.state.lock();
        s.expire();
        Ok(s.kv.get(key).map(|(v, _)| v.clone()))
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let mut s = self.inner.state.lock();
        s.expire();
        Ok(s.kv
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect())
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut s = self.inner.state.lock();
        s.expire();
        Ok(s.remove(key))
    }

    fn grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let mut s = self.inner.state.lock();
        let id = s.next_lease;
        s.next_lease += 1;
        let deadline = s.now() + ttl;
        s.leases.insert(
            id,
            Lease {
                ttl,
                deadline,
                keys: BTreeSet::new(),
            },
        );
        drop(s);
        self.inner.cv.notify_all();
        Ok(LeaseId(id))
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut s = self.inner.state.lock();
        s.expire();
        let now = s.now();
        let l = s
            .leases
            .get_mut(&lease.0)
            .ok_or_else(|| lease_not_found(lease))?;
        l.deadline = now + l.ttl;
        Ok(())
    }

    fn revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut s = self.inner.state.lock();
        s.expire();
        if s.end_lease(lease.0) {
            Ok(())
        } else {
            Err(lease_not_found(lease))
        }
    }

    fn watch(&self, prefix: &str) -> Result<Watch, StoreError> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut s = self.inner.state.lock();
        s.expire();
        for (k, (v, _)) in s.kv.range(prefix.to_string()..) {
            if !k.starts_with(prefix) {
                break;
            }
            // The receiver is alive (held right here).
            let _ = tx.send(Event::Join {
                key: k.clone(),
                value: v.clone(),
            });
        }
        s.watchers.push((prefix.to_string(), tx));
        Ok(Watch::new(rx, ENDPOINT, prefix, Box::new(())))
    }
}
