//! `weft-bench`: weft's microbenchmarks (p2p, proxy, imm) on any backend,
//! each next to its raw baseline. See `docs/benchmarks.md`.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use weft_bench::{BackendKind, Config, Suite};

#[derive(Parser, Debug)]
#[command(
    name = "weft-bench",
    version,
    about = "weft microbenchmarks, side by side with raw baselines"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Backend(s), as weft provider specs: loopback, loopback-null,
    /// libfabric:tcp, libfabric:shm, libfabric:efa, verbs, verbs:DEVICE, nvlink (same host).
    /// Repeat or comma-separate for several.
    #[arg(
        long,
        global = true,
        value_delimiter = ',',
        default_value = "loopback-null"
    )]
    backend: Vec<BackendKind>,
    /// Short run for CI smoke tests (numbers are not meaningful).
    #[arg(long, global = true)]
    quick: bool,
    /// NIC counts for p2p (default 1,2,4,8; quick 1,2).
    #[arg(long, global = true, value_delimiter = ',')]
    nics: Vec<usize>,
    /// Cases of p2p to run: single, paged, imm (default: all). Repeat or
    /// comma-separate
    #[arg(long, global = true, value_delimiter = ',')]
    cases: Vec<weft_bench::p2p::Case>,
    /// Largest single-WRITE size of p2p, in bytes (default: all sizes,
    /// 64 B … 64 MiB).
    #[arg(long, global = true, value_name = "BYTES")]
    max_size: Option<u64>,
    /// Pages per paged submit of p2p (default 100,10000). Repeat or
    /// comma-separate.
    #[arg(long, global = true, value_delimiter = ',')]
    page_counts: Vec<u64>,
    /// Interleaved rounds per case (default 5; quick 2).
    #[arg(long, global = true)]
    rounds: Option<usize>,
    /// Thread placement of p2p and imm rows: `auto` (distinct CPUs from
    /// the topology when this process may use >= 8 CPUs, else unpinned),
    /// `off`, or 5 CPUs for initiator,target,submitter,tx-aux,rx-aux
    /// (e.g. 2,4,6,8,10 or 2-6).
    #[arg(long, global = true, default_value = "auto")]
    pin: weft_bench::pin::PinMode,
    /// Write the report as JSON.
    #[arg(long, global = true, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write the rows as CSV.
    #[arg(long, global = true, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Write an SVG plot of p2p bandwidth vs size (and the same chart,
    /// without text, as a PNG next to it: `F.svg` → `F.png`).
    #[arg(long, global = true, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// No progress line on stderr.
    #[arg(long, global = true)]
    no_progress: bool,
}

#[derive(Subcommand, Debug, Clone)]
enum Cmd {
    /// Single WRITE bandwidth/latency 64 B … 64 MiB, paged WRITEs, imm-only latency.
    P2p,
    /// Host-path breakdown (submit → enqueued → pickup → first WR → all posted) of scatters to 8…128 peers.
    Proxy,
    /// ImmCounter throughput and early-arrival handling.
    Imm,
    /// Everything.
    All,
    /// RL weight transfer at the paper's scale (weft-rl's simulation over the loopback fabric).
    Rl,
    /// MoE dispatch/combine, CPU path on loopback, P swept, vs the naive reference.
    Moe(weft_bench::moe::MoeArgs),
    /// MoE dispatch/combine latency MODEL (CX7, EFA) at EP8…64 next to the paper.
    MoeModel(weft_bench::moe_model::ModelArgs),
    /// KvCache transfer (Qwen3-235B-like and DeepSeek-V3 MLA shapes) vs raw paged writes.
    Kvcache,
    /// SEND/RECV and WRITE-with-imm ping-pong, two processes on libfabric or nvlink,
    /// measured like and next to fi_pingpong; CPU per GB and per M WRs.
    Pingpong(weft_bench::pingpong::PingArgs),
    /// Polling policies: submit → completion after an idle gap, idle CPU per group.
    Poll,
    /// The server side of `pingpong` (started by it; control on stdin/stdout).
    #[command(hide = true)]
    PingpongPeer,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let suite = match &cli.cmd {
        Cmd::P2p => Suite::P2p,
        Cmd::Proxy => Suite::Proxy,
        Cmd::Imm => Suite::Imm,
        Cmd::All => Suite::All,
        Cmd::Rl => Suite::Rl,
        Cmd::Moe(a) => return weft_bench::moe::run_cpu(a, cli.quick),
        Cmd::MoeModel(a) => return weft_bench::moe_model::run_model(a, cli.quick),
        Cmd::Kvcache => Suite::Kvcache,
        Cmd::Pingpong(_) => Suite::Pingpong,
        Cmd::Poll => Suite::Poll,
        Cmd::PingpongPeer => {
            let Some(kind) = cli.backend.first() else {
                eprintln!("pingpong-peer: no --backend");
                return ExitCode::FAILURE;
            };
            return match weft_bench::pingpong::peer_main(kind) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("pingpong-peer ({kind}): {e}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    let mut cfg = Config::new(suite, cli.quick);
    cfg.backends = cli.backend.clone();
    cfg.nics = (!cli.nics.is_empty()).then(|| cli.nics.clone());
    cfg.rounds = cli.rounds;
    cfg.p2p_cases = (!cli.cases.is_empty()).then(|| cli.cases.clone());
    cfg.max_size = cli.max_size;
    cfg.page_counts = (!cli.page_counts.is_empty()).then(|| cli.page_counts.clone());
    if let Err(e) = weft_bench::pin::Placement::resolve(&cli.pin) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    cfg.pin = cli.pin.clone();
    cfg.progress = !cli.no_progress;
    cfg.command = std::env::args().collect::<Vec<_>>().join(" ");
    if let Cmd::Pingpong(a) = &cli.cmd {
        cfg.pingpong = a.clone();
    }
    cfg.peer_exe = std::env::current_exe().ok();
    let report = weft_bench::run(&cfg);
    let width = weft_bench::report::TERMINAL_WIDTH;
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    print!(
        "{}",
        weft_bench::table::wrap(
            &format!(
                "weft-bench on {} ({}; {:.1} s).",
                report.machine,
                if report.quick { "quick" } else { "full" },
                report.elapsed_s
            ),
            width
        )
    );
    if cpus <= 4 {
        print!(
            "{}",
            weft_bench::table::wrap(
                &format!(
                    "{cpus} CPUs: the numbers are indicative; compare ratios, which are \
                     measured against baselines of the same run."
                ),
                width
            )
        );
    }
    println!();
    print!("{}", report.table());
    let mut ok = true;
    let mut write = |path: &Option<PathBuf>, body: String, what: &str| {
        if let Some(p) = path {
            if let Err(e) = std::fs::write(p, body) {
                eprintln!("error: writing {what} to {}: {e}", p.display());
                ok = false;
            }
        }
    };
    write(&cli.json, report.json(), "JSON");
    write(&cli.csv, report.csv(), "CSV");
    write(&cli.plot, report.svg(), "plot");
    if let Some(p) = &cli.plot {
        let png = p.with_extension("png");
        match report.png(&png) {
            Ok(()) => println!(
                "\nplot: {} (bandwidth vs size; {} is the same without text)",
                p.display(),
                png.display()
            ),
            Err(e) => {
                eprintln!("error: {e}");
                ok = false;
            }
        }
    }
    for (path, what) in [(&cli.csv, "CSV"), (&cli.json, "JSON")] {
        if let Some(p) = path {
            println!(
                "{what}: {} (every column, baseline names, targets)",
                p.display()
            );
        }
    }
    let failed = report
        .rows
        .iter()
        .filter(|r| matches!(r.status, weft_bench::Status::Failed(_)))
        .count();
    if failed > 0 {
        eprintln!("{failed} measurement(s) failed");
        ok = false;
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
