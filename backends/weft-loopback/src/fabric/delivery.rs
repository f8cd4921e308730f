//! Delivery of posted operations: link timing (serialization, latency,
//! jitter), loss and retransmission, WRITE chunks landing at the target (the
//! immediate is reported once, after the last chunk), and SENDs taking posted
//! receive buffers (or waiting for one, up to the RNR timeout).

use super::events::EvKind;
use super::op::{Body, DropMode, Op, Phase};
use super::state::State;
use super::{dur_ns, nic_name, Loc};
use crate::addr;
use crate::mem::{self, Span};
use crate::trace::TraceKind;
use rand::Rng;
use weft_transport::{Completion, RemoteAccessReason, TransportError};

impl State {
    // --- link timing ------------------------------------------------------

    /// Serialization time of `bytes` at `gbps`.
    fn ser(bytes: u64, gbps: f64) -> u64 {
        if gbps.is_finite() && gbps > 0.0 {
            // bits / (Gbit/s) = ns. f64 arithmetic is deterministic.
            (bytes as f64 * 8.0 / gbps) as u64
        } else {
            0
        }
    }

    pub(super) fn one_way(&self, src: Loc, dst: Loc) -> u64 {
        if self.cfg.null {
            return 0;
        }
        let (a, b) = (self.model(src), self.model(dst));
        (dur_ns(a.latency) / 2).saturating_add(dur_ns(b.latency) / 2)
    }

    /// Arrival time of `bytes` sent now from `src` to `dst`, updating the
    /// link-occupancy model.
    pub(super) fn transit(&mut self, src: Loc, dst: Loc, bytes: u64, extra: u64) -> u64 {
        if self.cfg.null {
            return self.now.saturating_add(extra);
        }
        let now = self.now;
        let lat = self.one_way(src, dst);
        let sm = self.model(src);
        let mut t = now;
        if let Some(s) = self.nic_mut(src) {
            let depart = now.max(s.tx_free);
            s.tx_free = depart.saturating_add(Self::ser(bytes, sm.link_gbps));
            t = s.tx_free;
        }
        t = t.saturating_add(lat).saturating_add(extra);
        if let Some(d) = self.nic_mut(dst) {
            let rx = Self::ser(bytes, d.model.link_gbps);
            let start = t.max(d.rx_free);
            d.rx_free = start.saturating_add(rx);
            t = d.rx_free;
        }
        let jitter = dur_ns(self.cfg.jitter);
        if jitter > 0 {
            t = t.saturating_add(self.rng.gen_range(0..=jitter));
        }
        t
    }

    // --- arrival ----------------------------------------------------------

    /// Whether this transmission is lost; if so schedules the retransmission.
    fn lost(&mut self, id: u64, mode: DropMode, chunk: u32, attempt: u32, resend: EvKind) -> bool {
        let lost = match mode {
            DropMode::Once => attempt == 0,
            DropMode::Random => {
                !self.cfg.null
                    && self.cfg.drop_prob > 0.0
                    && attempt < self.cfg.retry_limit
                    && self.rng.gen::<f64>() < self.cfg.drop_prob
            }
        };
        if lost {
            self.stats.drops += 1;
            self.stats.retransmits += 1;
            self.record(TraceKind::Dropped {
                op: id,
                chunk,
                attempt,
            });
            let t = self.now.saturating_add(dur_ns(self.cfg.retransmit_delay));
            self.schedule(t, resend);
        }
        lost
    }

    pub(super) fn on_chunk(&mut self, id: u64, idx: u32, attempt: u32) {
        let Some(op) = self.ops.get(&id) else { return };
        if !matches!(op.phase, Phase::InFlight) {
            return;
        }
        let (src, dst, mode) = (op.src, op.dst, op.drop);
        let Body::Write {
            src_key,
            src_addr,
            len,
            rkey,
            dst_addr,
            imm,
            chunk,
            nchunks,
            ..
        } = op.body
        else {
            return;
        };
        let resend = EvKind::Chunk {
            op: id,
            idx,
            attempt: attempt.saturating_add(1),
        };
        if self.lost(id, mode, idx, attempt, resend) {
            return;
        }
        if !self.reachable(dst) {
            let e = self.unreachable(src, dst, self.dst_state(dst));
            self.finish(id, Err(e));
            return;
        }
        // All checks at the target, at arrival, against the whole WRITE.
        let src_dev = match self.check_local(src, src_key, src_addr, len) {
            Ok(d) => d,
            Err(e) => return self.finish(id, Err(e)),
        };
        let dst_dev = match self.check_remote(dst, rkey, dst_addr, len) {
            Ok(d) => d,
            Err(reason) => {
                let e = TransportError::RemoteAccess {
                    nic: nic_name(src),
                    peer: addr::encode(dst.0, dst.1),
                    rkey,
                    addr: dst_addr.unwrap_or(u64::MAX),
                    len,
                    reason,
                };
                return self.finish(id, Err(e));
            }
        };
        let off = u64::from(idx).saturating_mul(chunk);
        let bytes = chunk.min(len.saturating_sub(off));
        if self.copies() {
            // Bounds of the whole write were checked above; off + bytes <= len.
            let (Some(d), Some(s)) = (
                dst_addr.and_then(|a| a.checked_add(off)),
                src_addr.checked_add(off),
            ) else {
                let e = TransportError::RemoteAccess {
                    nic: nic_name(src),
                    peer: addr::encode(dst.0, dst.1),
                    rkey,
                    addr: dst_addr.unwrap_or(u64::MAX),
                    len,
                    reason: RemoteAccessReason::OutOfBounds,
                };
                return self.finish(id, Err(e));
            };
            let r = mem::copy(
                Span {
                    addr: d,
                    device: dst_dev,
                },
                Span {
                    addr: s,
                    device: src_dev,
                },
                bytes,
                self.device_copy.as_deref(),
                || nic_name(src),
            );
            if let Err(e) = r {
                return self.finish(id, Err(e));
            }
        }
        self.stats.chunks_delivered += 1;
        self.stats.bytes_delivered += bytes;
        self.record(TraceKind::ChunkLanded {
            op: id,
            chunk: idx,
            offset: off,
            len: bytes,
        });
        let Some(Op {
            body: Body::Write {
                landed, max_landed, ..
            },
            ..
        }) = self.ops.get_mut(&id)
        else {
            return;
        };
        *landed += 1;
        let inverted = max_landed.is_some_and(|m| idx < m);
        *max_landed = Some(max_landed.map_or(idx, |m| m.max(idx)));
        let all = *landed >= nchunks;
        if inverted {
            self.stats.inversions_within += 1;
        }
        if !all {
            return;
        }
        // Whole payload landed: count cross-write inversions, report imm.
        let last = self.last_landed.entry((src, dst)).or_insert(id);
        if id < *last {
            self.stats.inversions_across += 1;
        } else {
            *last = id;
        }
        if let Some(imm) = imm {
            if let Some(n) = self.nic_mut(dst) {
                n.cq.push(Completion::Imm { imm });
            }
            self.mark_ready(dst);
            self.stats.imms_delivered += 1;
            self.record(TraceKind::ImmDelivered { op: id, imm });
        }
        self.finish(id, Ok(()));
    }

    pub(super) fn on_send(&mut self, id: u64, attempt: u32) {
        let Some(op) = self.ops.get(&id) else { return };
        if !matches!(op.phase, Phase::InFlight) {
            return;
        }
        let (src, dst, mode) = (op.src, op.dst, op.drop);
        let resend = EvKind::SendArrive {
            op: id,
            attempt: attempt.saturating_add(1),
        };
        if self.lost(id, mode, 0, attempt, resend) {
            return;
        }
        if !self.reachable(dst) {
            let e = self.unreachable(src, dst, self.dst_state(dst));
            return self.finish(id, Err(e));
        }
        let has_recv = self.nic(dst).is_some_and(|n| !n.recvs.is_empty());
        if has_recv {
            self.deliver_send(id);
            return;
        }
        // Receiver not ready: wait for a buffer, up to the RNR timeout.
        if let Some(Op {
            body: Body::Send { waiting, .. },
            ..
        }) = self.ops.get_mut(&id)
        {
            *waiting = true;
        }
        if let Some(n) = self.nic_mut(dst) {
            n.rnr_wait.push_back(id);
        }
        self.stats.rnr_waits += 1;
        self.record(TraceKind::RnrWait { op: id });
        let t = self.now.saturating_add(dur_ns(self.cfg.rnr_timeout));
        self.schedule(t, EvKind::RnrTimeout { op: id });
    }

    /// Places SEND `id` into a posted buffer at its (reachable) target.
    fn deliver_send(&mut self, id: u64) {
        let Some(op) = self.ops.get(&id) else { return };
        let (src, dst, wr) = (op.src, op.dst, op.wr);
        let Body::Send {
            src_key,
            src_addr,
            len,
            ..
        } = op.body
        else {
            return;
        };
        let src_dev = match self.check_local(src, src_key, src_addr, len) {
            Ok(d) => d,
            Err(e) => return self.finish(id, Err(e)),
        };
        let nrecv = self.nic(dst).map_or(0, |n| n.recvs.len());
        if nrecv == 0 {
            return;
        }
        let i = if self.cfg.random_recv_match && nrecv > 1 {
            self.rng.gen_range(0..nrecv)
        } else {
            0
        };
        let Some(recv) = self.nic(dst).and_then(|n| n.recvs.get(i)).copied() else {
            return;
        };
        if len > recv.len {
            let e = TransportError::MessageTooLong {
                nic: nic_name(src),
                peer: addr::encode(dst.0, dst.1),
                len,
                capacity: recv.len,
            };
            return self.finish(id, Err(e));
        }
        // The buffer's registration is live: deregistration flushes buffers.
        let dst_dev = self
            .nic(dst)
            .and_then(|n| n.regs.get(&recv.key))
            .map(|r| r.device);
        let Some(dst_dev) = dst_dev else {
            let e = TransportError::Failed {
                nic: nic_name(src),
                wr: Some(wr),
                what: "receive buffer registration vanished".into(),
            };
            return self.finish(id, Err(e));
        };
        if self.copies() {
            let r = mem::copy(
                Span {
                    addr: recv.addr,
                    device: dst_dev,
                },
                Span {
                    addr: src_addr,
                    device: src_dev,
                },
                len,
                self.device_copy.as_deref(),
                || nic_name(src),
            );
            if let Err(e) = r {
                return self.finish(id, Err(e));
            }
        }
        if let Some(n) = self.nic_mut(dst).filter(|n| i < n.recvs.len()) {
            n.recvs.remove(i);
            n.cq.push(Completion::Recv {
                wr: recv.wr,
                result: Ok(len),
                from: Some(addr::encode(src.0, src.1)),
            });
        }
        self.mark_ready(dst);
        self.stats.recvs_matched += 1;
        self.stats.bytes_delivered += len;
        self.record(TraceKind::RecvMatched {
            op: id,
            recv_wr: recv.wr.0,
            len,
        });
        self.finish(id, Ok(()));
    }

    /// Hands newly posted buffers at `loc` to SENDs waiting there.
    pub(super) fn match_waiting(&mut self, loc: Loc) {
        loop {
            let Some(n) = self.nic_mut(loc) else { return };
            if n.recvs.is_empty() {
                return;
            }
            let Some(id) = n.rnr_wait.pop_front() else {
                return;
            };
            let waiting = matches!(
                self.ops.get(&id),
                Some(Op {
                    phase: Phase::InFlight,
                    body: Body::Send { waiting: true, .. },
                    ..
                })
            );
            if !waiting {
                continue;
            }
            if let Some(Op {
                body: Body::Send { waiting, .. },
                ..
            }) = self.ops.get_mut(&id)
            {
                *waiting = false;
            }
            self.deliver_send(id);
        }
    }
}
