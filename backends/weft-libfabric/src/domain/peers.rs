//! The peer table: every address added (by the user, or by a message that
//! arrived from it), its libfabric address and its per-peer counters.

use std::collections::BTreeMap;
use std::time::Instant;

use weft_transport::{NetAddr, PeerId, TransportError};

use super::shm::shm_peer;
use super::LibfabricDomain;
use crate::ffi;

pub(super) struct Peer {
    pub(super) addr: NetAddr,
    pub(super) fi_addr: u64,
    /// Why the peer is considered unreachable; posts to it then fail at once.
    pub(super) dead: Option<String>,
    /// Removed by [`weft_transport::Domain::remove_peer`]: its work fails
    /// with `PeerRemoved` and its address maps to a new peer if added again.
    pub(super) removed: bool,
    /// Removed to make room for a newer passive peer: no one outside the
    /// domain ever held its id, so once its AV entry is gone its slot is
    /// reused.
    pub(super) evicted: bool,
    /// Our operations to it not yet completed.
    pub(super) inflight: usize,
    /// Since when posts to it (with nothing in flight) keep failing with
    /// EAGAIN: the provider is still trying to connect.
    pub(super) eagain_since: Option<Instant>,
    /// Its own transmit endpoint (`peer_eps`), once opened, and its
    /// address in that endpoint's AV.
    pub(super) ep: Option<(usize, u64)>,
    /// Process id of an `shm` peer, for liveness checks.
    pub(super) pid: Option<i32>,
    /// An shm peer's key table, which WRITEs to it are checked against.
    pub(super) keys: Option<super::keys::PeerKeys>,
    /// Its region is watched (`shm::watch_region`) until it is removed or
    /// the domain dropped.
    pub(super) watched: bool,
    /// The region name of an shm peer in this same process: writes check
    /// that its engine is still open (`shm::local_open`).
    pub(super) local: Option<String>,
    /// Its entries in the EAGAIN backlog: while there are any, new work to
    /// the peer joins the backlog behind them without a futile attempt.
    pub(super) backlogged: usize,
    /// Operations issued to it so far (the issue number of the latest).
    pub(super) issued: u64,
    /// tcp: issue number of the latest operation the peer rejected by
    /// closing the connection (a remote access violation).
    pub(super) rejected: Option<u64>,
    /// Operations to it resolved so far (wrapping): its liveness signal.
    pub(super) done: u64,
    /// `done` at the previous sweep.
    pub(super) done_seen: u64,
    /// Since which sweep it has had work in flight and nothing resolved.
    pub(super) stalled_since: Option<Instant>,
}

/// Peers by address and by handle (`PeerId` is the index in `table`).
#[derive(Default)]
pub(super) struct Peers {
    pub(super) by_addr: BTreeMap<NetAddr, PeerId>,
    pub(super) table: Vec<Peer>,
    /// Removed peers whose in-flight work the next `poll` fails.
    pub(super) removing: Vec<PeerId>,
    /// Removed peers whose AV entry is still to be removed (once nothing
    /// of theirs, and no zombie slot, is left inside libfabric).
    pub(super) av_stale: Vec<PeerId>,
    /// Peers with an entry in the AV.
    pub(super) in_av: usize,
}

impl LibfabricDomain {
    /// The peer of handle `peer`.
    pub(super) fn peer(&self, peer: PeerId) -> Result<&Peer, TransportError> {
        usize::try_from(peer.0)
            .ok()
            .and_then(|i| self.peers.table.get(i))
            .ok_or_else(|| self.invalid(format!("unknown peer handle {}", peer.0)))
    }

    /// The address of `peer` (empty if unknown), for errors.
    pub(super) fn peer_addr(&self, peer: PeerId) -> NetAddr {
        self.peer(peer)
            .map(|p| p.addr.clone())
            .unwrap_or_else(|_| NetAddr(Vec::new()))
    }

    /// Rejects addresses that cannot be endpoint names of this provider
    /// before libfabric sees them (tcp;ofi_rxm's AV misbehaves after
    /// inserting garbage sockaddrs).
    fn check_addr_format(&self, addr: &NetAddr) -> Result<(), TransportError> {
        let own = &self.nic.addr.0;
        let fmt = self._info.addr_format;
        let bad = |why: &str| TransportError::InvalidArgument {
            nic: self.nic_name(),
            what: format!("peer address {addr}: {why}"),
        };
        if fmt == ffi::FI_ADDR_STR || self.is_shm {
            return Ok(());
        }
        if addr.0.len() != own.len() {
            return Err(bad(&format!(
                "{} bytes, this provider's addresses have {}",
                addr.0.len(),
                own.len()
            )));
        }
        if ffi::SOCKADDR_FORMATS.contains(&fmt) && addr.0.get(..2) != own.get(..2) {
            return Err(bad("wrong socket address family"));
        }
        Ok(())
    }
}

impl LibfabricDomain {
    /// Whether `addr` can be a new peer's address here (checked before a
    /// passive peer is removed to make room for it).
    pub(super) fn check_new_addr(&self, addr: &NetAddr) -> Result<(), TransportError> {
        if addr.0.is_empty() || addr.0.len() > 4096 {
            return Err(self.invalid(format!(
                "peer address of {} bytes is not a libfabric endpoint name",
                addr.0.len()
            )));
        }
        self.check_addr_format(addr)
    }

    /// [`weft_transport::Domain::add_peer`]: the peer of `addr`, added on
    /// first use.
    pub(super) fn insert_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        if let Some(p) = self.peers.by_addr.get(addr) {
            return Ok(*p);
        }
        self.check_new_addr(addr)?;
        let (pid, dead) = if self.is_shm {
            shm_peer(&addr.0)
        } else {
            (None, None)
        };
        let fi_addr = self.res.av_insert(&addr.0).map_err(|e| match e {
            TransportError::Provider { message, code, .. } => TransportError::PeerUnreachable {
                nic: self.nic_name(),
                peer: addr.clone(),
                reason: format!("fi_av_insert rejected the address: {message} (code {code})"),
            },
            other => other,
        })?;
        // A live shm peer's region is watched for its owner dying with
        // the region lock held (`shm::watch_region`).
        let mut watched = false;
        let local = pid
            .filter(|&p| u32::try_from(p).ok() == Some(std::process::id()))
            .and_then(|_| super::shm::region_name(&addr.0));
        let mut keys = None;
        if let (Some(pid), None) = (pid, &dead) {
            if let Some(name) = super::shm::region_name(&addr.0) {
                super::shm::watch_region(&name, pid);
                watched = true;
                keys = super::keys::PeerKeys::open(&name);
            }
        }
        let peer = Peer {
            addr: addr.clone(),
            fi_addr,
            dead,
            removed: false,
            evicted: false,
            inflight: 0,
            eagain_since: None,
            ep: None,
            pid,
            keys,
            watched,
            local,
            backlogged: 0,
            issued: 0,
            rejected: None,
            done: 0,
            done_seen: 0,
            stalled_since: None,
        };
        let id = match self.passive.take_free(&self.peers.removing) {
            Some(id) => {
                self.peers.table[id.0 as usize] = peer;
                id
            }
            None => {
                let id = u32::try_from(self.peers.table.len())
                    .map_err(|_| self.invalid("too many peers"))?;
                self.peers.table.push(peer);
                PeerId(id)
            }
        };
        self.peers.by_addr.insert(addr.clone(), id);
        self.peers.in_av += 1;
        Ok(id)
    }
}

impl LibfabricDomain {
    /// [`weft_transport::Domain::remove_peer`]: the handle is retired (posts
    /// naming it fail with `PeerRemoved`), its address unmapped (adding it
    /// again inserts a new AV entry under a new handle), and the next `poll`
    /// fails its work: backlogged and limbo entries, SENDs waiting for an
    /// answer, and operations inside libfabric (their slots become zombies
    /// until the provider hands them back). Its AV entry is removed
    /// (`fi_av_remove`) once nothing can still use it
    /// (`retire_av_entries`).
    pub(super) fn remove(&mut self, peer: PeerId) {
        self.passive.list.remove(peer);
        let Some(p) = self.peers.table.get_mut(peer.0 as usize) else {
            return;
        };
        if p.removed {
            return;
        }
        p.removed = true;
        p.dead = Some("removed".into());
        p.keys = None;
        let addr = p.addr.clone();
        if std::mem::take(&mut p.watched) {
            if let Some(name) = super::shm::region_name(&addr.0) {
                super::shm::unwatch_region(&name);
            }
        }
        if self.peers.by_addr.get(&addr) == Some(&peer) {
            self.peers.by_addr.remove(&addr);
        }
        self.peers.removing.push(peer);
        self.peers.av_stale.push(peer);
        self.peer_eps.check = true;
        tracing::debug!(nic = %self.nic.name, peer = %addr, "peer removed");
    }

    /// Removes the AV entries of removed peers once that is safe: nothing
    /// of theirs in flight, backlogged or in limbo, and no zombie slot in
    /// the domain (a zombie's peer is not recorded). Where that never holds
    /// (shm: operations to a killed peer are never handed back) the entry
    /// stays.
    ///
    /// shm keeps every entry: `fi_av_remove` of a peer whose region is gone
    /// crashes shm 1.17 (SIGSEGV, seen in `tests/lifecycle.rs`).
    pub(super) fn retire_av_entries(&mut self) {
        if self.is_shm {
            self.peers.av_stale.clear();
            return;
        }
        if self.peers.av_stale.is_empty()
            || self
                .slots
                .table
                .iter()
                .any(|s| matches!(s, super::slots::SlotUse::Zombie))
        {
            return;
        }
        let stale = std::mem::take(&mut self.peers.av_stale);
        for peer in stale {
            let busy = self
                .peers
                .table
                .get(peer.0 as usize)
                .is_some_and(|p| p.inflight > 0 || p.backlogged > 0)
                || self.limbo.entries.iter().any(|l| l.peer == peer);
            if busy {
                self.peers.av_stale.push(peer);
                continue;
            }
            let Some(fi_addr) = self.peers.table.get(peer.0 as usize).map(|p| p.fi_addr) else {
                continue;
            };
            match self.res.av_remove(fi_addr) {
                Ok(()) => {
                    self.peers.in_av = self.peers.in_av.saturating_sub(1);
                    if self
                        .peers
                        .table
                        .get(peer.0 as usize)
                        .is_some_and(|p| p.evicted)
                    {
                        self.passive.free.push(peer);
                    }
                }
                Err(e) => {
                    tracing::warn!(nic = %self.nic.name, error = %e, "fi_av_remove of a removed peer failed; entry kept");
                }
            }
        }
    }

    /// Entries in the address vector: peers added and not removed, plus
    /// removed ones whose entry is still in use (see `remove`).
    pub fn av_entries(&self) -> usize {
        self.peers.in_av
    }

    /// Entries in the peer table, removed peers included: a removed peer's
    /// entry stays (its handle keeps failing with `PeerRemoved`), except
    /// that of a passive peer removed to make room, which is reused once
    /// its AV entry is gone.
    pub fn peer_slots(&self) -> usize {
        self.peers.table.len()
    }

    /// Peers known to this domain and not removed (added by the user or by
    /// an incoming message): back to its earlier value once every peer
    /// added since is removed.
    pub fn peer_count(&self) -> usize {
        self.peers.by_addr.len()
    }
}
