//! Receives: user buffers on the SEND/RECV SRQ, zero-byte receives on the
//! WRITE_WITH_IMM SRQ (replenished on every poll) and the UD handshake
//! receives.

use super::{wr_id, VerbsDomain, GRH, KIND_IMM, KIND_RECV, KIND_UD, MAX_VERBS_WR_LEN, UD_SLOT};
use crate::ops::*;
use weft_transport::{LocalSlice, TransportError, WrId};

/// The domain's receives: user receives posted to the SEND/RECV SRQ and the
/// count of zero-byte WRITE_WITH_IMM receives to repost.
pub(super) struct Receives {
    /// Posted user receives by slot: `(generation, user wr, capacity)`.
    pub(super) slab: Vec<Option<(u32, WrId, u64)>>,
    /// Free slots of `slab`.
    pub(super) free: Vec<u32>,
    /// User receives posted and not completed (bounded by `recv_pool`).
    pub(super) posted: u32,
    /// WRITE_WITH_IMM receives consumed and not yet reposted.
    pub(super) imm_missing: u32,
}

impl<O: VerbsOps> VerbsDomain<O> {
    /// Posts a user receive buffer to the SEND/RECV SRQ.
    pub(super) fn accept_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        if let Some(d) = &self.dead {
            return Err(d.clone());
        }
        if self.recvs.posted >= self.cfg.recv_pool {
            return Err(TransportError::QueueFull {
                nic: self.nic.clone(),
            });
        }
        let lkey = if buf.len > 0 {
            self.resolve_local(&buf)?
        } else {
            0
        };
        let length = u32::try_from(buf.len)
            .unwrap_or(u32::MAX)
            .min(MAX_VERBS_WR_LEN as u32);
        self.op_gen = self.op_gen.wrapping_add(1) & 0x1fff_ffff;
        let gen = self.op_gen;
        let slot = match self.recvs.free.pop() {
            Some(s) => s,
            None => {
                self.recvs.slab.push(None);
                (self.recvs.slab.len() - 1) as u32
            }
        };
        let rwr = RecvWr {
            wr_id: wr_id(KIND_RECV, gen, slot),
            sge: (buf.len > 0).then_some(Sge {
                addr: buf.addr,
                length,
                lkey,
            }),
        };
        match self.ops.post_srq_recv(self.recv_srq, &[rwr]) {
            Ok(()) => {
                self.recvs.slab[slot as usize] = Some((gen, wr, u64::from(length)));
                self.recvs.posted += 1;
                Ok(())
            }
            Err(f) => {
                self.recvs.free.push(slot);
                Err(self.verr(f.error))
            }
        }
    }

    pub(super) fn post_ud_recv(&mut self, slot: u32) -> Result<(), TransportError> {
        let off = slot as usize * UD_SLOT;
        // A RoCE v2 IPv4 datagram writes only the GRH area's last 20 bytes:
        // no earlier datagram's header may linger in the first 20
        // (`ud_source`).
        self.ud.buf.write(off, &[0u8; GRH]);
        let wr = RecvWr {
            wr_id: wr_id(KIND_UD, 0, slot),
            sge: Some(Sge {
                addr: self.ud.buf.addr(off),
                length: UD_SLOT as u32,
                lkey: self.ud.lkey,
            }),
        };
        self.ops
            .post_recv(self.ud.qp, &[wr])
            .map_err(|f| f.error.into_transport(&self.nic))
    }

    pub(super) fn replenish_imm(&mut self) -> Result<(), TransportError> {
        let mut chain = Vec::new();
        while self.recvs.imm_missing > 0 {
            chain.clear();
            let n = self.recvs.imm_missing.min(32);
            for _ in 0..n {
                chain.push(RecvWr {
                    wr_id: wr_id(KIND_IMM, 0, 0),
                    sge: None,
                });
            }
            match self.ops.post_srq_recv(self.imm_srq, &chain) {
                Ok(()) => self.recvs.imm_missing -= n,
                Err(f) => {
                    self.recvs.imm_missing -= f.bad_index as u32;
                    return Err(f.error.into_transport(&self.nic));
                }
            }
        }
        Ok(())
    }
}
