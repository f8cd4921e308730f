//! The GPU path with a process per rank: every inference rank is a child
//! process (this test binary re-executed by `weft_testkit::child`) owning
//! its weights in device memory (`GpuInference`, its own engine), and for
//! each inference rank a trainer process runs the unshard / fuse / fp8
//! kernels on GPU 0 and WRITEs the result into that rank's memory
//! (`GpuTrainer`, its own engine) over the same-host backend `nvlink`
//! (CUDA IPC imports, copies on the copy engines). The inference side
//! checks every byte of two versions against the host reference (tiny MoE
//! and MLA models) or, for a model of ~1 GB, against a hash of the
//! trainer's image; the trainers then also time one WRITE of their whole
//! image over the same engines, all at once as their updates were (the
//! cross-process copy bound of the same run), and the parent prints both
//! rates.
//!
//! A trainer process here holds every trainer region of the plan (as
//! `GpuTrainer` does): the unshard reads real, uneven shards, but the
//! gathers between training ranks are not part of it.
//!
//! Skips without a GPU (prints `SKIP`), fails instead under
//! `WEFT_REQUIRE_GPU=1` (or `WEFT_CUDA_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::{DomainGroupSpec, EngineConfig, ProviderConfig, TransferEngine};
use weft_cuda::Gpu;
use weft_rl::cuda::{GpuInference, GpuTarget, GpuTrainer};
use weft_rl::meta::ModelLayout;
use weft_rl::models::{self, Attn, ModelConfig};
use weft_rl::{plan, Plan, PlanConfig};
use weft_testkit::child::{self, spawn_role, ChildProcess};

const ENTRY: &str = "rl_gpu_rank_entry";
/// Deadline of each wait of a step (a WRITE round, the whole image).
const WAIT: Duration = Duration::from_secs(60);
/// Versions pushed per case (the ~1 GB case: `WEFT_RL_XPROC_STEPS`, at
/// least 2; the first version pays the IPC imports and is left out of the
/// summary).
fn steps(c: usize) -> u64 {
    let env = std::env::var("WEFT_RL_XPROC_STEPS").ok();
    match (c, env.and_then(|v| v.parse::<u64>().ok())) {
        (2, Some(n)) => n.max(2),
        _ => 2,
    }
}

fn required() -> bool {
    ["WEFT_REQUIRE_GPU", "WEFT_CUDA_REQUIRE_GPU"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|v| v == "1"))
}

/// A model of about 1 GB of bf16 (16 experts, hidden 2048): large enough
/// that a rate means something, small enough for the host to make its
/// shards.
const BENCH: ModelConfig = ModelConfig {
    name: Cow::Borrowed("xproc-bench"),
    source: Cow::Borrowed("weft test model (not published)"),
    layers: 4,
    hidden: 2048,
    attn: Attn::Gqa {
        heads: 16,
        kv_heads: 4,
        head_dim: 128,
    },
    dense_layers: 1,
    dense_inter: 8192,
    experts: 16,
    shared_experts: 1,
    moe_inter: 1024,
    vocab: 32768,
    ..models::TINY_MOE
};

/// Case `c`: the layout, its plan, and whether the inference side checks
/// against the host reference (else against the trainer image's hash).
fn case(c: usize) -> Option<(ModelLayout, Plan, bool)> {
    let (m, pp, exact) = match c {
        0 => (models::TINY_MOE, 1, true),
        1 => (models::TINY_MLA, 2, true),
        2 => (BENCH, 1, false),
        _ => return None,
    };
    let (t, i) = crate::common::tiny_gpu_layouts(pp);
    let ml = models::build(&m, t, i).expect("layout");
    let p = plan(&ml, &PlanConfig::default()).expect("plan");
    Some((ml, p, exact))
}

/// This child's engine: one NIC of the same-host backend on GPU 0.
fn engine(gpu: &Gpu) -> Arc<TransferEngine> {
    let pm = gpu.peer_memory().expect("peer memory");
    let cfg = ProviderConfig::default()
        .with_nvlink(weft::NvlinkOptions::default().with_peer_memory(Arc::new(pm)));
    let b = weft::provider_with(&weft::ProviderSpec::Nvlink, &cfg).expect("nvlink");
    let mut ec = EngineConfig::default();
    ec.idle_sleep = Some(Duration::from_micros(50));
    let e = TransferEngine::builder()
        .group(DomainGroupSpec::new(b.host().expect("host"), vec![0]).device(gpu.device()))
        .config(ec)
        .build()
        .expect("engine");
    Arc::new(e)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// FNV-1a over the bytes an update writes into inference rank `rank`.
fn hash_ranges(p: &Plan, rank: usize, region: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for slot in &p.inference[rank].tensors {
        for (off, len) in std::iter::once(slot.data).chain(slot.scales) {
            for &b in &region[off as usize..(off + len) as usize] {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    h
}

fn recv() -> String {
    child::recv_line()
        .expect("parent pipe")
        .expect("a line from the parent")
}

/// The children: `inference/<case>/<rank>` or `trainer/<case>/<rank>`.
#[test]
fn rl_gpu_rank_entry() {
    let Some(role) = child::role() else { return };
    let f: Vec<&str> = role.split('/').collect();
    let (c, r): (usize, u32) = (f[1].parse().unwrap(), f[2].parse().unwrap());
    let (ml, p, exact) = case(c).expect("case");
    let p = Arc::new(p);
    let gpu = Gpu::open(0).expect("GPU (the parent found one)");
    let e = engine(&gpu);
    if f[0] == "inference" {
        let inf = GpuInference::new(&gpu, &p, r, e.clone(), WAIT).expect("inference rank");
        let t = inf.target().encode().expect("encode");
        child::send_line(&format!("target {}", hex(&t))).unwrap();
        for step in 0..steps(c) {
            assert_eq!(recv(), "arm");
            let round = inf.arm().expect("arm");
            child::send_line("armed").unwrap();
            inf.wait(round).expect("the update's WRITEs");
            let got = inf.read().expect("read");
            if exact {
                let want = crate::common::reference_region(&ml, &p, r as usize, 100 + step);
                let what = format!("inference {r} step {step}");
                let checked = crate::common::check_region(&got, &want, &what);
                child::send_line(&format!("ok {checked}")).unwrap();
            } else {
                let h = hash_ranges(&p, r as usize, &got);
                child::send_line(&format!("hash {h:016x}")).unwrap();
            }
        }
    } else {
        let tr = GpuTrainer::new(&gpu, ml.clone(), p.clone(), r, e.clone(), WAIT).expect("trainer");
        let line = recv();
        let hexed = line.strip_prefix("target ").expect("a target line");
        let target = GpuTarget::decode(&unhex(hexed)).expect("the target");
        for step in 0..steps(c) {
            for t in 0..p.trainers.len() {
                tr.load_trainer(t, &crate::common::trainer_image(&p, t, 100 + step))
                    .expect("shards");
            }
            let t0 = Instant::now();
            tr.run_stages().expect("stages");
            let stages = t0.elapsed();
            child::send_line(&format!("staged {}", stages.as_micros())).unwrap();
            assert_eq!(recv(), "write");
            let t0 = Instant::now();
            let (n, bytes) = tr.write(&target).expect("write");
            let w = t0.elapsed();
            let image = tr.read_image().expect("image");
            let h = hash_ranges(&p, r as usize, &image);
            child::send_line(&format!("wrote {n} {bytes} {} {h:016x}", w.as_nanos())).unwrap();
            // The bound, timed as the update was: every trainer at once.
            assert_eq!(recv(), "whole");
            let t0 = Instant::now();
            let whole = tr.write_whole(&target).expect("whole image");
            let wh = t0.elapsed();
            child::send_line(&format!("whole {whole} {}", wh.as_nanos())).unwrap();
        }
    }
    assert_eq!(recv(), "quit");
    drop(e);
    std::process::exit(0);
}

fn expect(c: &mut ChildProcess, what: &str) -> String {
    match c.recv_line_timeout(Duration::from_secs(300)) {
        Ok(Some(l)) => l,
        other => {
            let _ = c.kill();
            panic!("no {what} line: {other:?}");
        }
    }
}

fn have_gpu(test: &str) -> bool {
    match Gpu::open(0) {
        Ok(_) => true,
        Err(e) if !required() => {
            eprintln!("SKIP {test}: no usable CUDA GPU: {e}");
            false
        }
        Err(e) => panic!("{test}: WEFT_REQUIRE_GPU=1 but no usable GPU: {e}"),
    }
}

/// Runs case `c`: an inference process and a trainer process per
/// inference rank; prints each step's rates.
fn run(c: usize) {
    let (_, p, exact) = case(c).expect("case");
    let n = p.inference.len();
    let spawn = |role: String| spawn_role(ENTRY, &role, &[]).expect("spawn");
    let mut infs: Vec<ChildProcess> = (0..n)
        .map(|r| spawn(format!("inference/{c}/{r}")))
        .collect();
    let mut trs: Vec<ChildProcess> = (0..n).map(|r| spawn(format!("trainer/{c}/{r}"))).collect();
    for (i, t) in infs.iter_mut().zip(&mut trs) {
        let l = expect(i, "target");
        t.send_line(&l).unwrap();
    }
    let mut rates = Vec::new();
    for step in 0..steps(c) {
        for t in &mut trs {
            let l = expect(t, "staged");
            assert!(l.starts_with("staged "), "{l}");
        }
        for i in &mut infs {
            i.send_line("arm").unwrap();
            assert_eq!(expect(i, "armed"), "armed");
        }
        for t in &mut trs {
            t.send_line("write").unwrap();
        }
        let wrote: Vec<String> = trs.iter_mut().map(|t| expect(t, "wrote")).collect();
        for t in &mut trs {
            t.send_line("whole").unwrap();
        }
        let wholes: Vec<String> = trs.iter_mut().map(|t| expect(t, "whole")).collect();
        for (r, ((w, wh), i)) in wrote.iter().zip(&wholes).zip(&mut infs).enumerate() {
            let v: Vec<&str> = w.split_whitespace().collect();
            let x: Vec<&str> = wh.split_whitespace().collect();
            assert_eq!((v[0], x[0]), ("wrote", "whole"), "{w} / {wh}");
            let (wrs, bytes, ns, whole, wns) = (
                v[1].parse::<u64>().unwrap(),
                v[2].parse::<u64>().unwrap(),
                v[3].parse::<u64>().unwrap(),
                x[1].parse::<u64>().unwrap(),
                x[2].parse::<u64>().unwrap(),
            );
            let got = expect(i, "check");
            if exact {
                assert!(got.starts_with("ok "), "inference {r} step {step}: {got}");
            } else {
                assert_eq!(got, format!("hash {}", v[4]), "inference {r} step {step}");
            }
            let gbs = |b: u64, ns: u64| b as f64 / ns.max(1) as f64;
            if step > 0 {
                rates.push((gbs(bytes, ns), gbs(whole, wns)));
            }
            println!(
                "case {c} step {step} inference {r}: {wrs} WRITEs, {bytes} B: {:.2} GB/s; \
                 the whole image ({whole} B) in one WRITE: {:.2} GB/s; ratio {:.2}",
                gbs(bytes, ns),
                gbs(whole, wns),
                gbs(bytes, ns) / gbs(whole, wns)
            );
        }
    }
    let mmm = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        format!(
            "{:.1} / {:.1} / {:.1}",
            v[0],
            v[v.len() / 2],
            v[v.len() - 1]
        )
    };
    println!(
        "case {c}, versions 2..{}, every inference rank, min / median / max: update {} GB/s, \
         whole image {} GB/s, ratio {}",
        steps(c),
        mmm(rates.iter().map(|r| r.0).collect()),
        mmm(rates.iter().map(|r| r.1).collect()),
        mmm(rates.iter().map(|r| r.0 / r.1).collect())
    );
    for k in infs.iter_mut().chain(trs.iter_mut()) {
        k.send_line("quit").unwrap();
    }
    for (r, mut k) in infs.into_iter().chain(trs).enumerate() {
        assert!(k.wait().expect("wait").success(), "child {r} exit status");
    }
}

#[test]
fn gpu_xproc_rl_tiny_models_bit_exact() {
    if !have_gpu("gpu_xproc_rl_tiny_models_bit_exact") {
        return;
    }
    run(0);
    run(1);
}

#[test]
fn gpu_xproc_rl_one_gigabyte_model() {
    if !have_gpu("gpu_xproc_rl_one_gigabyte_model") {
        return;
    }
    run(2);
}
