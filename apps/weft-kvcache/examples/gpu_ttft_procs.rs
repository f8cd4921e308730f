//! KvCache prefill → decode across processes, GPU to GPU: `gpu_ttft` with
//! the prefiller in a process of its own, one process per GPU as serving
//! stacks run (on a one-GPU machine both share it). The decode process (this
//! one) owns its KV cache in device memory and starts the prefill process
//! (this binary with `--role prefill`), which owns its own cache, runs the
//! per-layer kernels (`fill_pattern`, a spin for the layer's compute time,
//! `scalar_inc` on a host-mapped watcher word the prefiller watches) and
//! serves each request layer by layer over the `nvlink` backend: WRITEs are
//! CUDA IPC copies from the prefill process's memory into this one's.
//!
//! Per shape (`--shape qwen3`: 94 layers x 32 KiB pages; `--shape dsv3`:
//! DeepSeek-V3's MLA latent, 61 layers x 144 KiB pages; default both) and
//! per-layer compute time (`--ms`, default 2.27,5,10,20,34.9):
//! - compute only: the prefill process's kernels with nobody watching;
//! - TTFT: request sent → decoder completion, and its overhead over
//!   compute only;
//! - per layer: the transfer time of one layer (its bytes over the copy
//!   bandwidth measured by a bare layer-sized request in the same run) and
//!   the prefill host's cost per layer (watcher fire → writes handed to the
//!   engine).
//!
//! Every request's pages are copied back and checked. Without a usable GPU
//! it prints `SKIP` and exits 0 (`WEFT_CUDA_REQUIRE_GPU=1`: fails instead).
//! Other arguments: `--pages N` (default 32 = 4096 tokens), `--reps N`
//! (default 3), `--json FILE`.

#[path = "common/ttft.rs"]
mod ttft;

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ttft::{arg, required, verify, Prefill, Side};
use weft::{Device, DomainGroupSpec, GroupAddress, TransferEngine};
use weft_cuda::Gpu;
use weft_kvcache::{Decoder, KvConfig, KvLayout, Prefiller, Route};

type R<T> = Result<T, String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn cfg() -> KvConfig {
    KvConfig {
        heartbeat: weft_kvcache::Heartbeat {
            interval: Duration::from_millis(20),
            timeout: Duration::from_secs(30),
        },
        ..KvConfig::default()
    }
}

fn engine(backend: &weft::Backend) -> R<Arc<TransferEngine>> {
    TransferEngine::builder()
        .group(DomainGroupSpec::new(backend.host().map_err(s)?, vec![0, 1]).device(Device::Cuda(0)))
        .build()
        .map(Arc::new)
        .map_err(s)
}

/// The prefill process: serves one request per `go` line from stdin.
fn prefill(gpu: &Gpu, layout: KvLayout) -> R<()> {
    let k = gpu.kernels().map_err(s)?;
    let backend = ttft::nvlink(gpu)?;
    let pe = engine(&backend)?;
    let src = Side::new(gpu, &layout)?;
    let pre = Prefiller::new(pe.clone(), layout, src.regions(), cfg()).map_err(s)?;
    let addr = weft::encode(&pre.address()).map_err(s)?;
    let hex: String = addr.iter().map(|b| format!("{b:02x}")).collect();
    println!("addr {hex}");
    let (stream, word) = (gpu.stream().map_err(s)?, gpu.watch_word().map_err(s)?);
    let (flag, spin_out) = (gpu.host_flag().map_err(s)?, gpu.alloc(32 * 8).map_err(s)?);
    let pf = Prefill {
        k: &k,
        stream: &stream,
        src: &src,
        word: &word,
        flag: &flag,
        spin_out: &spin_out,
        layout,
    };
    let src_pages: Vec<u32> = (0..layout.num_pages).collect();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(s)?;
        let f: Vec<&str> = line.split_whitespace().collect();
        let (seed, layer_ns, graph) = match f.as_slice() {
            ["go", a, b, c] => (
                a.parse::<u64>().map_err(s)?,
                b.parse::<u64>().map_err(s)?,
                *c == "graph",
            ),
            ["quit"] => break,
            _ => return Err(format!("prefill: bad command {line:?}")),
        };
        let g = if graph {
            stream.begin_capture().map_err(s)?;
            pf.launch(seed, layer_ns, true)?;
            Some(stream.end_capture().map_err(s)?)
        } else {
            None
        };
        let launch = || -> R<()> {
            match &g {
                Some(g) => g.launch(&stream).map_err(s),
                None => pf.launch(seed, layer_ns, true),
            }
        };
        // compute only: nobody watches the word
        let t = Instant::now();
        launch()?;
        stream.synchronize().map_err(s)?;
        println!("compute {}", t.elapsed().as_secs_f64());
        let st = pre.stats();
        let (r0, n0) = (st.reports.load(Relaxed), st.report_ns.load(Relaxed));
        st.report_ns_max.store(0, Relaxed);
        let inc = pre.next_request().map_err(s)?;
        let serve = pre.accept(&inc, &src_pages, 0).map_err(s)?;
        // SAFETY: `word` outlives `watch` (dropped below); the GPU and the
        // host write it atomically.
        #[allow(unsafe_code)]
        let watch = unsafe { serve.watch_word(word.host_ptr(), word.value()) };
        launch()?;
        stream.synchronize().map_err(s)?;
        serve.wait().map_err(s)?;
        drop(watch);
        let reports = st.reports.load(Relaxed) - r0;
        let ns = st.report_ns.load(Relaxed) - n0;
        println!(
            "served {} {}",
            ns as f64 / reports.max(1) as f64 / 1e3,
            st.report_ns_max.load(Relaxed) as f64 / 1e3
        );
    }
    pre.shutdown(Duration::from_secs(5));
    pe.shutdown();
    Ok(())
}

/// The prefill process and its pipes.
struct Peer {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(shape: &str, pages: u32) -> R<Self> {
        let exe = std::env::current_exe().map_err(s)?;
        let mut child = Command::new(exe)
            .args([
                "--role",
                "prefill",
                "--shape",
                shape,
                "--pages",
                &pages.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the prefill process: {e}"))?;
        let to = child.stdin.take().ok_or("no stdin")?;
        let from = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        Ok(Self { child, to, from })
    }

    fn send(&mut self, line: &str) -> R<()> {
        writeln!(self.to, "{line}")
            .and_then(|()| self.to.flush())
            .map_err(s)
    }

    /// The next line, split after its expected first word.
    fn expect(&mut self, word: &str) -> R<Vec<String>> {
        let mut line = String::new();
        if self.from.read_line(&mut line).map_err(s)? == 0 {
            return Err(format!("the prefill process ended (waiting for {word:?})"));
        }
        let mut f = line.split_whitespace().map(str::to_string);
        match f.next() {
            Some(w) if w == word => Ok(f.collect()),
            _ => Err(format!("prefill process said {line:?}, expected {word:?}")),
        }
    }
}

fn num(v: &[String], i: usize) -> R<f64> {
    v.get(i)
        .and_then(|x| x.parse().ok())
        .ok_or_else(|| format!("bad number in {v:?}"))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One shape: the prefill process, the decoder here, every (mode, ms).
fn decode(
    gpu: &Gpu,
    shape: &str,
    pages: u32,
    reps: u32,
    ms: &[f64],
    json: &mut Vec<String>,
) -> R<()> {
    let (name, layers, page) = ttft::shape(shape)?;
    let layout = ttft::layout(layers, page, pages);
    let backend = ttft::nvlink(gpu)?;
    let de = engine(&backend)?;
    let dst = Side::new(gpu, &layout)?;
    let mut peer = Peer::spawn(shape, pages)?;
    let addr = peer.expect("addr")?;
    let bytes: Vec<u8> = (0..addr.first().map_or(0, String::len) / 2)
        .map(|i| u8::from_str_radix(&addr[0][2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(s)?;
    let paddr: GroupAddress = weft::decode(&bytes).map_err(s)?;
    let dec = Decoder::new(de.clone(), layout, dst.regions(), cfg()).map_err(s)?;
    let route = Route::single(dec.add_prefiller(paddr), 1);
    let layer_mb = layout.layer_bytes().map_err(s)? as f64 / 1e6;
    println!(
        "gpu_ttft_procs on {}: {name}: {layers} layers x {pages} pages x {} KiB + 8 KiB tail \
         = {:.1} MB per request, prefill and decode in separate processes over nvlink, {reps} reps",
        gpu.name(),
        page / 1024,
        layer_mb * f64::from(layers)
    );
    println!("mode   layer_ms  compute_ms  ttft_ms  overhead_%  host_us/layer(avg,max)");
    let mut seed = 1u64;
    // The transfer alone: requests whose layers take no compute (`--ms 0`),
    // request sent → decoder completion.
    let mut bare = Vec::new();
    for graph in [false, true] {
        for &m in ms {
            let layer_ns = (m * 1e6) as u64;
            let mode = if graph { "graph" } else { "stream" };
            let (mut comp, mut ttft, mut host, mut host_max) = (vec![], vec![], vec![], 0.0f64);
            for _ in 0..reps {
                seed += 1000;
                peer.send(&format!("go {seed} {layer_ns} {mode}"))?;
                comp.push(num(&peer.expect("compute")?, 0)?);
                let lease = dec.alloc(pages).map_err(s)?;
                let t0 = Instant::now();
                let h = dec
                    .request(&route, &lease, &seed.to_le_bytes())
                    .map_err(s)?;
                h.wait().map_err(s)?;
                let took = t0.elapsed().as_secs_f64();
                ttft.push(took);
                let served = peer.expect("served")?;
                host.push(num(&served, 0)?);
                host_max = host_max.max(num(&served, 1)?);
                verify(&dst, &layout, seed)?;
                dec.free(lease);
                if layer_ns == 0 {
                    bare.push(took);
                }
            }
            let (c, t, h) = (median(&mut comp), median(&mut ttft), median(&mut host));
            println!(
                "{mode:6} {m:8.2}  {:10.1}  {:7.1}  {:10.2}  {h:.1}, {host_max:.1}",
                c * 1e3,
                t * 1e3,
                (t / c - 1.0) * 100.0
            );
            json.push(format!(
                "{{\"shape\":\"{shape}\",\"mode\":\"{mode}\",\"layer_ms\":{m},\"compute_ms\":{:.3},\
                 \"ttft_ms\":{:.3},\"overhead_pct\":{:.3},\"host_us_avg\":{h:.2},\"host_us_max\":{host_max:.2}}}",
                c * 1e3,
                t * 1e3,
                (t / c - 1.0) * 100.0
            ));
        }
    }
    if !bare.is_empty() {
        let t = median(&mut bare);
        let gbps = layer_mb * f64::from(layers) / 1e3 / t;
        println!(
            "transfer alone (layer_ms 0): {:.2} ms per request, {gbps:.1} GB/s, {:.1} us per layer",
            t * 1e3,
            t * 1e6 / f64::from(layers)
        );
    }
    peer.send("quit")?;
    let st = peer.child.wait().map_err(s)?;
    dec.shutdown();
    de.shutdown();
    if !st.success() {
        return Err(format!("the prefill process exited with {st}"));
    }
    Ok(())
}

fn run() -> R<()> {
    if let Err(e) = weft_cuda::probe() {
        if required() {
            return Err(format!("WEFT_CUDA_REQUIRE_GPU=1 but no usable GPU: {e}"));
        }
        println!("SKIP gpu_ttft_procs: no usable CUDA GPU: {e}");
        return Ok(());
    }
    let gpu = Gpu::open(0).map_err(s)?;
    let pages: u32 = arg("--pages").and_then(|v| v.parse().ok()).unwrap_or(32);
    if arg("--role").as_deref() == Some("prefill") {
        let (_, layers, page) = ttft::shape(&arg("--shape").unwrap_or_else(|| "qwen3".into()))?;
        return prefill(&gpu, ttft::layout(layers, page, pages));
    }
    let reps: u32 = arg("--reps")
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let ms: Vec<f64> = arg("--ms")
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![0.0, 2.27, 5.0, 10.0, 20.0, 34.9]);
    let shapes = match arg("--shape") {
        Some(x) => vec![x],
        None => vec!["qwen3".to_string(), "dsv3".to_string()],
    };
    let mut json = Vec::new();
    for sh in &shapes {
        decode(&gpu, sh, pages, reps, &ms, &mut json)?;
    }
    if let Some(p) = arg("--json") {
        std::fs::write(&p, format!("[{}]\n", json.join(",\n"))).map_err(|e| format!("{p}: {e}"))?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_ttft_procs FAILED: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
