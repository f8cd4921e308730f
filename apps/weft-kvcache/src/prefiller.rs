//! The prefill side: the requests being computed and posted, the decoders
//! it heartbeats, and its counters.

use crate::buf::host_buf;
use crate::wire::encode;
use crate::{
    expected_kv_byte, expected_tail_byte, HostBuf, KvConfig, KvError, KvLayout, KvRequest, Msg,
};
use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use weft_engine::{DoneCounter, GroupAddress, MrHandle, OnDone, TransferEngine};

/// Called by the prefiller's compute thread before "computing" a layer
/// (request id, layer); tests use it to hold a request at a layer.
pub type LayerHook = Arc<dyn Fn(u64, u32) + Send + Sync + 'static>;

struct PostState {
    posted: u64,
    closed: bool,
}

struct PreReq {
    req: KvRequest,
    cancelled: AtomicBool,
    post: Mutex<PostState>,
    done: Arc<DoneCounter>,
    src: HostBuf,
    src_h: Mutex<Option<MrHandle>>,
}

struct PreShared {
    engine: Arc<TransferEngine>,
    layout: KvLayout,
    active: Mutex<BTreeMap<(GroupAddress, u64), Arc<PreReq>>>,
    decoders: Mutex<BTreeSet<GroupAddress>>,
    hook: Option<LayerHook>,
    stop: AtomicBool,
    stats: PrefillStats,
    cfg: KvConfig,
}

/// Counters of a prefiller.
#[derive(Debug, Default)]
pub struct PrefillStats {
    /// Requests fully transferred.
    pub completed: AtomicU64,
    /// Requests cancelled (acked).
    pub cancelled: AtomicU64,
    /// Write submits posted (paged per layer + tail).
    pub submits: AtomicU64,
    /// Payload bytes posted.
    pub bytes: AtomicU64,
    /// Cancel messages received.
    pub cancel_requests: AtomicU64,
}

/// The prefill side: computes layers and pushes them into decoders.
pub struct Prefiller {
    sh: Arc<PreShared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Prefiller {
    /// Posts receive buffers and starts serving requests.
    pub fn new(
        engine: Arc<TransferEngine>,
        layout: KvLayout,
        cfg: KvConfig,
        hook: Option<LayerHook>,
    ) -> Result<Self, KvError> {
        let sh = Arc::new(PreShared {
            engine: engine.clone(),
            layout,
            active: Mutex::new(BTreeMap::new()),
            decoders: Mutex::new(BTreeSet::new()),
            hook,
            stop: AtomicBool::new(false),
            stats: PrefillStats::default(),
            cfg: cfg.clone(),
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Msg>();
        engine.submit_recvs(cfg.recv_len, cfg.recv_count, move |r| match r {
            Ok(bytes) => match postcard::from_bytes::<Msg>(bytes) {
                Ok(m) => {
                    let _ = tx.send(m);
                }
                Err(e) => tracing::warn!("prefiller: undecodable message: {e}"),
            },
            Err(e) => tracing::warn!("prefiller: receive error: {e}"),
        })?;
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| KvError::Size(format!("spawn: {e}")))
        };
        let s1 = sh.clone();
        let t1 = spawn("kv-prefill-serve", Box::new(move || s1.serve(rx)))?;
        let s2 = sh.clone();
        let t2 = spawn("kv-prefill-hb", Box::new(move || s2.heartbeat_loop()))?;
        Ok(Self {
            sh,
            threads: Mutex::new(vec![t1, t2]),
        })
    }

    /// Counters.
    pub fn stats(&self) -> &PrefillStats {
        &self.sh.stats
    }

    /// Stops serving (in-flight requests finish on their own threads).
    pub fn shutdown(&self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Prefiller {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl PreShared {
    fn send_to(&self, to: &GroupAddress, m: &Msg) {
        match encode(m) {
            Ok(b) => {
                if let Err(e) = self.engine.submit_send(to, &b, OnDone::callback(|_| {})) {
                    tracing::warn!("prefiller: send to {to:?} failed: {e}");
                }
            }
            Err(e) => tracing::warn!("prefiller: {e}"),
        }
    }

    fn serve(self: Arc<Self>, rx: Receiver<Msg>) {
        while !self.stop.load(Ordering::SeqCst) {
            let m = match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(m) => m,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
                Err(_) => return,
            };
            match m {
                Msg::Hello { from } => {
                    self.decoders.lock().insert(from);
                }
                Msg::Request(req) => {
                    self.decoders.lock().insert(req.reply_to.clone());
                    let to = req.reply_to.clone();
                    let id = req.id;
                    if let Err(e) = self.clone().start(req) {
                        tracing::warn!(id, "prefiller: request refused: {e}");
                        self.send_to(
                            &to,
                            &Msg::Failed {
                                id,
                                reason: e.to_string(),
                            },
                        );
                    }
                }
                Msg::Cancel { from, id } => {
                    self.stats.cancel_requests.fetch_add(1, Ordering::SeqCst);
                    let r = self.active.lock().get(&(from.clone(), id)).cloned();
                    match r {
                        Some(r) => r.cancelled.store(true, Ordering::SeqCst),
                        // Unknown or finished: nothing of it can land any more.
                        None => self.send_to(&from, &Msg::CancelAck { id }),
                    }
                }
                other => tracing::warn!("prefiller: unexpected message {other:?}"),
            }
        }
    }

    fn start(self: Arc<Self>, req: KvRequest) -> Result<(), KvError> {
        if req.layout != self.layout {
            return Err(KvError::Size(format!(
                "layout mismatch: decoder {:?}, prefiller {:?}",
                req.layout, self.layout
            )));
        }
        let n = u32::try_from(req.pages.len()).map_err(|_| KvError::Size("pages".into()))?;
        if n == 0 || req.pages.iter().any(|&p| p >= req.num_pages) {
            return Err(KvError::Size("page index out of range".into()));
        }
        let kv_len = self
            .layout
            .kv_bytes(n)
            .and_then(|k| k.checked_add(self.layout.tail_len))
            .and_then(|k| usize::try_from(k).ok())
            .ok_or_else(|| KvError::Size("source buffer".into()))?;
        let src = host_buf(kv_len, "source buffer")?;
        let (h, _) = self.engine.reg_mr(src.region())?;
        let key = (req.reply_to.clone(), req.id);
        let r = Arc::new(PreReq {
            req,
            cancelled: AtomicBool::new(false),
            post: Mutex::new(PostState {
                posted: 0,
                closed: false,
            }),
            done: Arc::new(DoneCounter::new()),
            src,
            src_h: Mutex::new(Some(h)),
        });
        self.active.lock().insert(key.clone(), r.clone());
        let sh = self.clone();
        std::thread::Builder::new()
            .name("kv-prefill-compute".into())
            .spawn(move || sh.compute(key, r))
            .map_err(|e| KvError::Size(format!("spawn: {e}")))?;
        Ok(())
    }

    /// Posts the writes of layers `from..to` (and the tail when `to` is
    /// past the last layer). Runs on the UVM watcher thread.
    fn post_layers(&self, r: &PreReq, from: u64, to: u64) {
        let l = self.layout;
        let mut ps = r.post.lock();
        if ps.closed || r.cancelled.load(Ordering::SeqCst) {
            return;
        }
        let Some(h) = *r.src_h.lock() else {
            return;
        };
        let n = u32::try_from(r.req.pages.len()).unwrap_or(0);
        let last = u64::from(l.layers);
        for layer in from..to.min(last) {
            let layer = layer as u32;
            let Some((sp, dp)) = l.layer_pages(layer, &r.req.pages, r.req.num_pages) else {
                ps.closed = true;
                return;
            };
            let res = self.engine.submit_paged_writes(
                l.page_len,
                Some(r.req.imm),
                (&h, &sp),
                (&r.req.kv, &dp),
                OnDone::counter(&r.done),
            );
            match res {
                Ok(_) => {
                    ps.posted += 1;
                    self.stats.submits.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .bytes
                        .fetch_add(l.page_len * sp.indices.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(id = r.req.id, layer, "prefiller: layer post failed: {e}");
                    ps.closed = true;
                    return;
                }
            }
        }
        if to > last {
            let Some(off) = l.kv_bytes(n) else { return };
            let res = self.engine.submit_single_write(
                l.tail_len,
                Some(r.req.imm),
                (&h, off),
                (&r.req.tail, r.req.tail_off),
                OnDone::counter(&r.done),
            );
            match res {
                Ok(_) => {
                    ps.posted += 1;
                    self.stats.submits.fetch_add(1, Ordering::Relaxed);
                    self.stats.bytes.fetch_add(l.tail_len, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(id = r.req.id, "prefiller: tail post failed: {e}");
                }
            }
            ps.closed = true;
        }
    }

    fn compute(self: Arc<Self>, key: (GroupAddress, u64), r: Arc<PreReq>) {
        let l = self.layout;
        let id = r.req.id;
        let n = u32::try_from(r.req.pages.len()).unwrap_or(0);
        let plen = usize::try_from(l.page_len).unwrap_or(0);
        let watch = {
            let sh = self.clone();
            let r2 = r.clone();
            self.engine
                .alloc_uvm_watcher(move |old, new| sh.post_layers(&r2, old, new))
        };
        let mut page = vec![0u8; plen];
        for layer in 0..l.layers {
            if let Some(h) = &self.hook {
                h(id, layer);
            }
            if r.cancelled.load(Ordering::SeqCst) || self.stop.load(Ordering::SeqCst) {
                break;
            }
            for head in 0..l.heads {
                for j in 0..n {
                    for (i, b) in page.iter_mut().enumerate() {
                        *b = expected_kv_byte(r.req.prompt_seed, layer, head, j, i as u64);
                    }
                    let off = l
                        .offset(n, layer, head, j)
                        .and_then(|o| usize::try_from(o).ok());
                    if let Some(off) = off {
                        r.src.write(off, &page);
                    }
                }
            }
            let mut value = u64::from(layer) + 1;
            if layer + 1 == l.layers {
                // The tail is produced with the last layer; it goes last.
                let tail: Vec<u8> = (0..l.tail_len)
                    .map(|i| expected_tail_byte(r.req.prompt_seed, i))
                    .collect();
                if let Some(off) = l.kv_bytes(n).and_then(|o| usize::try_from(o).ok()) {
                    r.src.write(off, &tail);
                }
                value += 1;
            }
            // The "GPU" signals the layer (a release store the watcher sees).
            watch.word().store(value, Ordering::Release);
        }
        // Wait until the watcher posted everything (or we stop posting).
        loop {
            let cancelled = r.cancelled.load(Ordering::SeqCst);
            {
                let mut ps = r.post.lock();
                if cancelled || self.stop.load(Ordering::SeqCst) {
                    ps.closed = true;
                }
                if ps.closed {
                    break;
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        drop(watch);
        let posted = r.post.lock().posted;
        // Delivery-complete: after this no write of the request can land.
        r.done.wait_for(posted);
        let failed = r.done.failed();
        if let Some(h) = r.src_h.lock().take() {
            let _ = self.engine.unreg_mr(h);
        }
        self.active.lock().remove(&key);
        let expected = u64::from(l.layers) + 1;
        if r.cancelled.load(Ordering::SeqCst) && (posted < expected || failed > 0) {
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            self.send_to(&key.0, &Msg::CancelAck { id });
        } else if failed > 0 || posted < expected {
            let reason = match r.done.first_error() {
                Some(e) => e.to_string(),
                None => "request aborted".into(),
            };
            self.send_to(&key.0, &Msg::Failed { id, reason });
        } else {
            self.stats.completed.fetch_add(1, Ordering::Relaxed);
            if r.cancelled.load(Ordering::SeqCst) {
                // Everything landed; the decoder's count completes it, but
                // confirm the cancel so it never waits for an ack.
                self.send_to(&key.0, &Msg::CancelAck { id });
            }
        }
    }

    fn heartbeat_loop(self: Arc<Self>) {
        while !self.stop.load(Ordering::SeqCst) {
            std::thread::sleep(self.cfg.heartbeat_interval);
            let ds: Vec<GroupAddress> = self.decoders.lock().iter().cloned().collect();
            for d in ds {
                self.send_to(&d, &Msg::Heartbeat);
            }
        }
    }
}
