//! Finding decoders and prefillers through a rendezvous store
//! (`weft::rendezvous`): each process announces its role's record under a
//! session lease; a decoder follows the prefillers (adding each that joins,
//! failing the requests of each that leaves), a prefiller follows the
//! decoders (dropping the work of each that leaves). A record leaves when
//! its process closes its session (a clean leave) or dies (its lease runs
//! out).
//!
//! Keys: `weft/<namespace>/app/kv-decoders/<name>` and
//! `weft/<namespace>/app/kv-prefillers/<name>`, each a [`KvPeer`].
//!
//! A peer acted on as departed stays dead for its address: if the same
//! address comes back after the grace, the decoder keeps refusing routes
//! to it and the prefiller keeps ignoring it. A restarted process has a new
//! engine, hence a new address, and joins as a new peer.

use crate::{Decoder, KvError, PeerLoss, Prefiller, PrefillerId};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weft::rendezvous::{Namespace, RecordEvent, Records, Session, Store, StoreError};
use weft::GroupAddress;

/// The record kind decoders announce themselves under.
pub const DECODERS: &str = "kv-decoders";
/// The record kind prefillers announce themselves under.
pub const PREFILLERS: &str = "kv-prefillers";

/// What a decoder or prefiller publishes: its engine's address (as the
/// engine gave it) and its generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvPeer {
    /// The address its messages come from and writes go to
    /// (`Decoder::address` / `Prefiller::address`).
    pub addr: GroupAddress,
    /// Bumped by the process each time it restarts.
    pub generation: u64,
}

/// The decoders and prefillers of one namespace of a store.
#[derive(Debug, Clone)]
pub struct KvRendezvous {
    decoders: Records<KvPeer>,
    prefillers: Records<KvPeer>,
    grace: Duration,
}

/// How long a follower waits, after a record left, for it to come back
/// with the same address before it acts on the leave (see
/// [`KvRendezvous::with_grace`]).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(1);

fn store_err(store: &Arc<dyn Store>, what: &'static str) -> impl FnOnce(StoreError) -> KvError {
    let store = store.endpoint().to_string();
    move |e| KvError::Rendezvous {
        what,
        store,
        error: e.to_string(),
    }
}

impl KvRendezvous {
    /// The KvCache roles of namespace `namespace` in `store`.
    pub fn new(store: Arc<dyn Store>, namespace: &str) -> Self {
        let ns = Namespace::new(store, namespace);
        KvRendezvous {
            decoders: Records::new(&ns, DECODERS),
            prefillers: Records::new(&ns, PREFILLERS),
            grace: DEFAULT_GRACE,
        }
    }

    /// Sets how long followers wait after a record left before acting on
    /// it ([`DEFAULT_GRACE`]). A record can leave and come back with the
    /// same address when its process's session had to re-grant its lease
    /// (a keep-alive delayed past the TTL, a store that lost its data);
    /// within the grace that is no departure. The follower's members drop
    /// the record at once either way, so nothing new is routed to it.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        self.decoders.namespace().store()
    }

    /// The decoders' records.
    pub fn decoders(&self) -> &Records<KvPeer> {
        &self.decoders
    }

    /// The prefillers' records.
    pub fn prefillers(&self) -> &Records<KvPeer> {
        &self.prefillers
    }

    /// Announces `dec` as decoder `name` under `session`'s lease.
    pub fn announce_decoder(
        &self,
        session: &Session,
        name: &str,
        dec: &Decoder,
        generation: u64,
    ) -> Result<(), KvError> {
        let rec = KvPeer {
            addr: dec.address(),
            generation,
        };
        self.decoders
            .publish(session, name, &rec)
            .map_err(store_err(self.store(), "announce decoder"))
    }

    /// Announces `pre` as prefiller `name` under `session`'s lease.
    pub fn announce_prefiller(
        &self,
        session: &Session,
        name: &str,
        pre: &Prefiller,
        generation: u64,
    ) -> Result<(), KvError> {
        let rec = KvPeer {
            addr: pre.address(),
            generation,
        };
        self.prefillers
            .publish(session, name, &rec)
            .map_err(store_err(self.store(), "announce prefiller"))
    }

    /// Withdraws decoder `name` of `session` (a clean leave: prefillers
    /// drop what they still serve for it, so drain its requests first).
    pub fn withdraw_decoder(&self, session: &Session, name: &str) -> Result<bool, KvError> {
        self.decoders
            .withdraw(session, name)
            .map_err(store_err(self.store(), "withdraw decoder"))
    }

    /// Withdraws prefiller `name` of `session` (decoders fail its requests
    /// in flight and stop routing to it).
    pub fn withdraw_prefiller(&self, session: &Session, name: &str) -> Result<bool, KvError> {
        self.prefillers
            .withdraw(session, name)
            .map_err(store_err(self.store(), "withdraw prefiller"))
    }

    /// Follows the prefillers for `dec`: each one that joins is added
    /// ([`Decoder::add_prefiller`]: greeted, heartbeated), each one that
    /// leaves is removed ([`Decoder::remove_prefiller`]: its requests fail
    /// with [`KvError::PrefillerDead`], [`PeerLoss::Left`]). The
    /// [`Follower`]'s members carry the [`PrefillerId`]s to route to.
    pub fn follow_prefillers(&self, dec: &Arc<Decoder>) -> Result<Follower, KvError> {
        let weak = Arc::downgrade(dec);
        let store = self.store().endpoint().to_string();
        Follower::start(
            &self.prefillers,
            "kv-follow-prefillers",
            self.grace,
            move |ch| {
                let dec = weak.upgrade()?;
                match ch {
                    Change::Join(p) => Some(dec.add_prefiller(p.addr.clone())),
                    Change::Leave(p) => {
                        dec.remove_prefiller(
                            &p.addr,
                            PeerLoss::Left {
                                store: store.clone(),
                            },
                        );
                        None
                    }
                }
            },
        )
    }

    /// Follows the decoders for `pre`: each one that leaves is removed
    /// ([`Prefiller::remove_decoder`]: what is still served for it ends
    /// with [`KvError::DecoderDead`], nothing more is written to it).
    pub fn follow_decoders(&self, pre: &Arc<Prefiller>) -> Result<Follower, KvError> {
        let weak = Arc::downgrade(pre);
        let store = self.store().endpoint().to_string();
        Follower::start(
            &self.decoders,
            "kv-follow-decoders",
            self.grace,
            move |ch| {
                if let (Change::Leave(p), Some(pre)) = (ch, weak.upgrade()) {
                    pre.remove_decoder(
                        &p.addr,
                        PeerLoss::Left {
                            store: store.clone(),
                        },
                    );
                }
                None
            },
        )
    }

    /// Follows the decoders without acting on them (a router picking a
    /// decoder per request, a monitor).
    pub fn watch_decoders(&self) -> Result<Follower, KvError> {
        Follower::start(&self.decoders, "kv-watch-decoders", self.grace, |_| None)
    }
}

/// A change a [`Follower`] acts on.
#[derive(Debug, Clone, Copy)]
pub enum Change<'a> {
    /// This peer joined (or came back with a new address).
    Join(&'a KvPeer),
    /// This peer left (or its old address was replaced).
    Leave(&'a KvPeer),
}

/// A peer a [`Follower`] sees in the store now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its name in the namespace.
    pub name: String,
    /// Its record.
    pub peer: KvPeer,
    /// For a decoder following prefillers: the id to route to.
    pub prefiller: Option<PrefillerId>,
}

#[derive(Default)]
struct FollowState {
    members: BTreeMap<String, Member>,
    /// Left, not yet acted on: since when.
    leaving: BTreeMap<String, (Member, Instant)>,
    joins: u64,
    leaves: u64,
    closed: Option<String>,
}

struct FollowShared {
    state: Mutex<FollowState>,
    cv: Condvar,
    stop: AtomicBool,
}

/// A background thread that watches one kind of KvCache records and keeps
/// the current members (by name). Dropping it stops the thread.
pub struct Follower {
    sh: Arc<FollowShared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Follower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.sh.state.lock();
        f.debug_struct("Follower")
            .field("members", &s.members.len())
            .field("joins", &s.joins)
            .field("leaves", &s.leaves)
            .finish()
    }
}

impl Follower {
    /// Watches `records`, calling `on` for every join and leave (from the
    /// follower's thread) and keeping what it returns with the member. A
    /// leave is acted on once the record stayed away for `grace`; a record
    /// that comes back with the same address within it keeps its member.
    pub fn start(
        records: &Records<KvPeer>,
        name: &'static str,
        grace: Duration,
        mut on: impl FnMut(Change<'_>) -> Option<PrefillerId> + Send + 'static,
    ) -> Result<Follower, KvError> {
        let store = records.namespace().store().clone();
        let watch = records.watch().map_err(store_err(&store, "watch"))?;
        let sh = Arc::new(FollowShared {
            state: Mutex::new(FollowState::default()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let bg = sh.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while !bg.stop.load(Ordering::Acquire) {
                    bg.expire(grace, &mut on);
                    let ev = match watch.recv_timeout(Duration::from_millis(20)) {
                        Ok(Some(ev)) => ev,
                        Ok(None) => continue,
                        Err(e @ StoreError::WatchClosed { .. }) => {
                            tracing::warn!("{name}: {e}");
                            bg.state.lock().closed = Some(e.to_string());
                            bg.cv.notify_all();
                            return;
                        }
                        Err(e) => {
                            tracing::warn!("{name}: skipping a record: {e}");
                            continue;
                        }
                    };
                    bg.apply(ev, &mut on);
                }
            })
            .map_err(|e| KvError::Spawn {
                name,
                error: e.to_string(),
            })?;
        Ok(Follower {
            sh,
            thread: Some(thread),
        })
    }

    /// The members now, by name.
    pub fn members(&self) -> Vec<Member> {
        self.sh.state.lock().members.values().cloned().collect()
    }

    /// Joins and leaves seen so far.
    pub fn counts(&self) -> (u64, u64) {
        let s = self.sh.state.lock();
        (s.joins, s.leaves)
    }

    /// Why the watch ended, if it did (the store went away).
    pub fn closed(&self) -> Option<String> {
        self.sh.state.lock().closed.clone()
    }

    /// Waits up to `timeout` until `pred` holds for the members; whether it
    /// did.
    pub fn wait_until(&self, timeout: Duration, mut pred: impl FnMut(&[Member]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = self.sh.state.lock();
        loop {
            let members: Vec<Member> = s.members.values().cloned().collect();
            if pred(&members) {
                return true;
            }
            if s.closed.is_some() || self.sh.cv.wait_until(&mut s, deadline).timed_out() {
                let members: Vec<Member> = s.members.values().cloned().collect();
                return pred(&members);
            }
        }
    }

    /// Stops following (the members stay as they were).
    pub fn stop(&mut self) {
        self.sh.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::warn!("rendezvous follower thread panicked");
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.stop();
    }
}

impl FollowShared {
    /// Acts on the leaves older than `grace`.
    fn expire(&self, grace: Duration, on: &mut impl FnMut(Change<'_>) -> Option<PrefillerId>) {
        let now = Instant::now();
        let gone: Vec<Member> = {
            let mut s = self.state.lock();
            let names: Vec<String> = s
                .leaving
                .iter()
                .filter(|(_, (_, t))| now.saturating_duration_since(*t) >= grace)
                .map(|(n, _)| n.clone())
                .collect();
            names
                .iter()
                .filter_map(|n| s.leaving.remove(n).map(|(m, _)| m))
                .collect()
        };
        for m in gone {
            on(Change::Leave(&m.peer));
            self.state.lock().leaves += 1;
            self.cv.notify_all();
        }
    }

    fn apply(
        &self,
        ev: RecordEvent<KvPeer>,
        on: &mut impl FnMut(Change<'_>) -> Option<PrefillerId>,
    ) {
        let (name, rec) = match ev {
            RecordEvent::Joined { name, rec } | RecordEvent::Updated { name, rec } => {
                (name, Some(rec))
            }
            RecordEvent::Left { name } => (name, None),
            _ => return,
        };
        let Some(rec) = rec else {
            // Out of the members now; acted on after the grace.
            let mut s = self.state.lock();
            if let Some(m) = s.members.remove(&name) {
                s.leaving.insert(name, (m, Instant::now()));
            }
            drop(s);
            self.cv.notify_all();
            return;
        };
        let old = {
            let mut s = self.state.lock();
            match s.leaving.remove(&name) {
                Some((m, _)) => Some(m),
                None => s.members.remove(&name),
            }
        };
        // The callbacks run without the lock: they step the decoder or
        // prefiller, whose own callbacks may read the members.
        let member = match old {
            // Same address (back within the grace, a new generation, a
            // re-put): the same peer.
            Some(mut m) if m.peer.addr == rec.addr => {
                m.peer = rec;
                m
            }
            old => {
                if let Some(o) = old {
                    on(Change::Leave(&o.peer));
                    self.state.lock().leaves += 1;
                }
                let prefiller = on(Change::Join(&rec));
                self.state.lock().joins += 1;
                Member {
                    name: name.clone(),
                    peer: rec,
                    prefiller,
                }
            }
        };
        self.state.lock().members.insert(name, member);
        self.cv.notify_all();
    }
}
