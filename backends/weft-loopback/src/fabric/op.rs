//! One posted operation ([`Op`]: a WRITE or a SEND, from post to
//! completion) and posting it: post-time checks, fault-injection rules,
//! chunking, scheduling its first transmission, and the null-mode fast path.

use super::events::{EvKind, FailReason};
use super::state::State;
use super::{dur_ns, nic_name, trace_error, Loc};
use crate::addr;
use crate::rules::{Action, OpKind};
use crate::trace::TraceKind;
use rand::seq::SliceRandom;
use rand::Rng;
use weft_transport::{Completion, Imm, LocalSlice, TransportError, WrId, WriteWr};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DropMode {
    Random,
    Once,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Body {
    Write {
        src_key: u64,
        src_addr: u64,
        len: u64,
        rkey: u64,
        dst_addr: Option<u64>,
        imm: Option<Imm>,
        chunk: u64,
        nchunks: u32,
        landed: u32,
        max_landed: Option<u32>,
    },
    Send {
        src_key: u64,
        src_addr: u64,
        len: u64,
        waiting: bool,
    },
}

#[derive(Debug)]
pub(super) enum Phase {
    InFlight,
    Acking(Result<(), TransportError>),
}

#[derive(Debug)]
pub(super) struct Op {
    pub(super) wr: WrId,
    pub(super) src: Loc,
    pub(super) dst: Loc,
    pub(super) body: Body,
    pub(super) phase: Phase,
    pub(super) drop: DropMode,
}

impl State {
    // --- rules ------------------------------------------------------------

    fn apply_rules(
        &mut self,
        op: u64,
        kind: OpKind,
        src: Loc,
        dst: Loc,
        imm: Option<Imm>,
    ) -> (Option<usize>, Action) {
        let hit = self.rules.iter_mut().enumerate().find_map(|(i, r)| {
            let open = r.rule.limit.is_none_or(|l| r.hits < l);
            (open && r.rule.matcher.matches(kind, src, Some(dst), imm)).then(|| {
                r.hits += 1;
                (i, r.rule.action)
            })
        });
        match hit {
            Some((i, action)) => {
                self.stats.rule_matches += 1;
                self.record(TraceKind::RuleMatched { op, rule: i });
                (Some(i), action)
            }
            None => (None, Action::Pass),
        }
    }

    /// Applies a rule decision. Returns the extra delay for the payload, or
    /// `None` when the payload must not be scheduled at all.
    fn decide(
        &mut self,
        id: u64,
        src: Loc,
        dst: Loc,
        rule: Option<usize>,
        action: Action,
    ) -> Option<u64> {
        match action {
            Action::Pass => Some(0),
            Action::Delay(d) => Some(dur_ns(d)),
            Action::Drop => {
                if let Some(op) = self.ops.get_mut(&id) {
                    op.drop = DropMode::Once;
                }
                Some(0)
            }
            Action::Fail => {
                let t = self.now.saturating_add(self.one_way(src, dst));
                self.schedule(
                    t,
                    EvKind::Fail {
                        op: id,
                        why: FailReason::Injected(rule.unwrap_or(0)),
                    },
                );
                None
            }
            Action::DropAll => {
                let tries = u64::from(self.cfg.retry_limit) + 1;
                self.stats.drops += tries;
                self.stats.retransmits += tries - 1;
                let t = self
                    .now
                    .saturating_add(self.one_way(src, dst))
                    .saturating_add(dur_ns(self.cfg.retransmit_delay).saturating_mul(tries));
                self.schedule(
                    t,
                    EvKind::Fail {
                        op: id,
                        why: FailReason::Partition,
                    },
                );
                None
            }
            Action::KillDst => {
                self.kill_host(dst.0);
                // Normally the kill failed this op already; if the target
                // named no NIC (nothing to kill), fail it here.
                if self.ops.contains_key(&id) {
                    let e = self.unreachable(src, dst, self.dst_state(dst));
                    self.complete(id, Err(e));
                }
                None
            }
        }
    }

    // --- posting ----------------------------------------------------------

    /// Posts one WRITE (the caller checked `has_room` and the peer).
    pub(crate) fn post_write(
        &mut self,
        src: Loc,
        dst: Loc,
        wr: &WriteWr,
    ) -> Result<(), TransportError> {
        let len = wr.src.len;
        if len > self.cfg.max_write_len {
            return Err(TransportError::InvalidArgument {
                nic: nic_name(src),
                what: format!(
                    "write {:?} of {len} bytes exceeds max_write_len {}",
                    wr.wr, self.cfg.max_write_len
                ),
            });
        }
        self.check_local(src, wr.src.mr.0, wr.src.addr, len)?;
        let id = self.next_op;
        self.next_op += 1;
        let kind = if len == 0 && wr.imm.is_some() {
            OpKind::ImmOnly
        } else {
            OpKind::Write
        };
        let (chunk, nchunks) = self.chunking(len);
        self.stats.writes_posted += 1;
        self.record(TraceKind::Posted {
            op: id,
            kind,
            src,
            dst: self.nic(dst).map(|_| dst),
            len,
            imm: wr.imm,
            chunks: nchunks,
        });
        let (rule, action) = self.apply_rules(id, kind, src, dst, wr.imm);
        if self.cfg.null && action == Action::Pass {
            self.null_write(id, src, dst, wr);
            return Ok(());
        }
        if let Some(n) = self.nic_mut(src) {
            n.inflight += 1;
        }
        self.ops.insert(
            id,
            Op {
                wr: wr.wr,
                src,
                dst,
                body: Body::Write {
                    src_key: wr.src.mr.0,
                    src_addr: wr.src.addr,
                    len,
                    rkey: wr.dst.rkey.0,
                    dst_addr: wr.dst.addr(),
                    imm: wr.imm,
                    chunk,
                    nchunks,
                    landed: 0,
                    max_landed: None,
                },
                phase: Phase::InFlight,
                drop: DropMode::Random,
            },
        );
        let Some(extra) = self.decide(id, src, dst, rule, action) else {
            return Ok(());
        };
        let mut order = std::mem::take(&mut self.shuffle_buf);
        order.clear();
        order.extend(0..nchunks);
        if self.cfg.shuffle_chunks && nchunks > 1 {
            order.shuffle(&mut self.rng);
        }
        for &idx in &order {
            let off = u64::from(idx).saturating_mul(chunk);
            let bytes = chunk.min(len.saturating_sub(off));
            let t = self.transit(src, dst, bytes, extra);
            self.schedule(
                t,
                EvKind::Chunk {
                    op: id,
                    idx,
                    attempt: 0,
                },
            );
        }
        self.shuffle_buf = order;
        Ok(())
    }

    /// Chunk size and count for a WRITE of `len` bytes.
    fn chunking(&mut self, len: u64) -> (u64, u32) {
        let max_chunks = u64::from(self.cfg.max_chunks.max(1));
        if self.cfg.null || max_chunks == 1 || len == 0 {
            return (len.max(1), 1);
        }
        let lo = self.cfg.chunk_min.max(1);
        let hi = self.cfg.chunk_max.max(lo);
        let cs = self.rng.gen_range(lo..=hi).max(len.div_ceil(max_chunks));
        let n = len.div_ceil(cs).max(1);
        (cs, u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Posts one SEND (the caller checked `has_room` and the peer).
    pub(crate) fn post_send(
        &mut self,
        src: Loc,
        dst: Loc,
        wr: WrId,
        s: LocalSlice,
    ) -> Result<(), TransportError> {
        if s.len > self.cfg.max_send_len {
            return Err(TransportError::InvalidArgument {
                nic: nic_name(src),
                what: format!(
                    "send {wr:?} of {} bytes exceeds max_send_len {}",
                    s.len, self.cfg.max_send_len
                ),
            });
        }
        self.check_local(src, s.mr.0, s.addr, s.len)?;
        let id = self.next_op;
        self.next_op += 1;
        if let Some(n) = self.nic_mut(src) {
            n.inflight += 1;
        }
        self.stats.sends_posted += 1;
        self.ops.insert(
            id,
            Op {
                wr,
                src,
                dst,
                body: Body::Send {
                    src_key: s.mr.0,
                    src_addr: s.addr,
                    len: s.len,
                    waiting: false,
                },
                phase: Phase::InFlight,
                drop: DropMode::Random,
            },
        );
        self.record(TraceKind::Posted {
            op: id,
            kind: OpKind::Send,
            src,
            dst: self.nic(dst).map(|_| dst),
            len: s.len,
            imm: None,
            chunks: 1,
        });
        let (rule, action) = self.apply_rules(id, OpKind::Send, src, dst, None);
        if let Some(extra) = self.decide(id, src, dst, rule, action) {
            let t = self.transit(src, dst, s.len, extra);
            self.schedule(t, EvKind::SendArrive { op: id, attempt: 0 });
        }
        Ok(())
    }

    /// Null-mode fast path for a WRITE no rule touched: the target-side
    /// checks and the immediate happen now, with no event and no op state
    /// (the completion is in the initiator's queue for its next poll).
    fn null_write(&mut self, id: u64, src: Loc, dst: Loc, wr: &WriteWr) {
        let len = wr.src.len;
        let result = if !self.reachable(dst) {
            Err(self.unreachable(src, dst, self.dst_state(dst)))
        } else {
            match self.check_remote(dst, wr.dst.rkey.0, wr.dst.addr(), len) {
                Err(reason) => Err(TransportError::RemoteAccess {
                    nic: nic_name(src),
                    peer: addr::encode(dst.0, dst.1),
                    rkey: wr.dst.rkey.0,
                    addr: wr.dst.addr().unwrap_or(u64::MAX),
                    len,
                    reason,
                }),
                Ok(_) => {
                    self.stats.chunks_delivered += 1;
                    self.stats.bytes_delivered += len;
                    self.record(TraceKind::ChunkLanded {
                        op: id,
                        chunk: 0,
                        offset: 0,
                        len,
                    });
                    if let Some(imm) = wr.imm {
                        if let Some(n) = self.nic_mut(dst) {
                            n.cq.push(Completion::Imm { imm });
                        }
                        self.mark_ready(dst);
                        self.stats.imms_delivered += 1;
                        self.record(TraceKind::ImmDelivered { op: id, imm });
                    }
                    Ok(())
                }
            }
        };
        if result.is_ok() {
            self.stats.completed_ok += 1;
        } else {
            self.stats.completed_err += 1;
        }
        if self.cfg.trace {
            let error = result.as_ref().err().map(trace_error);
            self.record(TraceKind::Completed { op: id, error });
        }
        if let Some(n) = self.nic_mut(src) {
            n.inflight += 1;
            n.cq.push(Completion::Write { wr: wr.wr, result });
        }
        self.mark_ready(src);
    }
}
