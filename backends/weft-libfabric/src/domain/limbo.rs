//! tcp: operations cancelled by a connection the peer closed, waiting to
//! learn whether they are to be issued again or failed (see
//! [`LibfabricDomain::settle_limbo`]).

use std::time::{Duration, Instant};

use weft_transport::{Completion, PeerId, TransportError};

use super::clock::Clock;
use super::post::Native;
use super::slots::SlotUse;
use super::LibfabricDomain;
use crate::ffi;

/// tcp: how long an operation cancelled by a broken connection waits to
/// learn whether an earlier operation's rejection broke it.
const LIMBO_WAIT: Duration = Duration::from_millis(200);

/// tcp: the pause before such an operation is issued again.
const LIMBO_RETRY: Duration = Duration::from_millis(1);

/// tcp;ofi_rxm tears a connection down when the target rejects a WRITE
/// (bad key, out of bounds); the operations it cancels with it wait here.
#[derive(Debug)]
pub(super) struct Limbo {
    /// The operations waiting.
    pub(super) entries: Vec<Waiting>,
    /// Per TX slot: what was handed to libfabric (re-issued from limbo).
    pub(super) natives: Vec<Option<Native>>,
    /// Per TX slot: the peer's issue number of its latest attempt.
    pub(super) issue_no: Vec<u64>,
    /// Per TX slot: when it first failed with a broken connection.
    pub(super) first_fail: Vec<Option<Instant>>,
}

impl Limbo {
    /// Empty, for `tx` TX slots.
    pub(super) fn new(tx: usize) -> Limbo {
        Limbo {
            entries: Vec::new(),
            natives: vec![None; tx],
            issue_no: vec![0; tx],
            first_fail: vec![None; tx],
        }
    }
}

/// tcp: an operation that failed because the connection broke, waiting to
/// learn whether the break was a rejection of an earlier operation (then it
/// never reached the target and is issued again) or the peer's death.
#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) i: usize,
    pub(super) peer: PeerId,
    /// Issue number of the attempt that failed.
    pub(super) issue_no: u64,
    /// The error it failed with.
    pub(super) error: TransportError,
    /// Not re-issued before (lets tcp;ofi_rxm notice the broken connection).
    pub(super) not_before: Instant,
    /// Failed for the peer's death if no rejection is seen by then.
    pub(super) until: Instant,
}

impl LibfabricDomain {
    /// tcp: what a failed operation `i` becomes. A rejected WRITE records
    /// its issue number; an operation cancelled by the broken connection
    /// goes to limbo (the slot stays reserved) and `None` is returned.
    pub(super) fn tcp_failure(
        &mut self,
        i: usize,
        used: SlotUse,
        e: TransportError,
        clock: &mut Clock,
    ) -> Option<TransportError> {
        let peer = used.peer()?;
        let no = self.limbo.issue_no.get(i).copied().unwrap_or(0);
        match &e {
            TransportError::RemoteAccess { .. } => {
                if let Some(p) = self.peers.table.get_mut(peer.0 as usize) {
                    p.rejected = Some(p.rejected.map_or(no, |r| r.max(no)));
                }
                Some(e)
            }
            TransportError::PeerUnreachable { .. }
                if matches!(
                    used,
                    SlotUse::Write { .. } | SlotUse::Send { sent: None, .. }
                ) && self.peer(peer).is_ok_and(|p| p.dead.is_none()) =>
            {
                // `release` ran: the slot is free again; take it back.
                let now = clock.now();
                if let Some(k) = self.slots.free_tx.iter().rposition(|&x| x == i) {
                    self.slots.free_tx.remove(k);
                }
                self.slots.table[i] = used;
                if let Some(f) = self.limbo.first_fail.get_mut(i) {
                    f.get_or_insert(now);
                }
                self.limbo.entries.push(Waiting {
                    i,
                    peer,
                    issue_no: no,
                    error: e,
                    not_before: now + LIMBO_RETRY,
                    until: now + LIMBO_WAIT,
                });
                None
            }
            _ => Some(e),
        }
    }

    /// tcp: settles operations in limbo. Issued after the latest rejection
    /// of their peer (so behind it on the closed connection: never
    /// delivered): issued again, until `connect_timeout` after their first
    /// failure. Issued before it: they may have been delivered before the
    /// connection closed, so they fail (`Failed`, outcome unknown) without
    /// condemning the peer. No rejection within `LIMBO_WAIT`: the peer is
    /// gone, as the error said.
    pub(super) fn settle_limbo(&mut self, out: &mut Vec<Completion>, clock: &mut Clock) {
        let now = clock.now();
        let mut k = 0;
        while k < self.limbo.entries.len() {
            let l = &self.limbo.entries[k];
            let (i, peer, no) = (l.i, l.peer, l.issue_no);
            let (dead, rejected) = match self.peer(peer) {
                Ok(p) => (p.dead.is_some(), p.rejected),
                Err(_) => (true, None),
            };
            let used = self.slots.table.get(i).copied().unwrap_or(SlotUse::Free);
            let behind = rejected.is_some_and(|r| no > r);
            if !dead && !behind && rejected.is_none() && now < l.until {
                k += 1;
                continue;
            }
            if behind && !dead && now < l.not_before {
                k += 1;
                continue;
            }
            let l = self.limbo.entries.swap_remove(k);
            let first = self
                .limbo
                .first_fail
                .get(i)
                .copied()
                .flatten()
                .unwrap_or(now);
            if behind && !dead && now.saturating_duration_since(first) < self.opts.connect_timeout {
                let Some(native) = self.limbo.natives.get(i).copied().flatten() else {
                    let _ = self.release_limbo(i);
                    continue;
                };
                tracing::debug!(nic = %self.nic.name, peer = %self.peer_addr(peer), slot = i, "re-issuing an operation cancelled by a connection the peer closed");
                match self.issue(i, native, false) {
                    Ok(0) => self.on_posted(i, peer),
                    Ok(rc) if rc == -ffi::FI_EAGAIN => self.park(i, native, Some(peer)),
                    Ok(rc) => {
                        let e = self.post_error(used, rc);
                        let used = self.release_limbo(i);
                        self.finish_error(used, e, out);
                    }
                    Err(e) => {
                        let used = self.release_limbo(i);
                        self.complete(used, Err(e), out);
                    }
                }
                continue;
            }
            let used = self.release_limbo(i);
            let e = if dead {
                self.live_peer(peer).err().unwrap_or(l.error)
            } else if rejected.is_some() && !behind {
                TransportError::Failed {
                    nic: self.nic_name(),
                    wr: match used {
                        SlotUse::Write { wr, .. } | SlotUse::Send { wr, .. } => Some(wr),
                        _ => None,
                    },
                    what: format!(
                        "the connection to {} closed after the peer rejected a later operation; \
                         whether this one was delivered is unknown ({})",
                        self.peer_addr(peer),
                        l.error
                    ),
                }
            } else {
                l.error
            };
            self.finish_error(used, e, out);
        }
    }

    /// Frees the slot of a limbo entry (not counted in flight).
    fn release_limbo(&mut self, i: usize) -> SlotUse {
        let used = self.slots.table.get(i).copied().unwrap_or(SlotUse::Free);
        self.slots.unreserve(i);
        used
    }
}
