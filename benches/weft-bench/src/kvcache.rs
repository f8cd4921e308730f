//! `kvcache`: KvCache transfer (weft-kvcache's decoder and prefiller over
//! the engine, layers reported one call each) for a Qwen3-235B-like shape
//! and a DeepSeek-V3 MLA shape: requests/s and GB/s, side by side with the
//! raw paged-write rate of the same backend — the same pages written with
//! the engine's paged writes (one per layer, plus the tail), no protocol —
//! measured on the same engines in alternating rounds.

use crate::backend::{BackendKind, Testbed};
use crate::engines::bench_config;
use crate::report::Row;
use crate::stats::median;
use crate::{Config, Progress};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{DomainGroupSpec, DoneCounter, HostBuffer, OnDone, TransferEngine};
use weft_kvcache::{
    layout::layer_pages, CacheRegions, Decoder, HeadMap, HeadOrder, Heartbeat, KvConfig, KvLayout,
    Prefiller, Route,
};

const BENCH: &str = "kvcache";

/// A baseline request in flight: its sender-side counter, and the
/// receiver's immediate and round flag when it counts immediates.
type InFlight = (Arc<DoneCounter>, Option<(u32, Arc<weft::DoneFlag>)>);

/// A model shape as one rank sees it.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Row name.
    pub name: &'static str,
    /// Layers.
    pub layers: u32,
    /// KV heads on one rank.
    pub kv_heads: u32,
    /// Bytes per page per head.
    pub page_len: u64,
    /// Tail bytes (hidden state).
    pub tail_len: u64,
}

/// Qwen3-235B-A22B: 94 layers, 4 KV heads over TP4 (one per rank), 32 KiB
/// pages (128 tokens), hidden state 4096 x bf16 as the tail.
pub const QWEN3: Shape = Shape {
    name: "qwen3_235b_tp4",
    layers: 94,
    kv_heads: 1,
    page_len: 32 * 1024,
    tail_len: 8 * 1024,
};

/// DeepSeek-V3: 61 layers, MLA latent (512 + 64) x bf16 = 1152 B per token,
/// replicated (one "head"), 64-token pages (72 KiB), hidden 7168 x bf16.
pub const DEEPSEEK_V3: Shape = Shape {
    name: "deepseek_v3_mla",
    layers: 61,
    kv_heads: 1,
    page_len: 64 * 1152,
    tail_len: 14 * 1024,
};

fn engine(tb: &Testbed) -> Result<Arc<TransferEngine>, String> {
    let p = tb.host()?;
    TransferEngine::builder()
        .group(DomainGroupSpec::new(p, (0..tb.nics()).collect::<Vec<_>>()))
        .config(bench_config())
        .build()
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

struct Bed {
    pe: Arc<TransferEngine>,
    de: Arc<TransferEngine>,
    pre: Arc<Prefiller>,
    dec: Decoder,
    route: Route,
    layout: KvLayout,
    app: Option<std::thread::JoinHandle<()>>,
    // the baseline's registrations of the same two caches
    src: weft::MrHandle,
    dst: weft::MrDesc,
    dst_tail: weft::MrDesc,
    src_tail: weft::MrHandle,
    _bufs: [HostBuffer; 4],
}

impl Drop for Bed {
    fn drop(&mut self) {
        self.dec.shutdown();
        self.pre.shutdown(Duration::from_secs(2));
        if let Some(t) = self.app.take() {
            let _ = t.join();
        }
        self.de.shutdown();
        self.pe.shutdown();
    }
}

fn e2s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Bed {
    fn new(tb: &Testbed, s: &Shape, pages: u32, concurrency: u32) -> Result<Self, String> {
        let layout = KvLayout {
            layers: s.layers,
            kv_heads: s.kv_heads,
            page_len: s.page_len,
            tail_len: s.tail_len,
            num_pages: pages * concurrency,
            tail_slots: concurrency,
            order: HeadOrder::HeadsBeforePages,
        };
        let kv = layout.kv_bytes().map_err(e2s)? as usize;
        let tail = layout.tail_bytes().map_err(e2s)? as usize;
        let bufs = [
            HostBuffer::new(kv).map_err(e2s)?,
            HostBuffer::new(tail).map_err(e2s)?,
            HostBuffer::new(kv).map_err(e2s)?,
            HostBuffer::new(tail).map_err(e2s)?,
        ];
        let (pe, de) = (engine(tb)?, engine(tb)?);
        let preg = CacheRegions::whole(bufs[0].region(), bufs[1].region());
        let dreg = CacheRegions::whole(bufs[2].region(), bufs[3].region());
        // The baseline's writes share the links with the protocol's
        // messages, and the CPU is saturated: a generous heartbeat timeout.
        let kvc = KvConfig {
            heartbeat: Heartbeat {
                interval: Duration::from_millis(20),
                timeout: Duration::from_secs(10),
            },
            ..KvConfig::default()
        };
        let pre = Arc::new(Prefiller::new(pe.clone(), layout, preg, kvc).map_err(e2s)?);
        let dec = Decoder::new(de.clone(), layout, dreg, kvc).map_err(e2s)?;
        let p = dec.add_prefiller(pe.main_address());
        let route = Route::single(p, layout.kv_heads);
        let (src, _) = pe.reg_mr(bufs[0].region()).map_err(e2s)?;
        let (src_tail, _) = pe.reg_mr(bufs[1].region()).map_err(e2s)?;
        let (_, dst) = de.reg_mr(bufs[2].region()).map_err(e2s)?;
        let (_, dst_tail) = de.reg_mr(bufs[3].region()).map_err(e2s)?;
        // The prefill application: serves every request from the same pages
        // as its destination, reporting each layer with a call.
        let p2 = pre.clone();
        let app = std::thread::spawn(move || {
            while let Ok(inc) = p2.next_request() {
                let Some(first) = inc.meta.first().copied() else {
                    continue;
                };
                let base = u32::from(first) * inc.pages;
                let src: Vec<u32> = (base..base + inc.pages).collect();
                let Ok(serve) = p2.accept(&inc, &src, u32::from(first)) else {
                    continue;
                };
                for l in 0..layout.layers {
                    let _ = serve.layer_ready(l);
                }
                let _ = serve.tail_ready();
            }
        });
        Ok(Bed {
            pe,
            de,
            pre,
            dec,
            route,
            layout,
            app: Some(app),
            src,
            dst,
            src_tail,
            dst_tail,
            _bufs: bufs,
        })
    }

    /// `n` requests of `pages` pages, `conc` in flight; returns seconds.
    fn kvcache(&self, n: u32, pages: u32, conc: u32) -> Result<f64, String> {
        let t0 = Instant::now();
        let mut q = VecDeque::new();
        let mut slots: VecDeque<u8> = (0..conc as u8).collect();
        for _ in 0..n {
            if q.len() >= conc as usize {
                let (lease, h, slot): (_, weft_kvcache::RequestHandle, u8) =
                    q.pop_front().ok_or("queue")?;
                h.wait().map_err(e2s)?;
                self.dec.free(lease);
                slots.push_back(slot);
            }
            let slot = slots.pop_front().ok_or("slot")?;
            let lease = self.dec.alloc(pages).map_err(e2s)?;
            let h = self
                .dec
                .request(&self.route, &lease, &[slot])
                .map_err(e2s)?;
            q.push_back((lease, h, slot));
        }
        for (lease, h, _) in q {
            h.wait().map_err(e2s)?;
            self.dec.free(lease);
        }
        Ok(t0.elapsed().as_secs_f64())
    }

    /// The same writes as engine paged writes (no protocol); seconds. With
    /// `imms`, every write carries an immediate and a request ends when the
    /// receiver's count fires (what the protocol's completion costs on top
    /// of the writes), else when the sender's completions are in.
    fn raw(&self, n: u32, pages: u32, conc: u32, imms: bool) -> Result<f64, String> {
        let l = &self.layout;
        let counts = self.de.imm_counts(0).map_err(e2s)?;
        let per_req_imms = u64::from(l.layers)
            * counts.paged_writes(l.page_len, u64::from(pages * l.kv_heads))
            + counts.single_write(l.tail_len);
        let heads: Vec<HeadMap> = (0..l.kv_heads)
            .map(|h| HeadMap { src: h, dst: h })
            .collect();
        let per_req = u64::from(l.layers) + 1;
        let t0 = Instant::now();
        let mut q: VecDeque<InFlight> = VecDeque::new();
        let finish = |(c, f): InFlight| {
            c.wait_for(per_req);
            if let Some((imm, f)) = f {
                f.wait().map_err(e2s)?;
                self.de.free_imm(imm);
            }
            if c.failed() > 0 {
                return Err("raw paged write failed".to_string());
            }
            Ok(())
        };
        for r in 0..n {
            if q.len() >= conc as usize {
                finish(q.pop_front().ok_or("queue")?)?;
            }
            let armed = if imms {
                let imm = self.de.alloc_imm().map_err(e2s)?;
                let (od, flag) = OnDone::flag();
                self.de
                    .expect_imm_count_with(imm, per_req_imms, od)
                    .map_err(e2s)?;
                Some((imm, flag))
            } else {
                None
            };
            let imm = armed.as_ref().map(|(i, _)| *i);
            let slot = r % conc;
            let pg: Vec<u32> = (slot * pages..(slot + 1) * pages).collect();
            let c = Arc::new(DoneCounter::new());
            for layer in 0..l.layers {
                let (sp, dp) = layer_pages(l, l, layer, &heads, &pg, &pg).ok_or("pages")?;
                self.pe
                    .submit_paged_writes(
                        l.page_len,
                        imm,
                        (&self.src, &sp),
                        (&self.dst, &dp),
                        OnDone::counter(&c),
                    )
                    .map_err(e2s)?;
            }
            let off = l.tail_offset(slot).ok_or("tail")?;
            self.pe
                .submit_single_write(
                    l.tail_len,
                    imm,
                    (&self.src_tail, off),
                    (&self.dst_tail, off),
                    OnDone::counter(&c),
                )
                .map_err(e2s)?;
            q.push_back((c, armed));
        }
        for x in q {
            finish(x)?;
        }
        Ok(t0.elapsed().as_secs_f64())
    }
}

fn shape_rows(cfg: &Config, tb: &Testbed, s: &Shape, backend: &str) -> Result<Vec<Row>, String> {
    let (pages, conc, n) = if cfg.quick { (4, 2, 6) } else { (16, 4, 40) };
    let bed = Bed::new(tb, s, pages, conc)?;
    let bytes = (u64::from(s.layers * s.kv_heads * pages) * s.page_len + s.tail_len) * u64::from(n);
    // warm-up (connections, registrations)
    bed.kvcache(conc, pages, conc)?;
    bed.raw(conc, pages, conc, false)?;
    bed.raw(conc, pages, conc, true)?;
    let (mut kv, mut raw, mut raw_imm) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..cfg.rounds() {
        kv.push(bed.kvcache(n, pages, conc)?);
        raw.push(bed.raw(n, pages, conc, false)?);
        raw_imm.push(bed.raw(n, pages, conc, true)?);
    }
    let (k, r, ri) = (median(&mut kv), median(&mut raw), median(&mut raw_imm));
    let param = format!(
        "{} layers x {} head x {pages} pages x {} B + {} B tail, {conc} in flight",
        s.layers, s.kv_heads, s.page_len, s.tail_len
    );
    let gbs = |secs: f64| bytes as f64 / secs / 1e9;
    let rps = |secs: f64| f64::from(n) / secs;
    let base = "engine paged writes";
    Ok(vec![
        Row::new(
            BENCH,
            s.name,
            backend,
            tb.nics(),
            param.clone(),
            "throughput",
            "GB/s",
            gbs(k),
            Some((gbs(r), base)),
        )
        // the same writes carrying immediates, ended by the receiver's count:
        // the part of the gap that is immediate counting, not the protocol
        .extra("paged_writes_with_imm_count", gbs(ri)),
        Row::new(
            BENCH,
            s.name,
            backend,
            tb.nics(),
            param,
            "requests",
            "req/s",
            rps(k),
            Some((rps(r), base)),
        )
        .extra("paged_writes_with_imm_count", rps(ri)),
    ])
}

/// Runs `kvcache` on `kind` (NIC count: the first of `--nics`, default 1).
pub fn run(cfg: &Config, kind: &BackendKind, progress: &mut Progress) -> Vec<Row> {
    let backend = kind.to_string();
    let nics = cfg
        .nics
        .as_ref()
        .and_then(|v| v.first().copied())
        .unwrap_or(1);
    if matches!(kind, BackendKind::LoopbackNull) {
        progress.step("");
        progress.step("");
        let why = "loopback-null copies no SEND payload: the request protocol cannot run".into();
        return vec![Row::unavailable(BENCH, "all", &backend, nics, why)];
    }
    let tb = match Testbed::new(kind, nics) {
        Ok(t) => t,
        Err(why) => {
            progress.step("");
            progress.step("");
            return vec![Row::unavailable(BENCH, "all", &backend, nics, why)];
        }
    };
    let mut rows = Vec::new();
    for s in [QWEN3, DEEPSEEK_V3] {
        progress.step(&format!("kvcache {backend} {}", s.name));
        match shape_rows(cfg, &tb, &s, &backend) {
            Ok(r) => rows.extend(r),
            Err(why) => rows.push(Row::failed(BENCH, s.name, &backend, nics, why)),
        }
    }
    rows
}
