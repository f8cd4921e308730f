//! The message layer: SEND/RECV over internal bounce buffers with receiver
//! ACKs ([`wire`] is the header format). Incoming messages are copied into
//! the user's posted receive buffers (or held for one until the RNR
//! timeout) and answered; a SEND completes on its answer.

pub(super) mod wire;

use std::collections::VecDeque;
use std::time::Instant;

use weft_transport::{Completion, LocalSlice, MrKey, NetAddr, PeerId, TransportError, WrId};

use self::wire::{self as msg, AckStatus, Header};
use super::clock::Clock;
use super::post::Native;
use super::slots::SlotUse;
use super::LibfabricDomain;
use crate::ffi::{CtlBuf, Desc};

/// A receive buffer posted by the user: filled by the message layer.
#[derive(Debug, Clone, Copy)]
pub(super) struct UserRecv {
    pub(super) wr: WrId,
    pub(super) mr: MrKey,
    pub(super) addr: u64,
    pub(super) len: u64,
}

/// An incoming message that found no receive buffer posted, waiting for one
/// until `since + rnr_timeout`.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) from: PeerId,
    pub(super) seq: u64,
    pub(super) payload: Vec<u8>,
    pub(super) since: Instant,
}

/// Received messages dropped unanswered, by reason
/// ([`LibfabricDomain::dropped_messages`]). A remote that sends garbage or
/// names addresses that cannot be peers' raises these; the first, second,
/// fourth, eighth… of each kind is logged at `warn`, the others at `debug`,
/// so a flood of them cannot flood the log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DroppedMessages {
    /// Did not parse as a weft message header.
    pub malformed: u64,
    /// Carried another payload length than its header says.
    pub wrong_length: u64,
    /// Came from an address that cannot be a peer's here (wrong length or
    /// address family, or refused by the address vector).
    pub unusable_sender: u64,
}

/// Counts one more dropped message in `n`; whether this one is logged at
/// `warn` (a power of two), not `debug`.
pub(super) fn count_dropped(n: &mut u64) -> bool {
    *n = n.saturating_add(1);
    n.is_power_of_two()
}

/// Counts a dropped message (`$n`: its [`DroppedMessages`] counter) and
/// logs it (the rest: `tracing` fields and message) at the level
/// [`count_dropped`] says.
macro_rules! dropped {
    ($n:expr, $($arg:tt)+) => {
        if $crate::domain::messages::count_dropped($n) {
            tracing::warn!($($arg)+)
        } else {
            tracing::debug!($($arg)+)
        }
    };
}
pub(super) use dropped;

/// The message layer's buffers and queues.
pub(super) struct Messages {
    /// SEND headers (one `HDR_MAX` area per TX and ACK slot), then the
    /// bounce buffers; registered, freed after the domain's resources are
    /// closed.
    pub(super) ctl: CtlBuf,
    pub(super) ctl_desc: Desc,
    /// Start of the bounce buffers in `ctl`, and the size of each.
    pub(super) bounce_off: usize,
    pub(super) bounce_len: usize,
    /// Start of the staging buffers in `ctl` (SENDs from device memory are
    /// copied there first), and the size of each (`max_send_len`; 0: the
    /// domain has none, not opened with hmem).
    pub(super) stage_off: usize,
    pub(super) stage_len: usize,
    /// ACKs waiting for a free ACK slot.
    pub(super) acks_out: VecDeque<(PeerId, u64, AckStatus)>,
    /// Posted user receive buffers, filled in order.
    pub(super) user_recvs: VecDeque<UserRecv>,
    /// Messages waiting for a receive buffer.
    pub(super) held: VecDeque<Held>,
    /// Generation of SEND sequence numbers (stale ACKs never match).
    pub(super) send_gen: u32,
    /// Messages dropped unanswered, by reason.
    pub(super) dropped: DroppedMessages,
}

impl LibfabricDomain {
    /// Received messages dropped unanswered so far, by reason.
    pub fn dropped_messages(&self) -> DroppedMessages {
        self.msgs.dropped
    }

    /// Posts bounce buffer `j` (slot `max_inflight + j`) as a receive.
    pub(super) fn post_bounce(
        &mut self,
        j: usize,
        clock: &mut Clock,
    ) -> Result<(), TransportError> {
        let i = self.opts.max_inflight + j;
        let native = Native::Recv {
            addr: self.msgs.ctl.addr() + (self.msgs.bounce_off + j * self.msgs.bounce_len) as u64,
            len: self.msgs.bounce_len,
            desc: self.msgs.ctl_desc,
        };
        self.submit(i, SlotUse::Bounce { j }, native, false, clock)
    }

    /// Re-posts bounce buffer `j` after its message was handled.
    pub(super) fn repost_bounce(&mut self, j: usize, clock: &mut Clock) {
        if let Err(e) = self.post_bounce(j, clock) {
            tracing::warn!(nic = %self.nic.name, bounce = j, error = %e, "bounce buffer lost: re-posting failed");
        }
    }

    /// Offset in `ctl` of the header area of TX or ACK slot `i`.
    pub(super) fn hdr_off(&self, i: usize) -> usize {
        let k = if i >= self.slots.ack_base {
            self.opts.max_inflight + (i - self.slots.ack_base)
        } else {
            i
        };
        k * msg::HDR_MAX
    }

    /// The result a SEND reports for the receiver's answer.
    pub(super) fn ack_result(
        &self,
        peer: PeerId,
        len: u64,
        a: AckStatus,
    ) -> Result<(), TransportError> {
        let nic = self.nic_name();
        match a {
            AckStatus::Delivered => Ok(()),
            AckStatus::NotReady => Err(TransportError::ReceiverNotReady {
                nic,
                peer: self.peer_addr(peer),
            }),
            AckStatus::TooLong { capacity } => Err(TransportError::MessageTooLong {
                nic,
                peer: self.peer_addr(peer),
                len,
                capacity,
            }),
        }
    }

    /// A message of `len` bytes arrived in bounce buffer `j`.
    pub(super) fn on_message(
        &mut self,
        j: usize,
        len: usize,
        out: &mut Vec<Completion>,
        clock: &mut Clock,
    ) {
        let off = self.msgs.bounce_off + j * self.msgs.bounce_len;
        let Some(mut bytes) = self.msgs.ctl.read(off, len.min(self.msgs.bounce_len)) else {
            return;
        };
        let (h, hlen) = match msg::decode(&bytes) {
            Ok(x) => x,
            Err(why) => {
                dropped!(&mut self.msgs.dropped.malformed, nic = %self.nic.name, len, %why, "malformed message dropped (not answered)");
                return;
            }
        };
        match h {
            Header::Ack { seq, status, from } => self.on_ack(seq, status, &from, out),
            Header::Data {
                seq,
                len: plen,
                from,
            } => {
                // `decode` checked that the header fits.
                bytes.drain(..hlen);
                let payload = bytes;
                if payload.len() as u64 != plen {
                    dropped!(&mut self.msgs.dropped.wrong_length, nic = %self.nic.name, header = plen, got = payload.len(), "message with a wrong length dropped (not answered)");
                    return;
                }
                let addr = NetAddr(from);
                let peer = match self.peers.by_addr.get(&addr) {
                    Some(p) => *p,
                    None => match self.new_passive_peer(&addr) {
                        Some(p) => p,
                        None => return,
                    },
                };
                let m = Held {
                    from: peer,
                    seq,
                    payload,
                    since: clock.now(),
                };
                if let Some(m) = self.deliver(m, out) {
                    if self.opts.rnr_timeout.is_zero()
                        || self.msgs.held.len() >= self.opts.bounces.max(1) * 4
                    {
                        self.msgs
                            .acks_out
                            .push_back((m.from, m.seq, AckStatus::NotReady));
                    } else {
                        self.msgs.held.push_back(m);
                    }
                }
            }
        }
    }

    /// Places `m` into the first posted receive buffer and queues the
    /// answer; gives `m` back when no buffer is posted.
    fn deliver(&mut self, m: Held, out: &mut Vec<Completion>) -> Option<Held> {
        while let Some(r) = self.msgs.user_recvs.front().copied() {
            if m.payload.len() as u64 > r.len {
                // The buffer stays posted; the message is dropped.
                self.msgs.acks_out.push_back((
                    m.from,
                    m.seq,
                    AckStatus::TooLong { capacity: r.len },
                ));
                return None;
            }
            self.msgs.user_recvs.pop_front();
            // Err: why the buffer cannot take it (gone, or a failed CUDA
            // copy into device memory).
            let placed = match self.mrs.get(&r.mr) {
                None => Err("is gone"),
                Some(e) => {
                    let off = e.offset(r.addr).and_then(|o| usize::try_from(o).ok());
                    match (off, e.window.as_ref()) {
                        (Some(off), Some(w)) if w.write(off, &m.payload) => Ok(()),
                        _ => Err("could not be written (a failed copy into device memory)"),
                    }
                }
            };
            match placed {
                Ok(()) => {
                    out.push(Completion::Recv {
                        wr: r.wr,
                        result: Ok(m.payload.len() as u64),
                        from: Some(self.peer_addr(m.from)),
                    });
                    self.msgs
                        .acks_out
                        .push_back((m.from, m.seq, AckStatus::Delivered));
                    return None;
                }
                Err(why) => {
                    // Deregistered while posted (or its copy failed): that
                    // buffer fails, the message tries the next one.
                    out.push(Completion::Recv {
                        wr: r.wr,
                        result: Err(TransportError::LocalAccess {
                            nic: self.nic_name(),
                            what: format!(
                                "RECV buffer [{:#x}, +{}): registration {} {why}",
                                r.addr, r.len, r.mr.0
                            ),
                        }),
                        from: None,
                    });
                }
            }
        }
        Some(m)
    }

    /// The receiver's answer to our SEND `seq`.
    fn on_ack(&mut self, seq: u64, status: AckStatus, from: &[u8], out: &mut Vec<Completion>) {
        let i = (seq & 0xffff_ffff) as usize;
        let Some(SlotUse::Send {
            peer,
            len,
            seq: s,
            sent,
            ack: None,
            ..
        }) = self.slots.table.get(i).copied()
        else {
            tracing::debug!(nic = %self.nic.name, seq, "stale or unknown ACK ignored");
            return;
        };
        if s != seq || self.peer(peer).map(|p| p.addr.0.as_slice()) != Ok(from) {
            tracing::debug!(nic = %self.nic.name, seq, "ACK for another message ignored");
            return;
        }
        if sent.is_some() {
            let r = self.ack_result(peer, len, status);
            let used = self.release(i);
            self.complete(used, r.map(|_| 0), out);
        } else if let Some(SlotUse::Send { ack, .. }) = self.slots.table.get_mut(i) {
            *ack = Some(status);
        }
    }

    /// Sends queued ACKs while ACK slots are free.
    pub(super) fn flush_acks(&mut self, clock: &mut Clock) {
        while let Some(&(peer, seq, status)) = self.msgs.acks_out.front() {
            let Some(i) = self.slots.free_ack.pop() else {
                return;
            };
            self.msgs.acks_out.pop_front();
            let dest = match self.live_peer(peer) {
                Ok(d) => d,
                Err(_) => {
                    self.slots.free_ack.push(i);
                    continue;
                }
            };
            let h = msg::ack(seq, status, &self.nic.addr.0);
            let off = self.hdr_off(i);
            if !self.msgs.ctl.write(off, &h) {
                self.slots.free_ack.push(i);
                continue;
            }
            let native = Native::Send {
                hdr: (
                    self.msgs.ctl.addr() + off as u64,
                    h.len(),
                    self.msgs.ctl_desc,
                ),
                payload: None,
                dest,
            };
            if let Err(e) = self.submit(i, SlotUse::Ack { peer }, native, false, clock) {
                if matches!(e, TransportError::Unsupported { .. }) {
                    // e.g. past `max_peer_endpoints` on shm: the sender will
                    // time out and declare this domain unreachable
                    tracing::warn!(nic = %self.nic.name, peer = %self.peer_addr(peer), error = %e,
                        "ACK not sent: the sender's SEND will time out");
                } else {
                    tracing::debug!(nic = %self.nic.name, peer = %self.peer_addr(peer), error = %e, "ACK not sent");
                }
            }
        }
    }

    /// Answers held messages whose RNR timeout passed with `NotReady`.
    pub(super) fn expire_held(&mut self, clock: &mut Clock) {
        let t = self.opts.rnr_timeout;
        while self
            .msgs
            .held
            .front()
            .is_some_and(|m| clock.now().saturating_duration_since(m.since) >= t)
        {
            if let Some(m) = self.msgs.held.pop_front() {
                self.msgs
                    .acks_out
                    .push_back((m.from, m.seq, AckStatus::NotReady));
            }
        }
    }
}

impl LibfabricDomain {
    /// Queues `buf` for the next incoming message. The message layer copies
    /// messages into it: host memory directly, CUDA memory through the CUDA
    /// runtime libfabric loaded (without one, `Unsupported`).
    pub(super) fn recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        self.local(&buf, "RECV buffer")?;
        let reachable = self.mrs.get(&buf.mr).is_some_and(|e| e.window.is_some());
        if !reachable {
            return Err(TransportError::Unsupported {
                nic: self.nic_name(),
                what: "RECV into device memory without a CUDA runtime loaded by libfabric \
                       (messages are copied from host bounce buffers)"
                    .into(),
            });
        }
        if self.msgs.user_recvs.len() >= self.caps.max_recvs {
            return Err(TransportError::QueueFull {
                nic: self.nic_name(),
            });
        }
        self.msgs.user_recvs.push_back(UserRecv {
            wr,
            mr: buf.mr,
            addr: buf.addr,
            len: buf.len,
        });
        // A message already waiting takes it at once (reported by `poll`).
        if let Some(m) = self.msgs.held.pop_front() {
            let mut stash = std::mem::take(&mut self.cq.stash);
            if let Some(m) = self.deliver(m, &mut stash) {
                self.msgs.held.push_front(m);
            }
            self.cq.stash = stash;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::count_dropped;

    #[test]
    fn dropped_messages_are_loud_at_powers_of_two_only() {
        let mut n = 0;
        let loud: Vec<u64> = (1..=1000u64).filter(|_| count_dropped(&mut n)).collect();
        assert_eq!(n, 1000);
        assert_eq!(loud, vec![1, 2, 4, 8, 16, 32, 64, 128, 256, 512]);
        let mut n = u64::MAX;
        assert!(!count_dropped(&mut n), "saturates, no overflow");
        assert_eq!(n, u64::MAX);
    }
}
