//! KvCache transfer with the KV pages in GPU memory on both sides and the
//! prefill "compute" on the GPU: per layer, a kernel writes the layer's
//! pages (`fill_pattern`), a kernel spins for the layer's compute time
//! (`wait_flag_write` on a flag that never rises, with the compute time as
//! its timeout) and `scalar_inc` bumps a host-mapped watcher word, which the
//! prefiller watches (`Serve::watch_word`) to post that layer's paged
//! writes; the tail goes last. Both as direct launches and as one CUDA
//! graph per request.
//!
//! Measures, for a Qwen3-235B-like shape (94 layers, 1 KV head per rank of
//! TP4, 32 KiB pages of 128 tokens) and per-layer compute times spanning the
//! paper's Table 3 range (2.27 … 34.9 ms):
//! - compute only: the same kernels, nothing watching the word;
//! - with transfer: request sent → decoder completion (TTFT as seen by the
//!   decoder), and its overhead over compute only;
//! - tail: last kernel done (stream synchronized) → decoder completion;
//! - host cost per layer: watcher fire → all of the layer's writes handed to
//!   the engine (`Prefiller::stats`).
//!
//! The data is verified after every request (decoder pages copied back and
//! compared with the pattern the kernels wrote).
//!
//! Without a usable GPU it prints `SKIP` and exits 0; with
//! `WEFT_CUDA_REQUIRE_GPU=1` it fails instead. Arguments (all optional):
//! `--pages N` (per prompt, default 32 = 4096 tokens), `--ms a,b,c` (per-layer
//! compute, default 2.27,5,10,20,34.9), `--reps N` (default 3), `--json FILE`,
//! `--provider nvlink` (both engines over the same-host backend, whose
//! WRITEs are copies on the GPU's copy engines; default: the simulated
//! fabric copying through one CUDA copier).

#[path = "common/ttft.rs"]
mod ttft;

use std::sync::Arc;
use std::time::{Duration, Instant};
use ttft::{arg, required, verify, Prefill, Side, TAIL};
use weft::loopback::{Fabric, FabricConfig};
use weft::{Device, DomainGroupSpec, TransferEngine};
use weft_cuda::Gpu;
use weft_kvcache::{Decoder, HeadOrder, KvConfig, KvLayout, Prefiller, Route};

const LAYERS: u32 = 94;
const PAGE: u64 = 32 * 1024;

fn run() -> Result<(), String> {
    if let Err(e) = weft_cuda::probe() {
        if required() {
            return Err(format!("WEFT_CUDA_REQUIRE_GPU=1 but no usable GPU: {e}"));
        }
        println!("SKIP gpu_ttft: no usable CUDA GPU: {e}");
        return Ok(());
    }
    let gpu = Gpu::open(0).map_err(|e| e.to_string())?;
    let k = gpu.kernels().map_err(|e| e.to_string())?;
    let pages: u32 = arg("--pages").and_then(|v| v.parse().ok()).unwrap_or(32);
    let reps: u32 = arg("--reps").and_then(|v| v.parse().ok()).unwrap_or(3);
    let ms: Vec<f64> = arg("--ms")
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![2.27, 5.0, 10.0, 20.0, 34.9]);
    let layout = KvLayout {
        layers: LAYERS,
        kv_heads: 1,
        page_len: PAGE,
        tail_len: TAIL,
        num_pages: pages,
        tail_slots: 1,
        order: HeadOrder::HeadsBeforePages,
    };
    let nvlink = match arg("--provider").as_deref() {
        None | Some("loopback") => None,
        Some("nvlink") => Some(ttft::nvlink(&gpu)?),
        Some(other) => return Err(format!("--provider {other}: loopback or nvlink")),
    };
    let mut fc = FabricConfig::ideal(1);
    fc.device_copy = Some(Arc::new(gpu.copy_engine().map_err(|e| e.to_string())?));
    let fabric = Fabric::new_realtime(fc);
    let mk = || -> Result<Arc<TransferEngine>, String> {
        let host: Arc<dyn weft::Provider> = match &nvlink {
            Some(b) => b.host().map_err(|e| e.to_string())?,
            None => Arc::new(fabric.provider(fabric.add_host(2))),
        };
        TransferEngine::builder()
            .group(DomainGroupSpec::new(host, vec![0, 1]).device(Device::Cuda(0)))
            .build()
            .map(Arc::new)
            .map_err(|e| e.to_string())
    };
    let (pe, de) = (mk()?, mk()?);
    let (src, dst) = (Side::new(&gpu, &layout)?, Side::new(&gpu, &layout)?);
    let cfg = KvConfig {
        heartbeat: weft_kvcache::Heartbeat {
            interval: Duration::from_millis(20),
            timeout: Duration::from_secs(30),
        },
        ..KvConfig::default()
    };
    let pre = Prefiller::new(pe.clone(), layout, src.regions(), cfg).map_err(|e| e.to_string())?;
    let dec = Decoder::new(de.clone(), layout, dst.regions(), cfg).map_err(|e| e.to_string())?;
    let route = Route::single(dec.add_prefiller(pe.main_address()), 1);
    let stream = gpu.stream().map_err(|e| e.to_string())?;
    let word = gpu.watch_word().map_err(|e| e.to_string())?;
    let flag = gpu.host_flag().map_err(|e| e.to_string())?;
    let spin_out = gpu.alloc(32 * 8).map_err(|e| e.to_string())?;
    let pf = Prefill {
        k: &k,
        stream: &stream,
        src: &src,
        word: &word,
        flag: &flag,
        spin_out: &spin_out,
        layout,
    };
    let src_pages: Vec<u32> = (0..pages).collect();
    let mb = (u64::from(LAYERS * pages) * PAGE + TAIL) as f64 / 1e6;
    println!(
        "gpu_ttft on {}: {LAYERS} layers x 1 KV head x {pages} pages x 32 KiB + 8 KiB tail \
         = {mb:.1} MB per request, {reps} reps",
        gpu.name()
    );
    println!("mode   layer_ms  compute_ms  ttft_ms  overhead_%  tail_us  host_us/layer(avg,max)");
    let mut json = Vec::new();
    let mut seed = 1u64;
    for graph in [false, true] {
        for &m in &ms {
            let layer_ns = (m * 1e6) as u64;
            let (mut comp, mut ttft, mut tail) = (Vec::new(), Vec::new(), Vec::new());
            let st = pre.stats();
            let r0 = st.reports.load(std::sync::atomic::Ordering::Relaxed);
            let n0 = st.report_ns.load(std::sync::atomic::Ordering::Relaxed);
            st.report_ns_max
                .store(0, std::sync::atomic::Ordering::Relaxed);
            for _ in 0..reps {
                seed += 1000;
                // compute only (the word is bumped but nobody watches it)
                let g = if graph {
                    stream.begin_capture().map_err(|e| e.to_string())?;
                    pf.launch(seed, layer_ns, true)?;
                    Some(stream.end_capture().map_err(|e| e.to_string())?)
                } else {
                    None
                };
                let t = Instant::now();
                match &g {
                    Some(g) => g.launch(&stream).map_err(|e| e.to_string())?,
                    None => pf.launch(seed, layer_ns, true)?,
                }
                stream.synchronize().map_err(|e| e.to_string())?;
                comp.push(t.elapsed().as_secs_f64());
                // with transfer
                let lease = dec.alloc(pages).map_err(|e| e.to_string())?;
                let t0 = Instant::now();
                let h = dec
                    .request(&route, &lease, &seed.to_le_bytes())
                    .map_err(|e| e.to_string())?;
                let inc = pre.next_request().map_err(|e| e.to_string())?;
                let serve = pre.accept(&inc, &src_pages, 0).map_err(|e| e.to_string())?;
                // SAFETY: `word` outlives `watch` (dropped at the end of this
                // iteration); the GPU and the host write it atomically.
                #[allow(unsafe_code)]
                let watch = unsafe { serve.watch_word(word.host_ptr(), word.value()) };
                match &g {
                    Some(g) => g.launch(&stream).map_err(|e| e.to_string())?,
                    None => pf.launch(seed, layer_ns, true)?,
                }
                stream.synchronize().map_err(|e| e.to_string())?;
                let tk = Instant::now();
                h.wait().map_err(|e| e.to_string())?;
                let td = Instant::now();
                serve.wait().map_err(|e| e.to_string())?;
                drop(watch);
                ttft.push((td - t0).as_secs_f64());
                tail.push((td.saturating_duration_since(tk)).as_secs_f64());
                verify(&dst, &layout, seed)?;
                dec.free(lease);
            }
            let med = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (c, t, tl) = (med(&mut comp), med(&mut ttft), med(&mut tail));
            let reports = st.reports.load(std::sync::atomic::Ordering::Relaxed) - r0;
            let ns = st.report_ns.load(std::sync::atomic::Ordering::Relaxed) - n0;
            let avg_us = ns as f64 / reports.max(1) as f64 / 1e3;
            let max_us = st.report_ns_max.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e3;
            let mode = if graph { "graph" } else { "stream" };
            println!(
                "{mode:6} {m:8.2}  {:10.1}  {:7.1}  {:10.2}  {:7.0}  {avg_us:.1}, {max_us:.1}",
                c * 1e3,
                t * 1e3,
                (t / c - 1.0) * 100.0,
                tl * 1e6
            );
            json.push(format!(
                "{{\"mode\":\"{mode}\",\"layer_ms\":{m},\"compute_ms\":{:.3},\"ttft_ms\":{:.3},\
                 \"overhead_pct\":{:.3},\"tail_us\":{:.1},\"host_us_avg\":{avg_us:.2},\
                 \"host_us_max\":{max_us:.2},\"reports\":{reports}}}",
                c * 1e3,
                t * 1e3,
                (t / c - 1.0) * 100.0,
                tl * 1e6
            ));
        }
    }
    if let Some(p) = arg("--json") {
        std::fs::write(&p, format!("[{}]\n", json.join(",\n"))).map_err(|e| format!("{p}: {e}"))?;
    }
    dec.shutdown();
    pre.shutdown(Duration::from_secs(5));
    de.shutdown();
    pe.shutdown();
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_ttft FAILED: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
