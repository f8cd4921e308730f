//! The decode side: the paged KvCache, its free page and tail-slot pools,
//! the pending requests and the liveness of the prefiller.

use crate::buf::host_buf;
use crate::wire::encode;
use crate::{
    expected_kv_byte, expected_tail_byte, HostBuf, KvConfig, KvError, KvLayout, KvRequest, Msg,
};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use weft_engine::{EngineError, GroupAddress, MrDesc, MrHandle, OnDone, TransferEngine};

/// Outcome of a finished request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    /// Request id.
    pub id: u64,
    /// Pages (per head) it filled.
    pub pages: Vec<u32>,
    /// Bytes verified (KV + tail).
    pub bytes: u64,
    /// Immediates consumed.
    pub imms: u32,
}

/// A pending request; [`RequestHandle::wait`] blocks for its outcome.
#[derive(Debug)]
pub struct RequestHandle {
    /// Request id.
    pub id: u64,
    rx: Receiver<Result<Completed, KvError>>,
}

impl RequestHandle {
    /// Blocks until the request completed, failed or was cancelled.
    pub fn wait(&self) -> Result<Completed, KvError> {
        self.rx
            .recv()
            .unwrap_or(Err(KvError::Engine(EngineError::ShutDown)))
    }
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum ReqState {
    Active,
    Cancelling,
}

struct DecReq {
    pages: Vec<u32>,
    tail_slot: u32,
    imm: u32,
    seed: u64,
    state: ReqState,
    tx: Sender<Result<Completed, KvError>>,
}

struct DecShared {
    engine: Arc<TransferEngine>,
    layout: KvLayout,
    num_pages: u32,
    kv: HostBuf,
    tail: HostBuf,
    kv_desc: MrDesc,
    tail_desc: MrDesc,
    handles: Mutex<Option<(MrHandle, MrHandle)>>,
    me: GroupAddress,
    peer: GroupAddress,
    free_pages: Mutex<BTreeSet<u32>>,
    free_tails: Mutex<BTreeSet<u32>>,
    reqs: Mutex<BTreeMap<u64, DecReq>>,
    next_id: AtomicU64,
    last_seen: Mutex<Instant>,
    dead: Mutex<Option<String>>,
    stop: AtomicBool,
    cfg: KvConfig,
}

/// The decode side: owns the paged KvCache.
pub struct Decoder {
    sh: Arc<DecShared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Decoder {
    /// Allocates and registers a KvCache of `num_pages` pages per head (and
    /// as many tail slots), posts receive buffers and starts heartbeats to
    /// `prefiller`.
    pub fn new(
        engine: Arc<TransferEngine>,
        layout: KvLayout,
        num_pages: u32,
        prefiller: GroupAddress,
        cfg: KvConfig,
    ) -> Result<Self, KvError> {
        let kv_len = layout
            .kv_bytes(num_pages)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| KvError::Size("kv cache".into()))?;
        let tail_len = layout
            .tail_len
            .checked_mul(u64::from(num_pages))
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| KvError::Size("tail slots".into()))?;
        let kv = host_buf(kv_len, "kv cache")?;
        let tail = host_buf(tail_len, "tail slots")?;
        let (kh, kv_desc) = engine.reg_mr(kv.region())?;
        let (th, tail_desc) = engine.reg_mr(tail.region())?;
        let me = engine.main_address();
        let sh = Arc::new(DecShared {
            engine: engine.clone(),
            layout,
            num_pages,
            kv,
            tail,
            kv_desc,
            tail_desc,
            handles: Mutex::new(Some((kh, th))),
            me: me.clone(),
            peer: prefiller.clone(),
            free_pages: Mutex::new((0..num_pages).collect()),
            free_tails: Mutex::new((0..num_pages).collect()),
            reqs: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
            last_seen: Mutex::new(Instant::now()),
            dead: Mutex::new(None),
            stop: AtomicBool::new(false),
            cfg: cfg.clone(),
        });
        let weak = Arc::downgrade(&sh);
        engine.submit_recvs(cfg.recv_len, cfg.recv_count, move |r| {
            let Some(sh) = weak.upgrade() else { return };
            match r {
                Ok(bytes) => match postcard::from_bytes::<Msg>(bytes) {
                    Ok(m) => sh.on_msg(m),
                    Err(e) => tracing::warn!("decoder: undecodable message: {e}"),
                },
                Err(e) => tracing::warn!("decoder: receive error: {e}"),
            }
        })?;
        sh.send(&Msg::Hello { from: me })?;
        let hb = {
            let sh = sh.clone();
            std::thread::Builder::new()
                .name("kv-decoder-hb".into())
                .spawn(move || sh.heartbeat_loop())
                .map_err(|e| KvError::Size(format!("spawn: {e}")))?
        };
        Ok(Self {
            sh,
            threads: Mutex::new(vec![hb]),
        })
    }

    /// Free pages now.
    pub fn free_pages(&self) -> u32 {
        u32::try_from(self.sh.free_pages.lock().len()).unwrap_or(u32::MAX)
    }

    /// Immediates a request of `pages` pages produces at this decoder.
    pub fn imm_count(&self, pages: u32) -> Result<u32, KvError> {
        self.sh.imm_count(pages)
    }

    /// Starts the transfer of a prompt of `pages` pages.
    pub fn submit(&self, pages: u32, prompt_seed: u64) -> Result<RequestHandle, KvError> {
        self.sh.submit(pages, prompt_seed)
    }

    /// Asks the prefiller to cancel `id`. Its pages return to the pool only
    /// once the prefiller confirms (or the request completes anyway).
    pub fn cancel(&self, id: u64) -> Result<(), KvError> {
        {
            let mut reqs = self.sh.reqs.lock();
            match reqs.get_mut(&id) {
                Some(r) => r.state = ReqState::Cancelling,
                None => return Ok(()),
            }
        }
        self.sh.send(&Msg::Cancel {
            from: self.sh.me.clone(),
            id,
        })
    }

    /// Stops heartbeats, fails pending requests and unregisters the cache.
    pub fn shutdown(&self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        self.sh.fail_all("decoder shut down");
        if let Some((a, b)) = self.sh.handles.lock().take() {
            let _ = self.sh.engine.unreg_mr(a);
            let _ = self.sh.engine.unreg_mr(b);
        }
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl DecShared {
    /// SENDs `m` to the prefiller; a failed SEND declares it dead.
    fn send(self: &Arc<Self>, m: &Msg) -> Result<(), KvError> {
        let bytes = encode(m)?;
        let weak = Arc::downgrade(self);
        self.engine.submit_send(
            &self.peer,
            &bytes,
            OnDone::callback(move |r| {
                if let (Err(e), Some(sh)) = (r, weak.upgrade()) {
                    tracing::warn!(peer = ?sh.peer, "decoder: send failed: {e}");
                    sh.declare_dead(&format!("send failed: {e}"));
                }
            }),
        )?;
        Ok(())
    }

    fn imm_count(&self, pages: u32) -> Result<u32, KvError> {
        let c = self.engine.imm_counts(0)?;
        let per_layer = c.paged_writes(
            self.layout.page_len,
            u64::from(pages) * u64::from(self.layout.heads),
        );
        let total = per_layer
            .checked_mul(u64::from(self.layout.layers))
            .and_then(|t| t.checked_add(c.single_write(self.layout.tail_len)))
            .ok_or_else(|| KvError::Size("imm count".into()))?;
        u32::try_from(total).map_err(|_| KvError::Size("imm count exceeds u32".into()))
    }

    fn submit(self: &Arc<Self>, n: u32, seed: u64) -> Result<RequestHandle, KvError> {
        if let Some(why) = self.dead.lock().clone() {
            return Err(KvError::PeerDead {
                peer: self.peer.clone(),
                why,
            });
        }
        if n == 0 {
            return Err(KvError::Size("a request needs at least one page".into()));
        }
        let count = self.imm_count(n)?;
        let pages: Vec<u32> = {
            let mut fp = self.free_pages.lock();
            let free = u32::try_from(fp.len()).unwrap_or(u32::MAX);
            if free < n {
                return Err(KvError::NoPages { need: n, free });
            }
            (0..n).filter_map(|_| fp.pop_first()).collect()
        };
        let Some(tail_slot) = self.free_tails.lock().pop_first() else {
            self.free_pages.lock().extend(pages);
            return Err(KvError::NoPages { need: n, free: 0 });
        };
        let imm = match self.engine.alloc_imm() {
            Ok(i) => i,
            Err(e) => {
                self.free_pages.lock().extend(pages);
                self.free_tails.lock().insert(tail_slot);
                return Err(e.into());
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.reqs.lock().insert(
            id,
            DecReq {
                pages: pages.clone(),
                tail_slot,
                imm,
                seed,
                state: ReqState::Active,
                tx,
            },
        );
        let weak = Arc::downgrade(self);
        let armed = self
            .engine
            .expect_imm_count(imm, u64::from(count), move |r| {
                if let Some(sh) = weak.upgrade() {
                    sh.on_imms(id, r);
                }
            });
        if let Err(e) = armed {
            self.finish(id, Err(e.into()));
            return Ok(RequestHandle { id, rx });
        }
        let req = KvRequest {
            id,
            reply_to: self.me.clone(),
            layout: self.layout,
            kv: self.kv_desc.clone(),
            num_pages: self.num_pages,
            pages,
            tail: self.tail_desc.clone(),
            tail_off: u64::from(tail_slot) * self.layout.tail_len,
            imm,
            prompt_seed: seed,
        };
        tracing::debug!(id, pages = n, imm, count, "decoder: request");
        if let Err(e) = self.send(&Msg::Request(req)) {
            self.finish(id, Err(e));
        }
        Ok(RequestHandle { id, rx })
    }

    /// Removes request `id`, releases its resources, reports `res`.
    fn finish(&self, id: u64, res: Result<Completed, KvError>) {
        let Some(r) = self.reqs.lock().remove(&id) else {
            return;
        };
        self.engine.free_imm(r.imm);
        self.free_pages.lock().extend(r.pages.iter().copied());
        self.free_tails.lock().insert(r.tail_slot);
        let _ = r.tx.send(res);
    }

    fn on_imms(&self, id: u64, r: Result<(), EngineError>) {
        let info = {
            let reqs = self.reqs.lock();
            reqs.get(&id)
                .map(|q| (q.pages.clone(), q.tail_slot, q.seed, q.state))
        };
        let Some((pages, tail_slot, seed, _state)) = info else {
            return; // already finished (cancel ack, death): stale callback
        };
        if let Err(e) = r {
            self.finish(id, Err(e.into()));
            return;
        }
        // All immediates arrived: every payload byte is in place.
        let res = self.verify(id, &pages, tail_slot, seed);
        self.finish(id, res);
    }

    fn verify(
        &self,
        id: u64,
        pages: &[u32],
        tail_slot: u32,
        seed: u64,
    ) -> Result<Completed, KvError> {
        let l = self.layout;
        let corrupt = |what: String| KvError::Corrupt { id, what };
        let plen = usize::try_from(l.page_len).map_err(|_| KvError::Size("page".into()))?;
        let mut bytes = 0u64;
        for layer in 0..l.layers {
            for h in 0..l.heads {
                for (j, &p) in pages.iter().enumerate() {
                    let j = u32::try_from(j).map_err(|_| KvError::Size("pages".into()))?;
                    let off = l
                        .offset(self.num_pages, layer, h, p)
                        .and_then(|o| usize::try_from(o).ok())
                        .ok_or_else(|| KvError::Size("offset".into()))?;
                    let got = self
                        .kv
                        .read(off, plen)
                        .ok_or_else(|| corrupt("page out of bounds".into()))?;
                    for (i, &b) in got.iter().enumerate() {
                        let want = expected_kv_byte(seed, layer, h, j, i as u64);
                        if b != want {
                            return Err(corrupt(format!(
                                "layer {layer} head {h} page {p} byte {i}: {b:#04x} != {want:#04x}"
                            )));
                        }
                    }
                    bytes += l.page_len;
                }
            }
        }
        let toff = usize::try_from(u64::from(tail_slot) * l.tail_len)
            .map_err(|_| KvError::Size("tail".into()))?;
        let tlen = usize::try_from(l.tail_len).map_err(|_| KvError::Size("tail".into()))?;
        let got = self
            .tail
            .read(toff, tlen)
            .ok_or_else(|| corrupt("tail out of bounds".into()))?;
        for (i, &b) in got.iter().enumerate() {
            let want = expected_tail_byte(seed, i as u64);
            if b != want {
                return Err(corrupt(format!("tail byte {i}: {b:#04x} != {want:#04x}")));
            }
        }
        bytes += l.tail_len;
        Ok(Completed {
            id,
            pages: pages.to_vec(),
            bytes,
            imms: self.imm_count(u32::try_from(pages.len()).unwrap_or(u32::MAX))?,
        })
    }

    fn on_msg(&self, m: Msg) {
        *self.last_seen.lock() = Instant::now();
        match m {
            Msg::Heartbeat => {}
            Msg::CancelAck { id } => {
                tracing::debug!(id, "decoder: cancel confirmed");
                self.finish(id, Err(KvError::Cancelled(id)));
            }
            Msg::Failed { id, reason } => self.finish(id, Err(KvError::Remote { id, reason })),
            other => tracing::warn!("decoder: unexpected message {other:?}"),
        }
    }

    fn declare_dead(&self, why: &str) {
        {
            let mut d = self.dead.lock();
            if d.is_some() {
                return;
            }
            *d = Some(why.to_string());
        }
        tracing::warn!(peer = ?self.peer, "decoder: prefiller dead: {why}");
        self.fail_all(why);
    }

    fn fail_all(&self, why: &str) {
        let ids: Vec<u64> = self.reqs.lock().keys().copied().collect();
        for id in ids {
            self.finish(
                id,
                Err(KvError::PeerDead {
                    peer: self.peer.clone(),
                    why: why.to_string(),
                }),
            );
        }
    }

    fn heartbeat_loop(self: Arc<Self>) {
        while !self.stop.load(Ordering::SeqCst) {
            std::thread::sleep(self.cfg.heartbeat_interval);
            if self.dead.lock().is_some() {
                continue;
            }
            let silent = self.last_seen.lock().elapsed();
            if silent > self.cfg.heartbeat_timeout {
                self.declare_dead(&format!("no heartbeat for {silent:?}"));
                continue;
            }
            if let Err(e) = self.send(&Msg::Heartbeat) {
                self.declare_dead(&format!("heartbeat send failed: {e}"));
            }
        }
    }
}
