//! MoE dispatch/combine with one process per rank on the GPU machine, at
//! the DeepSeek-V3 decode shape (H = 7168 fp8 + 56 f32 scales = 7392 bytes
//! per token, top-8 of 256 experts, 128 tokens per rank, bf16 outputs of
//! 7168): the parent starts N rank processes (this binary, `--rank R`),
//! each opening GPU 0 with its own `TransferEngine` over the same-host
//! backend `nvlink` (or libfabric `shm` with FI_HMEM), its own
//! `EngineRank` and stream; the ranks meet in a `dir:` rendezvous store.
//!
//! Per rank and step (cuEvent): dispatch (send launch → unpack done) and
//! combine (combine-send → weighted sum done); from the proxy's clock:
//! kernel launch → first engine submit. Every 10th step is checked byte for
//! byte against the naive reference and left out of the timings. The parent
//! prints p50/p99 over all ranks' samples.
//!
//! Usage: gpu_procs [--ranks N] [--iters I] [--provider nvlink|libfabric:shm]
//! [--p P] (defaults 8, 300, nvlink, 32).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::rendezvous::{self, Session};
use weft::{DomainGroupSpec, EngineConfig, LibfabricOptions, ProviderConfig, TransferEngine};
use weft_cuda::{Event, Gpu};
use weft_moe::cuda::{EngineRank, MoeKernels};
use weft_moe::{reference, Dims, MoeRendezvous, RankInput};

#[path = "common/dsv3.rs"]
mod dsv3;
// The tests' deterministic expert (outputs every process computes alike).
#[path = "../tests/moe/common/mod.rs"]
mod tests_common;
use dsv3::{dims, input, pct, us, Input};
use tests_common::expert_outputs;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
}

fn num(name: &str, default: u64) -> u64 {
    arg(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Every rank's inputs of step `step`: top-8 distinct experts per token,
/// uniform (a load-balanced router), the same in every process.
fn inputs(d: &Dims, step: u64) -> Vec<Input> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0000 + step);
    (0..d.ranks).map(|_| input(d, &mut rng)).collect()
}

fn engine(gpu: &Gpu, prov: &str) -> Res<Arc<TransferEngine>> {
    let mut cfg = ProviderConfig::default();
    if prov == "nvlink" {
        let pm = gpu.peer_memory()?;
        cfg = cfg.with_nvlink(weft::NvlinkOptions::default().with_peer_memory(Arc::new(pm)));
    } else {
        let name = prov.strip_prefix("libfabric:").unwrap_or(prov);
        cfg = cfg.with_libfabric(
            LibfabricOptions::same_machine(name)
                .with_hmem(true)
                .with_hmem_ipc(true),
        );
    }
    let b = weft::provider_with(&prov.parse()?, &cfg)?;
    let e = TransferEngine::builder()
        .group(DomainGroupSpec::new(b.host()?, vec![0]).device(gpu.device()))
        .config(EngineConfig::default())
        .build()?;
    Ok(Arc::new(e))
}

/// One rank: prints `SAMPLES <kind> <µs,...>` lines and `DONE`.
fn rank_main(r: u32, n: u32, iters: u64, prov: &str, store: &str, p: u32) -> Res<()> {
    let d = dims(n, p);
    let gpu = Gpu::open(0)?;
    let e = engine(&gpu, prov)?;
    let mut rank = EngineRank::new(&gpu, &d, r, e.clone(), Duration::from_secs(20))?;
    let mut k = MoeKernels::compile(&gpu)?;
    k.timeout_ns = 20_000_000_000;
    let stream = gpu.stream()?;
    let ev: Vec<Event> = (0..3).map(|_| Event::new(&gpu)).collect::<Result<_, _>>()?;
    let store = rendezvous::open(&store.parse()?)?;
    let session = Session::new(store.clone(), Duration::from_secs(10))?;
    let rdv = MoeRendezvous::new(store, "gpu-procs");
    rdv.publish(&session, rank.info())?;
    rank.connect(&rdv.gather(n, Duration::from_secs(120))?)?;
    let gr = rank.gpu_rank().clone();
    let (mut disp, mut comb, mut l2w) = (Vec::new(), Vec::new(), Vec::new());
    let warm = 10;
    let mut checked = 0;
    // A few steps' inputs made up front: generating them per step would
    // skew the ranks' launches by more than a step takes.
    let variants: Vec<Vec<Input>> = (0..4).map(|v| inputs(&d, v)).collect();
    for it in 0..iters + warm {
        let ins = &variants[(it % 4) as usize];
        let views: Vec<RankInput<'_>> = ins.iter().map(Input::view).collect();
        let t = gr.set_inputs(&views[r as usize])?;
        // Checked steps are not timed: the reference work delays the
        // launch.
        let check = it % 10 == 0;
        let want = if check {
            Some(reference::dispatch(&d, &views)?)
        } else {
            None
        };
        let outs: Option<Vec<Vec<u8>>> = want.as_ref().map(|w| {
            w.iter()
                .enumerate()
                .map(|(x, w)| expert_outputs(&d, x as u32, w))
                .collect()
        });
        ev[0].record(&stream)?;
        let launched = Instant::now();
        k.dispatch_send(&stream, &gr)?;
        k.dispatch_recv(&stream, &gr)?;
        ev[1].record(&stream)?;
        stream.synchronize()?;
        gr.check_kernels()?;
        // The expert outputs: from the reference on checked steps, else
        // whatever the last upload left (combine moves them all the same).
        if let (Some(w), Some(o)) = (&want, &outs) {
            let got = gr.read_expert_tokens()?;
            if got != w[r as usize] {
                return Err(format!("rank {r} step {it}: expert tokens differ").into());
            }
            gr.set_expert_outputs(&o[r as usize])?;
        }
        // Restart the clock: the checks above are not part of the combine.
        ev[1].record(&stream)?;
        k.combine_send(&stream, &gr)?;
        k.combine_recv(&stream, &gr)?;
        ev[2].record(&stream)?;
        stream.synchronize()?;
        gr.check_kernels()?;
        if let Some(o) = &outs {
            let want = reference::combine(&d, &views, o)?;
            if gr.read_combined(t)? != want[r as usize] {
                return Err(format!("rank {r} step {it}: combined tokens differ").into());
            }
            checked += 1;
        }
        // The proxy records a step after its weighted sum, which can be
        // after the stream finished: wait (briefly) for this step's entry.
        let waited = Instant::now();
        let mut this = None;
        while this.is_none() && waited.elapsed() < Duration::from_millis(200) {
            this = rank.take_times().into_iter().find(|t| t.step == it + 1);
            if this.is_none() {
                std::thread::yield_now();
            }
        }
        if it >= warm && !check {
            disp.push(f64::from(ev[1].elapsed_ms_since(&ev[0])?) * 1e3);
            comb.push(f64::from(ev[2].elapsed_ms_since(&ev[1])?) * 1e3);
            if let Some(pt) = this {
                l2w.push(us(pt.first_write.duration_since(launched)));
            }
        }
    }
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    // Dispatch times include the kernel's wait for the slowest peer: the
    // ranks start their steps at slightly different times.
    println!("SAMPLES dispatch {}", fmt(&disp));
    println!("SAMPLES combine {}", fmt(&comb));
    println!("SAMPLES launch_to_first_submit {}", fmt(&l2w));
    println!("CHECKED {checked}");
    rank.shutdown()?;
    session.close()?;
    e.shutdown();
    println!("DONE");
    Ok(())
}

fn main() -> Res<()> {
    let n = num("--ranks", 8) as u32;
    let iters = num("--iters", 300);
    let p = num("--p", 32) as u32;
    let prov = arg("--provider").unwrap_or_else(|| "nvlink".into());
    if let Some(r) = arg("--rank") {
        let store = arg("--store").ok_or("--store")?;
        return rank_main(r.parse()?, n, iters, &prov, &store, p);
    }
    let dir = std::env::temp_dir().join(format!("weft-moe-procs-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store = format!("dir:{}", dir.display());
    let gpu = Gpu::open(0)?;
    println!(
        "# weft-moe, one process per rank on {}: EP{n}, DeepSeek-V3 decode (7392 B tokens, top-8/256, T=128, bf16 out 7168), P={p}, {prov}, {iters} steps",
        gpu.name()
    );
    drop(gpu);
    let exe = std::env::current_exe()?;
    let kids: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .args(["--rank", &r.to_string(), "--ranks", &n.to_string()])
                .args(["--iters", &iters.to_string(), "--p", &p.to_string()])
                .args(["--provider", &prov, "--store", &store])
                .stdout(Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut samples: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut checked = 0u64;
    let mut failed = false;
    for (r, mut kid) in kids.into_iter().enumerate() {
        let out = kid.stdout.take().ok_or("stdout")?;
        let mut done = false;
        for line in BufReader::new(out).lines() {
            let line = line?;
            if let Some(rest) = line.strip_prefix("SAMPLES ") {
                let (kind, vals) = rest.split_once(' ').unwrap_or((rest, ""));
                samples
                    .entry(kind.to_string())
                    .or_default()
                    .extend(vals.split(',').filter_map(|v| v.parse::<f64>().ok()));
            } else if let Some(c) = line.strip_prefix("CHECKED ") {
                checked += c.parse::<u64>().unwrap_or(0);
            } else if line == "DONE" {
                done = true;
            }
        }
        let status = kid.wait()?;
        if !status.success() || !done {
            eprintln!("rank {r}: exit {status}, done {done}");
            failed = true;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("\n| per rank and step | p50 µs | p99 µs | samples |\n|---|---|---|---|");
    for (kind, v) in &mut samples {
        println!(
            "| {kind} | {:.1} | {:.1} | {} |",
            pct(v, 0.5),
            pct(v, 0.99),
            v.len()
        );
    }
    println!("\nsteps checked against the reference: {checked} (every 10th step of every rank)");
    if failed {
        return Err("a rank failed".into());
    }
    Ok(())
}
