//! Completion polling: reading the CQ and its error entries, and turning
//! them into completions (or into message-layer and liveness events).

use weft_transport::{Completion, TransportError};

use super::clock::Clock;
use super::slots::SlotUse;
use super::LibfabricDomain;
use crate::ffi::{self, CqEntry, CqError, CqRead};

/// Completions read outside `poll` (while a post waited for progress), and
/// the CQ read buffer.
#[derive(Debug, Default)]
pub(super) struct Completions {
    /// Completions `poll` returns first.
    pub(super) stash: Vec<Completion>,
    /// SEND/WRITE completions in `stash`: their slots are free again but
    /// they still count as outstanding until `poll` returns them.
    pub(super) stashed_tx: usize,
    /// Scratch for `fi_cq_read`.
    pub(super) scratch: Vec<CqEntry>,
}

impl LibfabricDomain {
    /// Drains the CQ (bounded) into `out`.
    pub(super) fn drain_cq(
        &mut self,
        out: &mut Vec<Completion>,
        clock: &mut Clock,
    ) -> Result<usize, TransportError> {
        let before = out.len();
        self.drain_cq_checked(out, clock)?;
        Ok(out.len() - before)
    }

    /// Drains the CQ (bounded) into `out`; whether it was read empty (the
    /// last read returned fewer entries than asked for and no error entry
    /// was pending).
    pub(super) fn drain_cq_checked(
        &mut self,
        out: &mut Vec<Completion>,
        clock: &mut Clock,
    ) -> Result<bool, TransportError> {
        for _ in 0..8 {
            let mut scratch = std::mem::take(&mut self.cq.scratch);
            scratch.clear();
            let r = self.res.cq_read(&mut scratch, 64);
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    self.cq.scratch = scratch;
                    return Err(e);
                }
            };
            for e in &scratch {
                self.on_entry(*e, out, clock);
            }
            self.cq.scratch = scratch;
            match r {
                CqRead::Entries(n) if n >= 64 => continue,
                CqRead::Entries(_) | CqRead::Empty => return Ok(true),
                CqRead::ErrorAvailable => {
                    // Bounded: at most a batch of error entries per round.
                    for _ in 0..64 {
                        match self.res.cq_readerr()? {
                            Some(err) => self.on_error(err, out, clock),
                            None => break,
                        }
                    }
                }
            }
        }
        Ok(false)
    }

    /// Handles one CQ entry: a remote immediate, a message in a bounce
    /// buffer, or the completion of one of our slots.
    fn on_entry(&mut self, e: CqEntry, out: &mut Vec<Completion>, clock: &mut Clock) {
        tracing::trace!(nic = %self.nic.name, flags = format_args!("{:#x}", e.flags), slot = ?e.slot, len = e.len, data = e.data, "cq entry");
        if ffi::is_remote_write(e.flags) {
            // The peer's immediate: remote CQ data, 32 bits on the wire.
            match u32::try_from(e.data) {
                Ok(imm) => out.push(Completion::Imm { imm }),
                Err(_) => {
                    tracing::warn!(nic = %self.nic.name, data = e.data, "remote CQ data wider than 32 bits ignored")
                }
            }
            return;
        }
        let Some(i) = e.slot else {
            tracing::debug!(nic = %self.nic.name, flags = format_args!("{:#x}", e.flags), "CQ entry without our context ignored");
            return;
        };
        // Handed back by the provider: no longer inside its endpoint.
        self.peer_eps.clear_slot(i, true);
        match self.slots.table.get(i).copied().unwrap_or(SlotUse::Free) {
            SlotUse::Bounce { j } => {
                self.on_message(j, e.len, out, clock);
                self.repost_bounce(j, clock);
                return;
            }
            SlotUse::Send {
                peer,
                len,
                sent: None,
                ack,
                ..
            } => {
                match ack {
                    Some(a) => {
                        let r = self.ack_result(peer, len, a);
                        let used = self.release(i);
                        self.complete(used, r.map(|_| 0), out);
                    }
                    // Sent; done when the receiver answers.
                    None => {
                        if let Some(SlotUse::Send { sent, .. }) = self.slots.table.get_mut(i) {
                            *sent = Some(clock.now());
                        }
                        if let Some(p) = self.peers.table.get_mut(peer.0 as usize) {
                            p.done = p.done.wrapping_add(1);
                        }
                    }
                }
                return;
            }
            _ => {}
        }
        let used = self.release(i);
        match used {
            SlotUse::Free => {
                tracing::warn!(nic = %self.nic.name, slot = i, "completion for a free slot ignored");
            }
            SlotUse::Zombie => {
                tracing::debug!(nic = %self.nic.name, slot = i, "completion of an operation already failed (slot freed)");
            }
            SlotUse::Ack { .. } => {}
            _ => self.complete(used, Ok(0), out),
        }
    }

    /// Handles one CQ error entry: fails its operation (tcp: or puts it in
    /// limbo).
    fn on_error(&mut self, err: CqError, out: &mut Vec<Completion>, clock: &mut Clock) {
        let Some(i) = err.slot else {
            tracing::warn!(
                nic = %self.nic.name,
                flags = format_args!("{:#x}", err.flags),
                err = err.err,
                prov_errno = err.prov_errno,
                message = %err.message,
                "CQ error entry without our context (target-side error?)"
            );
            return;
        };
        self.peer_eps.clear_slot(i, false);
        if let Some(SlotUse::Bounce { j }) = self.slots.table.get(i).copied() {
            // A message that did not fit (FI_ETRUNC: a peer with a larger
            // max_send_len) or a cancelled receive at close: nothing to
            // answer (the sender's SEND times out); the buffer goes back.
            tracing::warn!(nic = %self.nic.name, err = err.err, message = %err.message, "incoming message failed");
            if err.err.unsigned_abs() as i32 != libc::ECANCELED {
                self.repost_bounce(j, clock);
            }
            return;
        }
        let used = self.release(i);
        match used {
            SlotUse::Free => {
                tracing::warn!(nic = %self.nic.name, slot = i, message = %err.message, "error for a free slot ignored");
                return;
            }
            SlotUse::Zombie => {
                tracing::debug!(nic = %self.nic.name, slot = i, message = %err.message, "error for an operation already failed (slot freed)");
                return;
            }
            SlotUse::Ack { peer } => {
                tracing::debug!(nic = %self.nic.name, peer = %self.peer_addr(peer), message = %err.message, "ACK failed");
                return;
            }
            _ => {}
        }
        tracing::debug!(
            nic = %self.nic.name,
            err = err.err,
            prov_errno = err.prov_errno,
            message = %err.message,
            "CQ error entry"
        );
        let e = self.op_error(used, err.err, err.prov_errno, err.message, err.olen);
        if self.is_tcp {
            if let Some(e) = self.tcp_failure(i, used, e, clock) {
                self.finish_error(used, e, out);
            }
            return;
        }
        self.finish_error(used, e, out);
    }

    /// Reads the CQ into the stash (used when the provider says EAGAIN).
    pub(super) fn progress_into_stash(&mut self, clock: &mut Clock) -> Result<(), TransportError> {
        let mut stash = std::mem::take(&mut self.cq.stash);
        let before = stash.len();
        let r = self.drain_cq(&mut stash, clock);
        self.cq.stashed_tx += stash[before..]
            .iter()
            .filter(|c| matches!(c, Completion::Send { .. } | Completion::Write { .. }))
            .count();
        self.cq.stash = stash;
        r.map(|_| ())
    }
}
