//! Posting: the native operation each reserved slot hands to libfabric
//! (the WRITE, SEND and receive templates), issuing it, and what EAGAIN
//! turns it into.

use weft_transport::{Device, LocalSlice, PeerId, PostError, TransportError, WrId, WriteWr};

use super::clock::Clock;
use super::messages::wire as msg;
use super::slots::SlotUse;
use super::LibfabricDomain;
use crate::ffi::{self, Desc};

/// What to hand to libfabric for one reserved slot.
#[derive(Debug, Clone, Copy)]
pub(super) enum Native {
    Write {
        src: u64,
        len: usize,
        desc: Desc,
        dest: u64,
        raddr: u64,
        key: u64,
        data: Option<u64>,
    },
    /// A message: our header, then (unless empty) the payload.
    Send {
        hdr: (u64, usize, Desc),
        payload: Option<(u64, usize, Desc)>,
        dest: u64,
    },
    Recv {
        addr: u64,
        len: usize,
        desc: Desc,
    },
}

impl LibfabricDomain {
    /// Hands `n` to libfabric with context `i`; the provider's return
    /// code.
    ///
    /// Operations to a peer go out on its own endpoint where the provider
    /// needs that (`peer_eps`); receives always on the main one.
    pub(super) fn issue(&mut self, i: usize, n: Native, more: bool) -> Result<i64, TransportError> {
        let (ep, dest) = self.ep_for(i)?;
        let mut n = n;
        if let Some(d) = dest {
            match &mut n {
                Native::Write { dest, .. } | Native::Send { dest, .. } => *dest = d,
                Native::Recv { .. } => {}
            }
        }
        // A WRITE to an shm peer is checked against the peer's key table
        // first (`keys.rs`): the provider never completes one it rejects.
        let checked = match (n, self.slots.table.get(i)) {
            (
                Native::Write {
                    key, raddr, len, ..
                },
                Some(&SlotUse::Write { peer, .. }),
            ) => self.check_write(peer, key, raddr, len as u64)?,
            _ => None,
        };
        let rc = self.issue_on(ep, i, n, more);
        self.posted_write(checked);
        let rc = rc?;
        if rc == 0 && self.is_shm {
            self.ring_after_post(i);
        }
        if rc == 0 && ep != 0 {
            if let Some(e) = self.peer_eps.slot_ep.get_mut(i) {
                *e = Some(ep);
            }
        }
        Ok(rc)
    }

    fn issue_on(
        &mut self,
        ep: usize,
        i: usize,
        n: Native,
        more: bool,
    ) -> Result<i64, TransportError> {
        match n {
            Native::Write {
                src,
                len,
                desc,
                dest,
                raddr,
                key,
                data,
            } => self
                .res
                .writemsg(ep, i, src, len, desc, dest, raddr, key, data, more),
            Native::Send { hdr, payload, dest } => match payload {
                Some(p) => self.res.send(ep, i, &[hdr, p], dest),
                None => self.res.send(ep, i, &[hdr], dest),
            },
            Native::Recv { addr, len, desc } => self.res.recv(i, addr, len, desc),
        }
    }

    /// Issues reserved slot `i` (already taken off its free list). On EAGAIN
    /// after one progress round the work joins the backlog and is still
    /// accepted; on any other error the slot is released and the error
    /// returned. Work for a peer (or receives) with entries already in the
    /// backlog joins it directly, behind them: issuing it first would
    /// overtake them, and the attempt would most likely fail anyway.
    pub(super) fn submit(
        &mut self,
        i: usize,
        slot: SlotUse,
        n: Native,
        more: bool,
        clock: &mut Clock,
    ) -> Result<(), TransportError> {
        self.slots.table[i] = slot;
        if self.is_tcp {
            // Kept for re-issue from limbo (a new operation: no failure yet).
            if let Some(x) = self.limbo.natives.get_mut(i) {
                *x = Some(n);
            }
            if let Some(f) = self.limbo.first_fail.get_mut(i) {
                *f = None;
            }
        }
        let peer = slot.peer();
        let queued = match peer {
            Some(p) => self
                .peers
                .table
                .get(p.0 as usize)
                .is_some_and(|p| p.backlogged > 0),
            None => self.backlog.recvs > 0,
        };
        if queued {
            self.park(i, n, peer);
            return Ok(());
        }
        for attempt in 0..2 {
            let rc = match self.issue(i, n, more) {
                Ok(rc) => rc,
                Err(e) => {
                    self.slots.unreserve(i);
                    return Err(e);
                }
            };
            if rc == 0 {
                if let Some(p) = peer {
                    self.on_posted(i, p);
                }
                return Ok(());
            }
            if rc != -ffi::FI_EAGAIN {
                self.slots.unreserve(i);
                return Err(self.post_error(slot, rc));
            }
            if attempt == 0 {
                if let Err(e) = self.progress_into_stash(clock) {
                    self.slots.unreserve(i);
                    return Err(e);
                }
            }
        }
        if let Some(p) = peer {
            if let Err(e) = self.on_eagain(p, clock) {
                self.slots.unreserve(i);
                return Err(e);
            }
        }
        self.park(i, n, peer);
        Ok(())
    }

    /// Slot `i` was issued to `peer`: counts it and gives it the peer's next
    /// issue number.
    pub(super) fn on_posted(&mut self, i: usize, peer: PeerId) {
        if let Some(p) = self.peers.table.get_mut(peer.0 as usize) {
            p.inflight += 1;
            p.eagain_since = None;
            p.issued += 1;
            if let Some(q) = self.limbo.issue_no.get_mut(i) {
                *q = p.issued;
            }
        }
    }
}

impl LibfabricDomain {
    /// [`weft_transport::Domain::post_send`]: one message of a header and
    /// the payload, into one of the receiver's bounce buffers.
    pub(super) fn send(
        &mut self,
        wr: WrId,
        peer: PeerId,
        src: LocalSlice,
        clock: &mut Clock,
    ) -> Result<(), TransportError> {
        let dest = self.live_peer(peer)?;
        if src.len > self.caps.max_send_len {
            return Err(self.invalid(format!(
                "SEND of {} bytes exceeds max_send_len {}",
                src.len, self.caps.max_send_len
            )));
        }
        let len = usize::try_from(src.len).map_err(|_| self.invalid("SEND too long"))?;
        let desc = if src.len == 0 {
            None
        } else {
            Some(self.local(&src, "SEND source")?)
        };
        // libfabric 1.17's shm crashed the sending process on a SEND of
        // CUDA memory: a SEND from device memory is copied into one of the
        // domain's staging buffers first, and sent from there.
        let device = desc.is_some()
            && self
                .mrs
                .get(&src.mr)
                .is_some_and(|e| e.device != Device::Host);
        if device && (self.msgs.stage_len == 0 || ffi::CudaFence::get().is_none()) {
            return Err(TransportError::Unsupported {
                nic: self.nic_name(),
                what: "SEND from device memory without hmem or a CUDA runtime loaded by \
                       libfabric (it is staged through host memory)"
                    .into(),
            });
        }
        if self.slots.free_tx.len() <= self.cq.stashed_tx {
            return Err(TransportError::QueueFull {
                nic: self.nic_name(),
            });
        }
        let Some(i) = self.slots.free_tx.pop() else {
            return Err(TransportError::QueueFull {
                nic: self.nic_name(),
            });
        };
        let payload = match desc {
            None => None,
            Some(_) if device => {
                let Some(s) = self.slots.take_stage(i) else {
                    self.slots.free(i);
                    return Err(TransportError::QueueFull {
                        nic: self.nic_name(),
                    });
                };
                let off = self.msgs.stage_off + usize::from(s) * self.msgs.stage_len;
                if !self.stage_send(off, &src, len) {
                    self.slots.free(i);
                    return Err(TransportError::LocalAccess {
                        nic: self.nic_name(),
                        what: format!(
                            "SEND source [{:#x}, +{}): copying it from device memory failed",
                            src.addr, src.len
                        ),
                    });
                }
                Some((self.msgs.ctl.addr() + off as u64, len, self.msgs.ctl_desc))
            }
            Some(d) => Some((src.addr, len, d)),
        };
        self.msgs.send_gen = self.msgs.send_gen.wrapping_add(1);
        let seq = u64::from(self.msgs.send_gen) << 32 | i as u64;
        let h = msg::data(seq, src.len, &self.nic.addr.0);
        let off = self.hdr_off(i);
        if !self.msgs.ctl.write(off, &h) {
            self.slots.free(i);
            return Err(self.invalid("SEND header does not fit its slot"));
        }
        let slot = SlotUse::Send {
            wr,
            peer,
            len: src.len,
            seq,
            sent: None,
            ack: None,
        };
        self.submit(
            i,
            slot,
            Native::Send {
                hdr: (
                    self.msgs.ctl.addr() + off as u64,
                    h.len(),
                    self.msgs.ctl_desc,
                ),
                payload,
                dest,
            },
            false,
            clock,
        )
    }

    /// [`weft_transport::Domain::post_writes`]: one `fi_writemsg` per WR.
    pub(super) fn writes(
        &mut self,
        wrs: &[WriteWr],
        clock: &mut Clock,
    ) -> Result<usize, PostError> {
        let n = wrs.len().min(self.caps.max_batch);
        for (k, wr) in wrs.iter().take(n).enumerate() {
            let fail = |error| PostError { posted: k, error };
            let dest = self.live_peer(wr.peer).map_err(fail)?;
            if wr.src.len > self.caps.max_write_len {
                return Err(fail(self.invalid(format!(
                    "WRITE of {} bytes exceeds max_write_len {}",
                    wr.src.len, self.caps.max_write_len
                ))));
            }
            let len =
                usize::try_from(wr.src.len).map_err(|_| fail(self.invalid("WRITE too long")))?;
            let (src, desc) = if wr.src.len == 0 {
                (self.dummy.as_ptr() as usize as u64, self.dummy_desc)
            } else {
                (
                    wr.src.addr,
                    self.local(&wr.src, "WRITE source").map_err(fail)?,
                )
            };
            let raddr = if self.virt_addr {
                wr.dst.addr().ok_or_else(|| {
                    fail(self.invalid(format!(
                        "remote address {:#x} + {:#x} overflows",
                        wr.dst.base, wr.dst.offset
                    )))
                })?
            } else {
                wr.dst.offset
            };
            if self.slots.free_tx.len() <= self.cq.stashed_tx {
                return Ok(k);
            }
            let Some(i) = self.slots.free_tx.pop() else {
                return Ok(k);
            };
            let slot = SlotUse::Write {
                wr: wr.wr,
                peer: wr.peer,
                rkey: wr.dst.rkey.0,
                raddr,
                len: wr.src.len,
            };
            // With per-peer endpoints a batch continues on the same
            // endpoint only if the next WR goes to the same peer.
            let more = self.opts.fi_more
                && k + 1 < n
                && (!self.peer_eps.enabled || wrs[k + 1].peer == wr.peer)
                && !self.slots.free_tx.is_empty()
                && self.backlog.queue.is_empty();
            let native = Native::Write {
                src,
                len,
                desc,
                dest,
                raddr,
                key: wr.dst.rkey.0,
                data: wr.imm.map(u64::from),
            };
            self.submit(i, slot, native, more, clock).map_err(fail)?;
        }
        Ok(n)
    }
}

impl LibfabricDomain {
    /// Copies SEND source `src` (`len` bytes, device memory) into the
    /// staging buffer at `off` of the message buffers.
    fn stage_send(&mut self, off: usize, src: &LocalSlice, len: usize) -> bool {
        let Some(e) = self.mrs.get(&src.mr) else {
            return false;
        };
        let Some(w) = e.window.as_ref() else {
            return false;
        };
        let Some(src_off) = e.offset(src.addr).and_then(|o| usize::try_from(o).ok()) else {
            return false;
        };
        self.msgs.ctl.fill_from(off, w, src_off, len)
    }
}
