//! # weft-bench: the paper's microbenchmarks on any backend
//!
//! The core of the `weft-bench` binary, as a library so tests (and other
//! harnesses) can run it: [`run`] takes a [`Config`] and returns a
//! [`Report`] with one [`Row`] per measurement. Every row that measures
//! weft also carries its baseline, measured in the same run in alternating
//! rounds: the backend driven directly without the engine (`p2p`, `imm`),
//! the backend's own posting cost and a bare cross-thread queue hand-off
//! (`proxy`). See `docs/benchmarks.md`.

#![deny(unsafe_code)]

pub mod backend;
pub mod cpu;
#[allow(unsafe_code)]
pub mod engines;
pub mod fi_pingpong;
pub mod floor;
pub mod handoff;
pub mod imm;
pub mod kvcache;
pub mod moe;
pub mod moe_model;
pub mod p2p;
#[allow(unsafe_code)]
pub mod pin;
pub mod pingpong;
pub mod poll;
mod progress;
pub mod proxy;
pub mod raw;
pub mod report;
pub mod rig;
pub mod rl;
pub mod stats;
pub mod table;

pub use backend::{BackendKind, Testbed};
pub use progress::Progress;
pub use report::{Breakdown, Report, Row, Status, Target};

use std::time::Instant;

/// Which benchmarks to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// Point-to-point WRITEs.
    P2p,
    /// Host-path breakdown of scatters.
    Proxy,
    /// ImmCounter.
    Imm,
    /// All of the above.
    All,
    /// RL weight transfer at the paper's scale (simulated; not in `All`).
    Rl,
    /// KvCache transfer (not part of `All`).
    Kvcache,
    /// Polling policies: latency after idleness and idle CPU (part of `All`).
    Poll,
    /// Two-process ping-pong next to `fi_pingpong`, and CPU cost (part of
    /// `All` on libfabric backends).
    Pingpong,
}

/// What to run and how long.
#[derive(Debug, Clone)]
pub struct Config {
    /// Benchmarks.
    pub suite: Suite,
    /// Backends, each run in turn.
    pub backends: Vec<BackendKind>,
    /// Short run for CI smoke tests.
    pub quick: bool,
    /// NIC counts for `p2p` (default: 1, 2, 4, 8; quick: 1, 2).
    pub nics: Option<Vec<usize>>,
    /// Interleaved rounds (weft batch, baseline batch) per case.
    pub rounds: Option<usize>,
    /// Cases of `p2p` to run (default: all).
    pub p2p_cases: Option<Vec<p2p::Case>>,
    /// Largest single-WRITE size of `p2p` (default: all sizes).
    pub max_size: Option<u64>,
    /// Pages per paged submit of `p2p` (default: the plan's).
    pub page_counts: Option<Vec<u64>>,
    /// Thread placement of `p2p` and `imm` rows (see [`pin`]).
    pub pin: pin::PinMode,
    /// Show progress on stderr.
    pub progress: bool,
    /// The command line, recorded in the report.
    pub command: String,
    /// `pingpong` settings.
    pub pingpong: pingpong::PingArgs,
    /// This binary, re-executed as `pingpong-peer` for the server side of
    /// a libfabric ping-pong; `None` runs the server on a thread.
    pub peer_exe: Option<std::path::PathBuf>,
}

impl Config {
    /// Defaults for `suite` on loopback-null.
    pub fn new(suite: Suite, quick: bool) -> Self {
        Config {
            suite,
            backends: vec![BackendKind::LoopbackNull],
            quick,
            nics: None,
            rounds: None,
            p2p_cases: None,
            max_size: None,
            page_counts: None,
            pin: pin::PinMode::Auto,
            progress: false,
            command: String::new(),
            pingpong: pingpong::PingArgs::default(),
            peer_exe: None,
        }
    }

    /// NIC counts of `p2p`.
    pub fn nic_counts(&self) -> Vec<usize> {
        match &self.nics {
            Some(v) if !v.is_empty() => v.clone(),
            _ if self.quick => vec![1, 2],
            _ => vec![1, 2, 4, 8],
        }
    }

    /// Whether `p2p` runs `case`.
    pub fn runs_p2p(&self, case: p2p::Case) -> bool {
        self.p2p_cases.as_ref().is_none_or(|c| c.contains(&case))
    }

    /// Rounds per case.
    pub fn rounds(&self) -> usize {
        self.rounds.unwrap_or(if self.quick { 2 } else { 5 }).max(1)
    }
}

/// A one-line description of this machine.
pub fn machine() -> String {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!(
        "{cpus} CPUs ({model}), {} {}",
        std::env::consts::OS,
        std::env::consts::ARCH
    )
}

/// Runs the configured benchmarks.
pub fn run(cfg: &Config) -> Report {
    let start = Instant::now();
    let (p2p, proxy, imm) = match cfg.suite {
        Suite::P2p => (true, false, false),
        Suite::Proxy => (false, true, false),
        Suite::Imm => (false, false, true),
        Suite::All => (true, true, true),
        Suite::Rl => (false, false, false),
        Suite::Kvcache => (false, false, false),
        Suite::Pingpong => (false, false, false),
        Suite::Poll => (false, false, false),
    };
    let poll = matches!(cfg.suite, Suite::Poll | Suite::All);
    let ping = |kind: &BackendKind| match cfg.suite {
        Suite::Pingpong => true,
        Suite::All => matches!(kind, BackendKind::Libfabric(_)),
        _ => false,
    };
    let kv = cfg.suite == Suite::Kvcache;
    let plan = p2p::P2pPlan::new(cfg.quick).narrowed(cfg);
    let per_backend = usize::from(p2p) * plan.steps() * cfg.nic_counts().len()
        + usize::from(proxy) * proxy::peer_counts(cfg.quick).len()
        + usize::from(imm) * 2
        + usize::from(kv) * 2
        + usize::from(poll);
    let ping_steps =
        cfg.backends.iter().filter(|k| ping(k)).count() * cfg.pingpong.steps(cfg.quick);
    let mut progress = Progress::new(per_backend * cfg.backends.len() + ping_steps, cfg.progress);
    let mut rows = Vec::new();
    let mut bds = Vec::new();
    for kind in &cfg.backends {
        if p2p {
            rows.extend(p2p::run(cfg, kind, &mut progress));
        }
        if proxy {
            let (r, b) = proxy::run(cfg, kind, &mut progress);
            rows.extend(r);
            bds.extend(b);
        }
        if imm {
            rows.extend(imm::run(cfg, kind, &mut progress));
        }
        if kv {
            rows.extend(kvcache::run(cfg, kind, &mut progress));
        }
        if poll {
            rows.extend(poll::run(cfg, kind, &mut progress));
        }
        if ping(kind) {
            rows.extend(pingpong::run(cfg, &cfg.pingpong, kind, &mut progress));
        }
    }
    if cfg.suite == Suite::Rl {
        rows.extend(rl::run(cfg));
    }
    progress.finish();
    Report {
        command: cfg.command.clone(),
        quick: cfg.quick,
        machine: machine(),
        elapsed_s: start.elapsed().as_secs_f64(),
        rows,
        proxy_breakdown: bds,
    }
}
