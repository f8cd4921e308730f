//! The control half of the [`TransferEngine`] API: requests a group's
//! worker answers on its control channel (registrations, peer groups,
//! receive pools).

use super::{PeerGroupHandle, TransferEngine};
use crate::core::Control;
use crate::driver::GroupShared;
use crate::error::EngineError;
use crate::mem::{MrHandle, RawBuf, RecvCallback, RecvFromCallback, RecvPool, RecvSink};
use crate::recvq::RecvQueue;
use crate::request::GroupAddress;
use crossbeam_channel::Sender;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use weft_transport::{Device, MemRegion, MrDesc};

impl TransferEngine {
    /// Sends a control request to group `g`'s worker and waits for the
    /// answer (in manual mode the worker's control queue runs inline).
    pub(super) fn control<T>(
        &self,
        g: &GroupShared,
        make: impl FnOnce(Sender<Result<T, EngineError>>) -> Control,
    ) -> Result<T, EngineError> {
        if self.inner.shut.load(Ordering::SeqCst) {
            return Err(EngineError::ShutDown);
        }
        if let Some(e) = g.failed.get() {
            return Err(e.clone());
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        g.ctrl.send(make(tx)).map_err(|_| EngineError::ShutDown)?;
        // After the send: a worker that sees the count finds the message.
        g.ctrl_sent.fetch_add(1, Ordering::Release);
        if let Some(m) = &self.inner.manual {
            // Run the worker's control queue inline.
            let mut st = m.lock();
            if let Some(w) = st.workers.get_mut(g.index) {
                w.control_manual();
            }
        } else {
            g.kick();
        }
        rx.recv().map_err(|_| self.reply_closed(g))?
    }

    /// Why a control request's reply channel closed unanswered: the
    /// group's worker failed, or the engine shut down. A worker that
    /// panics while handling the request drops the reply sender as it
    /// unwinds, a moment before it records `WorkerFailed`: wait (briefly,
    /// yielding) for that record rather than report `ShutDown`.
    fn reply_closed(&self, g: &GroupShared) -> EngineError {
        let start = std::time::Instant::now();
        loop {
            if let Some(e) = g.failed.get() {
                return e.clone();
            }
            if self.inner.shut.load(Ordering::SeqCst)
                || start.elapsed() > std::time::Duration::from_secs(1)
            {
                return EngineError::ShutDown;
            }
            std::thread::yield_now();
        }
    }

    /// Registers memory with every NIC of the group serving its device
    /// (group 0 for host memory unless a group declares [`Device::Host`]
    /// explicitly first). Returns the local handle and the descriptor peers
    /// need to write into it (one `(NetAddr, rkey)` per NIC, in NIC order).
    pub fn reg_mr(&self, region: MemRegion) -> Result<(MrHandle, MrDesc), EngineError> {
        let g = self.group_for(region.device())?;
        self.reg_mr_on(g, region)
    }

    /// The group [`TransferEngine::reg_mr`] registers memory of `device` with.
    pub(super) fn group_for(&self, device: Device) -> Result<usize, EngineError> {
        self.inner
            .groups
            .iter()
            .position(|g| g.device == device)
            .or_else(|| (device == Device::Host).then_some(0))
            .ok_or_else(|| EngineError::InvalidArgument {
                what: format!("no domain group serves {device}"),
            })
    }

    /// [`TransferEngine::reg_mr`] from a raw pointer.
    ///
    /// # Safety
    /// The promises of [`MemRegion::new`] for as long as the memory stays
    /// registered.
    // Unsafe API: forwards the caller's promises to `MemRegion::new`.
    #[allow(unsafe_code)]
    pub unsafe fn reg_mr_ptr(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        device: Device,
    ) -> Result<(MrHandle, MrDesc), EngineError> {
        // SAFETY: forwarded to the caller.
        self.reg_mr(unsafe { MemRegion::new(ptr, len, device) })
    }

    /// Registers memory with every NIC of group `g`.
    pub fn reg_mr_on(
        &self,
        g: usize,
        region: MemRegion,
    ) -> Result<(MrHandle, MrDesc), EngineError> {
        let gs = self.group(g)?;
        let (key, mrs) = self.control(gs, |reply| Control::RegMr { region, reply })?;
        let (id, gen) = crate::wrid::split_mr_key(key);
        let info = self.info(g)?;
        let desc = MrDesc {
            addr: region.addr(),
            len: region.len() as u64,
            rkeys: info
                .addrs
                .iter()
                .zip(&mrs)
                .map(|(a, mr)| (a.clone(), mr.rkey))
                .collect(),
            incarnation: self.inner.incarnation,
        };
        let h = MrHandle {
            engine: self.inner.id,
            group: g as u32,
            id,
            gen,
            addr: region.addr(),
            len: region.len() as u64,
            device: region.device(),
        };
        Ok((h, desc))
    }

    /// Deregisters memory from every NIC of its group. Transfers still
    /// using it fail with a local-access error; a paged write from it with
    /// pages not yet planned (they are planned a window at a time) fails
    /// with [`EngineError::StaleMr`] when its next window is planned.
    ///
    /// A handle registered by another engine is refused with
    /// [`EngineError::InvalidArgument`] (and deregisters nothing).
    pub fn unreg_mr(&self, h: MrHandle) -> Result<(), EngineError> {
        let gs = self.own_group(&h)?;
        self.control(gs, |reply| Control::UnregMr { id: h.key(), reply })
    }

    /// Resolves a set of peers on every group, for scatter and barrier.
    /// Member `j` is the destination `dsts[j]` of later submits.
    pub fn add_peer_group(&self, addrs: &[GroupAddress]) -> Result<PeerGroupHandle, EngineError> {
        let mut ids = Vec::with_capacity(self.inner.groups.len());
        for gs in &self.inner.groups {
            let peers = addrs.to_vec();
            ids.push(self.control(gs, |reply| Control::AddPeerGroup { peers, reply })?);
        }
        Ok(PeerGroupHandle {
            engine: self.inner.id,
            ids,
            members: addrs.into(),
        })
    }

    /// Removes a peer (every NIC address of `peer`, at its incarnation) on
    /// every group, e.g. one whose process died or left; see "Peer
    /// lifecycle" in docs/engine.md and docs/operations.md.
    ///
    /// Its WRs still waiting for send-queue room fail with
    /// [`TransportError::PeerRemoved`](weft_transport::TransportError::PeerRemoved)
    /// (as [`EngineError::Transport`]); WRs already posted to it fail the
    /// same way or complete as usual, as the backend decides (each transfer
    /// still resolves exactly once); the backends free its connection
    /// state; peer groups with it as a member fail with
    /// [`EngineError::PeerRemoved`] from now on. Its incarnation stays
    /// refused for good: transfers naming it later (descriptors of the old
    /// incarnation) fail with `PeerRemoved` and never reach a process that
    /// answers at the same address later. A restarted peer (a new
    /// [`incarnation`](TransferEngine::incarnation)) is reached at its
    /// address, new or reused. A newer incarnation named at an address
    /// replaces the older one there as if this were called for it, but only
    /// once the older one ended: removed with this call, or reported
    /// unreachable by the transport; before, it is refused with
    /// [`EngineError::IncarnationUnproven`]. Calling this is how an
    /// application that learned of a restart by other means (its
    /// rendezvous store, its heartbeats) lets the new incarnation in; the
    /// engine believes the application, so pass addresses it trusts.
    /// Removing an unknown or already removed peer is a no-op. A peer with
    /// several domain groups is removed by passing each of its group
    /// addresses (each call removes the NIC addresses it names).
    pub fn remove_peer(&self, peer: &GroupAddress) -> Result<(), EngineError> {
        let mut first = Ok(());
        for gs in &self.inner.groups {
            let addrs = peer.nics.clone();
            let incarnation = peer.incarnation;
            let r = self.control(gs, |reply| Control::RemovePeer {
                addrs,
                incarnation,
                reply,
            });
            if first.is_ok() {
                first = r;
            }
        }
        // Rounds waiting on it will not see its immediates.
        self.fail_rounds_from(peer);
        first
    }

    /// Posts a rotating pool of `count` receive buffers for messages of up
    /// to `len` bytes on NIC 0 of group 0 (each buffer also holds the
    /// 20-byte SEND frame header). `cb` runs on the callback thread for
    /// every received message meant for this engine's incarnation (or
    /// receive error), on a copy of its bytes; frames meant for another
    /// incarnation, or malformed, are dropped and counted
    /// ([`GroupStats::recv_stale`](crate::GroupStats::recv_stale),
    /// [`GroupStats::recv_malformed`](crate::GroupStats::recv_malformed)). The
    /// worker re-posts the buffer as soon as it has copied the message out,
    /// while the pool's messages waiting for `cb` stay under
    /// [`EngineConfig::recv_backlog_bytes`](crate::EngineConfig::recv_backlog_bytes)
    /// (past it, peers' SENDs wait for `cb` to catch up). Buffers flushed at
    /// shutdown are not reported.
    pub fn submit_recvs(
        &self,
        len: u64,
        count: u32,
        cb: impl FnMut(Result<&[u8], EngineError>) + Send + 'static,
    ) -> Result<(), EngineError> {
        let cb = Box::new(cb) as RecvCallback;
        self.post_pool(len, count, RecvSink::Callback(parking_lot::Mutex::new(cb)))
            .map(drop)
    }

    /// [`submit_recvs`](Self::submit_recvs) whose callback is also told who
    /// sent each message: the sending NIC and the incarnation its frame
    /// names ([`MessageSender`](crate::MessageSender), with the same trust
    /// as [`RecvMsg::sender`](crate::RecvMsg::sender); `None` where the NIC
    /// does not say).
    pub fn submit_recvs_from(
        &self,
        len: u64,
        count: u32,
        cb: impl FnMut(Result<(&[u8], Option<&crate::MessageSender>), EngineError>) + Send + 'static,
    ) -> Result<(), EngineError> {
        let cb = Box::new(cb) as RecvFromCallback;
        self.post_pool(
            len,
            count,
            RecvSink::CallbackFrom(parking_lot::Mutex::new(cb)),
        )
        .map(drop)
    }

    /// Posts a rotating pool of `count` receive buffers for messages of up
    /// to `len` bytes on NIC 0 of group 0, like
    /// [`submit_recvs`](Self::submit_recvs), whose messages the caller
    /// takes from the returned [`RecvQueue`] on its own thread
    /// ([`RecvQueue::try_recv`], [`RecvQueue::recv_timeout`]) instead of in
    /// a callback: no callback-thread wake-up per message. The same
    /// incarnation check, counters and backlog bound apply; a message held
    /// (queued, or a [`RecvMsg`](crate::RecvMsg) not yet dropped) counts
    /// against the bound.
    pub fn recv_queue(&self, len: u64, count: u32) -> Result<RecvQueue, EngineError> {
        let pool = self.post_pool(len, count, RecvSink::Queue(Box::default()))?;
        Ok(RecvQueue { pool })
    }

    /// Makes a receive pool delivering to `sink` and has group 0's worker
    /// post it.
    fn post_pool(
        &self,
        len: u64,
        count: u32,
        sink: RecvSink,
    ) -> Result<Arc<RecvPool>, EngineError> {
        if len == 0 || count == 0 {
            return Err(EngineError::InvalidArgument {
                what: "receive pool needs len > 0 and count > 0".into(),
            });
        }
        let total =
            RecvPool::buffer_len(len, count).ok_or_else(|| EngineError::InvalidArgument {
                what: "receive pool size overflows".into(),
            })?;
        // Pool ids are part of receive WR ids and never reused: refuse
        // rather than wrap onto a live pool.
        let id = self
            .inner
            .next_pool
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_add(1))
            .map_err(|_| EngineError::RecvPoolsExhausted {
                limit: u32::from(u16::MAX),
            })?;
        let gs = self.group(0)?;
        let pool = Arc::new(RecvPool::new(
            id,
            RawBuf::new(total)?,
            len,
            count,
            sink,
            self.inner.config.recv_backlog_bytes,
            Arc::clone(gs) as Arc<dyn crate::mem::PoolGroup>,
        ));
        let posted = Arc::clone(&pool);
        self.control(gs, |reply| Control::RecvPool {
            pool: posted,
            reply,
        })?;
        Ok(pool)
    }
}
