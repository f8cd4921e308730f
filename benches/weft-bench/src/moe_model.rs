//! `weft-bench moe-model`: a **model**, not a measurement. The MoE
//! dispatch/combine protocol (the same `RankCore` and executor as the CPU
//! path) runs over the loopback fabric in step mode, whose NIC model
//! charges latency and link bandwidth (incast serialises at the receiver),
//! with every rank's host/device work charged from the paper's measured
//! kernel and proxy costs. Simulated time only; nothing is slept. The
//! DeepSeek-V3 decode shape (H = 7168 fp8 + 56 f32 scales, top-8 of 256
//! experts, 128 tokens per rank, bf16 outputs) at EP 8/16/32/64, printed
//! next to the paper's numbers.

use crate::moe::{ds_config, ds_inputs, pct, Rng};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use weft::loopback::{FabricConfig, NicModel};
use weft_moe::sim::{HostModel, RunOpts, SimCluster, SimConfig};
use weft_moe::{count_pairs, RouteMatrix, StepPlan};

/// Arguments of `moe-model`.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct ModelArgs {
    /// Routing seeds per EP size (each one synchronized step; p50/p99 are
    /// over ranks × seeds).
    #[arg(long, default_value_t = 3)]
    pub seeds: u32,
    /// Private slots per (source, destination), P.
    #[arg(long, default_value_t = 32)]
    pub private: u32,
    /// Largest EP size (8, 16, 32, 64).
    #[arg(long, default_value_t = 64)]
    pub max_ep: u32,
    /// Charge no host/device cost at all (network time only).
    #[arg(long)]
    pub network_only: bool,
}

/// A NIC preset of the model.
struct Nic {
    name: &'static str,
    nics: usize,
    model: NicModel,
    per_wr: Duration,
    note: &'static str,
}

fn us(x: f64) -> Duration {
    Duration::from_nanos((x * 1000.0) as u64)
}

fn nics() -> [Nic; 2] {
    [
        Nic {
            name: "CX7",
            nics: 1,
            model: NicModel {
                latency: us(2.0),
                link_gbps: 400.0,
            },
            per_wr: us(0.15),
            note: "1 NIC, 400 Gb/s, 2 µs one-way; 0.15 µs per WR posted (paper Table 9: 8.5 µs / 56 WRs)",
        },
        Nic {
            name: "EFA",
            nics: 2,
            model: NicModel {
                latency: us(6.0),
                link_gbps: 200.0,
            },
            per_wr: us(0.5),
            note: "2 NICs × 200 Gb/s, 6 µs one-way (assumption: SRD's higher per-message latency); \
                   0.5 µs per WR posted (paper Table 9: 27.9 µs / 56 WRs; it also stands in for EFA's \
                   lower small-message rate, which the loopback NIC model lacks)",
        },
    ]
}

/// The paper's kernel and proxy costs (charged per rank, see `sim.rs`).
fn host(per_wr: Duration, plan: Duration) -> HostModel {
    HostModel {
        count: us(3.0),
        pack: us(16.0),
        plan,
        unpack: us(25.0),
        combine_pack: us(13.0),
        combine_sum: us(15.0),
        submit: us(1.42),
        per_wr,
    }
}

/// Median wall time of `StepPlan::new` at rank 0 on this CPU for EP `n`.
fn plan_cost(n: u32, private: u32) -> Duration {
    let cfg = ds_config(n, private);
    let Ok(d) = cfg.validate() else {
        return Duration::ZERO;
    };
    let mut rng = Rng(n.into());
    let ins = ds_inputs(&d, &mut rng);
    let rows: Vec<Vec<u32>> = ins
        .iter()
        .filter_map(|i| count_pairs(&d, &i.ids).ok().map(|p| p.row))
        .collect();
    let Ok(m) = RouteMatrix::from_rows(&d, &rows) else {
        return Duration::ZERO;
    };
    let mut t: Vec<f64> = (0..31)
        .map(|_| {
            let s = Instant::now();
            let p = StepPlan::new(&d, 0, &m);
            let e = s.elapsed().as_secs_f64();
            std::hint::black_box(p.is_ok());
            e
        })
        .collect();
    Duration::from_secs_f64(pct(&mut t, 50.0))
}

/// Paper numbers: (EP, weft CX7 dispatch, combine, DeepEP dispatch, combine) in µs.
const PAPER: [(u32, &str, &str, &str, &str); 4] = [
    (8, "52", "65", "43", "64"),
    (16, "-", "-", "-", "-"),
    (32, "110", "186", "124", "267"),
    (64, "124", "203", "160", "327"),
];

/// Runs the model and prints the table.
pub fn run_model(a: &ModelArgs, quick: bool) -> ExitCode {
    let seeds = if quick { 1 } else { a.seeds.max(1) };
    let eps: Vec<u32> = [8u32, 16, 32, 64]
        .into_iter()
        .filter(|&e| e <= if quick { 8 } else { a.max_ep })
        .collect();
    println!("# MoE dispatch/combine — MODEL (simulated time on the loopback NIC model; not a measurement)");
    println!(
        "# DeepSeek-V3 decode: H=7168 fp8 + 56 f32 scales (7392 B/token), top-8 of 256 experts, \
         T=128 tokens/rank, bf16 outputs, P={}; {seeds} routing seed(s), p50/p99 over ranks × seeds",
        a.private
    );
    println!(
        "# costs per rank: count 3 µs + pack 16 µs (send kernel ≈ 19 µs), unpack 25 µs, combine pack 13 µs, \
         weighted sum 15 µs, 1.42 µs per submit to its first WR; plan = measured StepPlan::new median on this CPU"
    );
    if a.network_only {
        println!("# --network-only: every host/device cost is zero (network time alone)");
    }
    for n in nics() {
        println!("# {}: {}", n.name, n.note);
    }
    println!(
        "{:<4} {:>3} {:>8} | {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} | {:>13} {:>13} | {:>13} {:>13}",
        "nic",
        "EP",
        "plan µs",
        "disp p50",
        "disp p99",
        "wire",
        "comb p50",
        "comb p99",
        "wire",
        "paper disp",
        "paper comb",
        "DeepEP disp",
        "DeepEP comb"
    );
    for nic in nics() {
        for &ep in &eps {
            let plan = plan_cost(ep, a.private);
            let hm = if a.network_only {
                HostModel::zero()
            } else {
                host(nic.per_wr, plan)
            };
            match model_one(&nic, ep, a.private, seeds, hm) {
                Ok(m) => {
                    let (mut d, mut c) = (m.disp, m.comb);
                    let (pd, pc, dd, dc) = PAPER
                        .iter()
                        .find(|p| p.0 == ep)
                        .map_or(("-", "-", "-", "-"), |p| (p.1, p.2, p.3, p.4));
                    let (pd, pc, dd, dc) = if nic.name == "CX7" {
                        (pd, pc, dd, dc)
                    } else {
                        ("-", "-", "n/a", "n/a")
                    };
                    println!(
                        "{:<4} {:>3} {:>8.1} | {:>9.1} {:>9.1} {:>9.1} | {:>9.1} {:>9.1} {:>9.1} | {:>13} {:>13} | {:>13} {:>13}",
                        nic.name,
                        ep,
                        plan.as_secs_f64() * 1e6,
                        pct(&mut d, 50.0),
                        pct(&mut d, 99.0),
                        m.disp_floor,
                        pct(&mut c, 50.0),
                        pct(&mut c, 99.0),
                        m.comb_floor,
                        pd,
                        pc,
                        dd,
                        dc
                    );
                }
                Err(e) => {
                    eprintln!("moe-model {} EP{ep}: {e}", nic.name);
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    println!(
        "# wire = the most bytes one rank sends or receives in the phase (one copy per (token, k) pair, \
         as this protocol sends them) at the rank's total link rate: this protocol cannot beat it"
    );
    println!(
        "# paper columns: weft on CX7 and DeepEP from the paper (its EP8 runs over NVLink inside one node; \
         here every EP size goes over the NIC model). Known model gaps: see docs/benchmarks.md, \
         \"MoE dispatch and combine\""
    );
    ExitCode::SUCCESS
}

/// Model output of one EP size: latencies (µs) over ranks × seeds, and
/// the wire floors (µs): the most bytes any rank sends or receives in one
/// phase, at the rank's total link rate.
struct ModelOut {
    disp: Vec<f64>,
    comb: Vec<f64>,
    disp_floor: f64,
    comb_floor: f64,
}

/// The wire floor of `bytes_per_pair` per remote pair (µs), worst rank.
fn floor_us(d: &weft_moe::Dims, ids: &[&[u32]], bytes_per_pair: u64, gbps: f64) -> f64 {
    let n = d.ranks as usize;
    let (mut sent, mut recv) = (vec![0u64; n], vec![0u64; n]);
    for (s, ids) in ids.iter().enumerate() {
        for &e in *ids {
            let to = d.rank_of_expert(e) as usize;
            if to != s {
                sent[s] += bytes_per_pair;
                recv[to] += bytes_per_pair;
            }
        }
    }
    let most = sent.iter().chain(&recv).copied().max().unwrap_or(0);
    most as f64 * 8.0 / gbps / 1000.0
}

/// Dispatch and combine latencies (µs) over ranks × seeds.
fn model_one(
    nic: &Nic,
    ep: u32,
    private: u32,
    seeds: u32,
    host: HostModel,
) -> Result<ModelOut, weft_moe::MoeError> {
    let cfg = ds_config(ep, private);
    let d = cfg.validate()?;
    let sim = SimConfig {
        fabric: FabricConfig::ideal(u64::from(ep)),
        nics: nic.nics,
        nic: nic.model,
        host,
        tick: Duration::from_nanos(100),
    };
    let mut cl = SimCluster::new(&cfg, &sim)?;
    let mut disp = Vec::new();
    let mut comb = Vec::new();
    let (mut disp_floor, mut comb_floor) = (0f64, 0f64);
    let gbps = nic.model.link_gbps * nic.nics as f64;
    let opts = RunOpts {
        delays: Vec::new(),
        synchronized: true,
    };
    let out_row = d.out_row_bytes() as usize;
    for s in 0..seeds {
        let mut rng = Rng(u64::from(s) * 7919 + u64::from(ep));
        let ins = ds_inputs(&d, &mut rng);
        let ids: Vec<&[u32]> = ins.iter().map(|i| i.ids.as_slice()).collect();
        disp_floor = disp_floor.max(floor_us(&d, &ids, d.b_in, gbps));
        comb_floor = comb_floor.max(floor_us(&d, &ids, d.b_out, gbps));
        let views = vec![ins.iter().map(|i| i.view()).collect::<Vec<_>>()];
        let steps = cl.run_steps(&views, &opts, |_, _, t| vec![0u8; t.rows() * out_row])?;
        for st in &steps {
            for t in &st.times {
                disp.push(t.unpacked.saturating_sub(t.dispatch_start) as f64 / 1000.0);
                comb.push(t.summed.saturating_sub(t.combine_start) as f64 / 1000.0);
            }
        }
    }
    cl.shutdown()?;
    Ok(ModelOut {
        disp,
        comb,
        disp_floor,
        comb_floor,
    })
}
