//! One opened device context and the verbs objects made on it.

use super::*;

/// One opened libibverbs device context. Handles given out are the object
/// pointers; every call checks them against the live objects of this
/// context first.
pub struct IbvDevice {
    api: Arc<Api>,
    ctx: *mut IbvContext,
    name: String,
    pds: BTreeMap<u64, *mut c_void>,
    cqs: BTreeMap<u64, *mut IbvCq>,
    srqs: BTreeMap<u64, *mut IbvSrq>,
    qps: BTreeMap<u64, *mut IbvQp>,
    mrs: BTreeMap<u64, *mut IbvMr>,
    ahs: BTreeMap<u64, *mut c_void>,
    start: std::time::Instant,
}

// SAFETY: libibverbs objects may be used from any thread (rdma-core locks
// internally where needed); `IbvDevice` owns them and is used through
// `&mut self` only, so there is no unsynchronized sharing.
unsafe impl Send for IbvDevice {}

fn bad_handle(op: &'static str) -> VerbsError {
    VerbsError::new(op, 22, "unknown handle")
}

fn key<T>(p: *mut T) -> u64 {
    p as usize as u64
}

impl IbvDevice {
    /// The device of context `ctx` (just opened by `ibv_open_device`),
    /// with no objects yet; it closes `ctx` when dropped.
    pub(super) fn new(api: Arc<Api>, ctx: *mut IbvContext, name: String) -> Self {
        IbvDevice {
            api,
            ctx,
            name,
            pds: BTreeMap::new(),
            cqs: BTreeMap::new(),
            srqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            mrs: BTreeMap::new(),
            ahs: BTreeMap::new(),
            start: std::time::Instant::now(),
        }
    }

    fn mr_result(
        &mut self,
        op: &'static str,
        mr: *mut IbvMr,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        let mr = check_ptr(op, mr, &self.name)?;
        // SAFETY: a live MR just returned by libibverbs.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.mrs.insert(key(mr), mr);
        Ok((Mr(key(mr)), lkey, rkey))
    }
}

impl VerbsOps for IbvDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn query_port(&mut self, port: u8) -> Result<PortAttr, VerbsError> {
        let mut a = IbvPortAttr::default();
        // SAFETY: valid context; `a` is at least as large as the
        // `_compat_ibv_port_attr` the exported symbol fills.
        let rc = unsafe { (self.api.query_port)(self.ctx, port, &mut a) };
        check("ibv_query_port", rc, &format!("{} port {port}", self.name))?;
        Ok(PortAttr {
            state: a.state,
            active_mtu: a.active_mtu,
            gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
            max_msg_sz: a.max_msg_sz,
            lid: a.lid,
            link_layer: match a.link_layer {
                LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
            active_width: a.active_width,
            active_speed: a.active_speed,
        })
    }

    fn query_gid(&mut self, port: u8, index: u32) -> Result<GidEntry, VerbsError> {
        if let Some(ex) = self.api.query_gid_ex {
            let mut e = IbvGidEntry::default();
            // SAFETY: valid context and out-pointer of the stated size.
            let rc = unsafe {
                ex(
                    self.ctx,
                    u32::from(port),
                    index,
                    &mut e,
                    0,
                    std::mem::size_of::<IbvGidEntry>(),
                )
            };
            if check("ibv_query_gid_ex", rc, "").is_ok() {
                return Ok(GidEntry {
                    gid: Gid(e.gid),
                    gid_type: match e.gid_type {
                        GID_TYPE_IB => Some(GidType::Ib),
                        GID_TYPE_ROCE_V1 => Some(GidType::RoceV1),
                        GID_TYPE_ROCE_V2 => Some(GidType::RoceV2),
                        _ => None,
                    },
                });
            }
        }
        let mut gid = [0u8; 16];
        let idx = c_int::try_from(index).map_err(|_| bad_handle("ibv_query_gid"))?;
        // SAFETY: valid context and a 16-byte out buffer.
        let rc = unsafe { (self.api.query_gid)(self.ctx, port, idx, &mut gid) };
        check("ibv_query_gid", rc, &format!("index {index}"))?;
        Ok(GidEntry {
            gid: Gid(gid),
            gid_type: sysfs_gid_type(&self.name, port, index),
        })
    }

    fn alloc_pd(&mut self) -> Result<Pd, VerbsError> {
        // SAFETY: valid context.
        let pd = check_ptr("ibv_alloc_pd", unsafe { (self.api.alloc_pd)(self.ctx) }, "")?;
        self.pds.insert(key(pd), pd);
        Ok(Pd(key(pd)))
    }

    fn dealloc_pd(&mut self, pd: Pd) -> Result<(), VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_dealloc_pd"))?;
        // SAFETY: a live PD of this context.
        check("ibv_dealloc_pd", unsafe { (self.api.dealloc_pd)(p) }, "")?;
        self.pds.remove(&pd.0);
        Ok(())
    }

    fn reg_mr(
        &mut self,
        pd: Pd,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_reg_mr"))?;
        let len = usize::try_from(len).map_err(|_| VerbsError::new("ibv_reg_mr", 22, "length"))?;
        let ptr = addr as usize as *mut c_void;
        let mr = match self.api.reg_mr_iova2 {
            // SAFETY: the caller (a MemRegion's creator) promised the range is
            // valid while registered; PD is live.
            Some(f) => unsafe { f(p, ptr, len, addr, access) },
            // SAFETY: as above; optional flags are not understood by the old
            // entry point, so they are dropped.
            None => unsafe {
                (self.api.reg_mr)(p, ptr, len, (access & !ACCESS_OPTIONAL_RANGE) as c_int)
            },
        };
        self.mr_result("ibv_reg_mr", mr)
    }

    fn reg_dmabuf_mr(
        &mut self,
        pd: Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> Result<(Mr, u32, u32), VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_reg_dmabuf_mr"))?;
        let f = self
            .api
            .reg_dmabuf_mr
            .ok_or_else(|| VerbsError::new("ibv_reg_dmabuf_mr", 95, "libibverbs lacks it"))?;
        let len =
            usize::try_from(len).map_err(|_| VerbsError::new("ibv_reg_dmabuf_mr", 22, "length"))?;
        // SAFETY: PD is live; the fd/offset/length describe a dma-buf the
        // exporter handed us.
        let mr = unsafe { f(p, offset, len, iova, fd, access as c_int) };
        self.mr_result("ibv_reg_dmabuf_mr", mr)
    }

    fn dereg_mr(&mut self, mr: Mr) -> Result<(), VerbsError> {
        let p = *self
            .mrs
            .get(&mr.0)
            .ok_or_else(|| bad_handle("ibv_dereg_mr"))?;
        // SAFETY: a live MR of this context.
        check("ibv_dereg_mr", unsafe { (self.api.dereg_mr)(p) }, "")?;
        self.mrs.remove(&mr.0);
        Ok(())
    }

    fn create_cq(&mut self, cqe: u32) -> Result<Cq, VerbsError> {
        let n = c_int::try_from(cqe).map_err(|_| VerbsError::new("ibv_create_cq", 22, "cqe"))?;
        // SAFETY: valid context; no channel, vector 0.
        let cq = unsafe {
            (self.api.create_cq)(self.ctx, n, std::ptr::null_mut(), std::ptr::null_mut(), 0)
        };
        let cq = check_ptr("ibv_create_cq", cq, &format!("{cqe} entries"))?;
        self.cqs.insert(key(cq), cq);
        Ok(Cq(key(cq)))
    }

    fn destroy_cq(&mut self, cq: Cq) -> Result<(), VerbsError> {
        let p = *self
            .cqs
            .get(&cq.0)
            .ok_or_else(|| bad_handle("ibv_destroy_cq"))?;
        // SAFETY: a live CQ of this context.
        check("ibv_destroy_cq", unsafe { (self.api.destroy_cq)(p) }, "")?;
        self.cqs.remove(&cq.0);
        Ok(())
    }

    fn create_srq(&mut self, pd: Pd, max_wr: u32) -> Result<Srq, VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_create_srq"))?;
        let mut a = IbvSrqInitAttr {
            srq_context: std::ptr::null_mut(),
            max_wr,
            max_sge: 1,
            srq_limit: 0,
        };
        // SAFETY: live PD, valid attribute struct.
        let s = check_ptr(
            "ibv_create_srq",
            unsafe { (self.api.create_srq)(p, &mut a) },
            "",
        )?;
        self.srqs.insert(key(s), s);
        Ok(Srq(key(s)))
    }

    fn destroy_srq(&mut self, srq: Srq) -> Result<(), VerbsError> {
        let p = *self
            .srqs
            .get(&srq.0)
            .ok_or_else(|| bad_handle("ibv_destroy_srq"))?;
        // SAFETY: a live SRQ of this context.
        check("ibv_destroy_srq", unsafe { (self.api.destroy_srq)(p) }, "")?;
        self.srqs.remove(&srq.0);
        Ok(())
    }

    fn create_qp(&mut self, pd: Pd, init: &QpInit) -> Result<QpCreated, VerbsError> {
        let op = "ibv_create_qp";
        let p = *self.pds.get(&pd.0).ok_or_else(|| bad_handle(op))?;
        let scq = *self
            .cqs
            .get(&init.send_cq.0)
            .ok_or_else(|| bad_handle(op))?;
        let rcq = *self
            .cqs
            .get(&init.recv_cq.0)
            .ok_or_else(|| bad_handle(op))?;
        let srq = match init.srq {
            Some(s) => *self.srqs.get(&s.0).ok_or_else(|| bad_handle(op))? as *mut c_void,
            None => std::ptr::null_mut(),
        };
        let mut a = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq as *mut c_void,
            recv_cq: rcq as *mut c_void,
            srq,
            cap: IbvQpCap {
                max_send_wr: init.max_send_wr,
                max_recv_wr: if init.srq.is_some() {
                    0
                } else {
                    init.max_recv_wr
                },
                max_send_sge: init.max_sge,
                max_recv_sge: init.max_sge,
                max_inline_data: 0,
            },
            qp_type: match init.qp_type {
                QpType::Rc => QPT_RC,
                QpType::Ud => QPT_UD,
            },
            sq_sig_all: 0,
        };
        // SAFETY: live PD/CQs/SRQ, valid attribute struct (updated with the
        // actual capabilities on return).
        let qp = check_ptr(op, unsafe { (self.api.create_qp)(p, &mut a) }, "")?;
        self.qps.insert(key(qp), qp);
        // SAFETY: a live QP.
        let qpn = unsafe { (*qp).qp_num };
        Ok(QpCreated {
            qp: Qp(key(qp)),
            qpn,
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
        })
    }

    fn modify_qp(&mut self, qp: Qp, change: &ModifyQp) -> Result<(), VerbsError> {
        let p = *self
            .qps
            .get(&qp.0)
            .ok_or_else(|| bad_handle("ibv_modify_qp"))?;
        let mut a = IbvQpAttr::default();
        let mask = match *change {
            ModifyQp::Init {
                port,
                pkey_index,
                access,
                qkey,
            } => {
                a.qp_state = QPS_INIT;
                a.port_num = port;
                a.pkey_index = pkey_index;
                match qkey {
                    Some(q) => {
                        a.qkey = q;
                        QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_QKEY
                    }
                    None => {
                        a.qp_access_flags = access;
                        QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS
                    }
                }
            }
            ModifyQp::RtrRc {
                path_mtu,
                dest_qpn,
                rq_psn,
                ah,
                max_dest_rd_atomic,
                min_rnr_timer,
            } => {
                a.qp_state = QPS_RTR;
                a.path_mtu = path_mtu;
                a.dest_qp_num = dest_qpn;
                a.rq_psn = rq_psn;
                a.max_dest_rd_atomic = max_dest_rd_atomic;
                a.min_rnr_timer = min_rnr_timer;
                a.ah_attr = ah_attr(&ah);
                QP_STATE
                    | QP_AV
                    | QP_PATH_MTU
                    | QP_DEST_QPN
                    | QP_RQ_PSN
                    | QP_MAX_DEST_RD_ATOMIC
                    | QP_MIN_RNR_TIMER
            }
            ModifyQp::RtrUd => {
                a.qp_state = QPS_RTR;
                QP_STATE
            }
            ModifyQp::Rts {
                sq_psn,
                timeout,
                retry_cnt,
                rnr_retry,
                max_rd_atomic,
                rc,
            } => {
                a.qp_state = QPS_RTS;
                a.sq_psn = sq_psn;
                if rc {
                    a.timeout = timeout;
                    a.retry_cnt = retry_cnt;
                    a.rnr_retry = rnr_retry;
                    a.max_rd_atomic = max_rd_atomic;
                    QP_STATE
                        | QP_SQ_PSN
                        | QP_TIMEOUT
                        | QP_RETRY_CNT
                        | QP_RNR_RETRY
                        | QP_MAX_QP_RD_ATOMIC
                } else {
                    QP_STATE | QP_SQ_PSN
                }
            }
            ModifyQp::Err => {
                a.qp_state = QPS_ERR;
                QP_STATE
            }
            ModifyQp::Reset => {
                a.qp_state = QPS_RESET;
                QP_STATE
            }
        };
        // SAFETY: a live QP and a fully initialized attribute struct.
        let rc = unsafe { (self.api.modify_qp)(p, &mut a, mask) };
        check("ibv_modify_qp", rc, &format!("{change:?}"))
    }

    fn destroy_qp(&mut self, qp: Qp) -> Result<(), VerbsError> {
        let p = *self
            .qps
            .get(&qp.0)
            .ok_or_else(|| bad_handle("ibv_destroy_qp"))?;
        // SAFETY: a live QP of this context.
        check("ibv_destroy_qp", unsafe { (self.api.destroy_qp)(p) }, "")?;
        self.qps.remove(&qp.0);
        Ok(())
    }

    fn post_send(&mut self, qp: Qp, wrs: &[SendWr]) -> Result<(), PostFailure> {
        let fail = |i, e| PostFailure {
            bad_index: i,
            error: e,
        };
        let p = *self
            .qps
            .get(&qp.0)
            .ok_or_else(|| fail(0, bad_handle("ibv_post_send")))?;
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<IbvSge> = wrs
            .iter()
            .map(|w| {
                let s = w.sge.unwrap_or(Sge {
                    addr: 0,
                    length: 0,
                    lkey: 0,
                });
                IbvSge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                }
            })
            .collect();
        let mut chain: Vec<IbvSendWr> = Vec::with_capacity(wrs.len());
        for (i, w) in wrs.iter().enumerate() {
            let mut raw = IbvSendWr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: c_int::from(w.sge.is_some()),
                opcode: WR_SEND,
                send_flags: if w.signaled { SEND_SIGNALED } else { 0 },
                imm_data: 0,
                wr: [0; 32],
                qp_type: 0,
                _pad: 0,
                _tail: [0; 6],
            };
            match w.op {
                SendOp::Send => {}
                SendOp::Write { remote_addr, rkey } => {
                    raw.opcode = WR_RDMA_WRITE;
                    raw.wr[WR_RDMA_REMOTE_ADDR].copy_from_slice(&remote_addr.to_ne_bytes());
                    raw.wr[WR_RDMA_RKEY].copy_from_slice(&rkey.to_ne_bytes());
                }
                SendOp::WriteImm {
                    remote_addr,
                    rkey,
                    imm,
                } => {
                    raw.opcode = WR_RDMA_WRITE_WITH_IMM;
                    raw.imm_data = imm.to_be();
                    raw.wr[WR_RDMA_REMOTE_ADDR].copy_from_slice(&remote_addr.to_ne_bytes());
                    raw.wr[WR_RDMA_RKEY].copy_from_slice(&rkey.to_ne_bytes());
                }
                SendOp::UdSend {
                    ah,
                    remote_qpn,
                    remote_qkey,
                } => {
                    let ahp = *self
                        .ahs
                        .get(&ah.0)
                        .ok_or_else(|| fail(i, bad_handle("ibv_post_send")))?;
                    raw.wr[WR_UD_AH].copy_from_slice(&(ahp as usize).to_ne_bytes());
                    raw.wr[WR_UD_REMOTE_QPN].copy_from_slice(&remote_qpn.to_ne_bytes());
                    raw.wr[WR_UD_REMOTE_QKEY].copy_from_slice(&remote_qkey.to_ne_bytes());
                }
            }
            chain.push(raw);
        }
        // Link the chain (addresses are stable now: no more pushes).
        let base = chain.as_mut_ptr();
        let sbase = sges.as_mut_ptr();
        for i in 0..chain.len() {
            // SAFETY: i and i+1 are in bounds of `chain`/`sges`, which live
            // until after the call below.
            unsafe {
                let w = base.add(i);
                if (*w).num_sge > 0 {
                    (*w).sg_list = sbase.add(i);
                }
                if i + 1 < chain.len() {
                    (*w).next = base.add(i + 1);
                }
            }
        }
        let mut bad: *mut IbvSendWr = std::ptr::null_mut();
        // SAFETY: `p` is a live QP whose context pointer is the opened
        // context; ops.post_send is what ibv_post_send (inline) calls.
        let rc = unsafe {
            let ctx = (*p).context;
            match (*ctx).ops.post_send {
                Some(f) => f(p, base, &mut bad),
                None => 95,
            }
        };
        if rc == 0 {
            return Ok(());
        }
        let idx = if bad.is_null() {
            0
        } else {
            // SAFETY: bad_wr points into our chain array.
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        let code = if rc > 0 { rc } else { last_errno() };
        Err(fail(
            idx.min(wrs.len()),
            VerbsError::new("ibv_post_send", code, format!("bad_wr index {idx}")),
        ))
    }

    fn post_recv(&mut self, qp: Qp, wrs: &[RecvWr]) -> Result<(), PostFailure> {
        let p = *self.qps.get(&qp.0).ok_or_else(|| PostFailure {
            bad_index: 0,
            error: bad_handle("ibv_post_recv"),
        })?;
        // SAFETY: live QP; the context's post_recv is ibv_post_recv's target.
        post_recv_chain("ibv_post_recv", wrs, |head, bad| unsafe {
            match (*(*p).context).ops.post_recv {
                Some(f) => f(p, head, bad),
                None => 95,
            }
        })
    }

    fn post_srq_recv(&mut self, srq: Srq, wrs: &[RecvWr]) -> Result<(), PostFailure> {
        let p = *self.srqs.get(&srq.0).ok_or_else(|| PostFailure {
            bad_index: 0,
            error: bad_handle("ibv_post_srq_recv"),
        })?;
        // SAFETY: live SRQ; the context's post_srq_recv is the target of
        // ibv_post_srq_recv (inline).
        post_recv_chain("ibv_post_srq_recv", wrs, |head, bad| unsafe {
            match (*(*p).context).ops.post_srq_recv {
                Some(f) => f(p, head, bad),
                None => 95,
            }
        })
    }

    fn poll_cq(&mut self, cq: Cq, max: usize, out: &mut Vec<Wc>) -> Result<usize, VerbsError> {
        let p = *self
            .cqs
            .get(&cq.0)
            .ok_or_else(|| bad_handle("ibv_poll_cq"))?;
        let n = max.min(64);
        let mut buf = [IbvWc {
            wr_id: 0,
            status: 0,
            opcode: 0,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num: 0,
            src_qp: 0,
            wc_flags: 0,
            pkey_index: 0,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
        }; 64];
        // SAFETY: live CQ; `buf` holds `n` entries; ops.poll_cq is what
        // ibv_poll_cq (inline) calls.
        let rc = unsafe {
            match (*(*p).context).ops.poll_cq {
                Some(f) => f(p, n as c_int, buf.as_mut_ptr()),
                None => -95,
            }
        };
        if rc < 0 {
            return Err(VerbsError::new("ibv_poll_cq", -rc, ""));
        }
        let got = (rc as usize).min(n);
        for w in &buf[..got] {
            let status = WcStatus::from_raw(w.status);
            out.push(Wc {
                wr_id: w.wr_id,
                status,
                opcode: match w.opcode {
                    WC_SEND => WcOpcode::Send,
                    WC_RDMA_WRITE => WcOpcode::RdmaWrite,
                    WC_RECV => WcOpcode::Recv,
                    WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
                    o => WcOpcode::Other(o),
                },
                vendor_err: w.vendor_err,
                byte_len: w.byte_len,
                imm: (status == WcStatus::Success && w.wc_flags & WC_WITH_IMM != 0)
                    .then(|| u32::from_be(w.imm_data)),
                qp_num: w.qp_num,
                src_qp: w.src_qp,
                slid: w.slid,
                grh: w.wc_flags & WC_GRH != 0,
            });
        }
        Ok(got)
    }

    fn create_ah(&mut self, pd: Pd, attr: &AhAttr) -> Result<Ah, VerbsError> {
        let p = *self
            .pds
            .get(&pd.0)
            .ok_or_else(|| bad_handle("ibv_create_ah"))?;
        let mut a = ah_attr(attr);
        // SAFETY: live PD and a valid attribute struct.
        let ah = check_ptr(
            "ibv_create_ah",
            unsafe { (self.api.create_ah)(p, &mut a) },
            "",
        )?;
        self.ahs.insert(key(ah), ah);
        Ok(Ah(key(ah)))
    }

    fn destroy_ah(&mut self, ah: Ah) -> Result<(), VerbsError> {
        let p = *self
            .ahs
            .get(&ah.0)
            .ok_or_else(|| bad_handle("ibv_destroy_ah"))?;
        // SAFETY: a live AH of this context.
        check("ibv_destroy_ah", unsafe { (self.api.destroy_ah)(p) }, "")?;
        self.ahs.remove(&ah.0);
        Ok(())
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn entropy(&mut self) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(self.now_ns());
        h.write_u32(std::process::id());
        h.finish()
    }

    fn peer_memory(&self) -> bool {
        std::path::Path::new("/sys/module/nvidia_peermem").exists()
            || std::path::Path::new("/sys/kernel/mm/memory_peers/nv_mem").exists()
    }
}

fn ah_attr(ah: &AhAttr) -> IbvAhAttr {
    IbvAhAttr {
        grh: IbvGlobalRoute {
            dgid: ah.dgid.0,
            flow_label: 0,
            sgid_index: ah.sgid_index,
            hop_limit: ah.hop_limit,
            traffic_class: ah.traffic_class,
        },
        dlid: ah.dlid,
        sl: ah.sl,
        src_path_bits: 0,
        static_rate: 0,
        is_global: u8::from(ah.is_global),
        port_num: ah.port,
    }
}

fn post_recv_chain(
    op: &'static str,
    wrs: &[RecvWr],
    call: impl FnOnce(*mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int,
) -> Result<(), PostFailure> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<IbvSge> = wrs
        .iter()
        .map(|w| {
            let s = w.sge.unwrap_or(Sge {
                addr: 0,
                length: 0,
                lkey: 0,
            });
            IbvSge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            }
        })
        .collect();
    let mut chain: Vec<IbvRecvWr> = wrs
        .iter()
        .map(|w| IbvRecvWr {
            wr_id: w.wr_id,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: c_int::from(w.sge.is_some()),
        })
        .collect();
    let base = chain.as_mut_ptr();
    let sbase = sges.as_mut_ptr();
    for i in 0..chain.len() {
        // SAFETY: in bounds; both vectors outlive the call.
        unsafe {
            let w = base.add(i);
            if (*w).num_sge > 0 {
                (*w).sg_list = sbase.add(i);
            }
            if i + 1 < chain.len() {
                (*w).next = base.add(i + 1);
            }
        }
    }
    let mut bad: *mut IbvRecvWr = std::ptr::null_mut();
    let rc = call(base, &mut bad);
    if rc == 0 {
        return Ok(());
    }
    let idx = if bad.is_null() {
        0
    } else {
        // SAFETY: bad_wr points into our chain.
        usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
    };
    let code = if rc > 0 { rc } else { last_errno() };
    Err(PostFailure {
        bad_index: idx.min(wrs.len()),
        error: VerbsError::new(op, code, format!("bad_wr index {idx}")),
    })
}

impl Drop for IbvDevice {
    fn drop(&mut self) {
        // The domain destroys its objects; release anything left so the
        // context can close.
        for (_, qp) in std::mem::take(&mut self.qps) {
            // SAFETY: live objects of this context, each destroyed once.
            unsafe { (self.api.destroy_qp)(qp) };
        }
        for (_, ah) in std::mem::take(&mut self.ahs) {
            // SAFETY: as above.
            unsafe { (self.api.destroy_ah)(ah) };
        }
        for (_, s) in std::mem::take(&mut self.srqs) {
            // SAFETY: as above.
            unsafe { (self.api.destroy_srq)(s) };
        }
        for (_, cq) in std::mem::take(&mut self.cqs) {
            // SAFETY: as above.
            unsafe { (self.api.destroy_cq)(cq) };
        }
        for (_, mr) in std::mem::take(&mut self.mrs) {
            // SAFETY: as above.
            unsafe { (self.api.dereg_mr)(mr) };
        }
        for (_, pd) in std::mem::take(&mut self.pds) {
            // SAFETY: as above.
            unsafe { (self.api.dealloc_pd)(pd) };
        }
        // SAFETY: the context was opened by ibv_open_device and is closed once.
        unsafe { (self.api.close_device)(self.ctx) };
    }
}
