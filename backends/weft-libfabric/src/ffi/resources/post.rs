//! The data path of [`Resources`]: operation slots, WRITEs, SENDs and
//! receives, and reading the completion queue.

use super::*;

impl Resources {
    /// The context pointer of slot `i`.
    fn slot_ctx(&mut self, i: usize) -> Result<*mut c_void, TransportError> {
        let s = self
            .slots
            .get_mut(i)
            .ok_or_else(|| self_error_slot(&self.nic, i))?;
        let p: *mut OpSlot = s;
        Ok(p.cast())
    }

    fn slot_of(&self, ctx: *mut c_void) -> Option<usize> {
        if ctx.is_null() {
            return None;
        }
        let base = self.slots.as_ptr() as usize;
        let off = (ctx as usize).checked_sub(base)?;
        let i = off / size_of::<OpSlot>();
        (off % size_of::<OpSlot>() == 0 && i < self.slots.len()).then_some(i)
    }

    /// `fi_writemsg` through the pre-filled template of slot `i`: only
    /// addresses, lengths, key and data change. Returns the raw code.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn writemsg(
        &mut self,
        ep: usize,
        i: usize,
        src: u64,
        len: usize,
        desc: Desc,
        dest: u64,
        raddr: u64,
        key: u64,
        data: Option<u64>,
        more: bool,
    ) -> Result<i64, TransportError> {
        let ep = self.ep_at(ep)?;
        // SAFETY: the endpoint is open; `rma` is its RMA ops table.
        let rma = unsafe { (*ep).rma };
        let writemsg = op!(self, rma, FiOpsRma, writemsg, "fi_writemsg")?;
        let s = self
            .slots
            .get_mut(i)
            .ok_or_else(|| self_error_slot(&self.nic, i))?;
        s.iov[0].iov_base = src as usize as *mut c_void;
        s.iov[0].iov_len = len;
        s.desc[0] = desc.0;
        s.rma_iov = FiRmaIov {
            addr: raddr,
            len,
            key,
        };
        s.msg.addr = dest;
        s.msg.data = data.unwrap_or(0);
        let mut flags = FI_COMPLETION;
        if self.delivery_complete && len > 0 {
            flags |= FI_DELIVERY_COMPLETE;
        }
        if data.is_some() {
            flags |= FI_REMOTE_CQ_DATA;
        }
        if more {
            flags |= FI_MORE;
        }
        let msg: *const FiMsgRma = &s.msg;
        // SAFETY: the template's pointers all point into this slot, which
        // stays allocated and untouched until the operation's completion; the
        // source range is registered memory (checked by the caller).
        let rc = unsafe { writemsg(ep, msg, flags) };
        Ok(rc as i64)
    }

    /// Endpoint `ep`: 0 is the main one, `k + 1` the `k`th of
    /// [`Resources::open_tx_ep`].
    fn ep_at(&self, ep: usize) -> Result<*mut FidEp, TransportError> {
        let p = match ep {
            0 => self.ep,
            k => self.tx_eps.get(k - 1).map_or(ptr::null_mut(), |e| e.0),
        };
        if p.is_null() {
            return Err(TransportError::InvalidArgument {
                nic: self.nic.clone(),
                what: format!("internal: endpoint {ep} is not open"),
            });
        }
        Ok(p)
    }

    /// Opens another endpoint of `info` on this domain for the peer of
    /// endpoint name `peer`: it gets an AV of its own holding only that
    /// peer, shares the main CQ (slots identify operations whichever
    /// endpoint carried them) and the domain's registrations, and is
    /// enabled. Returns its index for [`Resources::writemsg`] and
    /// [`Resources::send`] and the peer's address in its AV. Its own
    /// address is told nobody: peers keep sending to the main endpoint.
    ///
    /// Its own AV rather than the main one: shm's `fi_enable` visits every
    /// peer of the endpoint's AV (`smr_exchange_all_peers` reads each
    /// peer's region), and the main AV keeps the entries of peers that are
    /// gone, whose regions may be unmapped (peers in this process).
    pub(crate) fn open_tx_ep(
        &mut self,
        info: &Info,
        peer: &[u8],
    ) -> Result<(usize, u64), TransportError> {
        super::super::keep_signals(|| self.open_tx_ep_inner(info, peer))
    }

    fn open_tx_ep_inner(
        &mut self,
        info: &Info,
        peer: &[u8],
    ) -> Result<(usize, u64), TransportError> {
        if self.mr_endpoint {
            // Registrations would have to be bound to each endpoint.
            return Err(TransportError::Unsupported {
                nic: self.nic.clone(),
                what: "extra endpoints with FI_MR_ENDPOINT registrations".into(),
            });
        }
        let av = self.open_av(info)?;
        let fi_addr = match self.av_insert_into(av, peer) {
            Ok(a) => a,
            Err(e) => {
                self.close_quietly(av.cast(), "av");
                return Err(e);
            }
        };
        // SAFETY: the domain is open.
        let dops = unsafe { (*self.domain).ops };
        let mut ep: *mut FidEp = ptr::null_mut();
        let opened = op!(self, dops, FiOpsDomain, endpoint, "fi_endpoint").and_then(|endpoint| {
            // SAFETY: valid domain and info (the one the domain was opened
            // with).
            let rc = unsafe { endpoint(self.domain, info.ptr, &mut ep, ptr::null_mut()) };
            self.check("fi_endpoint", i64::from(rc))
        });
        if let Err(e) = opened {
            self.close_quietly(av.cast(), "av");
            return Err(e);
        }
        let fid = ep.cast::<Fid>();
        let set_up = self
            .fid_bind(fid, av.cast(), 0, "fi_ep_bind(av)")
            .and_then(|()| {
                self.fid_bind(fid, self.cq.cast(), FI_TRANSMIT | FI_RECV, "fi_ep_bind(cq)")
            })
            .and_then(|()| self.fid_control(fid, FI_ENABLE, "fi_enable"));
        if let Err(e) = set_up {
            self.close_quietly(fid, "ep");
            self.close_quietly(av.cast(), "av");
            return Err(e);
        }
        let k = match self.tx_eps.iter().position(|p| p.0.is_null()) {
            Some(k) => {
                self.tx_eps[k] = (ep, av);
                k
            }
            None => {
                self.tx_eps.push((ep, av));
                self.tx_eps.len() - 1
            }
        };
        Ok((k + 1, fi_addr))
    }

    fn close_quietly(&self, fid: *mut Fid, what: &str) {
        let rc = Self::close(fid);
        if rc != 0 {
            tracing::warn!(nic = %self.nic, rc, what, "fi_close failed");
        }
    }

    /// Closes endpoint `ep` of [`Resources::open_tx_ep`] and its AV.
    /// Operations still inside it never complete: the caller has read every
    /// completion the CQ holds and no longer expects any from it.
    pub(crate) fn close_tx_ep(&mut self, ep: usize) -> Result<(), TransportError> {
        let (e, av) = match ep.checked_sub(1).and_then(|k| self.tx_eps.get_mut(k)) {
            Some(p) if !p.0.is_null() => std::mem::replace(p, (ptr::null_mut(), ptr::null_mut())),
            _ => return Err(self.error("fi_close(ep)", -(libc::EINVAL as i64))),
        };
        let rc = Self::close(e.cast());
        self.check("fi_close(ep)", i64::from(rc))?;
        let rc = Self::close(av.cast());
        self.check("fi_close(av)", i64::from(rc))
    }

    /// `fi_sendmsg` of `parts` (one or two `(address, length, descriptor)`
    /// source pieces, sent as one message) with slot `i` as context, with
    /// explicit flags (`FI_DELIVERY_COMPLETE` only when there are bytes:
    /// shm 1.17 never completes a zero-length one). Returns the raw code.
    pub(crate) fn send(
        &mut self,
        ep: usize,
        i: usize,
        parts: &[(u64, usize, Desc)],
        dest: u64,
    ) -> Result<i64, TransportError> {
        let ep = self.ep_at(ep)?;
        // SAFETY: the endpoint is open; `msg` is its MSG ops table.
        let ops = unsafe { (*ep).msg };
        let sendmsg = op!(self, ops, FiOpsMsg, sendmsg, "fi_sendmsg")?;
        let ctx = self.slot_ctx(i)?;
        if parts.is_empty() || parts.len() > 2 {
            return Err(self.error("fi_sendmsg", -(libc::EINVAL as i64)));
        }
        let len: usize = parts.iter().map(|p| p.1).sum();
        let mut flags = FI_COMPLETION;
        if self.delivery_complete && len > 0 {
            flags |= FI_DELIVERY_COMPLETE;
        }
        let s = self
            .slots
            .get_mut(i)
            .ok_or_else(|| self_error_slot(&self.nic, i))?;
        for (k, &(addr, len, desc)) in parts.iter().enumerate() {
            s.iov[k].iov_base = addr as usize as *mut c_void;
            s.iov[k].iov_len = len;
            s.desc[k] = desc.0;
        }
        let msg = FiMsg {
            msg_iov: s.iov.as_ptr(),
            desc: s.desc.as_mut_ptr(),
            iov_count: parts.len(),
            addr: dest,
            context: ctx,
            data: 0,
        };
        // SAFETY: registered source memory valid until completion; the iovs
        // and descriptors live in the reserved slot; the provider copies the
        // fi_msg itself during the call.
        let rc = unsafe { sendmsg(ep, &msg, flags) };
        Ok(rc as i64)
    }

    /// `fi_recv` (any source) with slot `i` as context. Returns the raw code.
    pub(crate) fn recv(
        &mut self,
        i: usize,
        buf: u64,
        len: usize,
        desc: Desc,
    ) -> Result<i64, TransportError> {
        // SAFETY: the endpoint is open; `msg` is its MSG ops table.
        let msg = unsafe { (*self.ep).msg };
        let recv = op!(self, msg, FiOpsMsg, recv, "fi_recv")?;
        let ctx = self.slot_ctx(i)?;
        // SAFETY: registered buffer valid until completion; slot reserved.
        let rc = unsafe {
            recv(
                self.ep,
                buf as usize as *mut c_void,
                len,
                desc.0,
                FI_ADDR_UNSPEC,
                ctx,
            )
        };
        Ok(rc as i64)
    }

    /// Reads up to `max` CQ entries into `out` (appending).
    pub(crate) fn cq_read(
        &mut self,
        out: &mut Vec<CqEntry>,
        max: usize,
    ) -> Result<CqRead, TransportError> {
        // SAFETY: the CQ is open.
        let ops = unsafe { (*self.cq).ops };
        let read = op!(self, ops, FiOpsCq, read, "fi_cq_read")?;
        let n = max.clamp(1, self.cq_buf.len());
        // SAFETY: buffer of `n` FI_CQ_FORMAT_DATA entries.
        let rc = unsafe { read(self.cq, self.cq_buf.as_mut_ptr().cast(), n) } as i64;
        if rc == -FI_EAGAIN {
            return Ok(CqRead::Empty);
        }
        if rc == -FI_EAVAIL {
            return Ok(CqRead::ErrorAvailable);
        }
        if rc < 0 {
            return Err(self.error("fi_cq_read", rc));
        }
        let got = usize::try_from(rc).unwrap_or(0).min(n);
        for k in 0..got {
            let e = self.cq_buf[k];
            out.push(CqEntry {
                slot: self.slot_of(e.op_context),
                flags: e.flags,
                len: e.len,
                data: e.data,
            });
        }
        Ok(if got == 0 {
            CqRead::Empty
        } else {
            CqRead::Entries(got)
        })
    }

    /// The CQ's wait object as a file descriptor (`fi_control(FI_GETWAIT)`),
    /// or `None` if the provider gives none.
    pub(super) fn cq_getwait(&self) -> Option<c_int> {
        let fid = self.cq.cast::<Fid>();
        let control = op!(self, self.fid_ops(fid), FiOps, control, "fi_control").ok()?;
        let mut fd: c_int = -1;
        // SAFETY: the CQ is open; FI_GETWAIT on an FI_WAIT_FD CQ writes one
        // int (the fd) through the pointer, which points at `fd`.
        let rc = unsafe { control(fid, FI_GETWAIT, (&mut fd as *mut c_int).cast()) };
        (rc == 0 && fd >= 0).then_some(fd)
    }

    /// The CQ's wait fd, when it has one: readable when `fi_cq_read` may
    /// find something (a completion, or socket data only progress moves).
    /// Owned by the provider; closed with the CQ.
    pub(crate) fn wait_fd(&self) -> Option<c_int> {
        self.wait_fd
    }

    /// `fi_trywait` on the CQ: `true` when the caller may block on
    /// [`Resources::wait_fd`], `false` when it must read the CQ first (or the
    /// CQ has no wait fd, or the call failed).
    pub(crate) fn trywait(&mut self) -> bool {
        if self.wait_fd.is_none() {
            return false;
        }
        // SAFETY: the fabric is open.
        let fops = unsafe { (*self.fabric).ops };
        let Ok(trywait) = op!(self, fops, FiOpsFabric, trywait, "fi_trywait") else {
            return false;
        };
        let mut fids = [self.cq.cast::<Fid>()];
        // SAFETY: the fabric and the CQ in `fids` are open; the array holds
        // exactly the one fid we pass as count.
        let rc = unsafe { trywait(self.fabric, fids.as_mut_ptr(), 1) };
        rc == 0
    }

    /// Reads one CQ error entry (`fi_cq_readerr`), with its text.
    pub(crate) fn cq_readerr(&mut self) -> Result<Option<CqError>, TransportError> {
        // SAFETY: the CQ is open.
        let ops = unsafe { (*self.cq).ops };
        let readerr = op!(self, ops, FiOpsCq, readerr, "fi_cq_readerr")?;
        let mut e = Padded::new(FiCqErrEntry {
            op_context: ptr::null_mut(),
            flags: 0,
            len: 0,
            buf: ptr::null_mut(),
            data: 0,
            tag: 0,
            olen: 0,
            err: 0,
            prov_errno: 0,
            err_data: ptr::null_mut(),
            err_data_size: 0,
        });
        // SAFETY: padded error entry; err_data_size 0 lets the provider
        // point err_data at its own buffer (valid until the next CQ read).
        let rc = unsafe { readerr(self.cq, e.as_mut(), 0) } as i64;
        if rc == -FI_EAGAIN {
            return Ok(None);
        }
        if rc < 0 {
            return Err(self.error("fi_cq_readerr", rc));
        }
        let v = e.get();
        let mut message = self.lib.strerror(i64::from(v.err));
        if v.prov_errno != 0 {
            let prov = self.cq_strerror(v.prov_errno, v.err_data);
            message = format!("{message}; provider errno {}: {prov}", v.prov_errno);
        }
        Ok(Some(CqError {
            slot: self.slot_of(v.op_context),
            flags: v.flags,
            err: i64::from(v.err),
            prov_errno: i64::from(v.prov_errno),
            olen: v.olen,
            message,
        }))
    }

    fn cq_strerror(&self, prov_errno: c_int, err_data: *mut c_void) -> String {
        // SAFETY: the CQ is open.
        let ops = unsafe { (*self.cq).ops };
        let Ok(strerror) = op!(self, ops, FiOpsCq, strerror, "fi_cq_strerror") else {
            return String::from("(no fi_cq_strerror)");
        };
        let mut buf = vec![0 as c_char; 256];
        // SAFETY: err_data is what readerr just returned (still valid: no CQ
        // read in between); output buffer of the given length.
        let p = unsafe { strerror(self.cq, prov_errno, err_data, buf.as_mut_ptr(), buf.len()) };
        if let Some(last) = buf.last_mut() {
            *last = 0;
        }
        let p = if p.is_null() { buf.as_ptr() } else { p };
        cstr_owned(p)
    }
}

fn self_error_slot(nic: &str, i: usize) -> TransportError {
    TransportError::InvalidArgument {
        nic: nic.to_string(),
        what: format!("internal: operation slot {i} out of range"),
    }
}
