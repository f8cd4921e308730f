//! Connections: per peer, two RC QPs (SEND/RECV and WRITE/WRITEIMM) brought
//! up by a three-way handshake over the domain's UD QP; retransmission
//! timers; retiring a connection after an error and reaping retired QPs once
//! their WRs have completed; declaring a peer unreachable.

use super::dma_buf::DmaBuf;
use super::ud_source::UdSource;
use super::{addr_str, wr_id, VerbsDomain, KIND_UD, UD_SEND_BIT, UD_SLOT, WEFT_QKEY};
use crate::ops::*;
use crate::wire::{Handshake, QpPair, VerbsAddr, HANDSHAKE_LEN};
use rand::Rng;
use std::collections::VecDeque;
use weft_transport::{NetAddr, PeerId, TransportError};

/// The domain's UD handshake channel: one UD QP, its registered buffer of
/// slots (receive slots first, then send slots) and the free send slots.
pub(super) struct Ud {
    pub(super) qp: Qp,
    pub(super) buf: DmaBuf,
    pub(super) mr: Mr,
    pub(super) lkey: u32,
    pub(super) send_free: Vec<u32>,
}

pub(super) struct QpEnd {
    pub(super) qp: Qp,
    pub(super) qpn: u32,
    pub(super) psn: u32,
    pub(super) room: u32,
    pub(super) outstanding: u32,
}

pub(super) struct Conn {
    pub(super) send: QpEnd,
    pub(super) write: QpEnd,
    pub(super) remote: Option<QpPair>,
    pub(super) remote_ready: bool,
    pub(super) rts: bool,
    pub(super) tries: u32,
    pub(super) next_retx: u64,
}

impl Conn {
    pub(super) fn pair(&self) -> QpPair {
        QpPair {
            send_qpn: self.send.qpn,
            write_qpn: self.write.qpn,
            send_psn: self.send.psn,
            write_psn: self.write.psn,
        }
    }
    pub(super) fn connected(&self) -> bool {
        self.rts && self.remote_ready
    }
}

pub(super) struct Peer {
    pub(super) addr: NetAddr,
    pub(super) va: VerbsAddr,
    pub(super) ah: Option<Ah>,
    pub(super) conn: Option<Conn>,
    /// Old connections whose WRs are still completing.
    pub(super) draining: Vec<Conn>,
    pub(super) unreachable: Option<String>,
    /// Removed by [`weft_transport::Domain::remove_peer`]: its work fails
    /// with `PeerRemoved`, its address maps to a new peer if added again.
    pub(super) removed: bool,
    pub(super) send_q: VecDeque<u32>,
    pub(super) write_q: VecDeque<u32>,
}

impl<O: VerbsOps> VerbsDomain<O> {
    /// The peer at `addr`, added (without connecting) if unknown.
    pub(super) fn peer_for(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        if let Some(p) = self.by_addr.get(addr) {
            return Ok(*p);
        }
        self.new_peer(addr)
    }

    /// A new peer at `addr` (not yet in `by_addr`), in a slot freed by an
    /// evicted passive peer if there is one.
    fn new_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        let va = VerbsAddr::decode(&addr.0).map_err(|why| TransportError::InvalidArgument {
            nic: self.nic.clone(),
            what: format!("address {addr}: {why}"),
        })?;
        let peer = Peer {
            addr: addr.clone(),
            va,
            ah: None,
            conn: None,
            draining: Vec::new(),
            unreachable: None,
            removed: false,
            send_q: VecDeque::new(),
            write_q: VecDeque::new(),
        };
        let pid = match self.passive.take_free() {
            Some(pid) => {
                self.peers[pid.0 as usize] = peer;
                pid
            }
            None => {
                let pid = PeerId(u32::try_from(self.peers.len()).map_err(|_| {
                    TransportError::InvalidArgument {
                        nic: self.nic.clone(),
                        what: "too many peers".into(),
                    }
                })?);
                self.peers.push(peer);
                pid
            }
        };
        self.by_addr.insert(addr.clone(), pid);
        Ok(pid)
    }

    // ---------------------------------------------------------------------
    // Connections

    pub(super) fn create_conn(&mut self, pid: PeerId) -> Result<(), TransportError> {
        let mut ends: Vec<QpEnd> = Vec::with_capacity(2);
        for srq in [self.recv_srq, self.imm_srq] {
            match self.create_end(pid, srq) {
                Ok(end) => ends.push(end),
                Err(e) => {
                    // The first QP, if it was made, goes too.
                    for end in ends {
                        self.qpn_peer.remove(&end.qpn);
                        let _ = self.ops.destroy_qp(end.qp);
                    }
                    return Err(e);
                }
            }
        }
        let write = ends.pop().expect("two QPs created");
        let send = ends.pop().expect("two QPs created");
        let now = self.ops.now_ns();
        if let Some(p) = self.peers.get_mut(pid.0 as usize) {
            p.conn = Some(Conn {
                send,
                write,
                remote: None,
                remote_ready: false,
                rts: false,
                tries: 0,
                next_retx: now,
            });
        }
        tracing::debug!(nic = %self.nic, peer = pid.0, "connecting");
        Ok(())
    }

    /// One RC QP of a new connection to `pid` on `srq`, in INIT.
    fn create_end(&mut self, pid: PeerId, srq: Srq) -> Result<QpEnd, TransportError> {
        let c = self
            .ops
            .create_qp(
                self.pd,
                &QpInit {
                    qp_type: QpType::Rc,
                    send_cq: self.send_cq,
                    recv_cq: self.recv_cq,
                    srq: Some(srq),
                    max_send_wr: self.cfg.sq_depth,
                    max_recv_wr: 0,
                    max_sge: 1,
                },
            )
            .map_err(|e| self.verr(e))?;
        let init = ModifyQp::Init {
            port: self.cfg.port,
            pkey_index: 0,
            access: access::LOCAL_WRITE | access::REMOTE_WRITE,
            qkey: None,
        };
        if let Err(e) = self.ops.modify_qp(c.qp, &init) {
            let _ = self.ops.destroy_qp(c.qp);
            return Err(self.verr(e));
        }
        self.qpn_peer.insert(c.qpn, pid);
        Ok(QpEnd {
            qp: c.qp,
            qpn: c.qpn,
            psn: self.rng.gen::<u32>() & 0xff_ffff,
            room: c.max_send_wr.min(self.cfg.sq_depth),
            outstanding: 0,
        })
    }

    pub(super) fn ensure_conn(&mut self, pid: PeerId) {
        let needs = self
            .peers
            .get(pid.0 as usize)
            .is_some_and(|p| p.conn.is_none() && p.unreachable.is_none());
        if needs {
            if let Err(e) = self.create_conn(pid) {
                tracing::warn!(nic = %self.nic, peer = pid.0, error = %e, "cannot create QPs");
                self.setup_failed(pid, format!("cannot create QPs: {e}"));
                return;
            }
            self.send_handshake(pid);
        }
    }

    pub(super) fn send_handshake(&mut self, pid: PeerId) {
        let now = self.ops.now_ns();
        let timeout = self.cfg.handshake_timeout_ns;
        let from = VerbsAddr::decode(&self.info.addr.0).expect("own address is valid");
        let mtu = self.port_attr.active_mtu as u8;
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        let Some(c) = p.conn.as_mut() else { return };
        c.tries += 1;
        c.next_retx = now.saturating_add(timeout);
        let remote = c.remote.unwrap_or_default();
        let msg = Handshake {
            from,
            qps: c.pair(),
            peer_send_qpn: remote.send_qpn,
            peer_write_qpn: remote.write_qpn,
            peer_send_psn: remote.send_psn,
            peer_write_psn: remote.write_psn,
            ready: c.rts,
            ack: c.remote_ready,
            mtu,
        };
        let va = p.va;
        let ah = match p.ah {
            Some(a) => a,
            None => {
                let attr = self.ah_attr(&va);
                match self.ops.create_ah(self.pd, &attr) {
                    Ok(a) => {
                        self.peers[pid.0 as usize].ah = Some(a);
                        a
                    }
                    Err(e) => {
                        tracing::warn!(nic = %self.nic, error = %e, "create_ah failed");
                        return;
                    }
                }
            }
        };
        let Some(slot) = self.ud.send_free.pop() else {
            tracing::debug!(nic = %self.nic, "no UD send slot; handshake waits for retransmit");
            return;
        };
        let bytes = msg.encode();
        let off = slot as usize * UD_SLOT;
        self.ud.buf.write(off, &bytes);
        let wr = SendWr {
            wr_id: wr_id(KIND_UD, 0, slot) | UD_SEND_BIT,
            op: SendOp::UdSend {
                ah,
                remote_qpn: va.ud_qpn,
                remote_qkey: WEFT_QKEY,
            },
            sge: Some(Sge {
                addr: self.ud.buf.addr(off),
                length: HANDSHAKE_LEN as u32,
                lkey: self.ud.lkey,
            }),
            signaled: true,
        };
        match self.ops.post_send(self.ud.qp, &[wr]) {
            Ok(()) => self.stats.handshakes_sent += 1,
            Err(f) => {
                self.ud.send_free.push(slot);
                tracing::warn!(nic = %self.nic, error = %f.error, "UD post_send failed");
            }
        }
    }

    pub(super) fn ah_attr(&self, va: &VerbsAddr) -> AhAttr {
        let global = self.port_attr.link_layer == LinkLayer::Ethernet || va.lid == 0;
        AhAttr {
            dlid: va.lid,
            is_global: global,
            dgid: va.gid,
            sgid_index: self.gid_index as u8,
            hop_limit: if global { 64 } else { 0 },
            traffic_class: self.cfg.traffic_class,
            sl: self.cfg.sl,
            port: self.cfg.port,
        }
    }

    /// A handshake datagram `bytes`, received from `src`.
    pub(super) fn on_handshake(&mut self, bytes: &[u8], src: UdSource) {
        let msg = match Handshake::decode(bytes) {
            Ok(m) => m,
            Err(why) => {
                self.stats.handshakes_malformed += 1;
                tracing::debug!(nic = %self.nic, why, "malformed handshake dropped");
                return;
            }
        };
        if !src.is(&msg.from) {
            self.stats.handshakes_spoofed += 1;
            tracing::debug!(nic = %self.nic, claimed = %addr_str(&msg.from.encode()), source_qpn = src.qpn, "handshake claiming another address than its source dropped");
            return;
        }
        self.stats.handshakes_received += 1;
        let addr = msg.from.encode();
        let pid = match self.by_addr.get(&addr) {
            Some(p) => *p,
            None => {
                // A new address: a passive peer, within the half-open bound.
                if !self.room_for_passive() {
                    self.stats.handshakes_refused += 1;
                    tracing::debug!(nic = %self.nic, peer = %addr_str(&addr), "handshake refused: too many half-open peers");
                    return;
                }
                match self.new_peer(&addr) {
                    Ok(p) => {
                        self.passive.list.push(p);
                        p
                    }
                    Err(_) => return,
                }
            }
        };
        if self.peers[pid.0 as usize].unreachable.is_some() {
            tracing::debug!(nic = %self.nic, peer = %addr_str(&addr), "handshake from a peer declared unreachable ignored");
            return;
        }
        // A peer that now presents different QPs replaced its connection.
        let stale = self.peers[pid.0 as usize]
            .conn
            .as_ref()
            .and_then(|c| c.remote)
            .is_some_and(|r| r != msg.qps);
        if stale {
            tracing::info!(nic = %self.nic, peer = %addr_str(&addr), "peer re-established the connection");
            self.retire_conn(pid, None);
        }
        if self.peers[pid.0 as usize].conn.is_none() {
            if let Err(e) = self.create_conn(pid) {
                tracing::warn!(nic = %self.nic, error = %e, "cannot create QPs for incoming handshake");
                if self.is_passive(pid) {
                    self.evict_passive(pid);
                }
                return;
            }
        }
        let needs_rts = self.peers[pid.0 as usize]
            .conn
            .as_ref()
            .is_some_and(|c| !c.rts);
        if needs_rts {
            if let Err(e) = self.bring_up(pid, &msg) {
                tracing::warn!(nic = %self.nic, error = %e, "QP bring-up failed");
                self.setup_failed(pid, format!("QP bring-up failed: {e}"));
                return;
            }
        }
        let (matches, was_connected) = {
            let c = self.peers[pid.0 as usize]
                .conn
                .as_ref()
                .expect("created above");
            // Our QPNs and our random PSNs: only a peer that got our
            // handshake knows the PSNs.
            (
                msg.peer_send_qpn == c.send.qpn
                    && msg.peer_write_qpn == c.write.qpn
                    && msg.peer_send_psn == c.send.psn
                    && msg.peer_write_psn == c.write.psn,
                c.connected(),
            )
        };
        let c = self.peers[pid.0 as usize]
            .conn
            .as_mut()
            .expect("created above");
        if msg.ready && matches {
            c.remote_ready = true;
        }
        let now_connected = c.connected();
        if !msg.ack || !matches {
            self.send_handshake(pid);
        }
        if now_connected && !was_connected {
            // It answered at the address it claimed: no longer half-open.
            self.passive.list.remove(pid);
            self.stats.connects += 1;
            tracing::debug!(nic = %self.nic, peer = pid.0, "connected");
            self.pump(pid);
        }
    }

    pub(super) fn bring_up(&mut self, pid: PeerId, msg: &Handshake) -> Result<(), TransportError> {
        let mtu = u32::from(msg.mtu)
            .clamp(1, 5)
            .min(self.port_attr.active_mtu);
        let va = msg.from;
        let ah = self.ah_attr(&va);
        let (sq, wq, spsn, wpsn) = {
            let c = self.peers[pid.0 as usize]
                .conn
                .as_ref()
                .expect("caller ensured");
            (c.send.qp, c.write.qp, c.send.psn, c.write.psn)
        };
        for (qp, dest, rq_psn, sq_psn) in [
            (sq, msg.qps.send_qpn, msg.qps.send_psn, spsn),
            (wq, msg.qps.write_qpn, msg.qps.write_psn, wpsn),
        ] {
            self.ops
                .modify_qp(
                    qp,
                    &ModifyQp::RtrRc {
                        path_mtu: mtu,
                        dest_qpn: dest,
                        rq_psn,
                        ah,
                        max_dest_rd_atomic: 1,
                        min_rnr_timer: self.cfg.min_rnr_timer,
                    },
                )
                .map_err(|e| self.verr(e))?;
            self.ops
                .modify_qp(
                    qp,
                    &ModifyQp::Rts {
                        sq_psn,
                        timeout: self.cfg.timeout,
                        retry_cnt: self.cfg.retry_cnt,
                        rnr_retry: self.cfg.rnr_retry,
                        max_rd_atomic: 1,
                        rc: true,
                    },
                )
                .map_err(|e| self.verr(e))?;
        }
        let c = self.peers[pid.0 as usize]
            .conn
            .as_mut()
            .expect("caller ensured");
        c.remote = Some(msg.qps);
        c.rts = true;
        Ok(())
    }

    /// Takes the current connection out of service. `errored`: QPN of the QP
    /// that hit a requester error (it is in ERR and flushes); the sibling
    /// (and both QPs when `None`) drain what is in flight. Unposted work
    /// stays queued for the next connection.
    pub(super) fn retire_conn(&mut self, pid: PeerId, errored: Option<u32>) {
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        let Some(c) = p.conn.take() else { return };
        self.stats.resets += 1;
        // Ops partially posted on the old connection continue from where
        // their acknowledged bytes end (set when their flushes arrive); ops
        // in the queue with nothing posted simply move over.
        p.draining.push(c);
        let has_work = !p.send_q.is_empty() || !p.write_q.is_empty();
        self.reap_draining(pid);
        // After an error, reconnect at once even without work, so the peer
        // learns about our new QPs before it uses the dead ones.
        if has_work || errored.is_some() {
            self.ensure_conn(pid);
        }
    }

    pub(super) fn reap_draining(&mut self, pid: PeerId) {
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        let mut keep = Vec::new();
        let mut gone = Vec::new();
        for c in p.draining.drain(..) {
            if c.send.outstanding == 0 && c.write.outstanding == 0 {
                gone.push(c);
            } else {
                keep.push(c);
            }
        }
        p.draining = keep;
        for c in gone {
            for end in [c.send, c.write] {
                self.qpn_peer.remove(&end.qpn);
                if let Err(e) = self.ops.destroy_qp(end.qp) {
                    tracing::warn!(nic = %self.nic, error = %e, "destroy_qp failed");
                }
            }
        }
    }

    /// Connection set-up for `pid` failed (`reason`): a passive peer is
    /// forgotten (no one asked for it; kept unreachable, it would refuse
    /// that address from then on), any other is marked unreachable.
    fn setup_failed(&mut self, pid: PeerId, reason: String) {
        if self.is_passive(pid) {
            self.evict_passive(pid);
        } else {
            self.mark_unreachable(pid, reason);
        }
    }

    pub(super) fn mark_unreachable(&mut self, pid: PeerId, reason: String) {
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        if p.unreachable.is_some() {
            return;
        }
        tracing::warn!(nic = %self.nic, peer = %addr_str(&p.addr), reason = %reason, "peer unreachable");
        p.unreachable = Some(reason.clone());
        if let Some(c) = p.conn.take() {
            p.draining.push(c);
        }
        // Move every QP of the peer to ERR so in-flight work flushes.
        let qps: Vec<Qp> = p
            .draining
            .iter()
            .flat_map(|c| [c.send.qp, c.write.qp])
            .collect();
        let queued: Vec<u32> = p.send_q.drain(..).chain(p.write_q.drain(..)).collect();
        for qp in qps {
            let _ = self.ops.modify_qp(qp, &ModifyQp::Err);
        }
        let err = self.peer_err(pid, reason);
        for slot in queued {
            self.fail_op(slot, err.clone());
        }
        // Ops with WRs in flight fail as their flushes arrive.
        self.reap_draining(pid);
    }

    /// Destroys a forgotten peer's address handle, if it had one; a failure
    /// is only logged (the handle is unreachable from then on either way).
    pub(super) fn drop_ah(&mut self, ah: Option<Ah>) {
        if let Some(ah) = ah {
            if let Err(e) = self.ops.destroy_ah(ah) {
                tracing::warn!(nic = %self.nic, error = %e, "destroy_ah failed");
            }
        }
    }

    /// [`weft_transport::Domain::remove_peer`]: fails its queued work at
    /// once and moves its QPs to ERR (in-flight WRs fail with
    /// `PeerRemoved` as their flushes arrive; the QPs are destroyed once
    /// drained), frees its address handle and unmaps its address, so adding
    /// it again creates a new peer: new QPs and a new handshake.
    pub(super) fn forget_peer(&mut self, pid: PeerId) {
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        if p.removed {
            return;
        }
        p.removed = true;
        self.passive.list.remove(pid);
        let Some(p) = self.peers.get_mut(pid.0 as usize) else {
            return;
        };
        // A peer already unreachable keeps its first reason; its queues are
        // empty and its QPs already in ERR.
        p.unreachable = None;
        let addr = p.addr.clone();
        let ah = p.ah.take();
        if self.by_addr.get(&addr) == Some(&pid) {
            self.by_addr.remove(&addr);
        }
        self.mark_unreachable(pid, "removed".into());
        self.drop_ah(ah);
        self.stats.peers_removed += 1;
        tracing::debug!(nic = %self.nic, peer = %addr_str(&addr), "peer removed");
    }

    pub(super) fn timers(&mut self) {
        let now = self.ops.now_ns();
        for i in 0..self.peers.len() {
            let pid = PeerId(i as u32);
            let due = self.peers[i]
                .conn
                .as_ref()
                .filter(|c| !c.connected() && now >= c.next_retx)
                .map(|c| c.tries);
            if let Some(tries) = due {
                let has_work =
                    !self.peers[i].send_q.is_empty() || !self.peers[i].write_q.is_empty();
                if tries >= self.cfg.handshake_tries && !has_work {
                    // Passive side with nothing to send: stop retransmitting
                    // but keep the QPs, so a slow peer can still finish.
                    if let Some(c) = self.peers[i].conn.as_mut() {
                        c.next_retx = u64::MAX;
                    }
                } else if tries >= self.cfg.handshake_tries {
                    self.mark_unreachable(pid, format!("no handshake answer after {tries} tries"));
                } else {
                    self.send_handshake(pid);
                }
            }
        }
    }

    pub(super) fn kick(&mut self, pid: PeerId) {
        if self.is_connected(pid) {
            self.pump(pid);
        } else if let Some(c) = self
            .peers
            .get_mut(pid.0 as usize)
            .and_then(|p| p.conn.as_mut())
            .filter(|c| c.next_retx == u64::MAX)
        {
            // An idle half-open connection got work: resume the handshake.
            c.tries = 0;
            self.send_handshake(pid);
        } else {
            self.ensure_conn(pid);
        }
    }
}
