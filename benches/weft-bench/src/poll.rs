//! `poll`: what each [`PollPolicy`] costs. For each policy, on engines with
//! the library's default settings otherwise:
//! - submit → completion of one 64 B WRITE after 1 ms of idleness (the
//!   worker has gone through its idle phases; a parked worker must be
//!   woken), p50 and p99, against `Busy` in the same run;
//! - the CPU an idle engine burns per group (its threads' on-CPU time over
//!   300 ms without work, in cores).

use crate::backend::{BackendKind, Testbed};
use crate::cpu::CpuSample;
use crate::engines::{wait_until, Shutdown};
use crate::report::Row;
use crate::stats::{median, ns, percentiles};
use crate::{Config, Progress};
use std::time::{Duration, Instant};
use weft::{DomainGroupSpec, EngineConfig, HostBuffer, OnDone, PollPolicy, TransferEngine};

const BENCH: &str = "poll";
/// Idle gap before each timed submit.
const GAP: Duration = Duration::from_millis(1);
/// Window over which idle CPU is measured.
const IDLE_WINDOW: Duration = Duration::from_millis(300);

/// One measured setting: a policy and, for `Adaptive`, when a
/// software-progress group sleeps in its NICs' wait fds
/// (`EngineConfig::idle_block_after`; the fd rows differ from plain
/// `adaptive` only on backends whose NICs have wait fds: libfabric tcp,
/// shm).
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    /// The policy.
    pub poll: PollPolicy,
    /// `EngineConfig::idle_block_after`.
    pub block_after: Option<Duration>,
}

/// The settings measured, with their row names.
pub fn policies() -> Vec<(&'static str, Setting)> {
    let default = EngineConfig::default().idle_block_after;
    let adaptive = |block_after| Setting {
        poll: PollPolicy::Adaptive,
        block_after,
    };
    vec![
        (
            "busy",
            Setting {
                poll: PollPolicy::Busy,
                block_after: default,
            },
        ),
        (
            "adaptive (default: fd sleep after 10 ms)",
            adaptive(default),
        ),
        ("adaptive, fd sleep at once", adaptive(Some(Duration::ZERO))),
        ("adaptive, no fd sleep", adaptive(None)),
        (
            "spin 50 us then park",
            Setting {
                poll: PollPolicy::SpinThenPark {
                    spin: Duration::from_micros(50),
                },
                block_after: default,
            },
        ),
    ]
}

fn engine(tb: &Testbed, set: Setting) -> Result<Shutdown, String> {
    let p = tb.host()?;
    TransferEngine::builder()
        .group(DomainGroupSpec::new(p, vec![0]))
        .config({
            let mut c = EngineConfig::default();
            c.poll = set.poll;
            c.idle_block_after = set.block_after;
            c
        })
        .build()
        .map(Shutdown)
        .map_err(|e| e.to_string())
}

struct Measured {
    lat_ns: Vec<f64>,
    idle_cores_per_group: Option<f64>,
}

fn measure(tb: &Testbed, set: Setting, samples: usize) -> Result<Measured, String> {
    let tx = engine(tb, set)?;
    let rx = engine(tb, set)?;
    // Idle CPU first: two engines, nothing to do.
    std::thread::sleep(Duration::from_millis(50));
    let s = CpuSample::now();
    std::thread::sleep(IDLE_WINDOW);
    let idle = s.since().engine_cores().map(|c| c / 2.0);
    let a = HostBuffer::new(4096).map_err(|e| e.to_string())?;
    let b = HostBuffer::new(4096).map_err(|e| e.to_string())?;
    let (src, _) = tx.reg_mr(a.region()).map_err(|e| e.to_string())?;
    let (_, dst) = rx.reg_mr(b.region()).map_err(|e| e.to_string())?;
    let mut lat = Vec::with_capacity(samples);
    for i in 0..samples + 5 {
        std::thread::sleep(GAP);
        let (od, flag) = OnDone::flag();
        let t0 = Instant::now();
        tx.submit_single_write(64, None, (&src, 0), (&dst, 0), od)
            .map_err(|e| e.to_string())?;
        wait_until(|| flag.is_done())?;
        let t = t0.elapsed();
        if let Some(Err(e)) = flag.result() {
            return Err(e.to_string());
        }
        if i >= 5 {
            lat.push(ns(t));
        }
    }
    drop((tx, rx));
    drop((a, b));
    Ok(Measured {
        lat_ns: lat,
        idle_cores_per_group: idle,
    })
}

/// Runs `poll` on `kind` (1 NIC).
pub fn run(cfg: &Config, kind: &BackendKind, progress: &mut Progress) -> Vec<Row> {
    let backend = kind.to_string();
    progress.step(&format!("poll {backend}"));
    let tb = match Testbed::new(kind, 1) {
        Ok(t) => t,
        Err(why) => return vec![Row::unavailable(BENCH, "all", &backend, 1, why)],
    };
    let samples = if cfg.quick { 30 } else { 400 };
    let pols = policies();
    // Interleaved rounds: per policy, p50s, p99s and idle CPU.
    let mut p50 = vec![Vec::new(); pols.len()];
    let mut p99 = vec![Vec::new(); pols.len()];
    let mut idle = vec![Vec::new(); pols.len()];
    let mut err: Vec<Option<String>> = vec![None; pols.len()];
    for _ in 0..cfg.rounds().min(3) {
        for (k, (_, pol)) in pols.iter().enumerate() {
            if err[k].is_some() {
                continue;
            }
            match measure(&tb, *pol, samples) {
                Ok(mut m) => {
                    let p = percentiles(&mut m.lat_ns);
                    p50[k].push(p.p50 / 1e3);
                    p99[k].push(p.p99 / 1e3);
                    if let Some(c) = m.idle_cores_per_group {
                        idle[k].push(c);
                    }
                }
                Err(e) => err[k] = Some(e),
            }
        }
    }
    let busy_p50 = (!p50[0].is_empty()).then(|| median(&mut p50[0].clone()));
    let busy_idle = (!idle[0].is_empty()).then(|| median(&mut idle[0].clone()));
    let mut rows = Vec::new();
    for (k, (name, _)) in pols.iter().enumerate() {
        if let Some(e) = err[k].take() {
            rows.push(Row::failed(
                BENCH,
                "submit_to_done_after_idle",
                &backend,
                1,
                e,
            ));
            continue;
        }
        let v50 = median(&mut p50[k]);
        let v99 = median(&mut p99[k]);
        rows.push(
            Row::new(
                BENCH,
                "submit_to_done_after_idle",
                &backend,
                1,
                format!("{name}, 64 B, 1 ms gap"),
                "p50",
                "us",
                v50,
                busy_p50.map(|b| (b, "busy polling")),
            )
            .extra("p99_us", v99)
            .extra("samples", samples as f64),
        );
        if !idle[k].is_empty() {
            rows.push(Row::new(
                BENCH,
                "idle_cpu_per_group",
                &backend,
                1,
                name.to_string(),
                "engine threads CPU",
                "cores",
                median(&mut idle[k]),
                busy_idle.map(|b| (b, "busy polling")),
            ));
        }
    }
    rows
}
