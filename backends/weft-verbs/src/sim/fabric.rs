//! The fabric's state: every node and every simulated resource (MRs, CQs,
//! SRQs, QPs, AHs, PDs) keyed by handle, the logical clock and the seeded
//! RNG; CQE delivery, flushes and the step that runs ready WRs.

use crate::ops::*;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, VecDeque};

use super::{SimConfig, SimStats};

pub(super) struct SimMr {
    pub(super) node: usize,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) access: u32,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
}

pub(super) struct SimCq {
    pub(super) node: usize,
    pub(super) cap: usize,
    pub(super) entries: VecDeque<Wc>,
    pub(super) overrun: bool,
}

pub(super) struct SimSrq {
    pub(super) node: usize,
    pub(super) max_wr: usize,
    pub(super) queue: VecDeque<RecvWr>,
}

pub(super) struct InFlight {
    pub(super) wr: SendWr,
    pub(super) ready_at: u64,
    pub(super) retries: u32,
    pub(super) rnr: u32,
}

pub(super) struct SimQp {
    pub(super) node: usize,
    pub(super) qpn: u32,
    pub(super) ty: QpType,
    pub(super) state: QpState,
    pub(super) send_cq: Cq,
    pub(super) recv_cq: Cq,
    pub(super) srq: Option<Srq>,
    pub(super) max_send_wr: usize,
    pub(super) max_recv_wr: usize,
    pub(super) sq: VecDeque<InFlight>,
    pub(super) rq: VecDeque<RecvWr>,
    pub(super) dest_qpn: u32,
    pub(super) dest: Option<AhAttr>,
    pub(super) qkey: u32,
    pub(super) retry_cnt: u8,
    pub(super) rnr_retry: u8,
    pub(super) remote_access: u32,
    pub(super) last_ready: u64,
    /// Set when the QP entered ERR; flushes happen in the next step.
    pub(super) flush_pending: bool,
}

pub(super) struct Node {
    pub(super) name: String,
    pub(super) alive: bool,
    pub(super) lid: u16,
    pub(super) gid: Gid,
    pub(super) stats: SimStats,
    pub(super) fail_post_at: Option<usize>,
    pub(super) drop_ud_to: u32,
    /// QPN of the last UD QP created on this device.
    pub(super) last_ud_qpn: Option<u32>,
    /// After a revival: the QPN the next UD QP of this device gets (its
    /// predecessor's, so the revived device has the same address).
    pub(super) reuse_ud_qpn: Option<u32>,
}

pub(super) struct Fabric {
    pub(super) cfg: SimConfig,
    pub(super) now: u64,
    pub(super) rng: ChaCha8Rng,
    pub(super) nodes: Vec<Node>,
    pub(super) next_id: u64,
    pub(super) next_key: u32,
    pub(super) next_qpn: u32,
    pub(super) mrs: BTreeMap<u64, SimMr>,
    pub(super) cqs: BTreeMap<u64, SimCq>,
    pub(super) srqs: BTreeMap<u64, SimSrq>,
    pub(super) qps: BTreeMap<u32, SimQp>,
    pub(super) ahs: BTreeMap<u64, (usize, AhAttr)>,
    pub(super) pds: BTreeMap<u64, usize>,
}

impl Fabric {
    pub(super) fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub(super) fn key(&mut self) -> u32 {
        self.next_key = self.next_key.wrapping_add(0x101);
        self.next_key
    }

    pub(super) fn push_cqe(&mut self, cq: Cq, wc: Wc) {
        let Some(c) = self.cqs.get_mut(&cq.0) else {
            return;
        };
        if c.overrun {
            return;
        }
        if c.entries.len() >= c.cap {
            c.overrun = true;
            tracing::error!(cq = cq.0, "simulated CQ overrun");
            return;
        }
        let node = c.node;
        c.entries.push_back(wc);
        if let Some(n) = self.nodes.get_mut(node) {
            match wc.status {
                WcStatus::Success => {}
                WcStatus::WrFlushErr => n.stats.flush_cqes += 1,
                _ => n.stats.error_cqes += 1,
            }
        }
    }

    pub(super) fn local_sge_ok(&self, node: usize, sge: &Option<Sge>, need_write: bool) -> bool {
        let Some(s) = sge else { return true };
        self.mrs.values().any(|m| {
            m.node == node
                && m.lkey == s.lkey
                && (!need_write || m.access & access::LOCAL_WRITE != 0)
                && span(m.addr, m.len, s.addr, u64::from(s.length))
        })
    }

    pub(super) fn find_node(&self, ah: &AhAttr) -> Option<usize> {
        if ah.is_global {
            self.nodes.iter().position(|n| n.gid == ah.dgid)
        } else {
            self.nodes.iter().position(|n| n.lid == ah.dlid)
        }
    }

    pub(super) fn set_err(&mut self, qpn: u32) {
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.state = QpState::Err;
            q.flush_pending = true;
        }
    }

    pub(super) fn flush(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        q.flush_pending = false;
        let sq: Vec<_> = q.sq.drain(..).map(|f| f.wr).collect();
        let rq: Vec<_> = q.rq.drain(..).collect();
        let (scq, rcq) = (q.send_cq, q.recv_cq);
        for wr in sq {
            self.push_cqe(
                scq,
                wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Other(0), qpn),
            );
        }
        for wr in rq {
            self.push_cqe(
                rcq,
                wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Other(0), qpn),
            );
        }
    }

    /// Fails the head WR of `qpn` with `status`, moves the QP to ERR.
    pub(super) fn fail_head(&mut self, qpn: u32, status: WcStatus) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(head) = q.sq.pop_front() else { return };
        let cq = q.send_cq;
        self.push_cqe(cq, wc(head.wr.wr_id, status, WcOpcode::Other(0), qpn));
        self.set_err(qpn);
    }

    pub(super) fn take_recv(&mut self, qpn: u32) -> Option<(RecvWr, Cq)> {
        let q = self.qps.get_mut(&qpn)?;
        let cq = q.recv_cq;
        match q.srq {
            Some(s) => self.srqs.get_mut(&s.0)?.queue.pop_front().map(|r| (r, cq)),
            None => q.rq.pop_front().map(|r| (r, cq)),
        }
    }

    pub(super) fn run(&mut self) {
        let qpns: Vec<u32> = self.qps.keys().copied().collect();
        for qpn in &qpns {
            if self.qps.get(qpn).is_some_and(|q| q.flush_pending) {
                self.flush(*qpn);
            }
        }
        for qpn in qpns {
            while let Some(q) = self.qps.get(&qpn) {
                if q.state != QpState::Rts {
                    break;
                }
                let Some(head) = q.sq.front() else { break };
                if head.ready_at > self.now {
                    break;
                }
                let alive = self.nodes.get(q.node).is_some_and(|n| n.alive);
                if !alive {
                    break;
                }
                match q.ty {
                    QpType::Ud => self.exec_ud(qpn),
                    QpType::Rc => self.exec_rc(qpn),
                }
            }
        }
    }
}

pub(super) fn span(base: u64, base_len: u64, addr: u64, len: u64) -> bool {
    match (addr.checked_add(len), base.checked_add(base_len)) {
        (Some(end), Some(bend)) => addr >= base && end <= bend,
        _ => false,
    }
}

pub(super) fn wc(wr_id: u64, status: WcStatus, opcode: WcOpcode, qpn: u32) -> Wc {
    Wc {
        wr_id,
        status,
        opcode,
        vendor_err: 0,
        byte_len: 0,
        imm: None,
        qp_num: qpn,
        src_qp: 0,
        slid: 0,
        grh: false,
    }
}
