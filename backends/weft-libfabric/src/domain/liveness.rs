//! Liveness: dead peers (posts to them fail at once), peers that never
//! connect (EAGAIN past `connect_timeout`), and the periodic sweep that
//! fails the work of exited `shm` peers, of peers stalled past
//! `write_timeout` and of SENDs whose answer is overdue.

use std::time::{Duration, Instant};

use weft_transport::{Completion, PeerId, TransportError};

use super::clock::Clock;
use super::slots::SlotUse;
use super::LibfabricDomain;
use crate::ffi;

/// How often `poll` sweeps its peers: `shm` peer processes that exited,
/// peers stalled past `write_timeout`, SENDs whose answer is overdue.
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// `poll` calls between two reads of the clock for [`SWEEP_INTERVAL`].
const SWEEP_CLOCK_EVERY: u32 = 16;

/// When `poll` last swept, and how many polls ago the clock was read.
#[derive(Debug)]
pub(super) struct Sweeper {
    last: Instant,
    /// `poll` calls since the clock was last read for a sweep.
    polls_unswept: u32,
}

impl Sweeper {
    /// Nothing swept yet; the first sweep comes [`SWEEP_INTERVAL`] after `now`.
    pub(super) fn new(now: Instant) -> Sweeper {
        Sweeper {
            last: now,
            polls_unswept: 0,
        }
    }

    /// Counts one `poll`; the time of the sweep when one is due.
    fn due(&mut self, clock: &mut Clock) -> Option<Instant> {
        // The clock is read every few polls only: an engine polls a
        // software provider continuously, and the deadlines here are coarse.
        self.polls_unswept += 1;
        if self.polls_unswept < SWEEP_CLOCK_EVERY {
            return None;
        }
        self.polls_unswept = 0;
        let now = clock.now();
        if now.saturating_duration_since(self.last) < SWEEP_INTERVAL {
            return None;
        }
        self.last = now;
        Some(now)
    }
}

impl LibfabricDomain {
    /// Declares `peer` unreachable for `reason` (the first reason stays).
    pub(super) fn mark_dead(&mut self, peer: PeerId, reason: String) {
        if let Some(p) = self.peers.table.get_mut(peer.0 as usize) {
            if p.dead.is_none() {
                self.peer_eps.check = true;
                tracing::warn!(nic = %self.nic.name, peer = %p.addr, %reason, "peer unreachable");
                p.dead = Some(reason);
            }
        }
    }

    /// The peer's fi_addr, or PeerUnreachable if it is known dead
    /// (`PeerRemoved` if it was removed).
    pub(super) fn live_peer(&self, peer: PeerId) -> Result<u64, TransportError> {
        let p = self.peer(peer)?;
        if p.removed {
            return Err(TransportError::PeerRemoved {
                nic: self.nic_name(),
                peer: p.addr.clone(),
            });
        }
        match &p.dead {
            Some(reason) => Err(TransportError::PeerUnreachable {
                nic: self.nic_name(),
                peer: p.addr.clone(),
                reason: reason.clone(),
            }),
            // A same-process shm peer whose engine shut down: its region
            // mapping is gone, the provider must not touch it.
            None if p
                .local
                .as_deref()
                .is_some_and(|n| !super::shm::local_open(n)) =>
            {
                Err(TransportError::PeerUnreachable {
                    nic: self.nic_name(),
                    peer: p.addr.clone(),
                    reason: "the engine of this shm endpoint (in this process) shut down".into(),
                })
            }
            None => Ok(p.fi_addr),
        }
    }

    /// A post to `peer` got EAGAIN even after progress. With nothing in
    /// flight to the peer that means the provider is still (re)connecting;
    /// past the connect timeout the peer is declared unreachable.
    pub(super) fn on_eagain(
        &mut self,
        peer: PeerId,
        clock: &mut Clock,
    ) -> Result<(), TransportError> {
        let timeout = self.opts.connect_timeout;
        let Some(p) = self.peers.table.get_mut(peer.0 as usize) else {
            return Ok(());
        };
        if p.inflight > 0 {
            p.eagain_since = None;
            return Ok(());
        }
        let now = clock.now();
        let since = *p.eagain_since.get_or_insert(now);
        let waited = now.saturating_duration_since(since);
        if waited < timeout {
            return Ok(());
        }
        let reason = format!(
            "no connection after {:.1} s (provider kept answering EAGAIN)",
            waited.as_secs_f64()
        );
        self.mark_dead(peer, reason);
        self.live_peer(peer).map(|_| ())
    }

    /// Reports failed operation `used` (a dead peer is marked so).
    pub(super) fn finish_error(
        &mut self,
        used: SlotUse,
        e: TransportError,
        out: &mut Vec<Completion>,
    ) {
        if let TransportError::PeerUnreachable { reason, .. } = &e {
            if let SlotUse::Write { peer, .. } | SlotUse::Send { peer, .. } = used {
                self.mark_dead(peer, reason.clone());
            }
        }
        tracing::debug!(nic = %self.nic.name, error = %e, "operation failed");
        self.complete(used, Err(e), out);
    }

    /// Every [`SWEEP_INTERVAL`]: fails every in-flight operation to `shm`
    /// peers whose process is gone (the shm provider never completes them)
    /// and to peers of any provider with work in flight and no completion
    /// for `write_timeout` (hung, or gone without closing the connection);
    /// then the SENDs whose answer is overdue.
    pub(super) fn sweep(&mut self, out: &mut Vec<Completion>, clock: &mut Clock) {
        let Some(now) = self.sweeper.due(clock) else {
            return;
        };
        let timeout = self.opts.write_timeout;
        // Peers with work in the EAGAIN backlog (reserved, never issued, so
        // not counted in `inflight`) are checked too.
        let mut newly_dead = Vec::new();
        for (k, p) in self.peers.table.iter_mut().enumerate() {
            if p.dead.is_some() {
                continue;
            }
            if let Some(pid) = p.pid {
                let busy = p.inflight > 0 || p.backlogged > 0;
                if busy && !ffi::process_alive(pid) {
                    newly_dead.push((PeerId(k as u32), "peer process exited".to_string()));
                    continue;
                }
            }
            if p.inflight == 0 || p.done != p.done_seen {
                p.done_seen = p.done;
                p.stalled_since = None;
                continue;
            }
            let since = *p.stalled_since.get_or_insert(now);
            if now.duration_since(since) >= timeout {
                newly_dead.push((
                    PeerId(k as u32),
                    format!(
                        "none of {} operations in flight completed within {:.1} s (peer hung or gone without closing the connection)",
                        p.inflight,
                        timeout.as_secs_f64()
                    ),
                ));
            }
        }
        // A stalled peer's operations stay inside the provider (none of
        // ours can cancel a WRITE): their slots become zombies until the
        // provider returns them, which it does if the peer wakes up.
        for (peer, reason) in newly_dead {
            self.mark_dead(peer, reason);
            self.fail_issued(peer, out);
        }
        self.sweep_unanswered(out, now);
        self.retire_av_entries();
        if self.peer_eps.deferred {
            self.peer_eps.check = true;
        }
    }

    /// Fails every operation to dead `peer` still inside libfabric: its slot
    /// becomes a zombie, reused once the provider hands it back (a SEND
    /// already completed there only waits for the answer: handled by
    /// `sweep_unanswered` and `settle_removed`).
    pub(super) fn fail_issued(&mut self, peer: PeerId, out: &mut Vec<Completion>) {
        for i in 0..self.slots.table.len() {
            let used = self.slots.table[i];
            let to_peer = matches!(used,
                SlotUse::Write { peer: p, .. }
                | SlotUse::Send { peer: p, sent: None, .. }
                | SlotUse::Ack { peer: p } if p == peer);
            if to_peer {
                self.slots.table[i] = SlotUse::Zombie;
                if let Some(p) = self.peers.table.get_mut(peer.0 as usize) {
                    p.inflight = p.inflight.saturating_sub(1);
                }
                let e = self
                    .live_peer(peer)
                    .err()
                    .unwrap_or(TransportError::NicDown {
                        nic: self.nic_name(),
                    });
                self.complete(used, Err(e), out);
            }
        }
    }

    /// Fails the work of peers removed since the last `poll` (see
    /// `remove`): issued operations (zombie slots), and SENDs waiting for
    /// their answer. Backlogged and limbo entries fail as `flush_backlog`
    /// and `settle_limbo` find the peer dead.
    pub(super) fn settle_removed(&mut self, out: &mut Vec<Completion>) {
        for peer in std::mem::take(&mut self.peers.removing) {
            self.fail_issued(peer, out);
            for i in 0..self.opts.max_inflight.min(self.slots.table.len()) {
                if !matches!(self.slots.table[i], SlotUse::Send { peer: p, sent: Some(_), .. } if p == peer)
                {
                    continue;
                }
                let used = self.release(i);
                let e = self
                    .live_peer(peer)
                    .err()
                    .unwrap_or(TransportError::NicDown {
                        nic: self.nic_name(),
                    });
                self.complete(used, Err(e), out);
            }
        }
    }

    /// Fails SENDs the provider completed but the receiver never answered:
    /// at once when the peer is known dead, else after `ack_timeout` (which
    /// declares the peer unreachable: it neither answers nor reports an
    /// error).
    fn sweep_unanswered(&mut self, out: &mut Vec<Completion>, now: Instant) {
        let timeout = self.opts.ack_timeout;
        for i in 0..self.opts.max_inflight.min(self.slots.table.len()) {
            let SlotUse::Send {
                peer,
                sent: Some(at),
                ..
            } = self.slots.table[i]
            else {
                continue;
            };
            let dead = self.peer(peer).is_ok_and(|p| p.dead.is_some());
            if !dead && now.saturating_duration_since(at) < timeout {
                continue;
            }
            if !dead {
                self.mark_dead(
                    peer,
                    format!(
                        "no answer to a SEND within {:.1} s (receiver gone or not polling)",
                        timeout.as_secs_f64()
                    ),
                );
            }
            let e = self
                .live_peer(peer)
                .err()
                .unwrap_or(TransportError::NicDown {
                    nic: self.nic_name(),
                });
            let used = self.release(i);
            self.complete(used, Err(e), out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polls `n` times at `now`; whether the last poll swept.
    fn polls(s: &mut Sweeper, n: u32, now: Instant) -> Option<Instant> {
        let mut due = None;
        for _ in 0..n {
            due = s.due(&mut Clock::at(now));
        }
        due
    }

    #[test]
    fn sweeps_every_interval_reading_the_clock_every_few_polls() {
        let t0 = Clock::system().now();
        let mut s = Sweeper::new(t0);
        // The interval has not passed: no sweep, however often polled.
        assert_eq!(polls(&mut s, SWEEP_CLOCK_EVERY, t0), None);
        let t1 = t0 + SWEEP_INTERVAL;
        // Past it, the sweep waits for the poll that reads the clock.
        assert_eq!(polls(&mut s, SWEEP_CLOCK_EVERY - 1, t1), None);
        assert_eq!(polls(&mut s, 1, t1), Some(t1));
        // The next one is an interval after that sweep.
        let almost = t1 + SWEEP_INTERVAL - Duration::from_millis(1);
        assert_eq!(polls(&mut s, SWEEP_CLOCK_EVERY, almost), None);
        let t2 = t1 + SWEEP_INTERVAL;
        assert_eq!(polls(&mut s, SWEEP_CLOCK_EVERY, t2), Some(t2));
    }
}
