//! The KvCache demo: one prefiller, two decoders, on any backend. The
//! "compute" (pattern data written layer by layer into the prefiller's own
//! cache) and the byte checks at the decoders are the demo's, not the
//! library's.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::{HostBuffer, TransferEngine};
use weft_kvcache::{CacheRegions, Decoder, HeadOrder, KvConfig, KvLayout, Prefiller, Route};

/// Deterministic content of byte `i` of stream `tag`.
pub fn pattern(tag: u64, i: u64) -> u8 {
    let x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ tag.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x >> 29) as u8
}

fn kv_tag(seed: u64, layer: u32, head: u32, j: u32) -> u64 {
    seed ^ (u64::from(layer) << 44) ^ (u64::from(head) << 32) ^ (u64::from(j) << 8)
}

fn tail_tag(seed: u64) -> u64 {
    seed ^ 0x7a11_0000_0000_0000
}

struct Cache {
    kv: HostBuffer,
    tail: HostBuffer,
}

impl Cache {
    fn new(l: &KvLayout) -> Result<Self, String> {
        let kv = HostBuffer::new(l.kv_bytes().map_err(|e| e.to_string())? as usize)
            .map_err(|e| e.to_string())?;
        let tail = HostBuffer::new(l.tail_bytes().map_err(|e| e.to_string())?.max(1) as usize)
            .map_err(|e| e.to_string())?;
        Ok(Self { kv, tail })
    }

    fn regions(&self) -> CacheRegions {
        CacheRegions::whole(self.kv.region(), self.tail.region())
    }
}

/// The prefill application: accepts every request, "computes" its layers
/// into its own cache and reports them (watcher word for even ids, calls
/// for odd ones).
fn prefill_app(pre: Arc<Prefiller>, cache: Arc<Cache>, l: KvLayout) {
    let free = Arc::new(Mutex::new((0..l.num_pages).collect::<BTreeSet<u32>>()));
    let slots = Arc::new(Mutex::new((0..l.tail_slots).collect::<BTreeSet<u32>>()));
    let mut watches = Vec::new();
    while let Ok(inc) = pre.next_request() {
        let seed = u64::from_le_bytes(inc.meta[..8].try_into().unwrap_or([0; 8]));
        let src: Vec<u32> = {
            let mut f = free.lock().unwrap_or_else(|e| e.into_inner());
            (0..inc.pages).filter_map(|_| f.pop_last()).collect()
        };
        let slot = slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_first()
            .unwrap_or(0);
        let serve = match pre.accept(&inc, &src, slot) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("  prefill: {e}");
                continue;
            }
        };
        {
            let (f, s, src) = (free.clone(), slots.clone(), src.clone());
            serve.on_complete(move |_| {
                f.lock().unwrap_or_else(|e| e.into_inner()).extend(src);
                s.lock().unwrap_or_else(|e| e.into_inner()).insert(slot);
            });
        }
        let watch = (inc.key.id % 2 == 0).then(|| serve.watch());
        let mut page = vec![0u8; l.page_len as usize];
        for layer in 0..l.layers {
            for h in 0..l.kv_heads {
                for (j, &p) in src.iter().enumerate() {
                    let tag = kv_tag(seed, layer, h, j as u32);
                    for (i, b) in page.iter_mut().enumerate() {
                        *b = pattern(tag, i as u64);
                    }
                    if let Some(off) = l.offset(layer, h, p) {
                        cache.kv.write(off as usize, &page);
                    }
                }
            }
            match &watch {
                Some(w) => w.word().store(u64::from(layer) + 1, Ordering::Release),
                None => {
                    let _ = serve.layer_ready(layer);
                }
            }
        }
        let t: Vec<u8> = (0..l.tail_len)
            .map(|i| pattern(tail_tag(seed), i))
            .collect();
        if let Some(off) = l.tail_offset(slot) {
            cache.tail.write(off as usize, &t);
        }
        match &watch {
            Some(w) => w.word().store(u64::from(serve.steps()), Ordering::Release),
            None => {
                let _ = serve.tail_ready();
            }
        }
        if let Some(w) = watch {
            watches.push((serve, w));
        }
        watches.retain(|(s, _)| !s.is_done());
    }
}

fn verify(c: &Cache, l: &KvLayout, pages: &[u32], slot: u32, seed: u64) -> Result<u64, String> {
    let mut bytes = 0;
    for layer in 0..l.layers {
        for h in 0..l.kv_heads {
            for (j, &p) in pages.iter().enumerate() {
                let off = l.offset(layer, h, p).ok_or("offset")? as usize;
                let got = c.kv.read(off, l.page_len as usize).ok_or("read")?;
                let tag = kv_tag(seed, layer, h, j as u32);
                if let Some(i) = (0..got.len()).find(|&i| got[i] != pattern(tag, i as u64)) {
                    return Err(format!("layer {layer} head {h} page {p} byte {i} differs"));
                }
                bytes += l.page_len;
            }
        }
    }
    let off = l.tail_offset(slot).ok_or("tail")? as usize;
    let got = c.tail.read(off, l.tail_len as usize).ok_or("read")?;
    if (0..got.len()).any(|i| got[i] != pattern(tail_tag(seed), i as u64)) {
        return Err("tail differs".into());
    }
    Ok(bytes + l.tail_len)
}

/// Runs the demo; returns (requests, bytes verified, seconds).
pub fn run(
    engine: impl Fn() -> Result<Arc<TransferEngine>, String>,
    seed: u64,
) -> Result<(u64, u64, f64), String> {
    let l = KvLayout {
        layers: 16,
        kv_heads: 4,
        page_len: 8 * 1024,
        tail_len: 32 * 1024,
        num_pages: 128,
        tail_slots: 16,
        order: HeadOrder::HeadsBeforePages,
    };
    let pe = engine()?;
    let des = [engine()?, engine()?];
    let t0 = Instant::now();
    let pcache = Arc::new(Cache::new(&l)?);
    let pre = Arc::new(
        Prefiller::new(pe.clone(), l, pcache.regions(), KvConfig::default())
            .map_err(|e| format!("prefiller: {e}"))?,
    );
    let app = {
        let (p, c) = (pre.clone(), pcache.clone());
        std::thread::spawn(move || prefill_app(p, c, l))
    };
    let mut decs = Vec::new();
    for d in &des {
        let cache = Cache::new(&l)?;
        let dec = Decoder::new(d.clone(), l, cache.regions(), KvConfig::default())
            .map_err(|e| format!("decoder: {e}"))?;
        let p = dec.add_prefiller(pe.main_address());
        decs.push((dec, cache, Route::single(p, l.kv_heads)));
    }
    let (mut requests, mut bytes) = (0u64, 0u64);
    let mut err = None;
    for round in 0..4u64 {
        let mut hs = Vec::new();
        for (d, (dec, _, route)) in decs.iter().enumerate() {
            for k in 0..3u64 {
                let n = 4 + ((seed + round * 7 + k * 3 + d as u64) % 13) as u32;
                let ps = seed ^ (round << 16) ^ (k << 8) ^ d as u64;
                let lease = dec.alloc(n).map_err(|e| format!("alloc: {e}"))?;
                let h = dec
                    .request(route, &lease, &ps.to_le_bytes())
                    .map_err(|e| format!("request: {e}"))?;
                hs.push((d, lease, h, ps));
            }
        }
        for (d, lease, h, ps) in hs {
            let (dec, cache, _) = &decs[d];
            match h.wait() {
                Ok(_) => match verify(cache, &l, lease.pages(), lease.tail_slot(), ps) {
                    Ok(b) => {
                        bytes += b;
                        requests += 1;
                    }
                    Err(e) => err = Some(format!("request {}: {e}", h.id())),
                },
                Err(e) => err = Some(format!("request {}: {e}", h.id())),
            }
            dec.free(lease);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "  {requests} requests ({} layers x {} heads x {} B pages + {} B tail) verified byte-exact: \
         {bytes} bytes",
        l.layers, l.kv_heads, l.page_len, l.tail_len,
    );
    for (dec, _, _) in &decs {
        dec.shutdown();
    }
    pre.shutdown(Duration::from_secs(2));
    drop(pre);
    for d in &des {
        d.shutdown();
    }
    pe.shutdown();
    let _ = app.join();
    match err {
        Some(e) => Err(e),
        None => Ok((requests, bytes, secs)),
    }
}
