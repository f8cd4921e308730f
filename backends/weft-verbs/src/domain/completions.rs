//! Completions: polling both CQs and translating work completions into
//! contract completions and errors, including the recovery after a flush
//! or an error (requeue on a new connection, or fail the peer's work).

use super::posting::{Lane, Op};
use super::ud_source::UdSource;
use super::{
    wr_gen, wr_kind, wr_slot, DefaultAddr, VerbsDomain, GRH, KIND_IMM, KIND_RECV, KIND_UD, UD_SLOT,
};
use crate::ops::*;
use weft_transport::{Completion, NetAddr, PeerId, RemoteAccessReason, TransportError};

impl<O: VerbsOps> VerbsDomain<O> {
    // ---------------------------------------------------------------------
    // Completions

    pub(super) fn map_status(&self, op: &Op, status: WcStatus, vendor: u32) -> TransportError {
        let peer = self
            .peers
            .get(op.peer.0 as usize)
            .map(|p| p.addr.clone())
            .unwrap_or_default_addr();
        let nic = self.nic.clone();
        match status {
            WcStatus::RetryExcErr => TransportError::PeerUnreachable {
                nic,
                peer,
                reason: "transport retry counter exceeded (IBV_WC_RETRY_EXC_ERR)".into(),
            },
            WcStatus::RnrRetryExcErr => TransportError::ReceiverNotReady { nic, peer },
            WcStatus::RemAccessErr => TransportError::RemoteAccess {
                nic,
                peer,
                rkey: u64::from(op.rkey),
                addr: op.remote_addr,
                len: op.len,
                // Verbs does not say which check failed; an rkey the target
                // does not know and an out-of-range access both land here.
                reason: RemoteAccessReason::Unspecified,
            },
            WcStatus::RemInvReqErr if op.lane == Lane::Send => TransportError::MessageTooLong {
                nic,
                peer,
                len: op.len,
                capacity: 0,
            },
            WcStatus::LocProtErr | WcStatus::LocAccessErr | WcStatus::LocLenErr => {
                TransportError::LocalAccess {
                    nic,
                    what: format!("{:?} on {:?} (vendor syndrome {vendor:#x})", status, op.wr),
                }
            }
            s => TransportError::Provider {
                nic,
                op: "ibv_poll_cq",
                code: i64::from(s.raw()),
                message: format!("work completion status {s:?} for {:?}", op.wr),
            },
        }
    }

    pub(super) fn on_send_wc(&mut self, wc: Wc) {
        let id = wc.wr_id;
        if wr_kind(id) == KIND_UD {
            let slot = wr_slot(id);
            self.ud.send_free.push(slot);
            return;
        }
        self.hw_outstanding = self.hw_outstanding.saturating_sub(1);
        let pid = self.qpn_peer.get(&wc.qp_num).copied();
        // Return the send-queue slot to whichever connection owns the QP.
        let mut on_current = false;
        if let Some(p) = pid.and_then(|p| self.peers.get_mut(p.0 as usize)) {
            for c in p.conn.iter_mut().chain(p.draining.iter_mut()) {
                for end in [&mut c.send, &mut c.write] {
                    if end.qpn == wc.qp_num {
                        end.room += 1;
                        end.outstanding = end.outstanding.saturating_sub(1);
                    }
                }
            }
            on_current = p
                .conn
                .as_ref()
                .is_some_and(|c| c.send.qpn == wc.qp_num || c.write.qpn == wc.qp_num);
        }
        let slot = wr_slot(id);
        let gen = wr_gen(id);
        let Some(op) = self
            .op_table
            .slab
            .get(slot as usize)
            .and_then(Option::as_ref)
            .filter(|o| o.gen == gen)
        else {
            return;
        };
        let piece_len = {
            // Pieces complete in order: this one starts at ok_bytes.
            let rest = op.len - op.ok_bytes.min(op.len);
            rest.min(self.max_wr_len)
        };
        match wc.status {
            WcStatus::Success => {
                if let Some(op) = self.op_mut(slot) {
                    op.inflight = op.inflight.saturating_sub(1);
                    op.ok_bytes += piece_len;
                }
                self.maybe_finish(slot);
            }
            WcStatus::WrFlushErr => {
                if on_current {
                    // Our QP is in ERR without an error completion of ours
                    // (a local catastrophic error, or the QP was moved
                    // there): rebuild the connection.
                    if let Some(p) = pid {
                        tracing::info!(nic = %self.nic, qpn = wc.qp_num, "flush on a live connection; rebuilding");
                        self.retire_conn(p, Some(wc.qp_num));
                    }
                }
                let unreachable = pid
                    .and_then(|p| self.peers.get(p.0 as usize))
                    .and_then(|p| p.unreachable.clone());
                let Some(op) = self.op_mut(slot) else { return };
                op.inflight = op.inflight.saturating_sub(1);
                let opid = op.peer;
                if let Some(r) = unreachable {
                    let e = self.peer_err(opid, r);
                    self.fail_op(slot, e);
                } else if op.error.is_none() {
                    // A flushed WR was not executed (it sat behind the WR
                    // that failed, or its QP was moved to ERR): resend the
                    // rest of the op on the next connection.
                    op.next_off = op.ok_bytes;
                    op.posted_all = false;
                    if op.inflight == 0 {
                        self.requeue(slot);
                    }
                    self.maybe_finish(slot);
                } else {
                    self.maybe_finish(slot);
                }
            }
            WcStatus::RetryExcErr if !on_current => {
                // A retired connection whose peer QP is gone: the WR was not
                // acknowledged; resend the rest on the current connection.
                let Some(op) = self.op_mut(slot) else { return };
                op.inflight = op.inflight.saturating_sub(1);
                if op.error.is_none() {
                    op.next_off = op.ok_bytes;
                    op.posted_all = false;
                }
                if op.inflight == 0 && op.error.is_none() {
                    self.requeue(slot);
                }
                self.maybe_finish(slot);
            }
            status => {
                let err = self.map_status(op, status, wc.vendor_err);
                let opid = op.peer;
                tracing::debug!(nic = %self.nic, wr = ?op.wr, status = ?status, "error completion");
                if let Some(op) = self.op_mut(slot) {
                    op.inflight = op.inflight.saturating_sub(1);
                }
                self.fail_op(slot, err.clone());
                if on_current {
                    match (status, err) {
                        (WcStatus::RetryExcErr, TransportError::PeerUnreachable { reason, .. }) => {
                            self.mark_unreachable(opid, reason)
                        }
                        // The QP is in ERR now: rebuild the connection; WRs
                        // behind this one flush and are resent.
                        _ => self.retire_conn(opid, Some(wc.qp_num)),
                    }
                }
            }
        }
        if let Some(p) = pid {
            self.reap_draining(p);
        }
    }

    /// Puts an op whose WRs were flushed or not acknowledged back in its
    /// peer's queue for its lane, in post order (before the first op
    /// accepted after it), unless it is queued already; its remaining bytes
    /// then go out on the peer's current connection.
    fn requeue(&mut self, slot: u32) {
        let Some(op) = self
            .op_table
            .slab
            .get(slot as usize)
            .and_then(Option::as_ref)
        else {
            return;
        };
        let (peer, lane, seq) = (op.peer, op.lane, op.seq);
        self.stats.requeued_ops += 1;
        let slab = &self.op_table.slab;
        let p = &mut self.peers[peer.0 as usize];
        let q = match lane {
            Lane::Send => &mut p.send_q,
            Lane::Write => &mut p.write_q,
        };
        if !q.contains(&slot) {
            let pos = q
                .iter()
                .position(|s| {
                    slab.get(*s as usize)
                        .and_then(Option::as_ref)
                        .is_some_and(|o| o.seq > seq)
                })
                .unwrap_or(q.len());
            q.insert(pos, slot);
        }
    }

    pub(super) fn on_recv_wc(&mut self, wc: Wc) {
        let id = wc.wr_id;
        match wr_kind(id) {
            KIND_UD => {
                let slot = wr_slot(id);
                if wc.status == WcStatus::Success {
                    let at = slot as usize * UD_SLOT;
                    let len = (wc.byte_len as usize).saturating_sub(GRH);
                    let bytes = self.ud.buf.read(at + GRH, len.min(UD_SLOT - GRH));
                    let grh = wc.grh.then(|| self.ud.buf.read(at, GRH));
                    let src = UdSource::new(wc.src_qp, wc.slid, grh.as_deref());
                    self.on_handshake(&bytes, src);
                }
                if let Err(e) = self.post_ud_recv(slot) {
                    tracing::warn!(nic = %self.nic, error = %e, "cannot repost UD receive");
                }
            }
            KIND_IMM => {
                self.recvs.imm_missing += 1;
                if wc.status == WcStatus::Success {
                    if let Some(imm) = wc.imm {
                        self.out_q.push_back(Completion::Imm { imm });
                    }
                } else {
                    self.on_responder_error(wc);
                }
            }
            KIND_RECV => {
                let slot = wr_slot(id);
                let gen = wr_gen(id);
                let Some(&Some((g, user, cap))) = self.recvs.slab.get(slot as usize) else {
                    return;
                };
                if g != gen {
                    return;
                }
                self.recvs.slab[slot as usize] = None;
                self.recvs.free.push(slot);
                self.recvs.posted = self.recvs.posted.saturating_sub(1);
                let result = match wc.status {
                    WcStatus::Success => Ok(u64::from(wc.byte_len)),
                    WcStatus::LocLenErr => Err(TransportError::MessageTooLong {
                        nic: self.nic.clone(),
                        peer: self.peer_of_qpn(wc.qp_num),
                        len: u64::from(wc.byte_len),
                        capacity: cap,
                    }),
                    s => Err(TransportError::Provider {
                        nic: self.nic.clone(),
                        op: "ibv_poll_cq",
                        code: i64::from(s.raw()),
                        message: format!("receive completion status {s:?}"),
                    }),
                };
                let failed = result.is_err();
                // The SRQ names the local QP it filled; that QP is one
                // peer's connection.
                let from = if failed {
                    None
                } else {
                    self.qpn_peer
                        .get(&wc.qp_num)
                        .and_then(|p| self.peers.get(p.0 as usize))
                        .map(|p| p.addr.clone())
                };
                self.out_q.push_back(Completion::Recv {
                    wr: user,
                    result,
                    from,
                });
                if failed {
                    self.on_responder_error(wc);
                }
            }
            _ => {}
        }
    }

    pub(super) fn peer_of_qpn(&self, qpn: u32) -> NetAddr {
        self.qpn_peer
            .get(&qpn)
            .and_then(|p| self.peers.get(p.0 as usize))
            .map(|p| p.addr.clone())
            .unwrap_or_default_addr()
    }

    /// A receive-side error moved one of a peer's QPs to ERR: rebuild.
    pub(super) fn on_responder_error(&mut self, wc: Wc) {
        if let Some(pid) = self.qpn_peer.get(&wc.qp_num).copied() {
            let current = self.peers[pid.0 as usize]
                .conn
                .as_ref()
                .is_some_and(|c| c.send.qpn == wc.qp_num || c.write.qpn == wc.qp_num);
            if current {
                tracing::info!(nic = %self.nic, qpn = wc.qp_num, status = ?wc.status, "responder QP error; rebuilding connection");
                self.retire_conn(pid, Some(wc.qp_num));
            }
        }
    }

    pub(super) fn poll_inner(&mut self) -> Result<(), TransportError> {
        if let Some(d) = &self.dead {
            return Err(d.clone());
        }
        for cq in [self.send_cq, self.recv_cq] {
            loop {
                let mut buf = std::mem::take(&mut self.wc_buf);
                buf.clear();
                let r = self.ops.poll_cq(cq, 64, &mut buf);
                let n = match r {
                    Ok(n) => n,
                    Err(e) => {
                        let err = if e.code == 75 {
                            TransportError::NicDown {
                                nic: format!("{} (CQ overrun)", self.nic),
                            }
                        } else {
                            self.verr(e)
                        };
                        self.dead = Some(err.clone());
                        self.wc_buf = buf;
                        return Err(err);
                    }
                };
                for wc in buf.drain(..) {
                    if cq == self.send_cq {
                        self.on_send_wc(wc);
                    } else {
                        self.on_recv_wc(wc);
                    }
                }
                self.wc_buf = buf;
                if n < 64 {
                    break;
                }
            }
        }
        if let Err(e) = self.replenish_imm() {
            tracing::warn!(nic = %self.nic, error = %e, "cannot replenish WRITE_WITH_IMM receives");
        }
        self.timers();
        for i in 0..self.peers.len() {
            let pid = PeerId(i as u32);
            let p = &self.peers[i];
            let work = !p.send_q.is_empty() || !p.write_q.is_empty();
            if work {
                self.kick(pid);
            }
            self.reap_draining(pid);
        }
        Ok(())
    }
}
