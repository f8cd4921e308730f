//! The GPU path on one GPU: N ranks (each its own buffers, stream and
//! proxy thread) run dispatch and combine with the NVRTC kernels; the
//! results must equal the CPU reference byte for byte. Two proxy groups:
//! `EngineGroup` (each rank its own TransferEngine on the adversarial
//! realtime loopback fabric, which copies GPU memory and reorders, splits,
//! drops and retransmits the writes) and the `LocalGroup` baseline (device
//! copies by the proxies). Skips without a GPU (prints `SKIP`), fails
//! instead when `WEFT_CUDA_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

use crate::common::{expert_outputs, inputs, routings, Owned, Routing, DTYPES};
use std::sync::Arc;
use std::time::Duration;
use weft::loopback::{Fabric, FabricConfig};
use weft_cuda::{Gpu, Graph, Stream};
use weft_moe::cuda::{EngineGroup, EngineGroupConfig, GpuRank, LocalGroup, MoeKernels, ProxyGroup};
use weft_moe::{reference, Dims, DispatchFormat, MoeConfig, OutDtype, RankInput, NO_EXPERT};

fn required() -> bool {
    std::env::var_os("WEFT_CUDA_REQUIRE_GPU").is_some_and(|v| v == "1")
}

/// Opens GPU 0 and compiles the MoE kernels, or skips.
fn setup(test: &str) -> Option<(Gpu, MoeKernels)> {
    // Up to 8 ranks' streams plus 8 proxy streams on one GPU: with the
    // default 8 hardware queues, a proxy's copy can queue behind another
    // rank's waiting kernel (see LocalGroup).
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) if !required() => {
            eprintln!("SKIP {test}: no usable CUDA GPU: {e}");
            return None;
        }
        Err(e) => panic!("{test}: WEFT_CUDA_REQUIRE_GPU=1 but no usable GPU: {e}"),
    };
    match MoeKernels::compile(&gpu) {
        Ok(mut k) => {
            // Well under the proxies' 20 s, so a stall shows as a kernel
            // timeout with the proxies' state; 3 s was once too short for
            // EP4 on the adversarial fabric (the step completed later).
            k.timeout_ns = 10_000_000_000;
            k.gather_blocks = 7;
            k.sum_blocks = 5;
            Some((gpu, k))
        }
        Err(e) if !required() => {
            eprintln!("SKIP {test}: GPU present but kernels unavailable: {e}");
            None
        }
        Err(e) => panic!("{test}: MoE kernels unavailable: {e}"),
    }
}

fn cfg(n: u32, l: u32, r: u32, t: u32, p: u32, tb: u32, dtype: OutDtype) -> Dims {
    cfg_h(n, l, r, t, p, tb, 40, dtype)
}

#[allow(clippy::too_many_arguments)]
fn cfg_h(n: u32, l: u32, r: u32, t: u32, p: u32, tb: u32, hidden: u32, dtype: OutDtype) -> Dims {
    let mut c = MoeConfig::new(n, n * l, r, t, tb, hidden);
    c.private_tokens = Some(p);
    c.out_dtype = dtype;
    c.validate().expect("valid config")
}

/// How a step's kernels are launched.
enum Launch {
    /// Four direct launches per rank.
    Direct,
    /// One captured graph per rank and phase, replayed every step.
    Graphs(Vec<(Graph, Graph)>),
}

/// Which proxies move the data.
#[derive(Clone, Copy, Debug)]
enum Proxies {
    /// `LocalGroup`: the proxies' own device copies.
    Local,
    /// `EngineGroup` on the adversarial loopback fabric with this seed and
    /// largest WRITE per WR.
    Engine { seed: u64, max_write: u64 },
    /// `EngineGroup` over the same-host backend (CUDA peer memory).
    Nvlink,
}

struct Cluster<'a> {
    k: &'a MoeKernels,
    group: Box<dyn ProxyGroup>,
    streams: Vec<Stream>,
    launch: Launch,
}

impl<'a> Cluster<'a> {
    fn new(gpu: &Gpu, k: &'a MoeKernels, d: &Dims, graphs: bool, px: Proxies) -> Cluster<'a> {
        let group: Box<dyn ProxyGroup> = match px {
            Proxies::Local => {
                Box::new(LocalGroup::new(gpu, d, Duration::from_secs(5)).expect("local group"))
            }
            Proxies::Engine { seed, max_write } => {
                // The adversarial simulated fabric, copying GPU memory with
                // the GPU's copy engine: every rank a host of it.
                let fabric = Fabric::new_realtime(FabricConfig {
                    max_write_len: max_write,
                    device_copy: Some(Arc::new(gpu.copy_engine().expect("copy engine"))),
                    ..FabricConfig::adversarial(seed)
                });
                let hosts: weft_moe::cuda::HostFn = Arc::new(move |_| {
                    let h = fabric.add_host(1);
                    Ok(Arc::new(fabric.provider(h)) as Arc<dyn weft::Provider>)
                });
                let cfg = EngineGroupConfig::new(hosts, Duration::from_secs(20));
                Box::new(EngineGroup::new(gpu, d, cfg).expect("engine group"))
            }
            Proxies::Nvlink => {
                let cfg = EngineGroupConfig::nvlink(gpu, Duration::from_secs(20)).expect("nvlink");
                Box::new(EngineGroup::new(gpu, d, cfg).expect("engine group over nvlink"))
            }
        };
        let streams: Vec<Stream> = (0..d.ranks)
            .map(|_| gpu.stream().expect("stream"))
            .collect();
        let mut c = Cluster {
            k,
            group,
            streams,
            launch: Launch::Direct,
        };
        if graphs {
            let mut g = Vec::new();
            for r in 0..d.ranks {
                let (s, rk) = (&c.streams[r as usize], c.rank(r));
                s.begin_capture().unwrap();
                k.dispatch_send(s, rk).unwrap();
                k.dispatch_recv(s, rk).unwrap();
                let gd = s.end_capture().unwrap();
                s.begin_capture().unwrap();
                k.combine_send(s, rk).unwrap();
                k.combine_recv(s, rk).unwrap();
                let gc = s.end_capture().unwrap();
                g.push((gd, gc));
            }
            c.launch = Launch::Graphs(g);
        }
        c
    }

    fn rank(&self, r: u32) -> &GpuRank {
        self.group.rank(r).expect("rank")
    }

    fn sync(&self) {
        for s in &self.streams {
            s.synchronize().expect("stream");
        }
        let n = self.streams.len() as u32;
        if (0..n).any(|r| self.rank(r).check_kernels().is_err()) {
            let states: Vec<String> = (0..n)
                .map(|r| format!("rank {r}: {}", self.rank(r).state()))
                .collect();
            panic!(
                "a receive kernel timed out; proxies healthy: {}\n{}",
                self.group.healthy(),
                states.join("\n")
            );
        }
    }

    /// Launches every rank's send kernels before any receive kernel (the
    /// receive kernels spin while resident).
    fn dispatch(&self) {
        let n = self.streams.len() as u32;
        match &self.launch {
            Launch::Direct => {
                for r in 0..n {
                    self.k
                        .dispatch_send(&self.streams[r as usize], self.rank(r))
                        .unwrap();
                }
                for r in 0..n {
                    self.k
                        .dispatch_recv(&self.streams[r as usize], self.rank(r))
                        .unwrap();
                }
            }
            Launch::Graphs(g) => {
                for (gr, s) in g.iter().zip(&self.streams) {
                    gr.0.launch(s).unwrap();
                }
            }
        }
        self.sync();
    }

    fn combine(&self) {
        let n = self.streams.len() as u32;
        match &self.launch {
            Launch::Direct => {
                for r in 0..n {
                    self.k
                        .combine_send(&self.streams[r as usize], self.rank(r))
                        .unwrap();
                }
                for r in 0..n {
                    self.k
                        .combine_recv(&self.streams[r as usize], self.rank(r))
                        .unwrap();
                }
            }
            Launch::Graphs(g) => {
                for (gr, s) in g.iter().zip(&self.streams) {
                    gr.1.launch(s).unwrap();
                }
            }
        }
        self.sync();
    }

    /// One step: upload, dispatch, compare, expert outputs, combine, compare.
    fn step(&self, d: &Dims, ins: &[Owned], what: &str) {
        let views: Vec<RankInput<'_>> = ins.iter().map(Owned::input).collect();
        let mut tokens = Vec::new();
        for (r, v) in views.iter().enumerate() {
            tokens.push(self.rank(r as u32).set_inputs(v).expect("inputs"));
        }
        self.dispatch();
        let want = reference::dispatch(d, &views).unwrap();
        // Not vacuous: every pair with an expert arrived somewhere.
        let pairs: usize = views
            .iter()
            .map(|v| v.topk_ids.iter().filter(|&&e| e != NO_EXPERT).count())
            .sum();
        let rows: u32 = (0..d.ranks)
            .map(|r| self.rank(r).received_rows().unwrap())
            .sum();
        assert_eq!(rows as usize, pairs, "{what}: received rows");
        let mut outs = Vec::new();
        for r in 0..d.ranks {
            let got = self.rank(r).read_expert_tokens().unwrap();
            assert!(
                got == want[r as usize],
                "{what}: rank {r}: expert tokens differ from the reference"
            );
            let y = expert_outputs(d, r, &got);
            self.rank(r).set_expert_outputs(&y).unwrap();
            outs.push(y);
        }
        self.combine();
        let want = reference::combine(d, &views, &outs).unwrap();
        for r in 0..d.ranks {
            let got = self.rank(r).read_combined(tokens[r as usize]).unwrap();
            assert!(
                got == want[r as usize],
                "{what}: rank {r}: combined tokens differ from the reference"
            );
        }
    }

    fn finish(self) {
        drop(self.launch);
        self.group.shutdown().expect("proxies");
    }
}

/// Runs `steps` consecutive steps (buffer reuse, barriers) per routing.
fn run(gpu: &Gpu, k: &MoeKernels, d: &Dims, rts: &[Routing], seed: u64, steps: u64, graphs: bool) {
    run_with(gpu, k, d, rts, seed, steps, graphs, Proxies::Local);
}

/// [`run`] with the given proxies.
#[allow(clippy::too_many_arguments)]
fn run_with(
    gpu: &Gpu,
    k: &MoeKernels,
    d: &Dims,
    rts: &[Routing],
    seed: u64,
    steps: u64,
    graphs: bool,
    px: Proxies,
) {
    let c = Cluster::new(gpu, k, d, graphs, px);
    for &rt in rts {
        for i in 0..steps {
            let s = seed.wrapping_mul(1000).wrapping_add(i);
            let what = format!(
                "N={} L={} R={} T={} P={} tb={} {:?} {rt:?} seed {s} graphs={graphs} {px:?}",
                d.ranks, d.local, d.topk, d.max_tokens, d.private, d.token_bytes, d.out_dtype
            );
            let ins = inputs(d, rt, s, i % 2 == 1);
            c.step(d, &ins, &what);
        }
    }
    c.finish();
}

#[test]
fn gpu_kernels_compile() {
    let Some((_gpu, k)) = setup("gpu_kernels_compile") else {
        return;
    };
    assert!(k.timeout_ns > 0);
}

#[test]
fn gpu_ep1_ep2_ep4_ep8_random_bit_exact() {
    let Some((gpu, k)) = setup("gpu_ep1_ep2_ep4_ep8_random_bit_exact") else {
        return;
    };
    for (n, seed) in [(1u32, 1u64), (2, 2), (4, 3), (8, 4)] {
        for dtype in DTYPES {
            let d = cfg(n, 4, 4, 24, 3, 64, dtype);
            run(&gpu, &k, &d, &[Routing::Random], seed, 3, false);
        }
    }
}

#[test]
fn gpu_edge_cases_bit_exact() {
    let Some((gpu, k)) = setup("gpu_edge_cases_bit_exact") else {
        return;
    };
    // P = 0, small P, P ≥ T, P = T·R; every routing (one expert, all local,
    // duplicate experts, an empty sender, skewed); an odd token size (the
    // byte-copy path).
    // Hidden 36 in bf16 (72-byte rows, not a multiple of 16) takes the
    // scalar weighted sum; the others the vector one.
    for (n, p, tb, h, dt) in [
        (4u32, 0u32, 48u32, 40u32, OutDtype::Bf16),
        (4, 1, 52, 36, OutDtype::Bf16),
        (4, 16, 48, 36, OutDtype::F32),
        (2, 64, 32, 40, OutDtype::F32),
        (8, 2, 100, 36, OutDtype::Bf16),
    ] {
        let d = cfg_h(n, 2, 4, 16, p, tb, h, dt);
        run(
            &gpu,
            &k,
            &d,
            &routings(&d),
            u64::from(n * 100 + p),
            2,
            false,
        );
    }
}

#[test]
fn gpu_graph_replay_bit_exact() {
    let Some((gpu, k)) = setup("gpu_graph_replay_bit_exact") else {
        return;
    };
    for (n, dtype) in [
        (2u32, OutDtype::F32),
        (4, OutDtype::Bf16),
        (8, OutDtype::Bf16),
    ] {
        let d = cfg(n, 4, 8, 32, 4, 64, dtype);
        run(
            &gpu,
            &k,
            &d,
            &[Routing::Random, Routing::Skewed],
            77,
            3,
            true,
        );
    }
}

#[test]
fn gpu_deepseek_shape_ep8_bit_exact() {
    let Some((gpu, k)) = setup("gpu_deepseek_shape_ep8_bit_exact") else {
        return;
    };
    // H = 7168 fp8 + 56 f32 scales, top-8 of 256 experts, 128 tokens, EP8:
    // bytes as given, then bf16 tokens quantised by the send kernel.
    let mut c = MoeConfig::new(8, 256, 8, 128, 7168 + 56 * 4, 7168);
    c.private_tokens = Some(32);
    let d = c.validate().unwrap();
    run(&gpu, &k, &d, &[Routing::Random], 5, 2, false);
    c.dispatch = DispatchFormat::Fp8 { round_scale: false };
    let d = c.validate().unwrap();
    run(&gpu, &k, &d, &[Routing::Random], 6, 2, false);
}

#[test]
fn gpu_fp8_dispatch_bit_exact() {
    let Some((gpu, k)) = setup("gpu_fp8_dispatch_bit_exact") else {
        return;
    };
    // The send kernel's quantisation against quant.rs, both scale rules.
    for (n, seed) in [(1u32, 11u64), (2, 12), (4, 13)] {
        for round_scale in [false, true] {
            let mut c = MoeConfig::new(n, n * 4, 4, 24, 256 + 8, 256);
            c.private_tokens = Some(3);
            c.dispatch = DispatchFormat::Fp8 { round_scale };
            let d = c.validate().unwrap();
            run(
                &gpu,
                &k,
                &d,
                &[Routing::Random, Routing::SomeNone, Routing::DupExperts],
                seed,
                2,
                false,
            );
        }
    }
}

// ---- The engine-driven path (EngineGroup) ----

#[test]
fn gpu_engine_ep2_ep4_ep8_random_bit_exact() {
    let Some((gpu, k)) = setup("gpu_engine_ep2_ep4_ep8_random_bit_exact") else {
        return;
    };
    // Small WRITE limit: scatters and overflow writes split into many WRs
    // (more immediates to count, more reordering).
    random_ep248(&gpu, &k, 21, |seed| Proxies::Engine {
        seed,
        max_write: 200,
    });
}

/// Random routings at EP 2, 4 and 8 (seeds `first..first + 3`), both
/// output types, over the proxies `px(seed)` gives.
fn random_ep248(gpu: &Gpu, k: &MoeKernels, first: u64, px: impl Fn(u64) -> Proxies) {
    for (n, seed) in [(2u32, first), (4, first + 1), (8, first + 2)] {
        for dtype in DTYPES {
            let d = cfg(n, 4, 4, 24, 3, 64, dtype);
            run_with(gpu, k, &d, &[Routing::Random], seed, 3, false, px(seed));
        }
    }
}

#[test]
fn gpu_engine_edge_cases_bit_exact() {
    let Some((gpu, k)) = setup("gpu_engine_edge_cases_bit_exact") else {
        return;
    };
    edge_cases(&gpu, &k, |seed| Proxies::Engine {
        seed,
        max_write: 1 << 20,
    });
}

/// P = 0, P = 1, P ≥ T, P = T·R, every routing of `routings`, odd token
/// and row sizes, both output types, over the proxies `px(seed)` gives.
fn edge_cases(gpu: &Gpu, k: &MoeKernels, px: impl Fn(u64) -> Proxies) {
    for (n, p, tb, h, dt) in [
        (4u32, 0u32, 48u32, 40u32, OutDtype::Bf16),
        (4, 1, 52, 36, OutDtype::Bf16),
        (4, 16, 48, 36, OutDtype::F32),
        (2, 64, 32, 40, OutDtype::F32),
        (8, 2, 100, 36, OutDtype::Bf16),
    ] {
        let d = cfg_h(n, 2, 4, 16, p, tb, h, dt);
        let seed = u64::from(n * 1000 + p);
        run_with(gpu, k, &d, &routings(&d), seed, 2, false, px(seed));
    }
}

#[test]
fn gpu_engine_graph_replay_bit_exact() {
    let Some((gpu, k)) = setup("gpu_engine_graph_replay_bit_exact") else {
        return;
    };
    for (n, dtype) in [
        (2u32, OutDtype::F32),
        (4, OutDtype::Bf16),
        (8, OutDtype::Bf16),
    ] {
        let d = cfg(n, 4, 8, 32, 4, 64, dtype);
        let px = Proxies::Engine {
            seed: 500 + u64::from(n),
            max_write: 1 << 20,
        };
        run_with(
            &gpu,
            &k,
            &d,
            &[Routing::Random, Routing::Skewed],
            78,
            3,
            true,
            px,
        );
    }
}

/// The engine path over nvlink: random routings at EP 2/4/8, the edge
/// cases and the DeepSeek-V3 shape, bit-exact.
#[test]
fn gpu_nvlink_engine_bit_exact() {
    let Some((gpu, k)) = setup("gpu_nvlink_engine_bit_exact") else {
        return;
    };
    random_ep248(&gpu, &k, 31, |_| Proxies::Nvlink);
    edge_cases(&gpu, &k, |_| Proxies::Nvlink);
    deepseek_ep8(&gpu, &k, Proxies::Nvlink);
}

/// The DeepSeek-V3 decode shape at EP8 (32 private tokens) over `px`.
fn deepseek_ep8(gpu: &Gpu, k: &MoeKernels, px: Proxies) {
    let mut c = MoeConfig::new(8, 256, 8, 128, 7168 + 56 * 4, 7168);
    c.private_tokens = Some(32);
    let d = c.validate().unwrap();
    run_with(gpu, k, &d, &[Routing::Random], 6, 2, false, px);
}

#[test]
fn gpu_engine_deepseek_shape_ep8_bit_exact() {
    let Some((gpu, k)) = setup("gpu_engine_deepseek_shape_ep8_bit_exact") else {
        return;
    };
    deepseek_ep8(
        &gpu,
        &k,
        Proxies::Engine {
            seed: 9,
            max_write: 1 << 40,
        },
    );
}
