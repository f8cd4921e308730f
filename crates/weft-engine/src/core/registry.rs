//! What the control plane sets up on a group: memory registrations (one
//! per NIC, under a generation-checked key), resolved peer groups and
//! receive pools.

use super::{Control, Event, WorkerCore};
use crate::error::EngineError;
use crate::mem::RecvPool;
use crate::request::GroupAddress;
use crate::wrid::{mr_key, split_mr_key, wr_recv};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use weft_transport::{
    Access, Incarnation, LocalMr, MemRegion, MrKey, NetAddr, PeerId, TransportError,
};

pub(super) struct MrEntry {
    pub(super) nics: Vec<LocalMr>,
}

/// One member of a peer group.
pub(super) struct Member {
    /// The member's incarnation.
    pub(super) incarnation: Incarnation,
    /// Per NIC, the resolved peer and the address it was resolved from.
    pub(super) nics: Vec<(NetAddr, PeerId)>,
}

pub(super) struct PeerGroup {
    pub(super) members: Vec<Member>,
    /// A member removed with `TransferEngine::remove_peer` or replaced by
    /// a newer incarnation: `(member, address)`; the group is refused from
    /// then on.
    pub(super) removed: Option<(usize, NetAddr)>,
}

pub(super) struct PoolState {
    pub(super) pool: Arc<RecvPool>,
    pub(super) mr: LocalMr,
    pub(super) waiting: VecDeque<u32>,
    /// Finished buffers held back while the pool is at its backlog bound.
    pub(super) held: VecDeque<u32>,
}

/// The registrations, peer groups and receive pools of one group.
#[derive(Default)]
pub(super) struct Registry {
    pub(super) mrs: Vec<Option<MrEntry>>,
    /// Generation of each `mrs` slot, bumped on every deregistration.
    pub(super) mr_gens: Vec<u32>,
    pub(super) peer_groups: Vec<PeerGroup>,
    pub(super) pools: BTreeMap<u16, PoolState>,
    /// Receive buffers held back by pools at their backlog bound, over all
    /// pools.
    held: usize,
}

impl Registry {
    /// The live registration `key` names; a key whose generation is not
    /// the slot's current one is stale.
    pub(super) fn mr_entry(&self, key: u64) -> Result<&MrEntry, EngineError> {
        let (id, gen) = split_mr_key(key);
        let current = self.mr_gens.get(id as usize).copied();
        match current {
            Some(c) if c != gen => Err(EngineError::StaleMr {
                id: u64::from(id),
                gen,
                current: c,
            }),
            _ => self
                .mrs
                .get(id as usize)
                .and_then(Option::as_ref)
                .ok_or_else(|| EngineError::UnknownMr(u64::from(id))),
        }
    }

    /// Takes a slot for a registration of `nics` (one per NIC); returns its
    /// key (the slot and its current generation).
    pub(super) fn insert_mr(&mut self, nics: Vec<LocalMr>) -> Result<u64, EngineError> {
        let id = match self.mrs.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.mrs.push(None);
                self.mr_gens.push(0);
                self.mrs.len() - 1
            }
        };
        let id32 = u32::try_from(id).map_err(|_| EngineError::InvalidArgument {
            what: "too many registrations".into(),
        })?;
        self.mrs[id] = Some(MrEntry { nics });
        Ok(mr_key(id32, self.mr_gens[id]))
    }

    /// Frees the registration `key` names and bumps its slot's generation
    /// (the key is stale from now on); returns it for deregistering.
    pub(super) fn remove_mr(&mut self, key: u64) -> Result<MrEntry, EngineError> {
        self.mr_entry(key)?;
        let id = split_mr_key(key).0 as usize;
        let entry = self
            .mrs
            .get_mut(id)
            .and_then(Option::take)
            .ok_or(EngineError::UnknownMr(id as u64))?;
        if let Some(g) = self.mr_gens.get_mut(id) {
            *g = g.wrapping_add(1);
        }
        Ok(entry)
    }

    /// Holds finished buffer `idx` of `pool` back (the pool is at its
    /// backlog bound) until [`Registry::take_releasable`] finds the pool
    /// below it.
    pub(super) fn hold_recv(&mut self, pool: u16, idx: u32) {
        if let Some(ps) = self.pools.get_mut(&pool) {
            ps.held.push_back(idx);
            self.held += 1;
        }
    }

    /// Whether a pool holds buffers back but is below its backlog bound.
    pub(super) fn held_releasable(&self) -> bool {
        self.held > 0
            && self
                .pools
                .values()
                .any(|p| !p.held.is_empty() && !p.pool.backlogged())
    }

    /// The held buffers `(pool, index)` of every pool below its backlog
    /// bound, no longer held.
    pub(super) fn take_releasable(&mut self) -> Vec<(u16, u32)> {
        if self.held == 0 {
            return Vec::new();
        }
        let mut ready = Vec::new();
        for (&id, p) in &mut self.pools {
            if !p.held.is_empty() && !p.pool.backlogged() {
                ready.extend(p.held.drain(..).map(|i| (id, i)));
            }
        }
        self.held -= ready.len();
        ready
    }

    pub(super) fn check_peer_group(
        &self,
        group: usize,
        peers: u32,
        n: usize,
    ) -> Result<(), EngineError> {
        let g =
            self.peer_groups
                .get(peers as usize)
                .ok_or_else(|| EngineError::InvalidArgument {
                    what: format!("unknown peer group {peers}"),
                })?;
        if let Some((member, peer)) = &g.removed {
            return Err(EngineError::PeerRemoved {
                group,
                peer_group: peers,
                member: *member,
                peer: peer.clone(),
            });
        }
        if g.members.len() != n {
            return Err(EngineError::InvalidArgument {
                what: format!(
                    "peer group {peers} has {} members, got {n} destinations",
                    g.members.len()
                ),
            });
        }
        Ok(())
    }
}

impl WorkerCore {
    pub(crate) fn handle_control(&mut self, c: Control) {
        self.sync_incarnations();
        match c {
            Control::RegMr { region, reply } => {
                let _ = reply.send(self.reg_mr(&region));
            }
            Control::UnregMr { id, reply } => {
                let _ = reply.send(self.unreg_mr(id));
            }
            Control::AddPeerGroup { peers, reply } => {
                let _ = reply.send(self.add_peer_group(peers));
            }
            Control::RecvPool { pool, reply } => {
                let _ = reply.send(self.add_recv_pool(pool));
            }
            Control::RemovePeer {
                addrs,
                incarnation,
                reply,
            } => {
                let _ = reply.send(self.remove_peers(&addrs, incarnation));
            }
            Control::Lanes { dst, reply } => {
                let _ = reply.send(self.nics_to(&dst));
            }
        }
    }

    pub(super) fn reg_mr(
        &mut self,
        region: &MemRegion,
    ) -> Result<(u64, Vec<LocalMr>), EngineError> {
        let mut nics = Vec::with_capacity(self.nics.len());
        for (i, n) in self.nics.iter_mut().enumerate() {
            match n.domain.register(region, Access::RemoteWrite) {
                Ok(mr) => nics.push(mr),
                Err(e) => {
                    for (j, mr) in nics.iter().enumerate() {
                        let _ = self.nics_dereg(j, mr.key);
                    }
                    return Err(EngineError::Control {
                        group: self.group,
                        nic: i,
                        op: "register",
                        source: Box::new(e),
                    });
                }
            }
        }
        let key = self.reg.insert_mr(nics.clone())?;
        Ok((key, nics))
    }

    pub(super) fn nics_dereg(&mut self, nic: usize, key: MrKey) -> Result<(), TransportError> {
        match self.nics.get_mut(nic) {
            Some(n) => n.domain.deregister(key),
            None => Ok(()),
        }
    }

    pub(super) fn unreg_mr(&mut self, key: u64) -> Result<(), EngineError> {
        let entry = self.reg.remove_mr(key)?;
        let mut first = Ok(());
        for (i, mr) in entry.nics.iter().enumerate() {
            if let Err(e) = self.nics_dereg(i, mr.key) {
                if first.is_ok() {
                    first = Err(EngineError::Control {
                        group: self.group,
                        nic: i,
                        op: "deregister",
                        source: Box::new(e),
                    });
                }
            }
        }
        first
    }

    pub(super) fn add_peer_group(&mut self, peers: Vec<GroupAddress>) -> Result<u32, EngineError> {
        let mut members = Vec::with_capacity(peers.len());
        for p in peers {
            let nics = p.nics.len().min(self.nics.len());
            let mut m = Vec::with_capacity(nics);
            for (nic, addr) in p.nics.into_iter().take(nics).enumerate() {
                let group = self.group;
                let id = self
                    .resolve(nic, &addr, p.incarnation)
                    .map_err(|e| e.into_error(group, nic, None, &addr, "add_peer"))?;
                m.push((addr, id));
            }
            members.push(Member {
                incarnation: p.incarnation,
                nics: m,
            });
        }
        let id = u32::try_from(self.reg.peer_groups.len()).map_err(|_| {
            EngineError::InvalidArgument {
                what: "too many peer groups".into(),
            }
        })?;
        // Resolving a later member can admit a newer incarnation elsewhere
        // and drop a member resolved before it (with the epoch already
        // consumed): check every member once more now.
        let removed = members.iter().enumerate().find_map(|(j, m)| {
            m.nics
                .iter()
                .find(|(a, _)| !self.addrs.incs.is_live(a, m.incarnation))
                .map(|(a, _)| (j, a.clone()))
        });
        self.reg.peer_groups.push(PeerGroup { members, removed });
        Ok(id)
    }

    pub(super) fn add_recv_pool(&mut self, pool: Arc<RecvPool>) -> Result<(), EngineError> {
        let mr = self.nics[0]
            .domain
            .register(&pool.buf.region(), Access::LocalOnly)
            .map_err(|e| EngineError::Control {
                group: self.group,
                nic: 0,
                op: "register receive pool",
                source: Box::new(e),
            })?;
        let id = pool.id;
        let count = pool.count;
        self.reg.pools.insert(
            id,
            PoolState {
                pool,
                mr,
                waiting: VecDeque::new(),
                held: VecDeque::new(),
            },
        );
        for idx in 0..count {
            self.repost(id, idx);
        }
        Ok(())
    }

    /// Holds finished buffer `idx` of `pool` back ([`Registry::hold_recv`]).
    pub(super) fn hold_recv(&mut self, pool: u16, idx: u32) {
        self.reg.hold_recv(pool, idx);
    }

    /// Whether a pool holds buffers back but is below its backlog bound
    /// (`release_held` has work).
    pub(crate) fn held_releasable(&self) -> bool {
        self.reg.held_releasable()
    }

    /// Re-posts the held buffers of every pool below its backlog bound.
    /// Returns whether it re-posted any.
    #[inline]
    pub(crate) fn release_held(&mut self) -> bool {
        let ready = self.reg.take_releasable();
        for &(id, i) in &ready {
            self.repost(id, i);
        }
        !ready.is_empty()
    }

    pub(super) fn repost(&mut self, pool: u16, idx: u32) {
        let Some(ps) = self.reg.pools.get_mut(&pool) else {
            return;
        };
        let nic = &mut self.nics[0];
        if nic.dead.is_some() {
            return;
        }
        if nic.recvs_posted >= nic.caps.max_recvs.max(1) {
            ps.waiting.push_back(idx);
            return;
        }
        let Some(buf) = ps.mr.slice(u64::from(idx) * ps.pool.stride, ps.pool.stride) else {
            return;
        };
        match nic.domain.post_recv(wr_recv(pool, idx), buf) {
            Ok(()) => nic.recvs_posted += 1,
            Err(e) if e.is_retryable() => ps.waiting.push_back(idx),
            Err(e) => {
                let err = EngineError::Control {
                    group: self.group,
                    nic: 0,
                    op: "post_recv",
                    source: Box::new(e),
                };
                self.out.push(Event::Recv {
                    pool: Arc::clone(&ps.pool),
                    result: Err(err),
                    from: None,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_transport::{Device, Rkey};

    fn mr(k: u64) -> LocalMr {
        LocalMr {
            key: MrKey(k),
            rkey: Rkey(k),
            addr: 0x1000 * k,
            len: 64,
            device: Device::Host,
        }
    }

    #[test]
    fn a_removed_registration_leaves_a_stale_key_and_its_slot_is_reused() {
        let mut r = Registry::default();
        let a = r.insert_mr(vec![mr(1), mr(2)]).unwrap();
        let b = r.insert_mr(vec![mr(3)]).unwrap();
        assert_ne!(a, b);
        assert_eq!(r.mr_entry(a).unwrap().nics.len(), 2);
        let gone = r.remove_mr(a).unwrap();
        assert_eq!(gone.nics[1].key, MrKey(2));
        assert!(matches!(
            r.mr_entry(a),
            Err(EngineError::StaleMr {
                gen: 0,
                current: 1,
                ..
            })
        ));
        assert!(matches!(r.remove_mr(a), Err(EngineError::StaleMr { .. })));
        // The slot comes back under the next generation; `b` is untouched.
        let c = r.insert_mr(vec![mr(4)]).unwrap();
        assert_eq!(split_mr_key(c), (split_mr_key(a).0, 1));
        assert_eq!(r.mr_entry(b).unwrap().nics[0].key, MrKey(3));
        assert!(matches!(
            r.mr_entry(mr_key(9, 0)),
            Err(EngineError::UnknownMr(9))
        ));
    }

    #[test]
    fn held_buffers_of_an_unknown_pool_are_not_counted() {
        let mut r = Registry::default();
        r.hold_recv(7, 0);
        assert!(!r.held_releasable());
        assert!(r.take_releasable().is_empty());
    }
}
