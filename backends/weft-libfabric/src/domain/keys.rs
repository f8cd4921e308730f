//! `shm` key tables and doorbells (see `ffi::KeyTable`, `ffi::Bell`): a
//! domain publishes the keys of its remotely writable registrations, and
//! checks a WRITE to an shm peer against that peer's table before handing
//! it to the provider, which would otherwise drop a WRITE with a stale key
//! without ever completing it (and every later operation on the endpoint
//! with it). A domain with nothing to do sleeps on its doorbell; a peer
//! that posts to it, or waits on it, rings.

use std::time::Duration;

use weft_transport::{PeerId, RemoteAccessReason, TransportError};

use super::clock::Clock;
use super::slots::SlotUse;
use super::LibfabricDomain;
use crate::ffi::{self, KeyTable, Ringer, Verdict};

/// How long a deregistration waits for writers between their check and
/// their post (a writer there is inside one provider call).
const QUIESCE_BOUND: Duration = Duration::from_millis(200);

/// A peer's key table, mapped by a writer, with the lane it posts under,
/// and the peer's doorbell.
pub(super) struct PeerKeys {
    table: KeyTable,
    lane: usize,
    ringer: Option<Ringer>,
}

impl PeerKeys {
    /// Maps the table of the shm peer whose region is `region` and takes a
    /// lane in it; `None` when it has none (not a weft domain, an older
    /// one) or no lane is free: its WRITEs then go unchecked.
    pub(super) fn open(region: &str) -> Option<PeerKeys> {
        let table = match KeyTable::open(region) {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(region, error = %e, "shm peer without a key table: its WRITEs go unchecked");
                return None;
            }
        };
        let Some(lane) = table.claim_lane(ffi::process_alive) else {
            tracing::debug!(
                region,
                "no free lane in the shm peer's key table: its WRITEs go unchecked"
            );
            return None;
        };
        let ringer = Ringer::open(region)
            .map_err(|e| tracing::debug!(region, error = %e, "shm peer without a doorbell"))
            .ok();
        Some(PeerKeys {
            table,
            lane,
            ringer,
        })
    }

    /// Wakes the peer if it sleeps on its doorbell.
    fn ring_if_sleeping(&self) {
        if let Some(r) = &self.ringer {
            if self.table.sleeping() {
                r.ring();
            }
        }
    }
}

impl Drop for PeerKeys {
    fn drop(&mut self) {
        self.table.release_lane(self.lane);
    }
}

impl std::fmt::Debug for PeerKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerKeys")
            .field("lane", &self.lane)
            .finish_non_exhaustive()
    }
}

impl LibfabricDomain {
    /// Owner: a remotely writable registration with remote key `rkey` over
    /// `[addr, addr+len)` exists now.
    pub(super) fn publish_key(&self, rkey: u64, addr: u64, len: u64) {
        if let Some(t) = &self.keys {
            // Offset-addressed providers name remote bytes from 0.
            let base = if self.virt_addr { addr } else { 0 };
            if !t.publish(rkey, base, len) {
                tracing::warn!(nic = %self.nic.name, "shm key table full: WRITEs to unknown keys of this domain are no longer refused early");
            }
        }
    }

    /// Owner, before closing the registration with remote key `rkey`:
    /// withdraws the key, waits for writers that may have checked it just
    /// before, and progresses the endpoint so WRITEs they queued run while
    /// the memory is still registered.
    pub(super) fn withdraw_key(&mut self, rkey: u64) {
        let Some(t) = &self.keys else { return };
        if !t.revoke(rkey) {
            return;
        }
        let busy = t.quiesce(QUIESCE_BOUND, ffi::process_alive);
        if busy > 0 {
            tracing::warn!(nic = %self.nic.name, busy, "writers still posting to a withdrawn key after the bound");
        }
        let mut clock = Clock::system();
        for _ in 0..2 {
            if let Err(e) = self.progress_into_stash(&mut clock) {
                tracing::debug!(nic = %self.nic.name, error = %e, "progress before deregistration");
                break;
            }
        }
    }

    /// Writer: checks a WRITE to `peer` against the peer's key table and,
    /// when it may go out, raises this domain's posting flag there. Returns
    /// the peer whose flag to lower with [`LibfabricDomain::posted_write`]
    /// once the provider has the WRITE; `None` when nothing was raised.
    pub(super) fn check_write(
        &self,
        peer: PeerId,
        rkey: u64,
        raddr: u64,
        len: u64,
    ) -> Result<Option<PeerId>, TransportError> {
        let Some(p) = self.peers.table.get(peer.0 as usize) else {
            return Ok(None);
        };
        let Some(k) = &p.keys else { return Ok(None) };
        k.table.posting(k.lane, true);
        let reason = match k.table.check(rkey, raddr, len) {
            Verdict::Valid | Verdict::Unsure => return Ok(Some(peer)),
            Verdict::OutOfBounds { .. } => RemoteAccessReason::OutOfBounds,
            Verdict::UnknownKey => RemoteAccessReason::UnknownKey,
        };
        k.table.posting(k.lane, false);
        Err(TransportError::RemoteAccess {
            nic: self.nic_name(),
            peer: p.addr.clone(),
            rkey,
            addr: raddr,
            len,
            reason,
        })
    }

    /// Writer: the WRITE [`LibfabricDomain::check_write`] allowed is with
    /// the provider (or was refused by it).
    pub(super) fn posted_write(&self, peer: Option<PeerId>) {
        let Some(peer) = peer else { return };
        if let Some(k) = self
            .peers
            .table
            .get(peer.0 as usize)
            .and_then(|p| p.keys.as_ref())
        {
            k.table.posting(k.lane, false);
        }
    }
}

impl LibfabricDomain {
    /// After an operation was handed to the provider in slot `i`: wakes
    /// its peer if that sleeps (it must progress to take the operation).
    pub(super) fn ring_after_post(&self, i: usize) {
        let peer = match self.slots.table.get(i) {
            Some(SlotUse::Write { peer, .. })
            | Some(SlotUse::Send { peer, .. })
            | Some(SlotUse::Ack { peer }) => *peer,
            _ => return,
        };
        if let Some(k) = self
            .peers
            .table
            .get(peer.0 as usize)
            .and_then(|p| p.keys.as_ref())
        {
            k.ring_if_sleeping();
        }
    }

    /// Once per `poll`: the next shm peer (round robin) with operations in
    /// flight is woken if it sleeps (a transfer in several steps, such as
    /// shm's staged copies, needs both sides to progress).
    pub(super) fn ring_busy_peer(&mut self) {
        let n = self.peers.table.len();
        if n == 0 || self.keys.is_none() {
            return;
        }
        self.ring_cursor = (self.ring_cursor + 1) % n;
        let p = &self.peers.table[self.ring_cursor];
        if p.inflight > 0 {
            if let Some(k) = &p.keys {
                k.ring_if_sleeping();
            }
        }
    }

    /// shm's `try_wait`: with nothing of this domain's own pending, raises
    /// the sleeping flag (peers that post to it from then on ring), then
    /// progresses once to catch what arrived before the flag was seen.
    /// `false` (flag lowered) when that found work.
    pub(super) fn shm_try_wait(&mut self, idle: bool) -> bool {
        let (Some(t), Some(_)) = (&self.keys, &self.bell) else {
            return false;
        };
        if !idle {
            return false;
        }
        t.set_sleeping(true);
        let mut clock = Clock::system();
        let found = match self.progress_into_stash(&mut clock) {
            Ok(()) => !self.cq.stash.is_empty(),
            Err(_) => true,
        };
        if found {
            if let Some(t) = &self.keys {
                t.set_sleeping(false);
            }
        }
        self.asleep = !found;
        !found
    }

    /// At the start of `poll`: if this domain slept on its doorbell, it is
    /// awake now (flag lowered, rings drained).
    pub(super) fn wake_from_bell(&mut self) {
        if !std::mem::take(&mut self.asleep) {
            return;
        }
        if let (Some(t), Some(b)) = (&self.keys, &self.bell) {
            t.set_sleeping(false);
            b.drain();
        }
    }
}
