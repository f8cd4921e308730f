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
//! A trainer killed mid-update (SIGKILL while it WRITEs): its inference
//! rank's round fails typed within its deadline, the last good version
//! stays live and bit-exact, a replacement trainer process pushes the
//! failed version again and the next version goes to every rank.
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
/// The inference ranks' deadline in the killed-trainer case: the bound
/// the survivors learn of the death within.
const KILL_WAIT: Duration = Duration::from_secs(3);

fn wait_of(c: usize) -> Duration {
    if c == 3 {
        KILL_WAIT
    } else {
        WAIT
    }
}

/// The trainer shards' seed of version `v`.
fn seed(v: u64) -> u64 {
    100 + v
}
/// Versions pushed per case (the ~1 GB case: `WEFT_RL_XPROC_STEPS`, at
/// least 3). The first use of each of an inference rank's two buffers
/// pays its IPC import: versions 0 and 1 are left out of the summary.
fn steps(c: usize) -> u64 {
    let env = std::env::var("WEFT_RL_XPROC_STEPS").ok();
    match (c, env.and_then(|v| v.parse::<u64>().ok())) {
        (2, Some(n)) => n.max(3),
        _ => 3,
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
/// Case 3 is case 0's model for the killed trainer.
fn case(c: usize) -> Option<(ModelLayout, Plan, bool)> {
    let (m, pp, exact) = match c {
        0 | 3 => (models::TINY_MOE, 1, true),
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

/// The check line of `got`, inference rank `r`'s bytes of version `v`:
/// `ok <bytes checked>` against the host reference, or `hash <h>`.
fn check_line(ml: &ModelLayout, p: &Plan, exact: bool, r: u32, v: u64, got: &[u8]) -> String {
    if exact {
        let want = crate::common::reference_region(ml, p, r as usize, seed(v));
        let checked = crate::common::check_region(got, &want, &format!("inference {r} v{v}"));
        format!("ok {checked}")
    } else {
        format!("hash {:016x}", hash_ranges(p, r as usize, got))
    }
}

/// The children: `inference/<case>/<rank>` or `trainer/<case>/<rank>`,
/// each serving the parent's commands until `quit`.
#[test]
fn rl_gpu_rank_entry() {
    let Some(role) = child::role() else { return };
    let f: Vec<&str> = role.split('/').collect();
    let (c, r): (usize, u32) = (f[1].parse().unwrap(), f[2].parse().unwrap());
    let (ml, p, exact) = case(c).expect("case");
    let p = Arc::new(p);
    let gpu = Gpu::open(0).expect("GPU (the parent found one)");
    let e = engine(&gpu);
    let arg = |l: &str, cmd: &str| -> u64 {
        l.strip_prefix(cmd)
            .and_then(|x| x.trim().parse().ok())
            .unwrap_or_else(|| panic!("{role}: not a {cmd}line: {l}"))
    };
    if f[0] == "inference" {
        let inf = GpuInference::new(&gpu, &p, r, e.clone(), wait_of(c)).expect("inference rank");
        let t = inf.target().encode().expect("encode");
        child::send_line(&format!("target {}", hex(&t))).unwrap();
        loop {
            let l = recv();
            if l.starts_with("arm ") {
                let v = arg(&l, "arm ");
                let round = inf.arm(v).expect("arm");
                child::send_line("armed").unwrap();
                let t0 = Instant::now();
                match inf.wait(round) {
                    Ok(()) => {
                        let (live, got) = inf.read().expect("read").expect("live");
                        assert_eq!(live, v, "{role}: live after the round");
                        child::send_line(&check_line(&ml, &p, exact, r, v, &got)).unwrap();
                    }
                    Err(e) => {
                        let ms = t0.elapsed().as_millis();
                        child::send_line(&format!("failed {ms} {e}")).unwrap();
                    }
                }
            } else if l == "live" {
                match inf.read().expect("read") {
                    Some((v, got)) => {
                        let c = check_line(&ml, &p, exact, r, v, &got);
                        child::send_line(&format!("live {v} {c}")).unwrap();
                    }
                    None => child::send_line("live none").unwrap(),
                }
            } else if l == "recover" {
                inf.recover();
                child::send_line("recovered").unwrap();
            } else {
                assert_eq!(l, "quit", "{role}");
                break;
            }
        }
    } else {
        let tr = GpuTrainer::new(&gpu, ml.clone(), p.clone(), r, e.clone(), WAIT).expect("trainer");
        let line = recv();
        let hexed = line.strip_prefix("target ").expect("a target line");
        let target = GpuTarget::decode(&unhex(hexed)).expect("the target");
        loop {
            let l = recv();
            if l.starts_with("load ") {
                let v = arg(&l, "load ");
                for t in 0..p.trainers.len() {
                    tr.load_trainer(t, &crate::common::trainer_image(&p, t, seed(v)))
                        .expect("shards");
                }
                let t0 = Instant::now();
                tr.run_stages().expect("stages");
                child::send_line(&format!("staged {}", t0.elapsed().as_micros())).unwrap();
            } else if l.starts_with("write ") {
                let v = arg(&l, "write ");
                let t0 = Instant::now();
                let (n, bytes) = tr.write(&target, v).expect("write");
                let w = t0.elapsed();
                let image = tr.read_image().expect("image");
                let h = hash_ranges(&p, r as usize, &image);
                child::send_line(&format!("wrote {n} {bytes} {} {h:016x}", w.as_nanos())).unwrap();
            } else if l.starts_with("whole ") {
                let v = arg(&l, "whole ");
                let t0 = Instant::now();
                let whole = tr.write_whole(&target, v).expect("whole image");
                let wh = t0.elapsed();
                child::send_line(&format!("whole {whole} {}", wh.as_nanos())).unwrap();
            } else {
                assert_eq!(l, "quit", "{role}");
                break;
            }
        }
    }
    drop(e);
    std::process::exit(0);
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

/// A rank process: which side and its rank.
#[derive(Clone, Copy, Debug)]
enum Who {
    Inf(usize),
    Tr(usize),
}

/// One inference rank's rates of one version: the update's GB/s and the
/// whole image's.
type Rates = (f64, f64);

/// The processes of case `c`: an inference process and a trainer process
/// per inference rank.
struct Ranks {
    c: usize,
    exact: bool,
    infs: Vec<ChildProcess>,
    trs: Vec<ChildProcess>,
    /// Each inference rank's target line (for replacement trainers).
    targets: Vec<String>,
}

impl Ranks {
    fn spawn(c: usize) -> Ranks {
        let (_, p, exact) = case(c).expect("case");
        let n = p.inference.len();
        let spawn = |role: String| spawn_role(ENTRY, &role, &[]).expect("spawn");
        let infs = (0..n)
            .map(|r| spawn(format!("inference/{c}/{r}")))
            .collect();
        let trs = (0..n).map(|r| spawn(format!("trainer/{c}/{r}"))).collect();
        let mut k = Ranks {
            c,
            exact,
            infs,
            trs,
            targets: Vec::new(),
        };
        for r in 0..n {
            let l = k.line(Who::Inf(r), "target");
            k.send(Who::Tr(r), &l);
            k.targets.push(l);
        }
        k
    }

    fn child(&mut self, w: Who) -> &mut ChildProcess {
        match w {
            Who::Inf(r) => &mut self.infs[r],
            Who::Tr(r) => &mut self.trs[r],
        }
    }

    fn send(&mut self, w: Who, l: &str) {
        self.child(w).send_line(l).expect("a child's stdin");
    }

    /// `w`'s next line; without one, every child's state in the panic.
    fn line(&mut self, w: Who, what: &str) -> String {
        match self.child(w).recv_line_timeout(Duration::from_secs(300)) {
            Ok(Some(l)) => l,
            other => {
                let mut states = Vec::new();
                for (k, c) in self.infs.iter_mut().chain(&mut self.trs).enumerate() {
                    states.push(format!("child {k} (pid {}): {:?}", c.id(), c.try_wait()));
                }
                for c in self.infs.iter_mut().chain(&mut self.trs) {
                    let _ = c.kill();
                }
                panic!(
                    "case {}: no {what} line from {w:?}: {other:?}; {states:?}",
                    self.c
                );
            }
        }
    }

    /// Checks `w`'s check line of a completed round.
    fn expect_ok(&mut self, r: usize, v: u64, want_hash: &str) {
        let got = self.line(Who::Inf(r), "check");
        if self.exact {
            assert!(got.starts_with("ok "), "inference {r} v{v}: {got}");
        } else {
            assert_eq!(got, format!("hash {want_hash}"), "inference {r} v{v}");
        }
    }

    /// Pushes version `v` to inference ranks `ranks` (their trainers
    /// staged it: [`Ranks::load`]), checks it there and times the whole
    /// image into the same buffers; returns each rank's rates.
    fn push(&mut self, v: u64, ranks: &[usize]) -> Vec<Rates> {
        for &r in ranks {
            self.send(Who::Inf(r), &format!("arm {v}"));
            assert_eq!(self.line(Who::Inf(r), "armed"), "armed");
        }
        let wrote = self.ask_trainers(ranks, &format!("write {v}"), "wrote");
        let wholes = self.ask_trainers(ranks, &format!("whole {v}"), "whole");
        let mut rates = Vec::new();
        for ((&r, w), wh) in ranks.iter().zip(&wrote).zip(&wholes) {
            let x: Vec<&str> = w.split_whitespace().collect();
            let y: Vec<&str> = wh.split_whitespace().collect();
            assert_eq!((x[0], y[0]), ("wrote", "whole"), "{w} / {wh}");
            let n = |s: &str| s.parse::<u64>().unwrap();
            let (wrs, bytes, ns, whole, wns) = (n(x[1]), n(x[2]), n(x[3]), n(y[1]), n(y[2]));
            self.expect_ok(r, v, x[4]);
            let gbs = |b: u64, ns: u64| b as f64 / ns.max(1) as f64;
            println!(
                "case {} version {v} inference {r}: {wrs} WRITEs, {bytes} B: {:.2} GB/s; \
                 the whole image ({whole} B) in one WRITE: {:.2} GB/s; ratio {:.2}",
                self.c,
                gbs(bytes, ns),
                gbs(whole, wns),
                gbs(bytes, ns) / gbs(whole, wns)
            );
            rates.push((gbs(bytes, ns), gbs(whole, wns)));
        }
        rates
    }

    /// Sends `cmd` to the trainers of `ranks` (all at once), then reads
    /// each one's `what` line.
    fn ask_trainers(&mut self, ranks: &[usize], cmd: &str, what: &str) -> Vec<String> {
        for &r in ranks {
            self.send(Who::Tr(r), cmd);
        }
        ranks.iter().map(|&r| self.line(Who::Tr(r), what)).collect()
    }

    /// The trainers of `ranks` stage version `v`.
    fn load(&mut self, v: u64, ranks: &[usize]) {
        for l in self.ask_trainers(ranks, &format!("load {v}"), "staged") {
            assert!(l.starts_with("staged "), "{l}");
        }
    }

    fn quit(mut self) {
        for k in self.infs.iter_mut().chain(self.trs.iter_mut()) {
            k.send_line("quit").unwrap();
        }
        for (r, k) in self.infs.iter_mut().chain(&mut self.trs).enumerate() {
            assert!(k.wait().expect("wait").success(), "child {r} exit status");
        }
    }
}

/// Runs case `c`: every version to every inference rank; prints each
/// version's rates and their spread.
fn run(c: usize) {
    let mut k = Ranks::spawn(c);
    let all: Vec<usize> = (0..k.infs.len()).collect();
    let mut rates = Vec::new();
    for v in 0..steps(c) {
        k.load(v, &all);
        let r = k.push(v, &all);
        if v > 1 {
            rates.extend(r);
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
        steps(c) - 1,
        mmm(rates.iter().map(|r| r.0).collect()),
        mmm(rates.iter().map(|r| r.1).collect()),
        mmm(rates.iter().map(|r| r.0 / r.1).collect())
    );
    k.quit();
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

/// Trainer 1 SIGKILLed during the round of version 2 (before it is told to
/// write, then 0 and 500 µs after, so the kill lands before, during or
/// after its WRITEs): inference rank 1 either completed version 2 or its round
/// failed typed within its deadline with version 1 still live and
/// bit-exact; a replacement trainer process then pushes version 2 again
/// (to rank 1 only) and version 3 goes to both ranks.
#[test]
fn gpu_xproc_rl_trainer_killed_mid_update() {
    if !have_gpu("gpu_xproc_rl_trainer_killed_mid_update") {
        return;
    }
    let mut failed_rounds = 0;
    // `None`: killed after the rounds are armed, before it is told to
    // write (the round fails for certain); else µs after "write".
    for (attempt, delay_us) in [None, Some(0u64), Some(500)].into_iter().enumerate() {
        let mut k = Ranks::spawn(3);
        assert_eq!(k.infs.len(), 2, "the case has two inference ranks");
        let all = [0, 1];
        for v in 0..2 {
            k.load(v, &all);
            k.push(v, &all);
        }
        k.load(2, &all);
        for r in all {
            k.send(Who::Inf(r), "arm 2");
            assert_eq!(k.line(Who::Inf(r), "armed"), "armed");
        }
        k.send(Who::Tr(0), "write 2");
        if let Some(d) = delay_us {
            k.send(Who::Tr(1), "write 2");
            std::thread::sleep(Duration::from_micros(d));
        }
        let status = k.trs[1].kill().expect("kill trainer 1");
        let w = k.line(Who::Tr(0), "wrote");
        assert!(w.starts_with("wrote "), "{w}");
        k.expect_ok(0, 2, "");
        let got = k.line(Who::Inf(1), "round");
        let redo = if let Some(rest) = got.strip_prefix("failed ") {
            failed_rounds += 1;
            let ms: u64 = rest.split_whitespace().next().unwrap().parse().unwrap();
            let bound = KILL_WAIT.as_millis() as u64 + 2000;
            assert!(
                ms <= bound,
                "attempt {attempt}: failed after {ms} ms (> {bound})"
            );
            assert!(
                rest.contains("no completion within"),
                "attempt {attempt}: not the typed deadline: {rest}"
            );
            k.send(Who::Inf(1), "live");
            let live = k.line(Who::Inf(1), "live");
            assert!(live.starts_with("live 1 ok "), "attempt {attempt}: {live}");
            true
        } else {
            assert!(got.starts_with("ok "), "attempt {attempt}: {got}");
            false
        };
        println!(
            "attempt {attempt}: trainer 1 killed {} ({status:?}); inference 1: {}",
            match delay_us {
                None => "before writing version 2".to_string(),
                Some(d) => format!("{d} µs into writing version 2"),
            },
            if redo {
                "round failed, version 1 live"
            } else {
                "version 2 had landed"
            }
        );
        k.trs[1] = spawn_role(ENTRY, "trainer/3/1", &[]).expect("replacement trainer");
        let t = k.targets[1].clone();
        k.send(Who::Tr(1), &t);
        if redo {
            k.send(Who::Inf(1), "recover");
            assert_eq!(k.line(Who::Inf(1), "recovered"), "recovered");
            k.load(2, &[1]);
            k.push(2, &[1]);
        }
        k.load(3, &all);
        k.push(3, &all);
        k.quit();
    }
    println!("{failed_rounds} of 3 kills failed inference 1's round");
    assert!(failed_rounds > 0, "no kill failed a round");
}
