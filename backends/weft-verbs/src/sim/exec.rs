//! Executing the WR at the head of a send queue: UD datagrams and RC
//! SEND / WRITE / WRITE_WITH_IMM, including the responder's checks and the
//! copy between registered buffers.

use super::fabric::{span, wc, Fabric};
use super::GRH_LEN;
use crate::domain::ud_source::ipv4_header;
use crate::ops::*;
use rand::Rng;

impl Fabric {
    pub(super) fn exec_ud(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(head) = q.sq.pop_front() else { return };
        let (node, scq) = (q.node, q.send_cq);
        let wr = head.wr;
        let mtu = mtu_bytes(self.cfg.active_mtu).unwrap_or(4096);
        if !self.local_sge_ok(node, &wr.sge, false) {
            self.push_cqe(scq, wc(wr.wr_id, WcStatus::LocProtErr, WcOpcode::Send, qpn));
            self.set_err(qpn);
            return;
        }
        let len = wr.sge.map_or(0, |s| s.length);
        if len > mtu {
            self.push_cqe(scq, wc(wr.wr_id, WcStatus::LocLenErr, WcOpcode::Send, qpn));
            self.set_err(qpn);
            return;
        }
        if let SendOp::UdSend {
            ah,
            remote_qpn,
            remote_qkey,
        } = wr.op
        {
            self.nodes[node].stats.ud_sent += 1;
            let dest = self.ahs.get(&ah.0).map(|(_, a)| *a);
            let dnode = dest.and_then(|a| self.find_node(&a));
            let drop_random = self.rng.gen_bool(self.cfg.ud_drop_prob.clamp(0.0, 1.0));
            let mut delivered = false;
            if let Some(d) = dnode {
                let rule_drop = self.nodes[d].drop_ud_to > 0;
                if rule_drop {
                    self.nodes[d].drop_ud_to -= 1;
                }
                let ok = !rule_drop
                    && !drop_random
                    && self.nodes[d].alive
                    && self.qps.get(&remote_qpn).is_some_and(|r| {
                        r.node == d
                            && r.ty == QpType::Ud
                            && matches!(r.state, QpState::Rtr | QpState::Rts)
                            && r.qkey == remote_qkey
                    });
                if ok {
                    if let Some((rwr, rcq)) = self.take_recv(remote_qpn) {
                        let cap = rwr.sge.map_or(0, |s| s.length as usize);
                        if cap >= GRH_LEN + len as usize && self.local_sge_ok(d, &rwr.sge, true) {
                            let global = dest.is_some_and(|a| a.is_global);
                            if let (Some(dst), Some(src)) = (rwr.sge, wr.sge) {
                                // What a device writes into the GRH area:
                                // nothing without a GRH; for an
                                // IPv4-mapped source GID (RoCE v2 over
                                // IPv4) an IPv4 header in the last 20
                                // bytes only; else an IPv6-format GRH.
                                let (sgid, dgid) = (self.nodes[node].gid.0, self.nodes[d].gid.0);
                                let mut grh = [0u8; GRH_LEN];
                                let at = if !global {
                                    GRH_LEN
                                } else if self.nodes[node].gid.is_ipv4_mapped() {
                                    let ip = |g: [u8; 16]| [g[12], g[13], g[14], g[15]];
                                    let udp = u16::try_from(len).unwrap_or(u16::MAX);
                                    grh[20..].copy_from_slice(&ipv4_header(
                                        ip(sgid),
                                        ip(dgid),
                                        udp,
                                    ));
                                    20
                                } else {
                                    grh[0] = 0x60;
                                    grh[8..24].copy_from_slice(&sgid);
                                    grh[24..40].copy_from_slice(&dgid);
                                    0
                                };
                                // SAFETY: both SGEs were checked against live
                                // registrations of their nodes, whose owners
                                // promised (MemRegion::new / internal buffers)
                                // the memory stays valid while registered;
                                // `at <= GRH_LEN <= cap`.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        grh[at..].as_ptr(),
                                        (dst.addr as usize as *mut u8).add(at),
                                        GRH_LEN - at,
                                    );
                                    std::ptr::copy(
                                        src.addr as usize as *const u8,
                                        (dst.addr as usize as *mut u8).add(GRH_LEN),
                                        len as usize,
                                    );
                                }
                            }
                            let mut w =
                                wc(rwr.wr_id, WcStatus::Success, WcOpcode::Recv, remote_qpn);
                            w.byte_len = GRH_LEN as u32 + len;
                            w.src_qp = qpn;
                            w.grh = global;
                            if self.cfg.link_layer != LinkLayer::Ethernet {
                                w.slid = self.nodes[node].lid;
                            }
                            self.push_cqe(rcq, w);
                            delivered = true;
                        } else {
                            let w = wc(rwr.wr_id, WcStatus::LocLenErr, WcOpcode::Recv, remote_qpn);
                            self.push_cqe(rcq, w);
                        }
                    }
                }
            }
            if !delivered {
                self.nodes[node].stats.ud_dropped += 1;
            }
        }
        if wr.signaled {
            self.push_cqe(scq, wc(wr.wr_id, WcStatus::Success, WcOpcode::Send, qpn));
        }
    }

    pub(super) fn exec_rc(&mut self, qpn: u32) {
        let now = self.now;
        let (ack_timeout, rnr_delay) = (self.cfg.ack_timeout_ns, self.cfg.rnr_delay_ns);
        let Some(q) = self.qps.get(&qpn) else { return };
        let Some(head) = q.sq.front() else { return };
        let wr = head.wr;
        let node = q.node;
        let scq = q.send_cq;
        let retry_cnt = q.retry_cnt;
        let rnr_retry = q.rnr_retry;
        // Local protection check.
        if !self.local_sge_ok(node, &wr.sge, false) {
            self.fail_head(qpn, WcStatus::LocProtErr);
            return;
        }
        // Find the responder: right node, alive, connected back to us.
        let dnode = q.dest.and_then(|a| self.find_node(&a));
        let dest_qpn = q.dest_qpn;
        let responder_ok = dnode.is_some_and(|d| {
            self.nodes[d].alive
                && self.qps.get(&dest_qpn).is_some_and(|r| {
                    r.node == d
                        && r.ty == QpType::Rc
                        && matches!(r.state, QpState::Rtr | QpState::Rts)
                        && r.dest_qpn == qpn
                })
        });
        if !responder_ok {
            self.nodes[node].stats.retries += 1;
            let q = self.qps.get_mut(&qpn).expect("checked above");
            let h = q.sq.front_mut().expect("checked above");
            if h.retries >= u32::from(retry_cnt) {
                self.fail_head(qpn, WcStatus::RetryExcErr);
            } else {
                h.retries += 1;
                h.ready_at = now.saturating_add(ack_timeout);
            }
            return;
        }
        let Some(d) = dnode else { return };
        let len = wr.sge.map_or(0u64, |s| u64::from(s.length));
        let (remote_write, needs_recv, imm) = match wr.op {
            SendOp::Send => (None, true, None),
            SendOp::Write { remote_addr, rkey } => (Some((remote_addr, rkey)), false, None),
            SendOp::WriteImm {
                remote_addr,
                rkey,
                imm,
            } => (Some((remote_addr, rkey)), true, Some(imm)),
            SendOp::UdSend { .. } => {
                self.fail_head(qpn, WcStatus::LocQpOpErr);
                return;
            }
        };
        let remote_access = self.qps.get(&dest_qpn).map_or(0, |r| r.remote_access);
        if let Some((raddr, rkey)) = remote_write {
            let ok = remote_access & access::REMOTE_WRITE != 0
                && (len == 0
                    || self.mrs.values().any(|m| {
                        m.node == d
                            && m.rkey == rkey
                            && m.access & access::REMOTE_WRITE != 0
                            && span(m.addr, m.len, raddr, len)
                    }));
            if !ok {
                self.fail_head(qpn, WcStatus::RemAccessErr);
                return;
            }
        }
        let mut recv = None;
        if needs_recv {
            match self.take_recv(dest_qpn) {
                Some(r) => recv = Some(r),
                None => {
                    self.nodes[node].stats.rnr_naks += 1;
                    let q = self.qps.get_mut(&qpn).expect("checked above");
                    let h = q.sq.front_mut().expect("checked above");
                    if rnr_retry != 7 && h.rnr >= u32::from(rnr_retry) {
                        self.fail_head(qpn, WcStatus::RnrRetryExcErr);
                    } else {
                        h.rnr += 1;
                        h.ready_at = now.saturating_add(rnr_delay);
                    }
                    return;
                }
            }
        }
        // Move the bytes.
        match (wr.op, &recv) {
            (SendOp::Send, Some((rwr, rcq))) => {
                let cap = rwr.sge.map_or(0, |s| u64::from(s.length));
                if len > cap || !self.local_sge_ok(d, &rwr.sge, true) {
                    let st = if len > cap {
                        WcStatus::LocLenErr
                    } else {
                        WcStatus::LocProtErr
                    };
                    self.push_cqe(*rcq, wc(rwr.wr_id, st, WcOpcode::Recv, dest_qpn));
                    self.set_err(dest_qpn);
                    self.fail_head(qpn, WcStatus::RemInvReqErr);
                    return;
                }
                if let (Some(src), Some(dst)) = (wr.sge, rwr.sge) {
                    // SAFETY: both SGEs were bounds-checked against live
                    // registrations (see exec_ud).
                    unsafe {
                        std::ptr::copy(
                            src.addr as usize as *const u8,
                            dst.addr as usize as *mut u8,
                            len as usize,
                        )
                    };
                }
                let mut w = wc(rwr.wr_id, WcStatus::Success, WcOpcode::Recv, dest_qpn);
                w.byte_len = len as u32;
                w.src_qp = qpn;
                self.push_cqe(*rcq, w);
            }
            (SendOp::Write { remote_addr, .. } | SendOp::WriteImm { remote_addr, .. }, _) => {
                if let Some(src) = wr.sge {
                    // SAFETY: source checked against a local registration and
                    // the target range against a remote-writable one.
                    unsafe {
                        std::ptr::copy(
                            src.addr as usize as *const u8,
                            remote_addr as usize as *mut u8,
                            len as usize,
                        )
                    };
                }
                if let (Some(imm), Some((rwr, rcq))) = (imm, &recv) {
                    let mut w = wc(
                        rwr.wr_id,
                        WcStatus::Success,
                        WcOpcode::RecvRdmaWithImm,
                        dest_qpn,
                    );
                    w.byte_len = len as u32;
                    w.imm = Some(imm);
                    w.src_qp = qpn;
                    self.push_cqe(*rcq, w);
                }
            }
            _ => {}
        }
        let q = self.qps.get_mut(&qpn).expect("checked above");
        q.sq.pop_front();
        if wr.signaled {
            let op = match wr.op {
                SendOp::Send | SendOp::UdSend { .. } => WcOpcode::Send,
                _ => WcOpcode::RdmaWrite,
            };
            self.push_cqe(scq, wc(wr.wr_id, WcStatus::Success, op, qpn));
        }
    }
}
