//! Posting: the op table (accepted SENDs and WRITEs until their completion
//! is emitted), per-peer lane queues, splitting long WRITEs into WRs,
//! chaining up to `chain_len` WRs per doorbell and send-queue / hardware
//! budget accounting.

use super::{wr_id, VerbsDomain, KIND_OP};
use crate::ops::*;
use weft_transport::{
    Completion, LocalSlice, PeerId, PostError, RemoteAccessReason, TransportError, WrId, WriteWr,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    Send,
    Write,
}

/// Accepted SENDs and WRITEs until their completion is emitted.
pub(super) struct OpTable {
    /// Ops by slot (the slot is in the wr_id of every WR of the op).
    pub(super) slab: Vec<Option<Op>>,
    /// Free slots of `slab`.
    pub(super) free: Vec<u32>,
    /// Acceptance sequence number of the last op.
    pub(super) next_seq: u64,
    /// Ops accepted and not completed (bounded by `max_inflight`).
    pub(super) inflight: usize,
}

pub(super) struct Op {
    pub(super) gen: u32,
    pub(super) lane: Lane,
    pub(super) wr: WrId,
    pub(super) peer: PeerId,
    pub(super) src_addr: u64,
    pub(super) lkey: u32,
    pub(super) len: u64,
    pub(super) remote_addr: u64,
    pub(super) rkey: u32,
    pub(super) imm: Option<u32>,
    /// Bytes handed to the NIC so far.
    pub(super) next_off: u64,
    /// Bytes whose WRs completed successfully (a prefix: RC is in order).
    pub(super) ok_bytes: u64,
    /// Whether the last WR (the one carrying the imm) was posted.
    pub(super) posted_all: bool,
    /// Posted WRs whose completions are outstanding.
    pub(super) inflight: u32,
    /// QPN the op's WRs are on.
    pub(super) qpn: u32,
    pub(super) error: Option<TransportError>,
    /// Acceptance order (keeps requeued ops in post order).
    pub(super) seq: u64,
}

impl<O: VerbsOps> VerbsDomain<O> {
    /// Accepts a SEND: checks it, queues it on the peer's send lane and
    /// posts what the queues allow.
    pub(super) fn accept_send(
        &mut self,
        wr: WrId,
        peer: PeerId,
        src: LocalSlice,
    ) -> Result<(), TransportError> {
        self.check_room()?;
        self.check_peer(peer)?;
        if src.len > self.caps.max_send_len {
            return Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: format!(
                    "SEND of {} bytes exceeds {} bytes",
                    src.len, self.caps.max_send_len
                ),
            });
        }
        let lkey = if src.len > 0 {
            self.resolve_local(&src)?
        } else {
            0
        };
        self.enqueue(Op {
            gen: 0,
            lane: Lane::Send,
            wr,
            peer,
            src_addr: src.addr,
            lkey,
            len: src.len,
            remote_addr: 0,
            rkey: 0,
            imm: None,
            next_off: 0,
            ok_bytes: 0,
            posted_all: false,
            inflight: 0,
            qpn: 0,
            error: None,
            seq: 0,
        });
        self.kick(peer);
        Ok(())
    }

    /// Accepts up to `max_batch` WRITEs, queues them per peer and posts what
    /// the queues allow.
    pub(super) fn accept_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        let mut touched: Vec<PeerId> = Vec::new();
        let mut accepted = 0;
        let mut error = None;
        for w in wrs.iter().take(self.caps.max_batch) {
            if let Err(e) = self.check_room() {
                if e.is_retryable() {
                    break;
                }
                error = Some(e);
                break;
            }
            match self.make_write(w) {
                Err(e) => {
                    error = Some(e);
                    break;
                }
                Ok(Err(completion_error)) => {
                    self.op_table.inflight += 1;
                    let slot = self.alloc_op(Op {
                        gen: 0,
                        lane: Lane::Write,
                        wr: w.wr,
                        peer: w.peer,
                        src_addr: 0,
                        lkey: 0,
                        len: w.src.len,
                        remote_addr: 0,
                        rkey: 0,
                        imm: None,
                        next_off: 0,
                        ok_bytes: 0,
                        posted_all: false,
                        inflight: 0,
                        qpn: 0,
                        error: None,
                        seq: 0,
                    });
                    self.fail_op(slot, completion_error);
                }
                Ok(Ok(op)) => {
                    let pid = op.peer;
                    self.enqueue(op);
                    if !touched.contains(&pid) {
                        touched.push(pid);
                    }
                }
            }
            accepted += 1;
        }
        for pid in touched {
            self.kick(pid);
        }
        match error {
            Some(error) => Err(PostError {
                posted: accepted,
                error,
            }),
            None => Ok(accepted),
        }
    }

    pub(super) fn alloc_op(&mut self, mut op: Op) -> u32 {
        self.op_gen = self.op_gen.wrapping_add(1) & 0x1fff_ffff;
        op.gen = self.op_gen;
        if let Some(s) = self.op_table.free.pop() {
            self.op_table.slab[s as usize] = Some(op);
            s
        } else {
            self.op_table.slab.push(Some(op));
            (self.op_table.slab.len() - 1) as u32
        }
    }

    pub(super) fn op_mut(&mut self, slot: u32) -> Option<&mut Op> {
        self.op_table
            .slab
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
    }

    /// Emits the op's completion and frees it if it is finished.
    pub(super) fn maybe_finish(&mut self, slot: u32) {
        let done = match self
            .op_table
            .slab
            .get(slot as usize)
            .and_then(Option::as_ref)
        {
            Some(op) => {
                op.inflight == 0 && (op.error.is_some() || (op.posted_all && op.ok_bytes == op.len))
            }
            None => false,
        };
        if !done {
            return;
        }
        let Some(op) = self.op_table.slab[slot as usize].take() else {
            return;
        };
        self.op_table.free.push(slot);
        self.op_table.inflight = self.op_table.inflight.saturating_sub(1);
        if let Some(p) = self.peers.get_mut(op.peer.0 as usize) {
            let q = match op.lane {
                Lane::Send => &mut p.send_q,
                Lane::Write => &mut p.write_q,
            };
            q.retain(|s| *s != slot);
        }
        let result = match op.error {
            Some(e) => Err(e),
            None => Ok(()),
        };
        self.out_q.push_back(match op.lane {
            Lane::Send => Completion::Send { wr: op.wr, result },
            Lane::Write => Completion::Write { wr: op.wr, result },
        });
    }

    pub(super) fn fail_op(&mut self, slot: u32, err: TransportError) {
        if let Some(op) = self.op_mut(slot) {
            if op.error.is_none() {
                op.error = Some(err);
            }
            let (peer, lane) = (op.peer, op.lane);
            if let Some(p) = self.peers.get_mut(peer.0 as usize) {
                match lane {
                    Lane::Send => p.send_q.retain(|s| *s != slot),
                    Lane::Write => p.write_q.retain(|s| *s != slot),
                }
            }
        }
        self.maybe_finish(slot);
    }

    // ---------------------------------------------------------------------
    // Posting

    /// Posts as many queued WRs of `pid` as the send queues, the domain's
    /// hardware budget and the chain length allow.
    pub(super) fn pump(&mut self, pid: PeerId) {
        for lane in [Lane::Send, Lane::Write] {
            while self.pump_lane(pid, lane) {}
        }
    }

    /// One doorbell's worth. Returns whether another round may post more.
    pub(super) fn pump_lane(&mut self, pid: PeerId, lane: Lane) -> bool {
        let Some(p) = self.peers.get(pid.0 as usize) else {
            return false;
        };
        let Some(c) = p.conn.as_ref().filter(|c| c.connected()) else {
            return false;
        };
        let (qp, qpn, room) = match lane {
            Lane::Send => (c.send.qp, c.send.qpn, c.send.room),
            Lane::Write => (c.write.qp, c.write.qpn, c.write.room),
        };
        let budget = self.cfg.hw_send_budget.saturating_sub(self.hw_outstanding);
        let max = (room.min(budget) as usize).min(self.cfg.chain_len);
        if max == 0 {
            return false;
        }
        let queue = match lane {
            Lane::Send => &p.send_q,
            Lane::Write => &p.write_q,
        };
        // Plan: (slot, offset, len, last) per WR, without mutating ops.
        let mut plan: Vec<(u32, u64, u64, bool)> = Vec::with_capacity(max);
        for &slot in queue.iter() {
            let Some(op) = self
                .op_table
                .slab
                .get(slot as usize)
                .and_then(Option::as_ref)
            else {
                continue;
            };
            if op.error.is_some() {
                continue;
            }
            if op.inflight > 0 && op.qpn != qpn {
                // Still completing on a retired connection: wait, keeping
                // the lane in order.
                break;
            }
            let mut off = op.next_off;
            loop {
                if plan.len() >= max {
                    break;
                }
                let rest = op.len - off;
                let n = rest.min(self.max_wr_len);
                let last = off + n == op.len;
                plan.push((slot, off, n, last));
                off += n;
                if last {
                    break;
                }
            }
            if plan.len() >= max {
                break;
            }
        }
        if plan.is_empty() {
            return false;
        }
        let wrs: Vec<SendWr> = plan
            .iter()
            .filter_map(|&(slot, off, n, last)| {
                let op = self.op_table.slab.get(slot as usize)?.as_ref()?;
                let sge = (n > 0).then(|| Sge {
                    addr: op.src_addr + off,
                    length: n as u32,
                    lkey: op.lkey,
                });
                let sop = match (op.lane, op.imm, last) {
                    (Lane::Send, _, _) => SendOp::Send,
                    (Lane::Write, Some(imm), true) => SendOp::WriteImm {
                        remote_addr: op.remote_addr + off,
                        rkey: op.rkey,
                        imm,
                    },
                    (Lane::Write, _, _) => SendOp::Write {
                        remote_addr: op.remote_addr + off,
                        rkey: op.rkey,
                    },
                };
                Some(SendWr {
                    wr_id: wr_id(KIND_OP, op.gen, slot),
                    op: sop,
                    sge,
                    signaled: true,
                })
            })
            .collect();
        let (posted, failure) = match self.ops.post_send(qp, &wrs) {
            Ok(()) => (wrs.len(), None),
            Err(f) => (f.bad_index.min(wrs.len()), Some(f.error)),
        };
        // Commit the posted prefix.
        for &(slot, off, n, last) in &plan[..posted] {
            if let Some(op) = self.op_mut(slot) {
                op.next_off = off + n;
                op.inflight += 1;
                op.qpn = qpn;
                if last {
                    op.posted_all = true;
                }
            }
            if last {
                let p = &mut self.peers[pid.0 as usize];
                let q = match lane {
                    Lane::Send => &mut p.send_q,
                    Lane::Write => &mut p.write_q,
                };
                q.retain(|s| *s != slot);
            }
        }
        self.hw_outstanding += posted as u32;
        if let Some(c) = self.peers[pid.0 as usize].conn.as_mut() {
            let end = match lane {
                Lane::Send => &mut c.send,
                Lane::Write => &mut c.write,
            };
            end.room -= posted as u32;
            end.outstanding += posted as u32;
        }
        match failure {
            None => posted == max,
            Some(e) => {
                self.stats.partial_posts += 1;
                tracing::debug!(nic = %self.nic, posted, total = wrs.len(), error = %e, "partial post_send");
                if e.code == 12 || e.code == 11 {
                    // ENOMEM/EAGAIN: the send queue is full; the rest stays
                    // queued and is posted after completions free room.
                    posted > 0
                } else {
                    // The QP refused work: take the connection out of service
                    // and rebuild it; the unposted WRs stay queued.
                    let err = self.verr(e);
                    tracing::warn!(nic = %self.nic, error = %err, "post_send rejected; resetting connection");
                    self.retire_conn(pid, None);
                    false
                }
            }
        }
    }

    pub(super) fn enqueue(&mut self, mut op: Op) -> u32 {
        self.op_table.next_seq += 1;
        op.seq = self.op_table.next_seq;
        let pid = op.peer;
        let lane = op.lane;
        let slot = self.alloc_op(op);
        self.op_table.inflight += 1;
        let p = &mut self.peers[pid.0 as usize];
        match lane {
            Lane::Send => p.send_q.push_back(slot),
            Lane::Write => p.write_q.push_back(slot),
        }
        slot
    }

    pub(super) fn make_write(
        &self,
        wr: &WriteWr,
    ) -> Result<Result<Op, TransportError>, TransportError> {
        self.check_peer(wr.peer)?;
        let lkey = if wr.src.len > 0 {
            self.resolve_local(&wr.src)?
        } else {
            0
        };
        let Some(remote_addr) = wr.dst.addr() else {
            return Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: "remote address overflows".into(),
            });
        };
        if remote_addr.checked_add(wr.src.len).is_none() {
            return Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: "remote range overflows".into(),
            });
        }
        let Ok(rkey) = u32::try_from(wr.dst.rkey.0) else {
            // Not a verbs rkey: no NIC can accept it. Fail like the target
            // would, as a completion.
            return Ok(Err(TransportError::RemoteAccess {
                nic: self.nic.clone(),
                peer: self.peers[wr.peer.0 as usize].addr.clone(),
                rkey: wr.dst.rkey.0,
                addr: remote_addr,
                len: wr.src.len,
                reason: RemoteAccessReason::UnknownKey,
            }));
        };
        Ok(Ok(Op {
            gen: 0,
            lane: Lane::Write,
            wr: wr.wr,
            peer: wr.peer,
            src_addr: wr.src.addr,
            lkey,
            len: wr.src.len,
            remote_addr,
            rkey,
            imm: wr.imm,
            next_off: 0,
            ok_bytes: 0,
            posted_all: false,
            inflight: 0,
            qpn: 0,
            error: None,
            seq: 0,
        }))
    }
}
