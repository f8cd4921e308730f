//! `weft-rl`: plan, simulate and run RL weight transfers.
//!
//! - `weft-rl plan --model kimi-k2` prints the routing summary for a model
//!   and layout (default: the paper's).
//! - `weft-rl simulate` predicts update times at the paper's scale.
//! - `weft-rl run --provider libfabric:tcp` runs real updates between
//!   processes (P2P and Rank0 side by side, checked bit-exact; `--kill`).
//!   With `--rendezvous dir:/path` (or `etcd:http://host:2379`; `mem` for
//!   loopback threads) the ranks publish their memory descriptors in the
//!   store and read each other's from it; the controller only relays each
//!   rank's generation.

mod demo;
mod run;
mod worker;
#[cfg(test)]
mod worker_fuzz;

use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use weft_rl::models::{self, InferLayout, ModelConfig, TrainLayout};
use weft_rl::sim::{simulate, SimConfig};
use weft_rl::summary::Summary;
use weft_rl::{plan, ModelLayout, Plan, PlanConfig};

#[derive(Parser)]
#[command(name = "weft-rl", about = "RL weight transfer over weft")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the routing summary of a model and layout.
    Plan(LayoutArgs),
    /// Predict update times at the paper's scale (the plan's WRITEs over the
    /// loopback fabric's NIC model, simulated time; the event-level cost
    /// model next to it): P2P vs Rank0 vs the bandwidth bound vs the paper.
    Simulate(SimArgs),
    /// Real updates: trainer and inference ranks as processes (libfabric)
    /// or threads (loopback), P2P and Rank0 side by side, checked bit-exact.
    Run(RunArgs),
    /// (internal) one rank of `run`.
    #[command(hide = true)]
    Worker {
        /// trainer | inference.
        role: String,
        /// Rank.
        rank: u32,
        /// Encoded spec.
        spec: String,
    },
}

#[derive(Args, Clone)]
struct RunArgs {
    /// loopback, libfabric:tcp, libfabric:shm.
    #[arg(long, default_value = "loopback")]
    provider: String,
    /// Model (tiny-moe, tiny-mla).
    #[arg(long, default_value = "tiny-moe")]
    model: String,
    /// A Hugging Face config.json instead of --model (every rank reads it).
    #[arg(long)]
    config: Option<String>,
    /// FSDP.
    #[arg(long, default_value_t = 2)]
    fsdp: u32,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pp: u32,
    /// Expert parallelism.
    #[arg(long, default_value_t = 2)]
    ep: u32,
    /// Inference ranks.
    #[arg(long, default_value_t = 2)]
    inference: u32,
    /// Inference ranks per instance.
    #[arg(long, default_value_t = 2)]
    instance: u32,
    /// Inference attention TP.
    #[arg(long, default_value_t = 2)]
    tp: u32,
    /// NICs per rank.
    #[arg(long, default_value_t = 1)]
    nics: usize,
    /// Updates.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Kill a trainer during one more update, check, replace, retry.
    #[arg(long)]
    kill: bool,
    /// Unit size in KiB.
    #[arg(long, default_value_t = 256)]
    unit_kib: u64,
    /// Watermark in KiB.
    #[arg(long, default_value_t = 2048)]
    watermark_kib: u64,
    /// Step deadline in ms.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Ranks publish their memory descriptors in this rendezvous store and
    /// read each other's from it (`mem` for loopback threads, `dir:/path`
    /// or `etcd:http://host:2379` for processes); the controller only
    /// relays generations.
    #[arg(long)]
    rendezvous: Option<String>,
    /// The rendezvous namespace (one per run sharing a store).
    #[arg(long, default_value = "weft-rl")]
    namespace: String,
}

#[derive(Args, Clone)]
struct SimArgs {
    /// Models (default: the paper's three).
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// A Hugging Face config.json to simulate (instead of --models).
    #[arg(long)]
    config: Option<String>,
    /// A layout file (JSON: train fsdp/pp/ep, inference ranks/instance/tp)
    /// instead of the paper's layout.
    #[arg(long)]
    layout: Option<String>,
    /// NICs per GPU.
    #[arg(long, default_value_t = 1)]
    nics: u32,
    /// Gbit/s per NIC.
    #[arg(long, default_value_t = 400.0)]
    nic_gbps: f64,
    /// Unit size in MiB.
    #[arg(long, default_value_t = 2)]
    unit_mib: u64,
    /// Watermark in MiB.
    #[arg(long, default_value_t = 512)]
    watermark_mib: u64,
    /// Ramp-up waves per mesh group (a quarter, a half, ... of the
    /// watermark); 0 for none.
    #[arg(long, default_value_t = 2)]
    ramp: u32,
    /// Fabric seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// As `plan --fp8-fallback`.
    #[arg(long)]
    fp8_fallback: bool,
    /// Model one wave at a time per trainer (the pipeline before waves
    /// overlapped), for comparison.
    #[arg(long)]
    no_overlap: bool,
}

#[derive(Args, Clone)]
struct LayoutArgs {
    /// qwen3-235b-a22b, deepseek-v3, kimi-k2, tiny-moe, tiny-mla.
    #[arg(long, default_value = "kimi-k2")]
    model: String,
    /// A Hugging Face config.json instead of --model (Llama, Mistral,
    /// Qwen2/3, Qwen3-MoE, Mixtral, DeepSeek-V3, Kimi-K2 field names).
    #[arg(long)]
    config: Option<String>,
    /// A layout file (JSON: {"train": {"fsdp", "pp", "ep"}, "inference":
    /// {"ranks", "instance", "tp"}}) instead of the paper's layout; the
    /// flags below override it.
    #[arg(long)]
    layout: Option<String>,
    /// FSDP degree (default: the paper's layout).
    #[arg(long)]
    fsdp: Option<u32>,
    /// Pipeline stages.
    #[arg(long)]
    pp: Option<u32>,
    /// Expert parallelism.
    #[arg(long)]
    ep: Option<u32>,
    /// Training tensor parallelism.
    #[arg(long)]
    train_tp: Option<u32>,
    /// HSDP replicas of the training layout.
    #[arg(long)]
    replicas: Option<u32>,
    /// Inference ranks.
    #[arg(long)]
    inference: Option<u32>,
    /// Inference ranks per instance.
    #[arg(long)]
    instance: Option<u32>,
    /// Inference attention TP.
    #[arg(long)]
    tp: Option<u32>,
    /// Inference pipeline stages per instance.
    #[arg(long)]
    inference_pp: Option<u32>,
    /// NICs per trainer.
    #[arg(long, default_value_t = 1)]
    nics: usize,
    /// Unit size in MiB.
    #[arg(long, default_value_t = 2)]
    unit_mib: u64,
    /// Watermark in MiB.
    #[arg(long, default_value_t = 512)]
    watermark_mib: u64,
    /// Ramp-up waves per mesh group (a quarter, a half, ... of the
    /// watermark); 0 for none.
    #[arg(long, default_value_t = 2)]
    ramp: u32,
    /// Keep fp8 targets that cannot be quantised as given (fused segments
    /// that are not whole 128-row tiles) in bf16 instead of refusing the
    /// layout; the plan lists them.
    #[arg(long)]
    fp8_fallback: bool,
}

impl LayoutArgs {
    fn resolve(&self) -> Result<(ModelConfig, TrainLayout, InferLayout, PlanConfig), String> {
        let m = models::load(self.config.as_deref().unwrap_or(&self.model))
            .map_err(|e| e.to_string())?;
        let from_file = self.layout.is_some();
        let (mut t, mut i) = match &self.layout {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|e| format!("--layout {path}: {e}"))?;
                models::LayoutFile::parse(&text)
                    .map_err(|e| format!("--layout {path}: {e}"))?
                    .layouts()
            }
            None => models::paper_layout(&m),
        };
        t.fsdp = self.fsdp.unwrap_or(t.fsdp);
        t.pp = self.pp.unwrap_or(t.pp);
        t.ep = self.ep.unwrap_or(t.ep);
        t.tp = self.train_tp.unwrap_or(t.tp);
        t.replicas = self.replicas.unwrap_or(t.replicas);
        i.ranks = self.inference.unwrap_or(i.ranks);
        // The paper's layout shrinks to fit a smaller --inference; a layout
        // file's numbers stand as written (`build` refuses what does not fit).
        let fit = |v: u32, cap: u32| if from_file { v } else { v.min(cap) };
        i.instance = self.instance.unwrap_or(fit(i.instance, i.ranks));
        i.pp = self.inference_pp.unwrap_or(i.pp);
        i.attn_tp = self.tp.unwrap_or(fit(i.attn_tp, i.instance / i.pp.max(1)));
        let mib = |field: &'static str, v: u64| {
            v.checked_mul(1 << 20)
                .filter(|&b| b > 0)
                .ok_or_else(|| format!("--{field} {v}: a size in MiB above 0 (and below 2^44)"))
        };
        if !(1..=64).contains(&self.nics) {
            return Err(format!("--nics {}: 1 to 64 NICs per trainer", self.nics));
        }
        let cfg = PlanConfig {
            unit_bytes: mib("unit-mib", self.unit_mib)?,
            watermark: mib("watermark-mib", self.watermark_mib)?,
            ramp: self.ramp,
            ..PlanConfig::default()
        };
        cfg.validate().map_err(|e| e.to_string())?;
        Ok((m, t, i, cfg))
    }

    fn build(&self) -> Result<(ModelConfig, TrainLayout, InferLayout, ModelLayout, Plan), String> {
        let (m, t, i, cfg) = self.resolve()?;
        let mut ml = models::build(&m, t, i).map_err(|e| e.to_string())?;
        if self.fp8_fallback {
            let fb = ml.fp8_fallback(cfg.block);
            if let Some(f) = fb.first() {
                println!(
                    "fp8 fallback: {} tensors kept bf16 (e.g. inference {} {}: {})",
                    fb.len(),
                    f.inference,
                    f.tensor,
                    f.reason
                );
            }
        }
        let p = plan(&ml, &cfg).map_err(|e| e.to_string())?;
        Ok((m, t, i, ml, p))
    }
}

fn cmd_plan(a: &LayoutArgs) -> Result<(), String> {
    let t0 = Instant::now();
    let (m, t, i, ml, p) = a.build()?;
    let dt = t0.elapsed();
    println!(
        "{} ({}): FSDP/PP/EP/TP = {}/{}/{}/{} on {} trainers -> {} inference ranks (instances of {}, attention TP {}, {} stages)",
        m.name,
        m.source,
        t.fsdp,
        t.pp,
        t.ep,
        t.tp,
        t.ranks(),
        i.ranks,
        i.instance,
        i.attn_tp,
        i.pp
    );
    println!("{}", Summary::of(&ml, &p, a.nics));
    println!("planned in {:.2} s", dt.as_secs_f64());
    Ok(())
}

/// The paper's reported update time per model (seconds).
fn paper(m: &str) -> &'static str {
    match m {
        "kimi-k2" => "1.2-1.3 (Table 5: 1.233)",
        "deepseek-v3" | "qwen3-235b-a22b" => "1.2-2.0 (training logs)",
        _ => "-",
    }
}

fn cmd_simulate(a: &SimArgs) -> Result<(), String> {
    let names: Vec<String> = if let Some(c) = &a.config {
        vec![c.clone()]
    } else if a.models.is_empty() {
        vec![
            "kimi-k2".into(),
            "deepseek-v3".into(),
            "qwen3-235b-a22b".into(),
        ]
    } else {
        a.models.clone()
    };
    let cfg = SimConfig {
        nics: a.nics,
        nic_gbps: a.nic_gbps,
        seed: a.seed,
        pipelined: !a.no_overlap,
        ..SimConfig::default()
    };
    cfg.validate().map_err(|e| e.to_string())?;
    println!(
        "loopback fabric (timing-only, step mode, seed {}): {} x {} Gb/s NICs per GPU, {} us one-way; \
         modelled: unshard over NVLink {} GB/s (same {}-GPU node) or the NICs, quantise {} GB/s/GPU + {} us/kernel, submit {} us/WR",
        cfg.seed, cfg.nics, cfg.nic_gbps, cfg.latency_us, cfg.nvlink_gbs, cfg.gpus_per_node, cfg.quant_gbs,
        cfg.kernel_us, cfg.submit_us
    );
    println!("| model | layout | into inference | weft P2P (fabric) | unshard / quantise / write / wait (slowest rank) | cost model | bytes / aggregate bw | P2P ÷ bound | Rank0 (model) | paper | WRs / fabric events | plan + sim wall |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for n in names {
        let t0 = Instant::now();
        let la = LayoutArgs {
            model: n.clone(),
            config: None,
            layout: a.layout.clone(),
            fsdp: None,
            pp: None,
            ep: None,
            train_tp: None,
            replicas: None,
            inference: None,
            instance: None,
            tp: None,
            inference_pp: None,
            nics: a.nics as usize,
            unit_mib: a.unit_mib,
            watermark_mib: a.watermark_mib,
            ramp: a.ramp,
            fp8_fallback: a.fp8_fallback,
        };
        let (m, t, i, ml, p) = la.build()?;
        let n = m.name.to_string();
        let planned = t0.elapsed();
        let r = simulate(&ml, &p, &cfg).map_err(|e| e.to_string())?;
        println!(
            "| {n} | FSDP/PP/EP{} {}/{}/{}{} x{} -> {} (TP{}{}, instances of {}) | {} | {:.3} s | {:.3} / {:.3} / {:.3} / {:.3} s | {:.3} s | {:.3} s | {:.3} | {:.1} s | {} | {:.2} M / {:.2} M | {:.1} + {:.1} s |",
            if t.tp > 1 { "/TP" } else { "" }, t.fsdp, t.pp, t.ep,
            if t.tp > 1 { format!("/{}", t.tp) } else { String::new() }, t.ranks(), i.ranks, i.attn_tp,
            if i.pp > 1 { format!(" PP{}", i.pp) } else { String::new() }, i.instance,
            weft_rl::summary::human(r.bytes as f64),
            r.p2p_s, r.unshard_s, r.quant_s, r.write_s, r.wait_s, r.model.p2p_s, r.bound_s, r.p2p_s / r.bound_s, r.rank0_s, paper(&n),
            r.wrs as f64 / 1e6, r.events as f64 / 1e6,
            planned.as_secs_f64(), (t0.elapsed() - planned).as_secs_f64()
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Plan(a) => cmd_plan(a),
        Cmd::Simulate(a) => cmd_simulate(a),
        Cmd::Run(a) => run::run(
            &worker::Spec {
                provider: a.provider.clone(),
                model: a.config.clone().unwrap_or_else(|| a.model.clone()),
                train: TrainLayout {
                    fsdp: a.fsdp,
                    pp: a.pp,
                    ep: a.ep,
                    tp: 1,
                    replicas: 1,
                },
                infer: InferLayout {
                    ranks: a.inference,
                    instance: a.instance,
                    attn_tp: a.tp,
                    pp: 1,
                },
                nics: a.nics,
                unit_bytes: a.unit_kib << 10,
                watermark: a.watermark_kib << 10,
                timeout_ms: a.timeout_ms,
                rendezvous: a
                    .rendezvous
                    .as_ref()
                    .map(|r| (r.clone(), a.namespace.clone())),
            },
            a.steps,
            a.kill,
        ),
        Cmd::Worker { role, rank, spec } => run::worker_main(role, *rank, spec),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-rl: {e}");
            ExitCode::FAILURE
        }
    }
}
