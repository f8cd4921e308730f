//! `weft-rl`: plan, simulate and run RL weight transfers.
//!
//! - `weft-rl plan --model kimi-k2` prints the routing summary for a model
//!   and layout (default: the paper's).

use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use weft_rl::models::{self, InferLayout, ModelConfig, TrainLayout};
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
}

#[derive(Args, Clone)]
struct LayoutArgs {
    /// qwen3-235b-a22b, deepseek-v3, kimi-k2, tiny-moe, tiny-mla.
    #[arg(long, default_value = "kimi-k2")]
    model: String,
    /// FSDP degree (default: the paper's layout).
    #[arg(long)]
    fsdp: Option<u32>,
    /// Pipeline stages.
    #[arg(long)]
    pp: Option<u32>,
    /// Expert parallelism.
    #[arg(long)]
    ep: Option<u32>,
    /// Inference ranks.
    #[arg(long)]
    inference: Option<u32>,
    /// Inference ranks per instance.
    #[arg(long)]
    instance: Option<u32>,
    /// Inference attention TP.
    #[arg(long)]
    tp: Option<u32>,
    /// NICs per trainer.
    #[arg(long, default_value_t = 1)]
    nics: usize,
    /// Unit size in MiB.
    #[arg(long, default_value_t = 8)]
    unit_mib: u64,
    /// Watermark in MiB.
    #[arg(long, default_value_t = 512)]
    watermark_mib: u64,
}

impl LayoutArgs {
    fn resolve(&self) -> Result<(ModelConfig, TrainLayout, InferLayout, PlanConfig), String> {
        let m = models::model(&self.model).ok_or_else(|| {
            let names: Vec<_> = models::MODELS.iter().map(|m| m.name).collect();
            format!(
                "unknown model {:?} (known: {})",
                self.model,
                names.join(", ")
            )
        })?;
        let (mut t, mut i) = models::paper_layout(&m);
        t.fsdp = self.fsdp.unwrap_or(t.fsdp);
        t.pp = self.pp.unwrap_or(t.pp);
        t.ep = self.ep.unwrap_or(t.ep);
        i.ranks = self.inference.unwrap_or(i.ranks);
        i.instance = self.instance.unwrap_or(i.instance.min(i.ranks));
        i.attn_tp = self.tp.unwrap_or(i.attn_tp.min(i.instance));
        let cfg = PlanConfig {
            unit_bytes: self.unit_mib << 20,
            watermark: self.watermark_mib << 20,
            ..PlanConfig::default()
        };
        Ok((m, t, i, cfg))
    }

    fn build(&self) -> Result<(ModelConfig, TrainLayout, InferLayout, ModelLayout, Plan), String> {
        let (m, t, i, cfg) = self.resolve()?;
        let ml = models::build(&m, t, i).map_err(|e| e.to_string())?;
        let p = plan(&ml, &cfg).map_err(|e| e.to_string())?;
        Ok((m, t, i, ml, p))
    }
}

fn cmd_plan(a: &LayoutArgs) -> Result<(), String> {
    let t0 = Instant::now();
    let (m, t, i, ml, p) = a.build()?;
    let dt = t0.elapsed();
    println!(
        "{} ({}): FSDP/PP/EP = {}/{}/{} on {} trainers -> {} inference ranks (instances of {}, attention TP {})",
        m.name,
        m.source,
        t.fsdp,
        t.pp,
        t.ep,
        t.ranks(),
        i.ranks,
        i.instance,
        i.attn_tp
    );
    println!("{}", Summary::of(&ml, &p, a.nics));
    println!("planned in {:.2} s", dt.as_secs_f64());
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Plan(a) => cmd_plan(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-rl: {e}");
            ExitCode::FAILURE
        }
    }
}
