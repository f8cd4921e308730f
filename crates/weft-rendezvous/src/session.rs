//! A lease kept alive on a background thread, with the entries put under it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::{LeaseId, Store, StoreError};

/// One process's presence in a store: a lease, renewed every third of its
/// TTL by a background thread, and the entries this process put under it.
///
/// When a keep-alive fails because the store is unreachable, the thread
/// retries with exponential backoff (up to a third of the TTL). When the
/// store no longer knows the lease (it expired during an outage, or etcd
/// came back without its data), the thread grants a new lease and puts every
/// entry of the session again, so watchers see this process come back.
///
/// [`Session::close`] (or dropping the session) revokes the lease: a clean
/// leave, which watchers see at once. A killed process's entries disappear
/// when its lease's TTL runs out.
pub struct Session {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

struct Inner {
    store: Arc<dyn Store>,
    ttl: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    lease: LeaseId,
    own: BTreeMap<String, Vec<u8>>,
    stop: bool,
    regrants: u64,
    healthy: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.inner.state.lock();
        f.debug_struct("Session")
            .field("endpoint", &self.inner.store.endpoint())
            .field("lease", &s.lease)
            .field("entries", &s.own.len())
            .finish()
    }
}

impl Session {
    /// Grants a lease of `ttl` on `store` and starts keeping it alive.
    pub fn new(store: Arc<dyn Store>, ttl: Duration) -> Result<Session, StoreError> {
        let ttl = ttl.max(Duration::from_millis(30));
        let lease = store.grant(ttl)?;
        let inner = Arc::new(Inner {
            store,
            ttl,
            state: Mutex::new(State {
                lease,
                own: BTreeMap::new(),
                stop: false,
                regrants: 0,
                healthy: true,
            }),
            cv: Condvar::new(),
        });
        let bg = inner.clone();
        let thread = std::thread::Builder::new()
            .name("weft-rendezvous-keepalive".into())
            .spawn(move || bg.run())
            .map_err(|e| StoreError::Unavailable {
                endpoint: inner.store.endpoint().to_string(),
                op: "spawn keep-alive thread".into(),
                reason: e.to_string(),
            })?;
        Ok(Session {
            inner,
            thread: Some(thread),
        })
    }

    /// The store this session lives in.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The current lease (changes when the session had to re-grant it).
    pub fn lease(&self) -> LeaseId {
        self.inner.state.lock().lease
    }

    /// How many times the session granted a new lease and put its entries
    /// again after the store lost the old one.
    pub fn regrants(&self) -> u64 {
        self.inner.state.lock().regrants
    }

    /// Whether the last keep-alive reached the store.
    pub fn is_healthy(&self) -> bool {
        self.inner.state.lock().healthy
    }

    /// Puts `key` under the session's lease and remembers it, so it is put
    /// again after a re-grant.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let lease = {
            let mut s = self.inner.state.lock();
            s.own.insert(key.to_string(), value.to_vec());
            s.lease
        };
        self.inner.store.put(key, value, Some(lease))
    }

    /// Deletes `key` and forgets it.
    pub fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.state.lock().own.remove(key);
        self.inner.store.delete(key)
    }

    /// Revokes the lease (its entries disappear now) and stops the
    /// keep-alive thread.
    pub fn close(mut self) -> Result<(), StoreError> {
        self.stop();
        let lease = self.inner.state.lock().lease;
        self.inner.store.revoke(lease)
    }

    fn stop(&mut self) {
        self.inner.state.lock().stop = true;
        self.inner.cv.notify_all();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::warn!(
                    endpoint = self.inner.store.endpoint(),
                    "keep-alive thread panicked"
                );
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop();
            let lease = self.inner.state.lock().lease;
            if let Err(e) = self.inner.store.revoke(lease) {
                tracing::debug!(error = %e, "session drop: revoke failed (the lease will expire)");
            }
        }
    }
}

impl Inner {
    fn run(&self) {
        let period = self.ttl / 3;
        let mut wait = period;
        // Set while keep-alives fail: 20 ms, doubling up to `period`.
        let mut backoff: Option<Duration> = None;
        loop {
            let lease = {
                let mut s = self.state.lock();
                if !s.stop {
                    self.cv.wait_for(&mut s, wait);
                }
                if s.stop {
                    return;
                }
                s.lease
            };
            let ok = match self.store.keep_alive(lease) {
                Ok(()) => {
                    let was_healthy = std::mem::replace(&mut self.state.lock().healthy, true);
                    if !was_healthy {
                        tracing::info!(endpoint = self.store.endpoint(), "store reachable again");
                        // The entries may be gone if the store lost its
                        // data; put them again (same values: watchers see
                        // no change where they still exist).
                        self.reput(lease)
                    } else {
                        Ok(())
                    }
                }
                Err(StoreError::LeaseNotFound { .. }) => self.regrant(),
                Err(e) => Err(e),
            };
            match ok {
                Ok(()) => {
                    backoff = None;
                    wait = period;
                }
                Err(e) => {
                    self.state.lock().healthy = false;
                    let next = backoff.map_or(Duration::from_millis(20), |b| b * 2);
                    wait = next.min(period);
                    backoff = Some(wait);
                    tracing::warn!(endpoint = self.store.endpoint(), error = %e, retry_ms = wait.as_millis() as u64, "rendezvous keep-alive failed");
                }
            }
        }
    }

    fn regrant(&self) -> Result<(), StoreError> {
        let lease = self.store.grant(self.ttl)?;
        {
            let mut s = self.state.lock();
            s.lease = lease;
            s.regrants += 1;
        }
        tracing::info!(
            endpoint = self.store.endpoint(),
            lease = lease.0,
            "rendezvous lease re-granted"
        );
        self.reput(lease)
    }

    fn reput(&self, lease: LeaseId) -> Result<(), StoreError> {
        let own = self.state.lock().own.clone();
        for (k, v) in &own {
            self.store.put(k, v, Some(lease))?;
        }
        Ok(())
    }
}
