//! The Rust side of `python/bench/moe_overhead.py`: N MoE ranks on threads
//! of one process, each with its own engine on the simulated fabric
//! (`loopback`, ideal profile), every step a dispatch and a combine per
//! rank after a barrier, each call timed alone — the same operations, inputs
//! and timing as the Python side, so the two differ by the binding only.
//! Prints one JSON object per measurement on stdout.
//!
//! `moe_overhead_rs RANKS STEPS TOKENS HIDDEN TOKEN_BYTES EXPERTS TOPK`
//! (defaults: the DeepSeek-V3 decode shape, 8 ranks, 200 steps).

use std::sync::{Arc, Barrier};
use std::time::Instant;
use weft::{DomainGroupSpec, ProviderConfig, TransferEngine};
use weft_moe::{ExpertTokens, MoeConfig, MoeRank, RankInput};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn report(op: &str, mut us: Vec<f64>) {
    let (p50, p99) = (pct(&mut us, 0.5), pct(&mut us, 0.99));
    println!(
        "{{\"op\": \"{op}\", \"lang\": \"rust\", \"n\": {}, \"p50_us\": {p50:.1}, \"p99_us\": {p99:.1}}}",
        us.len()
    );
}

/// Rank `r`'s top-k ids: token `t`'s `k`-th expert is
/// `(7t + 13r + k·E/K) mod E` (distinct per token, spread evenly); the
/// Python side uses the same rule.
fn ids(r: u32, t: u32, e: u32, k: u32) -> Vec<u32> {
    (0..t)
        .flat_map(|t| (0..k).map(move |j| (7 * t + 13 * r + j * (e / k)) % e))
        .collect()
}

fn main() -> Res<()> {
    let a: Vec<u32> = std::env::args()
        .skip(1)
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let arg = |i: usize, d: u32| a.get(i).copied().unwrap_or(d);
    let (n, steps, t, h, tb, e, k) = (
        arg(0, 8),
        arg(1, 200),
        arg(2, 128),
        arg(3, 7168),
        arg(4, 7168 + 56 * 4),
        arg(5, 256),
        arg(6, 8),
    );
    let backend = weft::provider_with(&"loopback".parse()?, &ProviderConfig::default())?;
    let mut cfg = MoeConfig::new(n, e, k, t, tb, h);
    cfg.step_timeout = std::time::Duration::from_secs(60);
    let mut ranks = Vec::new();
    let mut infos = Vec::new();
    let mut engines = Vec::new();
    for r in 0..n {
        let eng = Arc::new(
            TransferEngine::builder()
                .group(DomainGroupSpec::new(backend.host()?, vec![0]))
                .build()?,
        );
        let (rank, info) = MoeRank::prepare(eng.clone(), &cfg, r)?;
        ranks.push(rank);
        infos.push(info);
        engines.push(eng);
    }
    for rank in &mut ranks {
        rank.connect(&infos)?;
    }
    let barrier = Arc::new(Barrier::new(n as usize));
    let warm = 10;
    let handles: Vec<_> = ranks
        .into_iter()
        .enumerate()
        .map(|(r, mut rank)| {
            let barrier = barrier.clone();
            std::thread::spawn(move || -> Res<(Vec<f64>, Vec<f64>)> {
                let r = r as u32;
                let tokens: Vec<u8> = (0..t * tb).map(|i| (i * 31 + r) as u8).collect();
                let ids = ids(r, t, e, k);
                let weights = vec![0.125f32; ids.len()];
                let input = RankInput {
                    tokens: &tokens,
                    topk_ids: &ids,
                    topk_weights: &weights,
                };
                let (mut d, mut c) = (Vec::new(), Vec::new());
                let mut x = ExpertTokens::default();
                for s in 0..steps + warm {
                    barrier.wait();
                    let t0 = Instant::now();
                    let layout = rank.dispatch_into(&input, &mut x)?;
                    let dt = t0.elapsed();
                    let rows = x.expert_offsets.last().copied().unwrap_or(0) as usize;
                    let y = vec![0u8; rows * h as usize * 2];
                    barrier.wait();
                    let t0 = Instant::now();
                    let out = rank.combine(&y, &layout)?;
                    let ct = t0.elapsed();
                    assert_eq!(out.len(), (t * h * 2) as usize);
                    if s >= warm {
                        d.push(dt.as_secs_f64() * 1e6);
                        c.push(ct.as_secs_f64() * 1e6);
                    }
                }
                rank.shutdown()?;
                Ok((d, c))
            })
        })
        .collect();
    let (mut d, mut c) = (Vec::new(), Vec::new());
    for hd in handles {
        let (x, y) = hd.join().map_err(|_| "a rank panicked")??;
        d.extend(x);
        c.extend(y);
    }
    report("moe_dispatch", d);
    report("moe_combine", c);
    for e in engines {
        e.shutdown();
    }
    Ok(())
}
