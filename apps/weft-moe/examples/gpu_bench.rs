//! GPU measurement of weft-moe's kernels at the DeepSeek-V3 decode shape
//! (H = 7168 fp8 + 56 f32 scales = 7392 bytes per token, top-8 of 256
//! experts, 128 tokens per rank, bf16 outputs of 7168), on ONE GPU:
//!
//! 1. kernel-only (cuEvent): each rank's send kernels (count + pack),
//!    recv kernel (unpack), combine-send and combine-recv (weighted sum),
//!    with the recv flags pre-raised so nothing waits: EP8 (all 8 ranks,
//!    one after another on one stream; once more with fp8 dispatch, bf16
//!    tokens quantised by the pack kernel) and EP64 (rank 0's view);
//! 2. end to end on one GPU, EP8 (8 ranks, each its own stream, buffers and
//!    proxy thread): dispatch (send launch → unpack done) and combine
//!    (combine-send → sum done) per rank, the proxy's signal → first
//!    engine submit and the launch → first submit time, with P swept
//!    0…32, and graph replay, for the engine-driven path (`EngineGroup`:
//!    one TransferEngine per rank) over the same-host backend `nvlink`
//!    (each rank's WRITEs are copies into the other ranks' GPU buffers on
//!    the copy engines) and over the realtime loopback fabric (ideal
//!    profile with no wire model, GPU memory moved by one CUDA copier under
//!    the fabric's lock), and, as a baseline, `LocalGroup` (the proxies'
//!    own D2D copies).
//!
//! The torch baseline of the same dispatch/combine on the same GPU is
//! `apps/weft-moe/bench/torch_baseline.py`; `run-gpu.sh` runs both.
//!
//! Usage: gpu_bench [ITERS] (default 300). `WEFT_MOE_BENCH_MODES` (a
//! comma list of `nvlink`, `loopback`, `local`; default all) picks the
//! end-to-end groups.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::time::{Duration, Instant};
use weft::loopback::{Fabric, FabricConfig, FabricStats, NicModel};
use weft::DeviceCopy;
use weft_cuda::{Event, Gpu, Stream};
use weft_moe::cuda::{EngineGroup, EngineGroupConfig, GpuRank, LocalGroup, MoeKernels, ProxyGroup};
use weft_moe::{count_pairs, row_to_le_bytes, Dims, DispatchFormat};

#[path = "common/dsv3.rs"]
mod dsv3;
use dsv3::{dims, dims_with, input, pct, us, Input};

fn line(name: &str, v: &mut [f64]) {
    let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
    println!("| {name} | {p50:.1} | {p99:.1} | {} |", v.len());
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Kernel-only times of rank `r` of an EP-`n` group (flags pre-raised).
fn kernel_only(
    gpu: &Gpu,
    k: &MoeKernels,
    n: u32,
    ranks: &[u32],
    iters: usize,
    dispatch: DispatchFormat,
) -> Res<()> {
    let d = dims_with(n, 32, dispatch);
    let mut rng = ChaCha8Rng::seed_from_u64(u64::from(n));
    let ins: Vec<Input> = (0..n).map(|_| input(&d, &mut rng)).collect();
    let row_len = d.route_row_len() as usize;
    let mut all = vec![0u8; d.route_buf_len() as usize];
    for (s, i) in ins.iter().enumerate() {
        let c = count_pairs(&d, &i.ids)?;
        row_to_le_bytes(&c.row, &mut all[s * row_len..(s + 1) * row_len]);
    }
    let stream = gpu.stream()?;
    let ev: Vec<Event> = (0..6).map(|_| Event::new(gpu)).collect::<Result<_, _>>()?;
    let mut t: [Vec<f64>; 5] = Default::default();
    let mut tot: [Vec<f64>; 2] = Default::default();
    let rks: Vec<GpuRank> = ranks
        .iter()
        .map(|&r| GpuRank::new(gpu, &d, r))
        .collect::<Result<_, _>>()?;
    for rk in &rks {
        rk.set_inputs(&ins[rk.rank() as usize].view())?;
        rk.route_buffer().write(0, &all)?;
        rk.dispatch_ready().raise(u64::MAX);
        rk.combine_ready().raise(u64::MAX);
    }
    let (ea, eb) = (Event::new(gpu)?, Event::new(gpu)?);
    for it in 0..iters + 10 {
        // All listed ranks back to back: the totals are the kernels' share
        // of a whole EP-n dispatch/combine on one GPU (for the baseline).
        ea.record(&stream)?;
        for rk in &rks {
            k.dispatch_send(&stream, rk)?;
            k.dispatch_recv(&stream, rk)?;
        }
        eb.record(&stream)?;
        stream.synchronize()?;
        let dt = f64::from(eb.elapsed_ms_since(&ea)?) * 1e3;
        ea.record(&stream)?;
        for rk in &rks {
            k.combine_send(&stream, rk)?;
            k.combine_recv(&stream, rk)?;
        }
        eb.record(&stream)?;
        stream.synchronize()?;
        let ct = f64::from(eb.elapsed_ms_since(&ea)?) * 1e3;
        // Per kernel, per rank.
        for rk in &rks {
            ev[0].record(&stream)?;
            k.dispatch_count(&stream, rk)?;
            ev[1].record(&stream)?;
            k.dispatch_pack(&stream, rk)?;
            ev[2].record(&stream)?;
            k.dispatch_recv(&stream, rk)?;
            ev[3].record(&stream)?;
            k.combine_send(&stream, rk)?;
            ev[4].record(&stream)?;
            k.combine_recv(&stream, rk)?;
            ev[5].record(&stream)?;
            stream.synchronize()?;
            if it >= 10 {
                for (j, v) in t.iter_mut().enumerate() {
                    v.push(f64::from(ev[j + 1].elapsed_ms_since(&ev[j])?) * 1e3);
                }
            }
        }
        if it >= 10 {
            tot[0].push(dt);
            tot[1].push(ct);
        }
        rks[0].check_kernels()?;
    }
    let what = match dispatch {
        DispatchFormat::Raw => "",
        _ => ", fp8 dispatch: bf16 tokens quantised by the pack kernel",
    };
    println!(
        "\n### kernel-only, EP{n}, ranks {:?}{what} (µs, cuEventElapsedTime; flags pre-raised)\n",
        ranks
    );
    println!("| kernel | p50 µs | p99 µs | samples |\n|---|---|---|---|");
    let mut send: Vec<f64> = t[0].iter().zip(&t[1]).map(|(a, b)| a + b).collect();
    line("dispatch-send: count", &mut t[0]);
    line("dispatch-send: pack", &mut t[1]);
    line("dispatch-send (count + pack)", &mut send);
    line("dispatch-recv (wait kernel + unpack)", &mut t[2]);
    line("combine-send (pack)", &mut t[3]);
    line("combine-recv (wait kernel + weighted sum)", &mut t[4]);
    line(
        &format!("all {} ranks' dispatch kernels back to back", rks.len()),
        &mut tot[0],
    );
    line(
        &format!("all {} ranks' combine kernels back to back", rks.len()),
        &mut tot[1],
    );
    Ok(())
}

/// The group of an end-to-end run: the engine-driven path on the ideal
/// loopback fabric without a wire model (latency 0, unlimited bandwidth:
/// what is measured is kernels, proxies, engines and the CUDA copies), or
/// the `LocalGroup` baseline.
fn group(gpu: &Gpu, d: &Dims, mode: Mode) -> Res<(Box<dyn ProxyGroup>, Option<Fabric>)> {
    let timeout = Duration::from_secs(20);
    match mode {
        Mode::Local => return Ok((Box::new(LocalGroup::new(gpu, d, timeout)?), None)),
        Mode::Nvlink => {
            let cfg = EngineGroupConfig::nvlink(gpu, timeout)?;
            return Ok((Box::new(EngineGroup::new(gpu, d, cfg)?), None));
        }
        Mode::Loopback => {}
    }
    let mut fabric = FabricConfig::ideal(7);
    fabric.nic = NicModel {
        latency: Duration::ZERO,
        link_gbps: 0.0,
    };
    fabric.device_copy = Some(std::sync::Arc::new(gpu.copy_engine()?));
    let f = Fabric::new_realtime(fabric);
    let hosts = f.clone();
    let hosts: weft_moe::cuda::HostFn = std::sync::Arc::new(move |_| {
        let h = hosts.add_host(1);
        Ok(std::sync::Arc::new(hosts.provider(h)) as std::sync::Arc<dyn weft::Provider>)
    });
    let cfg = EngineGroupConfig::new(hosts, timeout);
    let g = EngineGroup::new(gpu, d, cfg)?;
    Ok((Box::new(g), Some(f)))
}

/// What the loopback fabric did per step, and how long the same number of
/// CUDA copies of the average size take one after another through one
/// `CudaCopy` (the fabric makes its copies under one lock, one at a time,
/// each waiting for its stream), measured now on the same GPU.
fn copy_floor(gpu: &Gpu, s0: &FabricStats, s1: &FabricStats, steps: u64) -> Res<[f64; 3]> {
    let steps = steps.max(1);
    let writes = (s1.writes_posted - s0.writes_posted) as f64 / steps as f64;
    let chunks = (s1.chunks_delivered - s0.chunks_delivered) / steps;
    let bytes = (s1.bytes_delivered - s0.bytes_delivered) / steps;
    let avg = (bytes / chunks.max(1)).max(1) as usize;
    let (a, b) = (gpu.alloc(avg)?, gpu.alloc(avg)?);
    let cc = gpu.copy_engine()?;
    let dev = gpu.device();
    let mut per_step = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        for _ in 0..chunks {
            cc.copy(b.device_ptr(), dev, a.device_ptr(), dev, avg as u64)?;
        }
        per_step.push(us(t.elapsed()));
    }
    Ok([writes, bytes as f64 / 1e6, pct(&mut per_step, 0.5)])
}

/// End to end with the proxies: EP8 on one GPU, P = `p`. (Indexes the
/// per-rank streams, events and graphs in parallel.)
#[allow(clippy::needless_range_loop)]
fn end_to_end(
    gpu: &Gpu,
    k: &MoeKernels,
    p: u32,
    iters: usize,
    graphs: bool,
    mode: Mode,
) -> Res<Vec<f64>> {
    let d = dims(8, p);
    let n = d.ranks as usize;
    let (group, fabric) = group(gpu, &d, mode)?;
    let mut stats0 = None;
    let mut rng = ChaCha8Rng::seed_from_u64(1000 + u64::from(p));
    let streams: Vec<Stream> = (0..n).map(|_| gpu.stream()).collect::<Result<_, _>>()?;
    let ev: Vec<[Event; 3]> = (0..n)
        .map(|_| {
            Ok::<_, weft_cuda::CudaError>([Event::new(gpu)?, Event::new(gpu)?, Event::new(gpu)?])
        })
        .collect::<Result<_, _>>()?;
    let rank = |r: usize| group.rank(r as u32).expect("rank");
    for r in 0..n {
        rank(r).set_inputs(&input(&d, &mut rng).view())?;
    }
    let mut gr = Vec::new();
    if graphs {
        for r in 0..n {
            let s = &streams[r];
            s.begin_capture()?;
            k.dispatch_send(s, rank(r))?;
            k.dispatch_recv(s, rank(r))?;
            k.combine_send(s, rank(r))?;
            k.combine_recv(s, rank(r))?;
            gr.push(s.end_capture()?);
        }
    }
    let (mut disp, mut comb, mut step) = (Vec::new(), Vec::new(), Vec::new());
    let (mut sig2w, mut l2w, mut l2c) = (Vec::new(), Vec::new(), Vec::new());
    let (mut pdr, mut ccr) = (Vec::new(), Vec::new());
    for it in 0..iters + 10 {
        if it == 10 {
            stats0 = fabric.as_ref().map(Fabric::stats);
        }
        let mut launched = Vec::with_capacity(n);
        if graphs {
            for r in 0..n {
                ev[r][0].record(&streams[r])?;
                launched.push(Instant::now());
                gr[r].launch(&streams[r])?;
                ev[r][2].record(&streams[r])?;
            }
        } else {
            for r in 0..n {
                ev[r][0].record(&streams[r])?;
                launched.push(Instant::now());
                k.dispatch_send(&streams[r], rank(r))?;
            }
            for r in 0..n {
                k.dispatch_recv(&streams[r], rank(r))?;
                ev[r][1].record(&streams[r])?;
                k.combine_send(&streams[r], rank(r))?;
            }
            for r in 0..n {
                k.combine_recv(&streams[r], rank(r))?;
                ev[r][2].record(&streams[r])?;
            }
        }
        for s in &streams {
            s.synchronize()?;
        }
        if !group.healthy() {
            let states: Vec<String> = (0..n)
                .map(|r| format!("rank {r}: {}", rank(r).state()))
                .collect();
            let err = group.shutdown().err();
            return Err(format!(
                "iteration {it}: a proxy stopped: {err:?}\n{}",
                states.join("\n")
            )
            .into());
        }
        for r in 0..n {
            if let Err(e) = rank(r).check_kernels() {
                return Err(format!("iteration {it}: {e}").into());
            }
            let times = group.take_times(r as u32);
            if it < 10 {
                continue;
            }
            if graphs {
                step.push(f64::from(ev[r][2].elapsed_ms_since(&ev[r][0])?) * 1e3);
            } else {
                disp.push(f64::from(ev[r][1].elapsed_ms_since(&ev[r][0])?) * 1e3);
                comb.push(f64::from(ev[r][2].elapsed_ms_since(&ev[r][1])?) * 1e3);
            }
            if let Some(pt) = times.last() {
                if n > 1 {
                    sig2w.push(us(pt.first_write.duration_since(pt.counted_seen)));
                }
                l2c.push(us(pt.counted_seen.duration_since(launched[r])));
                l2w.push(us(pt.first_write.duration_since(launched[r])));
                pdr.push(us(pt.dispatch_ready.duration_since(pt.packed_seen)));
                ccr.push(us(pt.combine_ready.duration_since(pt.combine_packed_seen)));
            }
        }
    }
    let stats1 = fabric.as_ref().map(Fabric::stats);
    group.shutdown()?;
    let floor = match (&stats0, &stats1) {
        (Some(a), Some(b)) => copy_floor(gpu, a, b, iters as u64)?.to_vec(),
        _ => vec![f64::NAN; 3],
    };
    if graphs {
        let what = mode.name();
        println!(
            "| graph replay, {what}, P={p} | step (4 kernels + proxies) | {:.1} | {:.1} | {} |",
            pct(&mut step, 0.5),
            pct(&mut step, 0.99),
            step.len()
        );
        return Ok(Vec::new());
    }
    let mut v = vec![
        pct(&mut disp, 0.5),
        pct(&mut disp, 0.99),
        pct(&mut comb, 0.5),
        pct(&mut comb, 0.99),
        pct(&mut sig2w, 0.5),
        pct(&mut l2c, 0.5),
        pct(&mut l2w, 0.5),
        pct(&mut l2w, 0.99),
        pct(&mut pdr, 0.5),
        pct(&mut ccr, 0.5),
    ];
    v.extend(floor);
    Ok(v)
}

fn main() -> Res<()> {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    // 8 ranks' streams + 8 proxy streams: more hardware queues than the
    // default 8, or copies queue behind waiting kernels (see LocalGroup).
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
    let gpu = Gpu::open(0)?;
    let mut k = MoeKernels::compile(&gpu)?;
    k.timeout_ns = 20_000_000_000;
    println!(
        "# weft-moe GPU bench on {} (DeepSeek-V3 decode: 7392 B tokens, top-8/256, T=128, bf16 out 7168)",
        gpu.name()
    );
    println!(
        "kernels: gather_blocks={} sum_blocks={}",
        k.gather_blocks, k.sum_blocks
    );
    let raw = DispatchFormat::Raw;
    let fp8 = DispatchFormat::Fp8 { round_scale: false };
    kernel_only(&gpu, &k, 8, &(0..8).collect::<Vec<_>>(), iters, raw)?;
    kernel_only(&gpu, &k, 8, &(0..8).collect::<Vec<_>>(), iters, fp8)?;
    kernel_only(&gpu, &k, 64, &[0], iters, raw)?;

    let modes = Mode::chosen();
    for &mode in &modes {
        let (title, ps): (&str, &[u32]) = match mode {
            Mode::Nvlink => ("engine-driven over nvlink (EngineGroup: a TransferEngine per rank, CUDA peer memory: copies on the copy engines)", &[0, 1, 4, 8, 16, 32]),
            Mode::Loopback => ("engine-driven over the loopback fabric (no wire model, one CUDA copier under the fabric's lock)", &[0, 8, 32]),
            Mode::Local => (
                "baseline LocalGroup (proxies' own D2D copies, no engine)",
                &[0, 8, 32],
            ),
        };
        println!("\n### end to end, EP8 on one GPU, {title}\n");
        println!("| P | dispatch p50 µs | dispatch p99 | combine p50 | combine p99 | signal→first submit p50 | launch→signal seen p50 | launch→first submit p50 | launch→first submit p99 | proxy packed→dispatch_ready p50 | proxy combine_packed→combine_ready p50 | fabric WRITEs/step | MB/step | serial-copy floor µs/step |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for &p in ps {
            let v = end_to_end(&gpu, &k, p, iters, false, mode)?;
            let fl = |x: f64| {
                if x.is_nan() {
                    "–".to_string()
                } else {
                    format!("{x:.1}")
                }
            };
            println!(
                "| {p} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {} |",
                v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], fl(v[10]), fl(v[11]), fl(v[12])
            );
        }
    }
    println!("\n| mode | what | p50 µs | p99 µs | samples |\n|---|---|---|---|---|");
    for &mode in &modes {
        end_to_end(&gpu, &k, 32, iters.max(300), true, mode)?;
    }
    Ok(())
}

/// Which group an end-to-end run drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `EngineGroup` over nvlink.
    Nvlink,
    /// `EngineGroup` over the loopback fabric.
    Loopback,
    /// `LocalGroup`.
    Local,
}

impl Mode {
    /// The modes `WEFT_MOE_BENCH_MODES` names (all by default).
    fn chosen() -> Vec<Mode> {
        let all = [Mode::Nvlink, Mode::Loopback, Mode::Local];
        match std::env::var("WEFT_MOE_BENCH_MODES") {
            Ok(v) => all
                .into_iter()
                .filter(|m| v.split(',').any(|w| m.name().ends_with(w.trim())))
                .collect(),
            Err(_) => all.to_vec(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Nvlink => "engine over nvlink",
            Mode::Loopback => "engine over loopback",
            Mode::Local => "local",
        }
    }
}
