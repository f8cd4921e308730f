//! Test fixtures: engines on a loopback fabric, caches in host buffers,
//! the synthetic "compute" that fills a prefiller's pages and the byte
//! checks of a decoder's pages.

#![allow(dead_code)]

use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use weft::loopback::{Fabric, HostId};
use weft::{DomainGroupSpec, EngineConfig, HostBuffer, TransferEngine};
use weft_kvcache::{
    CacheRegions, HeadOrder, Heartbeat, Incoming, KvConfig, KvError, KvLayout, LayerWatch,
    Prefiller, Serve,
};
use weft_testkit::pattern::pattern_byte;

pub fn engine(fabric: &Fabric, host: HostId, nics: usize) -> Arc<TransferEngine> {
    let p = Arc::new(fabric.provider(host));
    let cfg = {
        let mut c = EngineConfig::default();
        c.queue_capacity = 256;
        c.send_slots = 16;
        c.idle_sleep = Some(Duration::from_micros(300));
        c
    };
    Arc::new(
        TransferEngine::builder()
            .group(DomainGroupSpec::new(p, (0..nics).collect::<Vec<_>>()))
            .config(cfg)
            .build()
            .expect("engine builds"),
    )
}

pub fn kv_config() -> KvConfig {
    KvConfig {
        heartbeat: Heartbeat {
            interval: Duration::from_millis(20),
            timeout: Duration::from_millis(600),
        },
        ..KvConfig::default()
    }
}

pub fn layout(layers: u32, kv_heads: u32, page_len: u64, tail_len: u64, pages: u32) -> KvLayout {
    KvLayout {
        layers,
        kv_heads,
        page_len,
        tail_len,
        num_pages: pages,
        tail_slots: pages,
        order: HeadOrder::HeadsBeforePages,
    }
}

/// A cache in host memory.
pub struct Cache {
    pub layout: KvLayout,
    pub kv: HostBuffer,
    pub tail: HostBuffer,
}

impl Cache {
    pub fn new(layout: KvLayout) -> Self {
        let kv = HostBuffer::new(layout.kv_bytes().unwrap() as usize).unwrap();
        let tail = HostBuffer::new(layout.tail_bytes().unwrap().max(1) as usize).unwrap();
        Self { layout, kv, tail }
    }

    pub fn regions(&self) -> CacheRegions {
        CacheRegions::whole(self.kv.region(), self.tail.region())
    }

    /// The same memory as one registered region per layer (each layer a
    /// separate registration, as vLLM's per-layer tensors are), plus the
    /// tail region when the layout has a tail.
    pub fn per_layer_regions(&self) -> CacheRegions {
        let lb = self.layout.layer_bytes().unwrap() as usize;
        let layers = (0..self.layout.layers as usize)
            .map(|l| self.kv.sub_region(l * lb..(l + 1) * lb).unwrap())
            .collect();
        let r = CacheRegions::per_layer(layers);
        if self.layout.tail_len > 0 {
            r.with_tail(self.tail.region())
        } else {
            r
        }
    }

    /// Fills every KV page with `byte`.
    pub fn fill_pages(&self, pages: &[u32], byte: u8) {
        let l = &self.layout;
        let page = vec![byte; l.page_len as usize];
        for layer in 0..l.layers {
            for h in 0..l.kv_heads {
                for &p in pages {
                    let off = l.offset(layer, h, p).unwrap() as usize;
                    assert!(self.kv.write(off, &page));
                }
            }
        }
    }

    /// Checks every KV byte of `pages` is `byte`.
    pub fn check_filled(&self, pages: &[u32], byte: u8) -> Result<(), String> {
        let l = &self.layout;
        for layer in 0..l.layers {
            for h in 0..l.kv_heads {
                for &p in pages {
                    let off = l.offset(layer, h, p).unwrap() as usize;
                    let got = self.kv.read(off, l.page_len as usize).unwrap();
                    if let Some(i) = got.iter().position(|&b| b != byte) {
                        return Err(format!(
                            "layer {layer} head {h} page {p} byte {i}: {:#04x}, want {byte:#04x}",
                            got[i]
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Content of KV byte `i` of prompt page `j`, global head `g`, `layer`.
pub fn kv_byte(seed: u64, layer: u32, g: u32, j: u32, i: u64) -> u8 {
    pattern_byte(
        seed ^ (u64::from(layer) << 44) ^ (u64::from(g) << 32) ^ (u64::from(j) << 8),
        i,
    )
}

pub fn tail_byte(seed: u64, i: u64) -> u8 {
    pattern_byte(seed ^ 0x7a11_0000_0000_0000, i)
}

/// The "compute" of one layer at a prefill rank holding `global_heads`:
/// writes the prompt's pages `src_pages` of every head.
pub fn compute_layer(c: &Cache, global_heads: &[u32], src_pages: &[u32], seed: u64, layer: u32) {
    let l = &c.layout;
    let mut page = vec![0u8; l.page_len as usize];
    for (s, &g) in global_heads.iter().enumerate() {
        for (j, &p) in src_pages.iter().enumerate() {
            for (i, b) in page.iter_mut().enumerate() {
                *b = kv_byte(seed, layer, g, j as u32, i as u64);
            }
            let off = l.offset(layer, s as u32, p).unwrap() as usize;
            assert!(c.kv.write(off, &page));
        }
    }
}

pub fn compute_tail(c: &Cache, slot: u32, seed: u64) {
    let l = &c.layout;
    let t: Vec<u8> = (0..l.tail_len).map(|i| tail_byte(seed, i)).collect();
    assert!(c.tail.write(l.tail_offset(slot).unwrap() as usize, &t));
}

/// Checks a decode rank holding `global_heads` received prompt `seed` into
/// `pages` (and the tail into `slot`).
pub fn check_request(
    c: &Cache,
    global_heads: &[u32],
    pages: &[u32],
    slot: u32,
    seed: u64,
) -> Result<(), String> {
    let l = &c.layout;
    for layer in 0..l.layers {
        for (d, &g) in global_heads.iter().enumerate() {
            for (j, &p) in pages.iter().enumerate() {
                let off = l.offset(layer, d as u32, p).unwrap() as usize;
                let got = c.kv.read(off, l.page_len as usize).unwrap();
                for (i, &b) in got.iter().enumerate() {
                    let want = kv_byte(seed, layer, g, j as u32, i as u64);
                    if b != want {
                        return Err(format!(
                            "layer {layer} head {g} (local {d}) page {p} (prompt page {j}) \
                             byte {i}: {b:#04x} != {want:#04x}"
                        ));
                    }
                }
            }
        }
    }
    if l.tail_len > 0 {
        let got = c
            .tail
            .read(l.tail_offset(slot).unwrap() as usize, l.tail_len as usize)
            .unwrap();
        for (i, &b) in got.iter().enumerate() {
            if b != tail_byte(seed, i as u64) {
                return Err(format!("tail byte {i}: {b:#04x}"));
            }
        }
    }
    Ok(())
}

pub fn seed_of(inc: &Incoming) -> u64 {
    u64::from_le_bytes(inc.meta[..8].try_into().expect("8-byte meta"))
}

/// Called before computing a layer (request id, layer).
pub type Hook = Arc<dyn Fn(u64, u32) + Send + Sync>;

/// How the prefill app reports layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Call,
    Watcher,
    /// Alternate by request id.
    Mixed,
    /// An external word (as a GPU-mapped one would be), reused across
    /// requests: `Serve::watch_word` with the word's value as the base.
    External,
}

/// The prefill application of one rank: accepts every request, takes
/// source pages from its own pool, "computes" layer after layer (pattern
/// data), reports each, and returns the pages when the request ends.
pub struct PrefillApp {
    pub pre: Arc<Prefiller>,
    pub cache: Arc<Cache>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub serves: Arc<Mutex<Vec<Serve>>>,
}

impl PrefillApp {
    pub fn start(
        pre: Arc<Prefiller>,
        cache: Arc<Cache>,
        global_heads: Vec<u32>,
        signal: Signal,
        hook: Option<Hook>,
    ) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let serves = Arc::new(Mutex::new(Vec::new()));
        let (p2, c2, s2, sv2) = (pre.clone(), cache.clone(), stop.clone(), serves.clone());
        let thread = std::thread::spawn(move || {
            let free = Arc::new(Mutex::new(
                (0..c2.layout.num_pages).collect::<BTreeSet<u32>>(),
            ));
            let slots = Arc::new(Mutex::new(
                (0..c2.layout.tail_slots).collect::<BTreeSet<u32>>(),
            ));
            let mut watches: Vec<(Serve, LayerWatch)> = Vec::new();
            // outlives every watcher of it: dropped after `watches`
            let external = Box::new(std::sync::atomic::AtomicU64::new(1_000));
            while !s2.load(std::sync::atomic::Ordering::SeqCst) {
                watches.retain(|(s, _)| !s.is_done());
                let Some(inc) = p2.next_request_timeout(Duration::from_millis(20)) else {
                    continue;
                };
                let seed = seed_of(&inc);
                let (src, slot) = {
                    let mut f = free.lock();
                    let src: Vec<u32> = (0..inc.pages).filter_map(|_| f.pop_last()).collect();
                    if src.len() < inc.pages as usize {
                        f.extend(src);
                        p2.reject(&inc, "no source pages");
                        continue;
                    }
                    (src, slots.lock().pop_first().unwrap_or(0))
                };
                let serve = match p2.accept(&inc, &src, slot) {
                    Ok(s) => s,
                    Err(e) => {
                        // cancelled before it was accepted
                        assert!(matches!(e, KvError::NotIncoming { .. }), "{e}");
                        free.lock().extend(src);
                        slots.lock().insert(slot);
                        continue;
                    }
                };
                {
                    let (f, sl, src) = (free.clone(), slots.clone(), src.clone());
                    serve.on_complete(move |_| {
                        f.lock().extend(src);
                        sl.lock().insert(slot);
                    });
                }
                sv2.lock().push(serve.clone());
                let id = inc.key.id;
                let use_watch = match signal {
                    Signal::Call => false,
                    Signal::Watcher | Signal::External => true,
                    Signal::Mixed => id % 2 == 0,
                };
                let base = external.load(std::sync::atomic::Ordering::SeqCst);
                let w = use_watch.then(|| match signal {
                    // SAFETY: `external` is boxed (stable address), aligned,
                    // written only atomically, and outlives `watches`.
                    #[allow(unsafe_code)]
                    Signal::External => unsafe {
                        serve.watch_word(std::ptr::NonNull::from(&*external), base)
                    },
                    _ => serve.watch(),
                });
                let word: &std::sync::atomic::AtomicU64 = match signal {
                    Signal::External => &external,
                    _ => w.as_ref().map_or(&*external, |w| w.word()),
                };
                let off = if signal == Signal::External { base } else { 0 };
                for layer in 0..c2.layout.layers {
                    if let Some(h) = &hook {
                        h(id, layer);
                    }
                    // like a GPU kernel, the compute goes on even when the
                    // request was cancelled: reporting a layer of an ended
                    // request must post nothing
                    compute_layer(&c2, &global_heads, &src, seed, layer);
                    match &w {
                        Some(_) => word.store(
                            off + u64::from(layer) + 1,
                            std::sync::atomic::Ordering::Release,
                        ),
                        None => {
                            serve.layer_ready(layer).expect("layer_ready");
                        }
                    }
                }
                if inc.tail {
                    compute_tail(&c2, slot, seed);
                    match &w {
                        Some(_) => word.store(
                            off + u64::from(serve.steps()),
                            std::sync::atomic::Ordering::Release,
                        ),
                        None => serve.tail_ready().expect("tail_ready"),
                    }
                }
                if let Some(w) = w {
                    watches.push((serve, w));
                }
            }
        });
        Self {
            pre,
            cache,
            stop,
            thread: Some(thread),
            serves,
        }
    }

    pub fn stop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("prefill app thread");
        }
    }
}

impl Drop for PrefillApp {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A hook that blocks request `id` at `layer` until released.
pub fn gate(
    id: u64,
    layer: u32,
) -> (
    Hook,
    crossbeam_channel::Receiver<()>,
    crossbeam_channel::Sender<()>,
) {
    let (reached_tx, reached_rx) = crossbeam_channel::unbounded();
    let (release_tx, release_rx) = crossbeam_channel::unbounded::<()>();
    let hook: Hook = Arc::new(move |rid, l| {
        if rid == id && l == layer {
            let _ = reached_tx.send(());
            let _ = release_rx.recv();
        }
    });
    (hook, reached_rx, release_tx)
}

/// Runs a future to completion on this thread.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct T(std::thread::Thread);
    impl Wake for T {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(T(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}
