//! `shm` key tables (see `ffi::KeyTable`): a domain publishes the keys of
//! its remotely writable registrations, and checks a WRITE to an shm peer
//! against that peer's table before handing it to the provider, which
//! would otherwise drop a WRITE with a stale key without ever completing it
//! (and every later operation on the endpoint with it).

use std::time::Duration;

use weft_transport::{PeerId, RemoteAccessReason, TransportError};

use super::clock::Clock;
use super::LibfabricDomain;
use crate::ffi::{self, KeyTable, Verdict};

/// How long a deregistration waits for writers between their check and
/// their post (a writer there is inside one provider call).
const QUIESCE_BOUND: Duration = Duration::from_millis(200);

/// A peer's key table, mapped by a writer, with the lane it posts under.
pub(super) struct PeerKeys {
    table: KeyTable,
    lane: usize,
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
        Some(PeerKeys { table, lane })
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
