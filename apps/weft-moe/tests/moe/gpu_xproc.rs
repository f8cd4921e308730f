//! The GPU path with one process per rank, as serving stacks run it:
//! every rank is a child process (this test binary re-executed by
//! `weft_testkit::child::spawn_role`) on GPU 0 with its own
//! `TransferEngine`, its own `EngineRank` (buffers, proxy thread) and its
//! own stream. Ranks find each other through a `dir:` rendezvous store
//! (`MoeRendezvous`); WRITEs cross the process boundary over the same-host
//! backend `nvlink` (CUDA IPC imports of the peers' buffers, copies on the
//! copy engines) or over libfabric `shm` with FI_HMEM. Each child generates
//! every rank's inputs from the case's seed, runs its own kernels and checks
//! its expert tokens and combined tokens byte for byte against the naive
//! reference.
//!
//! Cases: random routings at EP 2/4/8 (EP8: 20 seeds), every edge-case
//! routing, both output types, the DeepSeek-V3 decode shape, graph replay;
//! and a rank killed in the middle of a step (the survivors must report
//! typed errors within a bound, and neither hang nor crash).
//!
//! Skips without a GPU (prints `SKIP`; fails under
//! `WEFT_CUDA_REQUIRE_GPU=1`). The `shm` case needs a libfabric built with
//! CUDA (`WEFT_LIBFABRIC_PATH`); with one that refuses GPU memory it skips
//! unless `WEFT_REQUIRE_CUDA_LIBFABRIC=1`.
#![cfg(feature = "cuda")]

use crate::common::{expert_outputs, inputs, routings, Routing};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::rendezvous::{self, Session};
use weft::{DomainGroupSpec, EngineConfig, LibfabricOptions, ProviderConfig, TransferEngine};
use weft_cuda::{Gpu, Stream};
use weft_moe::cuda::{EngineRank, GpuError, MoeKernels};
use weft_moe::{reference, Dims, MoeConfig, MoeError, MoeRendezvous, OutDtype, RankInput};
use weft_testkit::child::{self, spawn_role, ChildProcess};

const ENTRY: &str = "moe_gpu_rank_entry";
/// The children's rendezvous store (`dir:` spec).
const RDV_ENV: &str = "WEFT_MOE_GPU_TEST_RDV";
/// How long a proxy and a receive kernel wait before giving up.
const WAIT: Duration = Duration::from_secs(4);
/// Bound on how long survivors take to report a dead rank.
const DEATH_BOUND: Duration = Duration::from_secs(30);

fn required(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| v == "1")
}

/// One run of a group: shape, routings, steps, seed.
#[derive(Debug, Clone)]
struct Case {
    dims: Dims,
    routings: Vec<Routing>,
    steps: u64,
    seed: u64,
    graphs: bool,
    /// Rank killed (by the parent) after launching this step's send.
    kill: Option<(u32, u64)>,
}

#[allow(clippy::too_many_arguments)]
fn dims(n: u32, l: u32, r: u32, t: u32, p: u32, tb: u32, h: u32, dt: OutDtype) -> Dims {
    let mut c = MoeConfig::new(n, n * l, r, t, tb, h);
    c.private_tokens = Some(p);
    c.out_dtype = dt;
    c.validate().expect("valid config")
}

/// The cases, by index (parent and children build the same table).
fn case(i: usize) -> Option<Case> {
    let plain = |dims: Dims, steps, seed| Case {
        routings: vec![Routing::Random],
        dims,
        steps,
        seed,
        graphs: false,
        kill: None,
    };
    let edge = |dims: Dims, seed| Case {
        routings: routings(&dims),
        ..plain(dims, 2, seed)
    };
    Some(match i {
        0 => plain(dims(2, 4, 4, 24, 3, 64, 40, OutDtype::Bf16), 3, 1),
        1 => plain(dims(4, 4, 4, 24, 3, 64, 40, OutDtype::F32), 3, 2),
        2 => plain(dims(8, 4, 4, 24, 3, 64, 40, OutDtype::Bf16), 20, 3),
        3 => edge(dims(4, 2, 4, 16, 0, 48, 40, OutDtype::Bf16), 4),
        4 => edge(dims(4, 2, 4, 16, 16, 48, 36, OutDtype::F32), 5),
        5 => edge(dims(8, 2, 4, 16, 2, 100, 36, OutDtype::Bf16), 6),
        // DeepSeek-V3 decode: 7168 fp8 + 56 f32 scales, top-8 of 256, T 128.
        6 => plain(
            dims(8, 32, 8, 128, 32, 7168 + 56 * 4, 7168, OutDtype::Bf16),
            2,
            7,
        ),
        7 => Case {
            graphs: true,
            routings: vec![Routing::Random, Routing::Skewed],
            ..plain(dims(4, 4, 8, 32, 4, 64, 40, OutDtype::Bf16), 3, 8)
        },
        8 => Case {
            kill: Some((2, 2)),
            ..plain(dims(4, 4, 4, 24, 3, 64, 40, OutDtype::Bf16), 4, 9)
        },
        _ => return None,
    })
}

/// The engine of a child on `prov` (`nvlink` or `libfabric:shm`), one NIC
/// on GPU 0; `Err` says why the provider cannot serve GPU memory.
fn engine(gpu: &Gpu, prov: &str) -> Result<Arc<TransferEngine>, String> {
    let mut cfg = ProviderConfig::default();
    if prov == "nvlink" {
        let pm = gpu.peer_memory().map_err(|e| format!("peer memory: {e}"))?;
        cfg = cfg.with_nvlink(weft::NvlinkOptions::default().with_peer_memory(Arc::new(pm)));
    } else {
        cfg = cfg.with_libfabric(
            LibfabricOptions::same_machine("shm")
                .with_hmem(true)
                .with_hmem_ipc(true)
                .with_connect_timeout(Duration::from_secs(10)),
        );
    }
    let spec = prov.parse().map_err(|e| format!("{e}"))?;
    let b = weft::provider_with(&spec, &cfg).map_err(|e| e.to_string())?;
    let mut ec = EngineConfig::default();
    ec.idle_sleep = Some(Duration::from_micros(50));
    let e = TransferEngine::builder()
        .group(
            DomainGroupSpec::new(b.host().map_err(|e| e.to_string())?, vec![0])
                .device(gpu.device()),
        )
        .config(ec)
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Arc::new(e))
}

/// A child's kernels on its stream: direct launches or replayed graphs.
struct Launcher {
    k: MoeKernels,
    stream: Stream,
    graphs: Option<(weft_cuda::Graph, weft_cuda::Graph)>,
}

impl Launcher {
    fn dispatch_send(&self, rank: &EngineRank) -> Result<(), GpuError> {
        match &self.graphs {
            Some((d, _)) => d.launch(&self.stream).map_err(cu),
            None => self.k.dispatch_send(&self.stream, rank.gpu_rank()),
        }
    }

    fn dispatch_recv(&self, rank: &EngineRank) -> Result<(), GpuError> {
        match &self.graphs {
            Some(_) => Ok(()),
            None => self.k.dispatch_recv(&self.stream, rank.gpu_rank()),
        }
    }

    fn combine(&self, rank: &EngineRank) -> Result<(), GpuError> {
        match &self.graphs {
            Some((_, c)) => c.launch(&self.stream).map_err(cu),
            None => {
                self.k.combine_send(&self.stream, rank.gpu_rank())?;
                self.k.combine_recv(&self.stream, rank.gpu_rank())
            }
        }
    }

    /// Waits for the stream, then for the receive kernels' verdict.
    fn sync(&self, rank: &EngineRank) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(cu)?;
        rank.gpu_rank().check_kernels()
    }
}

fn cu(e: weft_cuda::CudaError) -> GpuError {
    GpuError::Cuda {
        rank: None,
        phase: weft_moe::Phase::Setup,
        source: e,
    }
}

/// One step of this rank; `Err` names what failed.
fn step(
    l: &Launcher,
    rank: &EngineRank,
    d: &Dims,
    views: &[RankInput<'_>],
    r: u32,
    victim: bool,
) -> Result<(), String> {
    let gr = rank.gpu_rank();
    let t = gr
        .set_inputs(&views[r as usize])
        .map_err(|e| format!("inputs: {e}"))?;
    l.dispatch_send(rank)
        .map_err(|e| format!("dispatch send: {e}"))?;
    if victim {
        child::send_line("launched").map_err(|e| e.to_string())?;
        // The parent kills this process now.
        std::thread::sleep(Duration::from_secs(600));
    }
    l.dispatch_recv(rank)
        .map_err(|e| format!("dispatch recv: {e}"))?;
    l.sync(rank).map_err(|e| format!("dispatch: {e:?}"))?;
    let want = reference::dispatch(d, views).map_err(|e| e.to_string())?;
    let got = gr.read_expert_tokens().map_err(|e| e.to_string())?;
    if got != want[r as usize] {
        return Err("expert tokens differ from the reference".into());
    }
    let outs: Vec<Vec<u8>> = want
        .iter()
        .enumerate()
        .map(|(x, w)| expert_outputs(d, x as u32, w))
        .collect();
    gr.set_expert_outputs(&outs[r as usize])
        .map_err(|e| e.to_string())?;
    // The weights come again with the combine, different from dispatch's
    // (DeepEP's order).
    let late: Vec<Vec<f32>> = views
        .iter()
        .map(|v| v.topk_weights.iter().map(|w| 0.5 - w).collect())
        .collect();
    let views2: Vec<RankInput<'_>> = views
        .iter()
        .zip(&late)
        .map(|(v, w)| RankInput {
            topk_weights: w,
            ..*v
        })
        .collect();
    gr.set_weights(&late[r as usize])
        .map_err(|e| e.to_string())?;
    l.combine(rank)
        .map_err(|e| format!("combine launch: {e}"))?;
    l.sync(rank).map_err(|e| format!("combine: {e:?}"))?;
    let want = reference::combine(d, &views2, &outs).map_err(|e| e.to_string())?;
    let got = gr.read_combined(t).map_err(|e| e.to_string())?;
    if got != want[r as usize] {
        return Err("combined tokens differ from the reference".into());
    }
    Ok(())
}

/// Whether `e` is what a survivor of a dead peer may see from its proxy:
/// a round or submit that timed out, a failed engine call, a signal wait.
fn peer_loss(e: &GpuError) -> bool {
    matches!(
        e,
        GpuError::Moe(
            MoeError::Timeout { .. } | MoeError::SubmitTimeout { .. } | MoeError::Engine { .. }
        ) | GpuError::Timeout { .. }
    )
}

/// The child: role `case/rank/provider`.
#[test]
fn moe_gpu_rank_entry() {
    let Some(role) = child::role() else { return };
    let f: Vec<&str> = role.split('/').collect();
    let (ci, r, prov): (usize, u32, &str) = (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2]);
    let c = case(ci).expect("case");
    let d = &c.dims;
    if std::env::var_os("RUST_LOG").is_some() {
        // Logs of the engine and the proxy on this child's stderr.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let gpu = Gpu::open(0).expect("GPU (the parent found one)");
    let e = match engine(&gpu, prov) {
        Ok(e) => e,
        Err(why) => {
            child::send_line(&format!("skip {why}")).unwrap();
            return;
        }
    };
    let mut rank = match EngineRank::new(&gpu, d, r, e.clone(), WAIT) {
        Ok(rk) => rk,
        Err(why) => {
            // libfabric without CUDA refuses the registration.
            child::send_line(&format!("skip {why}")).unwrap();
            return;
        }
    };
    let mut k = MoeKernels::compile(&gpu).expect("kernels");
    k.timeout_ns = WAIT.as_nanos() as u64;
    let stream = gpu.stream().expect("stream");
    let graphs = c.graphs.then(|| {
        stream.begin_capture().unwrap();
        k.dispatch_send(&stream, rank.gpu_rank()).unwrap();
        k.dispatch_recv(&stream, rank.gpu_rank()).unwrap();
        let gd = stream.end_capture().unwrap();
        stream.begin_capture().unwrap();
        k.combine_send(&stream, rank.gpu_rank()).unwrap();
        k.combine_recv(&stream, rank.gpu_rank()).unwrap();
        (gd, stream.end_capture().unwrap())
    });
    let l = Launcher { k, stream, graphs };
    let spec = std::env::var(RDV_ENV).expect("store spec");
    let store = rendezvous::open(&spec.parse().expect("spec")).expect("store");
    let session = Session::new(store.clone(), Duration::from_secs(10)).expect("session");
    let rdv = MoeRendezvous::new(store, &format!("gpu-case{ci}"));
    rdv.publish(&session, rank.info()).expect("publish");
    let all = rdv
        .gather(d.ranks, Duration::from_secs(120))
        .expect("gather");
    rank.connect(&all).expect("connect");
    child::send_line("connected").unwrap();
    let mut i = 0u64;
    for &rt in &c.routings {
        for s in 0..c.steps {
            let seed = c.seed * 1000 + i;
            let ins = inputs(d, rt, seed, s % 2 == 1);
            let views: Vec<RankInput<'_>> = ins.iter().map(|o| o.input()).collect();
            let victim = c.kill == Some((r, s));
            let start = Instant::now();
            if let Err(what) = step(&l, &rank, d, &views, r, victim) {
                if c.kill.is_none() {
                    // What the proxy saw says which round stalled.
                    let proxy = rank.shutdown().err();
                    panic!(
                        "rank {r} step {i} ({rt:?}, seed {seed}, {prov}): {what}; proxy: {proxy:?}"
                    );
                }
                // A survivor of the killed rank: the proxy must have
                // stopped with a typed error too.
                let waited = start.elapsed();
                // Its own wait runs out within WAIT (asking it to stop
                // earlier would end it cleanly).
                while rank.healthy() && start.elapsed() < WAIT * 3 {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let proxy = rank.shutdown().err();
                let typed = proxy.as_ref().is_some_and(peer_loss);
                child::send_line(&format!(
                    "failed {} typed={typed} after {what}; proxy: {proxy:?}",
                    waited.as_millis()
                ))
                .unwrap();
                e.shutdown();
                std::process::exit(0);
            }
            child::send_line(&format!("ok {i}")).unwrap();
            i += 1;
        }
    }
    let imms = weft_moe::ImmValues::for_instance(d.instance, e.imm_capacity()).unwrap();
    rank.shutdown().expect("shutdown");
    for v in imms.all() {
        assert_eq!(e.imm_pending(v), 0, "rank {r}: immediates left pending");
    }
    assert_eq!(e.stats().imm_excess, 0);
    session.close().expect("leave the store");
    child::send_line("done").unwrap();
    e.shutdown();
    std::process::exit(0);
}

fn expect(c: &mut ChildProcess, what: &str, r: usize, t: Duration) -> String {
    match c.recv_line_timeout(t) {
        Ok(Some(l)) => l,
        other => {
            let _ = c.kill();
            panic!("rank {r}: no {what} line: {other:?}");
        }
    }
}

/// Opens GPU 0 in the parent, or skips.
fn have_gpu(test: &str) -> bool {
    match Gpu::open(0) {
        Ok(_) => true,
        Err(e) if !required("WEFT_CUDA_REQUIRE_GPU") => {
            eprintln!("SKIP {test}: no usable CUDA GPU: {e}");
            false
        }
        Err(e) => panic!("{test}: WEFT_CUDA_REQUIRE_GPU=1 but no usable GPU: {e}"),
    }
}

/// Runs case `ci` with one child per rank on `prov`; returns false when
/// the provider cannot serve GPU memory here (and that is allowed).
fn cluster(ci: usize, prov: &str) -> bool {
    let c = case(ci).expect("case");
    let n = c.dims.ranks;
    let dir = std::env::temp_dir().join(format!("weft-moe-gpu-{}-{ci}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("store dir");
    let spec = format!("dir:{}", dir.display());
    let env = [(RDV_ENV, std::ffi::OsStr::new(&spec))];
    let mut kids: Vec<ChildProcess> = (0..n)
        .map(|r| spawn_role(ENTRY, &format!("{ci}/{r}/{prov}"), &env).expect("spawn"))
        .collect();
    let long = Duration::from_secs(180);
    for (r, k) in kids.iter_mut().enumerate() {
        let l = expect(k, "connected", r, long);
        if let Some(why) = l.strip_prefix("skip ") {
            assert!(
                prov == "nvlink" || !required("WEFT_REQUIRE_CUDA_LIBFABRIC"),
                "WEFT_REQUIRE_CUDA_LIBFABRIC=1 but {prov}: {why}"
            );
            assert!(prov != "nvlink", "nvlink refused: {why}");
            println!("SKIP: {prov} cannot serve GPU memory here: {why}");
            return false;
        }
        assert_eq!(l, "connected", "rank {r}");
    }
    let steps = c.steps * c.routings.len() as u64;
    if let Some((victim, at)) = c.kill {
        let v = victim as usize;
        for i in 0..at {
            for (r, k) in kids.iter_mut().enumerate() {
                assert_eq!(expect(k, "step", r, long), format!("ok {i}"), "rank {r}");
            }
        }
        assert_eq!(expect(&mut kids[v], "launched", v, long), "launched");
        kids[v].kill().expect("kill the victim");
        let killed = Instant::now();
        for (r, k) in kids.iter_mut().enumerate() {
            if r == v {
                continue;
            }
            let l = expect(k, "failed", r, DEATH_BOUND);
            let rest = l
                .strip_prefix("failed ")
                .unwrap_or_else(|| panic!("rank {r}: {l}"));
            assert!(rest.contains("typed=true"), "rank {r}: untyped: {l}");
            assert!(killed.elapsed() < DEATH_BOUND, "rank {r}: {l}");
            println!("rank {r} after the kill: {l}");
        }
        for (r, k) in kids.iter_mut().enumerate() {
            if r != v {
                assert!(k.wait().expect("wait").success(), "rank {r} exit status");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        return true;
    }
    for (r, k) in kids.iter_mut().enumerate() {
        for i in 0..steps {
            assert_eq!(expect(k, "step", r, long), format!("ok {i}"), "rank {r}");
        }
        assert_eq!(expect(k, "done", r, long), "done", "rank {r}");
    }
    for (r, mut k) in kids.into_iter().enumerate() {
        assert!(k.wait().expect("wait").success(), "rank {r} exit status");
    }
    let _ = std::fs::remove_dir_all(&dir);
    true
}

#[test]
fn gpu_xproc_nvlink_random_edge_cases_deepseek_graphs() {
    if !have_gpu("gpu_xproc_nvlink_random_edge_cases_deepseek_graphs") {
        return;
    }
    for ci in 0..=7 {
        assert!(cluster(ci, "nvlink"));
    }
}

#[test]
fn gpu_xproc_shm_hmem_ep4_ep8() {
    if !have_gpu("gpu_xproc_shm_hmem_ep4_ep8") {
        return;
    }
    for ci in [0, 1, 2, 5] {
        if !cluster(ci, "libfabric:shm") {
            return;
        }
    }
}

#[test]
fn gpu_xproc_rank_killed_mid_step() {
    if !have_gpu("gpu_xproc_rank_killed_mid_step") {
        return;
    }
    assert!(cluster(8, "nvlink"));
}
