//! `weft-bench moe`: the CPU path of MoE dispatch/combine (`weft_moe::MoeRank`)
//! measured on the realtime loopback fabric: one engine and one thread per
//! rank, all in this process, every step started together (a barrier), the
//! private-slot count P swept. Next to it, in the same run, the baseline:
//! the naive reference (`weft_moe::reference`), which copies every token
//! straight to its expert rows and sums the outputs with no transport at
//! all, timed on one thread for all ranks; the table gives our per-rank
//! p50 as a ratio to it. Wall-clock numbers of this machine.

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weft::loopback::{Fabric, FabricConfig, NicModel};
use weft::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_moe::{reference, Dims, MoeConfig, MoeRank, RankInput};

/// Arguments of `moe`.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct MoeArgs {
    /// Ranks (EP degree), one engine and one thread each.
    #[arg(long, default_value_t = 4)]
    pub ranks: u32,
    /// Tokens per rank per step (T).
    #[arg(long, default_value_t = 128)]
    pub tokens: u32,
    /// Hidden size (the DeepSeek-V3 token: H fp8 bytes + H/128 f32 scales).
    #[arg(long, default_value_t = 7168)]
    pub hidden: u32,
    /// Measured steps per P (after 2 warm-up steps).
    #[arg(long, default_value_t = 20)]
    pub iters: u32,
}

/// splitmix64: the bench's deterministic routing generator.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % u64::from(n.max(1))) as u32
    }
}

/// The DeepSeek-V3 decode shape at EP `n`: 256 experts, top-8, 128 tokens,
/// 7168 fp8 bytes + 56 f32 scales per token, bf16 outputs of 7168.
pub fn ds_config(n: u32, private: u32) -> MoeConfig {
    shape(n, 128, 7168, private)
}

fn shape(n: u32, tokens: u32, hidden: u32, private: u32) -> MoeConfig {
    let mut c = MoeConfig::new(n, 256, 8, tokens, hidden + hidden / 128 * 4, hidden);
    c.private_tokens = Some(private.min(tokens * 8));
    c.max_buffer_bytes = u64::MAX;
    c.step_timeout = Duration::from_secs(60);
    c
}

/// One rank's owned inputs.
#[derive(Debug, Clone)]
pub struct Input {
    /// Token rows.
    pub tokens: Vec<u8>,
    /// Top-k ids (distinct per token, as a router picks them).
    pub ids: Vec<u32>,
    /// Top-k weights.
    pub weights: Vec<f32>,
}

impl Input {
    /// The borrowed view.
    pub fn view(&self) -> RankInput<'_> {
        RankInput {
            tokens: &self.tokens,
            topk_ids: &self.ids,
            topk_weights: &self.weights,
        }
    }
}

/// Every rank's inputs: `max_tokens` tokens each, top-k distinct experts
/// drawn uniformly, token bytes from the generator.
pub fn ds_inputs(d: &Dims, rng: &mut Rng) -> Vec<Input> {
    (0..d.ranks)
        .map(|_| {
            let t = d.max_tokens as usize;
            let mut ids = Vec::with_capacity(t * d.topk as usize);
            for _ in 0..t {
                let start = ids.len();
                while ids.len() < start + d.topk as usize {
                    let e = rng.below(d.experts);
                    if !ids[start..].contains(&e) {
                        ids.push(e);
                    }
                }
            }
            let tokens = (0..t * d.token_bytes as usize)
                .map(|_| rng.next_u64() as u8)
                .collect();
            let weights = (0..ids.len())
                .map(|_| (rng.below(1000) as f32) / 1000.0)
                .collect();
            Input {
                tokens,
                ids,
                weights,
            }
        })
        .collect()
}

/// The `p`-th percentile (nearest rank) of `v` in place; 0 for an empty `v`.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[i.clamp(1, v.len()) - 1]
}

fn engine(fabric: &Fabric) -> Result<Arc<TransferEngine>, String> {
    let host = fabric.add_host(1);
    let p = Arc::new(fabric.provider(host));
    let cfg = {
        let mut c = EngineConfig::default();
        c.idle_sleep = Some(Duration::from_micros(50));
        c
    };
    TransferEngine::builder()
        .group(DomainGroupSpec::new(p, vec![0]))
        .config(cfg)
        .build()
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// Dispatch and combine times (µs).
type Times = (Vec<f64>, Vec<f64>);

/// Per-rank dispatch and combine wall times (µs) of `iters` steps at P.
fn measure(a: &MoeArgs, p: u32, inputs: &[Vec<Input>]) -> Result<Times, String> {
    let cfg = shape(a.ranks, a.tokens, a.hidden, p);
    let d = cfg.validate().map_err(|e| e.to_string())?;
    let fabric = Fabric::new_realtime(FabricConfig {
        nic: NicModel {
            latency: Duration::ZERO,
            link_gbps: 0.0,
        },
        ..FabricConfig::ideal(u64::from(p))
    });
    let engines = (0..a.ranks)
        .map(|_| engine(&fabric))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ranks = Vec::new();
    let mut infos = Vec::new();
    for (r, e) in engines.iter().enumerate() {
        let (rank, info) =
            MoeRank::prepare(e.clone(), &cfg, r as u32).map_err(|e| e.to_string())?;
        ranks.push(rank);
        infos.push(info);
    }
    for rank in &mut ranks {
        rank.connect(&infos).map_err(|e| e.to_string())?;
    }
    let barrier = Barrier::new(a.ranks as usize);
    let out_row = d.out_row_bytes() as usize;
    let warm = 2usize;
    let res: Vec<Result<Times, String>> = std::thread::scope(|sc| {
        let hs: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, mut rank)| {
                let barrier = &barrier;
                sc.spawn(move || {
                    let (mut dt, mut ct) = (Vec::new(), Vec::new());
                    for (k, step) in inputs.iter().enumerate() {
                        barrier.wait();
                        let s = Instant::now();
                        let (tok, layout) =
                            rank.dispatch(&step[r].view()).map_err(|e| e.to_string())?;
                        let t_d = s.elapsed();
                        let outs = vec![0u8; tok.rows() * out_row];
                        barrier.wait();
                        let s = Instant::now();
                        let y = rank.combine(&outs, &layout).map_err(|e| e.to_string())?;
                        let t_c = s.elapsed();
                        std::hint::black_box(y);
                        if k >= warm {
                            dt.push(t_d.as_secs_f64() * 1e6);
                            ct.push(t_c.as_secs_f64() * 1e6);
                        }
                    }
                    rank.shutdown().map_err(|e| e.to_string())?;
                    Ok((dt, ct))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("rank thread panicked".into()))
            })
            .collect()
    });
    for e in &engines {
        e.shutdown();
    }
    let (mut dt, mut ct) = (Vec::new(), Vec::new());
    for r in res {
        let (d, c) = r?;
        dt.extend(d);
        ct.extend(c);
    }
    Ok((dt, ct))
}

/// The reference's time per step (µs, median over the steps): dispatch of
/// every rank's tokens, and combine.
fn reference_times(a: &MoeArgs, inputs: &[Vec<Input>]) -> Result<(f64, f64), String> {
    let d = shape(a.ranks, a.tokens, a.hidden, 0)
        .validate()
        .map_err(|e| e.to_string())?;
    let out_row = d.out_row_bytes() as usize;
    let (mut dt, mut ct) = (Vec::new(), Vec::new());
    for step in inputs {
        let views: Vec<_> = step.iter().map(|i| i.view()).collect();
        let s = Instant::now();
        let x = reference::dispatch(&d, &views).map_err(|e| e.to_string())?;
        dt.push(s.elapsed().as_secs_f64() * 1e6);
        let outs: Vec<Vec<u8>> = x.iter().map(|t| vec![0u8; t.rows() * out_row]).collect();
        let s = Instant::now();
        let y = reference::combine(&d, &views, &outs).map_err(|e| e.to_string())?;
        ct.push(s.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(y);
    }
    Ok((pct(&mut dt, 50.0), pct(&mut ct, 50.0)))
}

/// Runs the CPU-path benchmark and prints the table.
pub fn run_cpu(a: &MoeArgs, quick: bool) -> ExitCode {
    let mut a = *a;
    if quick {
        a.ranks = a.ranks.min(2);
        a.tokens = a.tokens.min(16);
        a.hidden = a.hidden.min(1024);
        a.iters = a.iters.min(3);
    }
    let Ok(d) = shape(a.ranks, a.tokens, a.hidden, 0).validate() else {
        eprintln!("moe: invalid shape {a:?}");
        return ExitCode::FAILURE;
    };
    let mut rng = Rng(42);
    let inputs: Vec<Vec<Input>> = (0..a.iters + 2).map(|_| ds_inputs(&d, &mut rng)).collect();
    let (rd, rc) = match reference_times(&a, &inputs) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("moe reference: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "# MoE CPU path (MoeRank over the realtime loopback fabric, zero-latency infinite-bandwidth NIC model), \
         EP{} in one process, one engine + one thread per rank; T={} tokens/rank, token {} B, top-8 of 256, \
         bf16 out of {}; {} steps after 2 warm-up, p50/p99 over ranks × steps",
        a.ranks, a.tokens, d.token_bytes, a.hidden, a.iters
    );
    println!(
        "# baseline (same run): naive reference on one thread for all ranks, no transport: \
         dispatch {rd:.1} µs, combine {rc:.1} µs per step (median)"
    );
    println!(
        "{:>3} | {:>9} {:>9} {:>8} | {:>9} {:>9} {:>8}",
        "P", "disp p50", "disp p99", "÷ ref", "comb p50", "comb p99", "÷ ref"
    );
    for p in [0u32, 4, 8, 16, 32] {
        match measure(&a, p, &inputs) {
            Ok((mut dt, mut ct)) => {
                let (d50, c50) = (pct(&mut dt, 50.0), pct(&mut ct, 50.0));
                println!(
                    "{:>3} | {:>9.1} {:>9.1} {:>8.2} | {:>9.1} {:>9.1} {:>8.2}",
                    p,
                    d50,
                    pct(&mut dt, 99.0),
                    d50 / rd.max(1e-9),
                    c50,
                    pct(&mut ct, 99.0),
                    c50 / rc.max(1e-9)
                );
            }
            Err(e) => {
                eprintln!("moe P={p}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
