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
//! a group with a rank masked from the start (DeepEP's `mask_buffer`); and
//! a rank killed in the middle of a step: the survivors must report typed
//! errors within a bound, neither hang nor crash, and then go on without
//! it as a masked group (bit-exact against the reference over the active
//! ranks, the mask applied to the inputs by the test).
//!
//! Skips without a GPU (prints `SKIP`; fails under
//! `WEFT_CUDA_REQUIRE_GPU=1`). The `shm` case needs a libfabric built with
//! CUDA (`WEFT_LIBFABRIC_PATH`); with one that refuses GPU memory it skips
//! unless `WEFT_REQUIRE_CUDA_LIBFABRIC=1`.
#![cfg(feature = "cuda")]

use crate::common::{expert_outputs, inputs, masked_inputs, routings, Owned, Routing};
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
    /// Rank killed (by the parent) after launching this step's send; the
    /// survivors then run `steps` more steps with it masked.
    kill: Option<(u32, u64)>,
    /// Ranks masked from the start.
    masked: Vec<u32>,
}

#[allow(clippy::too_many_arguments)]
fn dims(n: u32, l: u32, r: u32, t: u32, p: u32, tb: u32, h: u32, dt: OutDtype) -> Dims {
    let mut c = MoeConfig::new(n, n * l, r, t, tb, h);
    c.private_tokens = Some(p);
    c.out_dtype = dt;
    c.validate().expect("valid config")
}

/// `d` (a whole group's shape) over its active ranks: `masked` out, the
/// immediates of `instance` (a group rebuilt after a failure takes the next
/// one: nothing of the failed step counts in it).
fn masked_dims(d: &Dims, masked: &[u32], instance: u32) -> Dims {
    let mut c = MoeConfig::new(
        d.ranks,
        d.experts,
        d.topk,
        d.max_tokens,
        d.token_bytes,
        d.hidden,
    );
    c.private_tokens = Some(d.private);
    c.out_dtype = d.out_dtype;
    c.masked = masked.to_vec();
    c.instance = instance;
    c.validate().expect("valid masked config")
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
        masked: Vec::new(),
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
        9 => Case {
            masked: vec![1, 4],
            routings: vec![Routing::Random, Routing::SomeNone, Routing::OneExpert(3)],
            ..plain(dims(6, 2, 4, 16, 2, 64, 40, OutDtype::F32), 2, 10)
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

/// One step of this rank: `mine` is what it passes (whole-group expert
/// ids), `views` every active rank's inputs with the mask applied (the
/// reference's), `a` its index among the `active` ranks (whole-group
/// numbers). `Err` names what failed.
#[allow(clippy::too_many_arguments)]
fn step(
    l: &Launcher,
    rank: &EngineRank,
    d: &Dims,
    mine: &RankInput<'_>,
    views: &[RankInput<'_>],
    a: usize,
    active: &[u32],
    victim: bool,
) -> Result<(), String> {
    let gr = rank.gpu_rank();
    let t = gr.set_inputs(mine).map_err(|e| format!("inputs: {e}"))?;
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
    let mut want = reference::dispatch(d, views).map_err(|e| e.to_string())?;
    for w in &mut want {
        for s in &mut w.source_rank {
            *s = active[*s as usize];
        }
    }
    let got = gr.read_expert_tokens().map_err(|e| e.to_string())?;
    if got != want[a] {
        return Err("expert tokens differ from the reference".into());
    }
    let outs: Vec<Vec<u8>> = want
        .iter()
        .enumerate()
        .map(|(x, w)| expert_outputs(d, x as u32, w))
        .collect();
    gr.set_expert_outputs(&outs[a]).map_err(|e| e.to_string())?;
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
    gr.set_weights(&late[a]).map_err(|e| e.to_string())?;
    l.combine(rank)
        .map_err(|e| format!("combine launch: {e}"))?;
    l.sync(rank).map_err(|e| format!("combine: {e:?}"))?;
    let want = reference::combine(d, &views2, &outs).map_err(|e| e.to_string())?;
    let got = gr.read_combined(t).map_err(|e| e.to_string())?;
    if got != want[a] {
        return Err("combined tokens differ from the reference".into());
    }
    Ok(())
}

/// A group this child runs steps in: the protocol's shape, the whole
/// group's, and the active ranks (whole-group numbers, ascending).
struct Group<'a> {
    d: &'a Dims,
    full: &'a Dims,
    active: Vec<u32>,
}

impl Group<'_> {
    /// Step `s` of routing `rt` (seed `seed`) for whole-group rank `r`.
    fn step(
        &self,
        l: &Launcher,
        rank: &EngineRank,
        r: u32,
        (rt, seed, s): (Routing, u64, u64),
        victim: bool,
    ) -> Result<(), String> {
        let ins = inputs(self.full, rt, seed, s % 2 == 1);
        let act: Vec<Owned> = masked_inputs(self.full, self.d.mask.masked(), &ins);
        let views: Vec<RankInput<'_>> = act.iter().map(Owned::input).collect();
        let a = self
            .active
            .iter()
            .position(|&g| g == r)
            .ok_or_else(|| format!("rank {r} is masked"))?;
        let mine = ins[r as usize].input();
        step(l, rank, self.d, &mine, &views, a, &self.active, victim)
    }
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

/// Publishes `rank`'s info under `name`, gathers the group's `n` and
/// connects.
fn join(
    rank: &mut EngineRank,
    store: &Arc<dyn weft::rendezvous::Store>,
    session: &Session,
    name: &str,
    n: u32,
) {
    let rdv = MoeRendezvous::new(store.clone(), name);
    rdv.publish(session, rank.info()).expect("publish");
    let all = rdv.gather(n, Duration::from_secs(120)).expect("gather");
    rank.connect(&all).expect("connect");
}

/// Shuts `rank` down and checks that none of its immediates is left
/// pending on `e`.
fn finish(rank: EngineRank, e: &TransferEngine, d: &Dims, r: u32) {
    let imms = weft_moe::ImmValues::for_instance(d.instance, e.imm_capacity()).unwrap();
    rank.shutdown().expect("shutdown");
    for v in imms.all() {
        assert_eq!(e.imm_pending(v), 0, "rank {r}: immediates left pending");
    }
}

/// The child: role `case/rank/provider`.
#[test]
fn moe_gpu_rank_entry() {
    let Some(role) = child::role() else { return };
    let f: Vec<&str> = role.split('/').collect();
    let (ci, r, prov): (usize, u32, &str) = (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2]);
    let c = case(ci).expect("case");
    let full = &c.dims;
    let d = if c.masked.is_empty() {
        full.clone()
    } else {
        masked_dims(full, &c.masked, 0)
    };
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
    if c.masked.contains(&r) {
        // A masked rank takes no part.
        match EngineRank::new(&gpu, &d, r, e.clone(), WAIT) {
            Err(GpuError::Moe(MoeError::Masked { rank })) if rank == r => {
                child::send_line("masked").unwrap()
            }
            other => panic!("rank {r} is masked, yet: {other:?}"),
        }
        e.shutdown();
        std::process::exit(0);
    }
    let mut rank = match EngineRank::new(&gpu, &d, r, e.clone(), WAIT) {
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
    join(
        &mut rank,
        &store,
        &session,
        &format!("gpu-case{ci}"),
        d.ranks,
    );
    child::send_line("connected").unwrap();
    let g = Group {
        d: &d,
        full,
        active: (0..full.ranks).filter(|x| !c.masked.contains(x)).collect(),
    };
    let mut i = 0u64;
    for &rt in &c.routings {
        for s in 0..c.steps {
            let seed = c.seed * 1000 + i;
            let victim = c.kill == Some((r, s));
            let start = Instant::now();
            let Err(what) = g.step(&l, &rank, r, (rt, seed, s), victim) else {
                child::send_line(&format!("ok {i}")).unwrap();
                i += 1;
                continue;
            };
            let Some((v, _)) = c.kill else {
                // What the proxy saw says which round stalled.
                let proxy = rank.shutdown().err();
                panic!("rank {r} step {i} ({rt:?}, seed {seed}, {prov}): {what}; proxy: {proxy:?}");
            };
            // A survivor of the killed rank: the proxy must have stopped
            // with a typed error too.
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
            // No replacement: the survivors go on with the dead rank
            // masked, under the next instance.
            assert!(l.graphs.is_none(), "graphs hold the old rank's buffers");
            let d2 = masked_dims(full, &[v], 1);
            let mut rank2 = EngineRank::new(&gpu, &d2, r, e.clone(), WAIT).expect("survivor rank");
            join(
                &mut rank2,
                &store,
                &session,
                &format!("gpu-case{ci}-masked"),
                d2.ranks,
            );
            let g2 = Group {
                d: &d2,
                full,
                active: (0..full.ranks).filter(|&x| x != v).collect(),
            };
            for s in 0..c.steps {
                let seed = c.seed * 1000 + 500 + s;
                if let Err(what) = g2.step(&l, &rank2, r, (Routing::Random, seed, s), false) {
                    let proxy = rank2.shutdown().err();
                    panic!(
                        "rank {r} masked step {s} (seed {seed}, {prov}): {what}; proxy: {proxy:?}"
                    );
                }
                child::send_line(&format!("ok masked {s}")).unwrap();
            }
            // (Immediates of the failed step may arrive after its rank was
            // shut down: the excess counter is not checked here.)
            finish(rank2, &e, &d2, r);
            session.close().expect("leave the store");
            child::send_line("done").unwrap();
            e.shutdown();
            std::process::exit(0);
        }
    }
    finish(rank, &e, &d, r);
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
        if c.masked.contains(&(r as u32)) {
            assert_eq!(expect(k, "masked", r, long), "masked", "rank {r}");
            continue;
        }
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
        // Then they go on without it, masked.
        for (r, k) in kids.iter_mut().enumerate() {
            if r == v {
                continue;
            }
            for s in 0..c.steps {
                assert_eq!(
                    expect(k, "masked step", r, long),
                    format!("ok masked {s}"),
                    "rank {r}"
                );
            }
            assert_eq!(expect(k, "done", r, long), "done", "rank {r}");
        }
        println!(
            "the survivors ran {} steps with rank {victim} masked",
            c.steps
        );
        for (r, k) in kids.iter_mut().enumerate() {
            if r != v {
                assert!(k.wait().expect("wait").success(), "rank {r} exit status");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        return true;
    }
    for (r, k) in kids.iter_mut().enumerate() {
        if c.masked.contains(&(r as u32)) {
            continue;
        }
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
fn gpu_xproc_masked_rank() {
    if !have_gpu("gpu_xproc_masked_rank") {
        return;
    }
    assert!(cluster(9, "nvlink"));
}

#[test]
fn gpu_xproc_rank_killed_mid_step() {
    if !have_gpu("gpu_xproc_rank_killed_mid_step") {
        return;
    }
    assert!(cluster(8, "nvlink"));
}
