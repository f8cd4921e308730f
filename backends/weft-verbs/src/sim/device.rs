//! One opened simulated device: the verbs calls of [`VerbsOps`] on the
//! fabric's state.

use super::fabric::{Fabric, InFlight, SimCq, SimMr, SimQp, SimSrq};
use super::SimFabric;
use crate::ops::*;
use rand::Rng;
use std::collections::VecDeque;
use std::sync::MutexGuard;

const EINVAL: i32 = 22;
const ENOMEM: i32 = 12;
const EOVERFLOW: i32 = 75;
const EOPNOTSUPP: i32 = 95;
const ENOENT: i32 = 2;
const EBUSY: i32 = 16;

fn verr(op: &'static str, code: i32, detail: impl Into<String>) -> VerbsError {
    VerbsError::new(op, code, detail)
}

/// One opened simulated device.
pub struct SimDevice {
    pub(super) fabric: SimFabric,
    pub(super) node: usize,
    pub(super) name: String,
}

impl SimDevice {
    fn f(&self) -> MutexGuard<'_, Fabric> {
        self.fabric.lock()
    }

    /// The fabric this device lives on.
    pub fn fabric(&self) -> &SimFabric {
        &self.fabric
    }
}

impl VerbsOps for SimDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn query_port(&mut self, port: u8) -> Result<PortAttr, VerbsError> {
        if port != 1 {
            return Err(verr("ibv_query_port", EINVAL, format!("port {port}")));
        }
        let f = self.f();
        let n = &f.nodes[self.node];
        Ok(PortAttr {
            state: if n.alive { PORT_ACTIVE } else { 1 },
            active_mtu: f.cfg.active_mtu,
            gid_tbl_len: 4,
            max_msg_sz: f.cfg.max_msg_sz,
            lid: if f.cfg.link_layer == LinkLayer::Ethernet {
                0
            } else {
                n.lid
            },
            link_layer: f.cfg.link_layer,
            active_width: 2,
            active_speed: 32,
        })
    }

    fn query_gid(&mut self, port: u8, index: u32) -> Result<GidEntry, VerbsError> {
        if port != 1 {
            return Err(verr("ibv_query_gid_ex", EINVAL, format!("port {port}")));
        }
        let f = self.f();
        let n = &f.nodes[self.node];
        let ib = f.cfg.link_layer != LinkLayer::Ethernet;
        // Table: 0 link-local (IB / RoCE v1), 1 link-local RoCE v2,
        // 2 IPv4-mapped RoCE v1, 3 IPv4-mapped RoCE v2 (the one to pick).
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[8..].copy_from_slice(&n.gid.0[8..]);
        let e = |gid, t| {
            Ok(GidEntry {
                gid,
                gid_type: Some(t),
            })
        };
        match (ib, index) {
            (true, 0) => e(n.gid, GidType::Ib),
            (true, _) => Err(verr("ibv_query_gid_ex", ENOENT, "")),
            (false, 0) => e(Gid(ll), GidType::RoceV1),
            (false, 1) => e(Gid(ll), GidType::RoceV2),
            (false, 2) => e(n.gid, GidType::RoceV1),
            (false, 3) => e(n.gid, GidType::RoceV2),
            _ => Err(verr("ibv_query_gid_ex", ENOENT, "")),
        }
    }

    fn alloc_pd(&mut self) -> Result<Pd, VerbsError> {
        let mut f = self.f();
        let id = f.id();
        f.pds.insert(id, self.node);
        Ok(Pd(id))
    }

    fn dealloc_pd(&mut self, pd: Pd) -> Result<(), VerbsError> {
        let mut f = self.f();
        f.pds
            .remove(&pd.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_dealloc_pd", EINVAL, ""))
    }

    fn reg_mr(
        &mut self,
        pd: Pd,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        let mut f = self.f();
        if f.pds.get(&pd.0) != Some(&self.node) {
            return Err(verr("ibv_reg_mr", EINVAL, "bad pd"));
        }
        if addr.checked_add(len).is_none() {
            return Err(verr("ibv_reg_mr", EINVAL, "range overflows"));
        }
        let id = f.id();
        let lkey = f.key();
        let rkey = f.key();
        f.mrs.insert(
            id,
            SimMr {
                node: self.node,
                addr,
                len,
                access,
                lkey,
                rkey,
            },
        );
        Ok((Mr(id), lkey, rkey))
    }

    fn reg_dmabuf_mr(
        &mut self,
        _pd: Pd,
        _offset: u64,
        _len: u64,
        _iova: u64,
        _fd: i32,
        _access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        Err(verr(
            "ibv_reg_dmabuf_mr",
            EOPNOTSUPP,
            "the simulated device has no GPU memory",
        ))
    }

    fn dereg_mr(&mut self, mr: Mr) -> Result<(), VerbsError> {
        self.f()
            .mrs
            .remove(&mr.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_dereg_mr", EINVAL, "unknown mr"))
    }

    fn create_cq(&mut self, cqe: u32) -> Result<Cq, VerbsError> {
        let mut f = self.f();
        if cqe == 0 || cqe > f.cfg.max_depth {
            return Err(verr("ibv_create_cq", EINVAL, format!("cqe {cqe}")));
        }
        let id = f.id();
        f.cqs.insert(
            id,
            SimCq {
                node: self.node,
                cap: cqe as usize,
                entries: VecDeque::new(),
                overrun: false,
            },
        );
        Ok(Cq(id))
    }

    fn destroy_cq(&mut self, cq: Cq) -> Result<(), VerbsError> {
        let mut f = self.f();
        if f.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
            return Err(verr("ibv_destroy_cq", EBUSY, "QPs still attached"));
        }
        f.cqs
            .remove(&cq.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_destroy_cq", EINVAL, ""))
    }

    fn create_srq(&mut self, pd: Pd, max_wr: u32) -> Result<Srq, VerbsError> {
        let mut f = self.f();
        if f.pds.get(&pd.0) != Some(&self.node) || max_wr == 0 || max_wr > f.cfg.max_depth {
            return Err(verr("ibv_create_srq", EINVAL, ""));
        }
        let id = f.id();
        f.srqs.insert(
            id,
            SimSrq {
                node: self.node,
                max_wr: max_wr as usize,
                queue: VecDeque::new(),
            },
        );
        Ok(Srq(id))
    }

    fn destroy_srq(&mut self, srq: Srq) -> Result<(), VerbsError> {
        let mut f = self.f();
        if f.qps.values().any(|q| q.srq == Some(srq)) {
            return Err(verr("ibv_destroy_srq", EBUSY, ""));
        }
        f.srqs
            .remove(&srq.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_destroy_srq", EINVAL, ""))
    }

    fn create_qp(&mut self, pd: Pd, init: &QpInit) -> Result<QpCreated, VerbsError> {
        let mut f = self.f();
        let node = self.node;
        let ok = f.pds.get(&pd.0) == Some(&node)
            && f.cqs.get(&init.send_cq.0).is_some_and(|c| c.node == node)
            && f.cqs.get(&init.recv_cq.0).is_some_and(|c| c.node == node)
            && init
                .srq
                .is_none_or(|s| f.srqs.get(&s.0).is_some_and(|s| s.node == node))
            && init.max_send_wr > 0
            && init.max_send_wr <= f.cfg.max_depth
            && init.max_recv_wr <= f.cfg.max_depth
            && !(init.qp_type == QpType::Ud && init.srq.is_some());
        if !ok {
            return Err(verr("ibv_create_qp", EINVAL, format!("{init:?}")));
        }
        let reuse = match f.nodes.get_mut(node) {
            Some(n) if init.qp_type == QpType::Ud => n.reuse_ud_qpn.take(),
            _ => None,
        };
        let qpn = match reuse.filter(|q| !f.qps.contains_key(q)) {
            Some(q) => q,
            None => {
                f.next_qpn += 1;
                f.next_qpn
            }
        };
        if init.qp_type == QpType::Ud {
            if let Some(n) = f.nodes.get_mut(node) {
                n.last_ud_qpn = Some(qpn);
            }
        }
        f.qps.insert(
            qpn,
            SimQp {
                node,
                qpn,
                ty: init.qp_type,
                state: QpState::Reset,
                send_cq: init.send_cq,
                recv_cq: init.recv_cq,
                srq: init.srq,
                max_send_wr: init.max_send_wr as usize,
                max_recv_wr: init.max_recv_wr as usize,
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                dest_qpn: 0,
                dest: None,
                qkey: 0,
                retry_cnt: 0,
                rnr_retry: 0,
                remote_access: 0,
                last_ready: 0,
                flush_pending: false,
            },
        );
        Ok(QpCreated {
            qp: Qp(u64::from(qpn)),
            qpn,
            max_send_wr: init.max_send_wr,
            max_recv_wr: init.max_recv_wr,
        })
    }

    fn modify_qp(&mut self, qp: Qp, change: &ModifyQp) -> Result<(), VerbsError> {
        let mut f = self.f();
        let node = self.node;
        let qpn = u32::try_from(qp.0).unwrap_or(0);
        let Some(q) = f.qps.get_mut(&qpn).filter(|q| q.node == node) else {
            return Err(verr("ibv_modify_qp", EINVAL, "unknown qp"));
        };
        let bad = |q: &SimQp| {
            verr(
                "ibv_modify_qp",
                EINVAL,
                format!("qp {:#x}: {:?} -> {change:?} not allowed", q.qpn, q.state),
            )
        };
        match *change {
            ModifyQp::Init {
                port, access, qkey, ..
            } => {
                if q.state != QpState::Reset || port != 1 {
                    return Err(bad(q));
                }
                if q.ty == QpType::Ud {
                    q.qkey = qkey.ok_or_else(|| bad(q))?;
                }
                q.remote_access = access;
                q.state = QpState::Init;
            }
            ModifyQp::RtrRc { dest_qpn, ah, .. } => {
                if q.state != QpState::Init || q.ty != QpType::Rc {
                    return Err(bad(q));
                }
                q.dest_qpn = dest_qpn;
                q.dest = Some(ah);
                q.state = QpState::Rtr;
            }
            ModifyQp::RtrUd => {
                if q.state != QpState::Init || q.ty != QpType::Ud {
                    return Err(bad(q));
                }
                q.state = QpState::Rtr;
            }
            ModifyQp::Rts {
                retry_cnt,
                rnr_retry,
                rc,
                ..
            } => {
                if q.state != QpState::Rtr || rc != (q.ty == QpType::Rc) {
                    return Err(bad(q));
                }
                q.retry_cnt = retry_cnt;
                q.rnr_retry = rnr_retry;
                q.state = QpState::Rts;
            }
            ModifyQp::Err => {
                q.state = QpState::Err;
                q.flush_pending = true;
            }
            ModifyQp::Reset => {
                q.state = QpState::Reset;
                q.sq.clear();
                q.rq.clear();
                q.flush_pending = false;
            }
        }
        Ok(())
    }

    fn destroy_qp(&mut self, qp: Qp) -> Result<(), VerbsError> {
        let mut f = self.f();
        let qpn = u32::try_from(qp.0).unwrap_or(0);
        match f.qps.get(&qpn) {
            Some(q) if q.node == self.node => {
                f.qps.remove(&qpn);
                Ok(())
            }
            _ => Err(verr("ibv_destroy_qp", EINVAL, "unknown qp")),
        }
    }

    fn post_send(&mut self, qp: Qp, wrs: &[SendWr]) -> Result<(), PostFailure> {
        let mut f = self.f();
        let node = self.node;
        let now = f.now;
        let latency = f.cfg.latency_ns;
        let qpn = u32::try_from(qp.0).unwrap_or(0);
        let fail = |i, code, d: &str| PostFailure {
            bad_index: i,
            error: verr("ibv_post_send", code, d),
        };
        let Some(q) = f.qps.get(&qpn).filter(|q| q.node == node) else {
            return Err(fail(0, EINVAL, "unknown qp"));
        };
        let ty = q.ty;
        if !matches!(q.state, QpState::Rts | QpState::Err) {
            return Err(fail(0, EINVAL, "qp not in RTS"));
        }
        let injected = if ty == QpType::Rc {
            f.nodes[node].fail_post_at.take()
        } else {
            None
        };
        let q = f.qps.get_mut(&qpn).expect("checked above");
        let mut posted = 0;
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            if injected == Some(i) || q.sq.len() >= q.max_send_wr {
                result = Err(fail(i, ENOMEM, "send queue full"));
                break;
            }
            let valid = match (ty, wr.op) {
                (QpType::Ud, SendOp::UdSend { .. }) => true,
                (QpType::Rc, SendOp::UdSend { .. }) | (QpType::Ud, _) => false,
                _ => true,
            };
            if !valid {
                result = Err(fail(i, EINVAL, "opcode not valid for QP type"));
                break;
            }
            let ready_at = now.saturating_add(latency).max(q.last_ready);
            q.last_ready = ready_at;
            q.sq.push_back(InFlight {
                wr: *wr,
                ready_at,
                retries: 0,
                rnr: 0,
            });
            posted += 1;
        }
        if q.state == QpState::Err {
            q.flush_pending = true;
        }
        let stats = &mut f.nodes[node].stats;
        match ty {
            QpType::Rc => {
                stats.rc_doorbells += 1;
                if posted > 0 {
                    stats.rc_chain_lens.push(posted);
                }
            }
            QpType::Ud => stats.ud_doorbells += 1,
        }
        result
    }

    fn post_recv(&mut self, qp: Qp, wrs: &[RecvWr]) -> Result<(), PostFailure> {
        let mut f = self.f();
        let node = self.node;
        let qpn = u32::try_from(qp.0).unwrap_or(0);
        let fail = |i, code, d: &str| PostFailure {
            bad_index: i,
            error: verr("ibv_post_recv", code, d),
        };
        let Some(q) = f.qps.get_mut(&qpn).filter(|q| q.node == node) else {
            return Err(fail(0, EINVAL, "unknown qp"));
        };
        if q.srq.is_some() || q.state == QpState::Reset {
            return Err(fail(0, EINVAL, "qp has an SRQ or is in RESET"));
        }
        for (i, wr) in wrs.iter().enumerate() {
            if q.rq.len() >= q.max_recv_wr {
                return Err(fail(i, ENOMEM, "receive queue full"));
            }
            q.rq.push_back(*wr);
        }
        if q.state == QpState::Err {
            q.flush_pending = true;
        }
        Ok(())
    }

    fn post_srq_recv(&mut self, srq: Srq, wrs: &[RecvWr]) -> Result<(), PostFailure> {
        let mut f = self.f();
        let node = self.node;
        let fail = |i, code, d: &str| PostFailure {
            bad_index: i,
            error: verr("ibv_post_srq_recv", code, d),
        };
        let Some(s) = f.srqs.get_mut(&srq.0).filter(|s| s.node == node) else {
            return Err(fail(0, EINVAL, "unknown srq"));
        };
        for (i, wr) in wrs.iter().enumerate() {
            if s.queue.len() >= s.max_wr {
                return Err(fail(i, ENOMEM, "srq full"));
            }
            s.queue.push_back(*wr);
        }
        Ok(())
    }

    fn poll_cq(&mut self, cq: Cq, max: usize, out: &mut Vec<Wc>) -> Result<usize, VerbsError> {
        let mut f = self.f();
        f.now = f.now.saturating_add(f.cfg.tick_ns);
        f.run();
        let node = self.node;
        let Some(c) = f.cqs.get_mut(&cq.0).filter(|c| c.node == node) else {
            return Err(verr("ibv_poll_cq", EINVAL, "unknown cq"));
        };
        if c.overrun {
            return Err(verr("ibv_poll_cq", EOVERFLOW, "CQ overrun"));
        }
        let n = max.min(c.entries.len());
        out.extend(c.entries.drain(..n));
        Ok(n)
    }

    fn create_ah(&mut self, pd: Pd, attr: &AhAttr) -> Result<Ah, VerbsError> {
        let mut f = self.f();
        if f.pds.get(&pd.0) != Some(&self.node) {
            return Err(verr("ibv_create_ah", EINVAL, "bad pd"));
        }
        if f.cfg.link_layer == LinkLayer::Ethernet && !attr.is_global {
            return Err(verr("ibv_create_ah", EINVAL, "RoCE needs a GRH"));
        }
        let id = f.id();
        f.ahs.insert(id, (self.node, *attr));
        Ok(Ah(id))
    }

    fn destroy_ah(&mut self, ah: Ah) -> Result<(), VerbsError> {
        self.f()
            .ahs
            .remove(&ah.0)
            .map(|_| ())
            .ok_or_else(|| verr("ibv_destroy_ah", EINVAL, ""))
    }

    fn now_ns(&self) -> u64 {
        self.f().now
    }

    fn entropy(&mut self) -> u64 {
        self.f().rng.gen()
    }

    fn peer_memory(&self) -> bool {
        false
    }
}
