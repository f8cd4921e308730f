//! `p2p`: single WRITE bandwidth and latency (64 B … 64 MiB), paged WRITEs
//! (1–64 KiB pages, 100 and 10 000 pages), immediate-only latency; one set
//! of rows per NIC count. Every weft measurement alternates, round by round,
//! with the same WRs posted on the raw backend; each weft round runs on an
//! engine pair built (and warmed up) for it and shut down before the raw
//! round, with the threads placed by `--pin` (see [`crate::rig`]).

use crate::backend::{BackendKind, Testbed};
use crate::engines::{wait_until, EnginePair};
use crate::pin::Placement;
use crate::raw::RawPair;
use crate::report::{fmt_bytes, Row, Target};
use crate::rig::Rig;
use crate::stats::{median, ns, percentiles, Percentiles};
use crate::{Config, Progress};
use std::time::{Duration, Instant};
use weft::shard::{plan_page, plan_single_write, Piece};
use weft::{OnDone, Pages, ShardConfig};

const BENCH: &str = "p2p";
const RAW: &str = "raw backend";
/// The raw baseline with the target progressed by a thread of its own.
const RAW_SPLIT: &str = "raw, target on own thread";
/// The raw baseline with the engine's threading: requests handed from the
/// bench thread to a posting worker (and the target, where it needs
/// polling, on a thread of its own); see [`RawPair::drive_handoff`].
const RAW_HANDOFF: &str = "raw behind a hand-off";
/// [`RAW_HANDOFF`] with each paged submit's two page lists copied into the
/// request on the bench thread and read and freed on the worker, as weft's
/// submit and worker do ([`RawPair::drive_handoff`]'s `carry`).
const RAW_HANDOFF_LISTS: &str = "raw behind a hand-off, page lists copied";

/// A group of `p2p` rows (`--cases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Case {
    /// Single WRITE bandwidth and latency per size.
    Single,
    /// Paged WRITEs.
    Paged,
    /// Immediate-only latency.
    Imm,
}

/// How a raw round is driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RawMode {
    /// [`RawPair::drive`]: one thread does everything.
    Same,
    /// [`RawPair::drive_split`]: the target on a thread of its own.
    Split,
    /// [`RawPair::drive_handoff`]: each transfer handed to a worker;
    /// with `split_target`, the target polled by a thread of its own.
    Handoff { split_target: bool },
}

/// The sizes, counts and budgets of one run.
#[derive(Debug, Clone)]
pub struct P2pPlan {
    /// Single-write sizes.
    pub sizes: Vec<u64>,
    /// Page sizes of the paged case.
    pub page_lens: Vec<u64>,
    /// Pages per paged submit.
    pub page_counts: Vec<u64>,
    /// Bytes moved per bandwidth batch.
    pub bw_bytes: u64,
    /// Most transfers per bandwidth batch.
    pub bw_max_ops: u64,
    /// Bytes per latency batch.
    pub lat_bytes: u64,
    /// Most transfers per latency batch.
    pub lat_max_ops: u64,
    /// Pages per paged batch.
    pub paged_pages: u64,
    /// Transfers in flight in bandwidth batches.
    pub window: u64,
    /// Distinct memory the paged case touches.
    pub paged_mem: u64,
}

impl P2pPlan {
    /// The plan for `quick` or full runs on `kind`: software and hardware
    /// transports get smaller batches than the simulated fabric so a full
    /// run stays in minutes.
    pub fn for_backend(quick: bool, kind: &BackendKind) -> Self {
        let mut p = Self::new(quick);
        if !quick && !kind.is_loopback() {
            p.bw_bytes = 64 << 20;
            p.bw_max_ops = 4096;
            p.lat_bytes = 4 << 20;
            p.lat_max_ops = 100;
            p.paged_pages = 20_000;
        }
        p
    }

    /// The plan for `quick` or full runs.
    pub fn new(quick: bool) -> Self {
        if quick {
            P2pPlan {
                sizes: vec![64, 64 << 10, 1 << 20],
                page_lens: vec![4 << 10],
                page_counts: vec![100, 10_000],
                bw_bytes: 4 << 20,
                bw_max_ops: 256,
                lat_bytes: 1 << 20,
                lat_max_ops: 30,
                paged_pages: 20_000,
                window: 16,
                paged_mem: 16 << 20,
            }
        } else {
            P2pPlan {
                sizes: (0..11).map(|i| 64u64 << (2 * i)).collect(),
                page_lens: vec![1 << 10, 4 << 10, 16 << 10, 64 << 10],
                page_counts: vec![100, 10_000],
                bw_bytes: 256 << 20,
                bw_max_ops: 20_000,
                lat_bytes: 16 << 20,
                lat_max_ops: 300,
                paged_pages: 200_000,
                window: 16,
                paged_mem: 64 << 20,
            }
        }
    }

    /// This plan with `cfg`'s `--max-size` and `--page-counts` applied.
    pub fn narrowed(mut self, cfg: &Config) -> Self {
        if let Some(m) = cfg.max_size {
            self.sizes.retain(|&s| s <= m);
        }
        if let Some(c) = &cfg.page_counts {
            self.page_counts = c.iter().map(|&n| n.max(1)).collect();
        }
        self
    }

    /// Progress steps of one NIC count.
    pub fn steps(&self) -> usize {
        self.sizes.len() + self.page_lens.len() * self.page_counts.len() + 1
    }
}

/// Runs `p2p` on `kind` for every NIC count of `cfg`.
pub fn run(cfg: &Config, kind: &BackendKind, progress: &mut Progress) -> Vec<Row> {
    let plan = P2pPlan::for_backend(cfg.quick, kind).narrowed(cfg);
    let mut rows = Vec::new();
    let backend = kind.to_string();
    for &nics in &cfg.nic_counts() {
        let tb = match Testbed::new(kind, nics) {
            Ok(tb) => tb,
            Err(why) => {
                progress.add_total(0);
                rows.push(Row::unavailable(BENCH, "all", &backend, nics, why));
                continue;
            }
        };
        let max = plan
            .sizes
            .iter()
            .copied()
            .max()
            .unwrap_or(64)
            .max(plan.paged_mem);
        let place = match Placement::resolve(&cfg.pin) {
            Ok(p) => p,
            Err(why) => {
                rows.push(Row::failed(BENCH, "setup", &backend, nics, why));
                continue;
            }
        };
        let mut rig = match Rig::new(&tb, max as usize, max as usize, place) {
            Ok(x) => x,
            Err(why) => {
                rows.push(Row::failed(BENCH, "setup", &backend, nics, why));
                continue;
            }
        };
        let placement = rig.label();
        // After a stall the engine/backend pair is in an unknown state:
        // the remaining cases of this NIC count are reported, not run.
        let mut stalled: Option<String> = None;
        let mut case = |rows: &mut Vec<Row>,
                        name: &str,
                        size: Option<u64>,
                        f: &mut dyn FnMut() -> Result<Vec<Row>, String>| {
            if let Some(why) = &stalled {
                rows.push(Row::failed(
                    BENCH,
                    name,
                    &backend,
                    nics,
                    format!("skipped after an earlier stall: {why}"),
                ));
                return;
            }
            match f() {
                Ok(r) => rows.extend(r.into_iter().map(|r| r.placed(&placement))),
                Err(why) => {
                    if why.contains("stalled") || why.contains("timed out") {
                        stalled = Some(why.clone());
                    }
                    let mut row = Row::failed(BENCH, name, &backend, nics, why).placed(&placement);
                    row.size_bytes = size;
                    rows.push(row);
                }
            }
        };
        let sizes: &[u64] = if cfg.runs_p2p(Case::Single) {
            &plan.sizes
        } else {
            &[]
        };
        for &size in sizes {
            progress.step(&format!(
                "p2p {backend} {nics}nic single_write {}",
                fmt_bytes(size)
            ));
            case(&mut rows, "single_write", Some(size), &mut || {
                single(cfg, &plan, &tb, &mut rig, size)
            });
        }
        let page_lens: &[u64] = if cfg.runs_p2p(Case::Paged) {
            &plan.page_lens
        } else {
            &[]
        };
        for &pl in page_lens {
            for &n in &plan.page_counts {
                progress.step(&format!(
                    "p2p {backend} {nics}nic paged {n} x {}",
                    fmt_bytes(pl)
                ));
                case(&mut rows, "paged_write", None, &mut || {
                    paged(cfg, &plan, &tb, &mut rig, pl, n)
                });
            }
        }
        if cfg.runs_p2p(Case::Imm) {
            progress.step(&format!("p2p {backend} {nics}nic imm-only latency"));
            case(&mut rows, "imm_only", None, &mut || {
                imm_only(cfg, &plan, &tb, &mut rig)
            });
        }
    }
    rows
}

fn tcp_target(tb: &Testbed, row: Row) -> Row {
    if *tb.kind() == BackendKind::Libfabric("tcp".into()) {
        if let Some(r) = row.ratio {
            return row.target(Target::at_least(r, 0.90, "x raw"));
        }
    }
    row
}

/// Raw WRs of transfer `t` of a single write of `len`: the engine's own
/// sharding plan, so both sides post the same WR set.
fn single_pieces(len: u64, lanes: usize, mwl: u64, t: u64) -> Vec<Piece> {
    plan_single_write(
        len,
        lanes,
        mwl,
        t as usize % lanes.max(1),
        &ShardConfig::default(),
    )
}

fn raw_single(
    raw: &mut RawPair,
    len: u64,
    count: u64,
    window: u64,
    imm: Option<u32>,
) -> Result<f64, String> {
    raw_single_as(raw, len, count, window, imm, RawMode::Same)
}

/// [`raw_single`] driven as `mode`.
fn raw_single_as(
    raw: &mut RawPair,
    len: u64,
    count: u64,
    window: u64,
    imm: Option<u32>,
    mode: RawMode,
) -> Result<f64, String> {
    let lanes = raw.lanes();
    let mwl = raw.max_write_len();
    // Pieces per transfer are identical for every transfer except the lane
    // rotation of unsharded writes; precompute transfer 0's shape.
    let per = single_pieces(len, lanes, mwl, 0).len().max(1) as u64;
    let mut cache: Vec<Vec<Piece>> = (0..lanes as u64)
        .map(|t| single_pieces(len, lanes, mwl, t))
        .collect();
    if cache.is_empty() {
        cache.push(single_pieces(len, 1, mwl, 0));
    }
    let total = count * per;
    let gen = |r: &RawPair, i: u64| {
        let tr = i / per;
        let k = (i % per) as usize;
        let ps = &cache[(tr % cache.len() as u64) as usize];
        let p = ps.get(k).ok_or("piece index")?;
        Ok((p.nic, r.wr(i, p.nic, p.offset, p.offset, p.len, imm)?))
    };
    let t = match mode {
        RawMode::Same => raw.drive(total, window * per, 0, gen)?,
        RawMode::Split => raw.drive_split(total, window * per, 0, gen)?,
        RawMode::Handoff { split_target } => {
            raw.drive_handoff(count, per, window, window * per, 0, split_target, None, gen)?
        }
    };
    Ok(ns(t.all_done))
}

fn single(
    cfg: &Config,
    plan: &P2pPlan,
    tb: &Testbed,
    rig: &mut Rig<'_>,
    size: u64,
) -> Result<Vec<Row>, String> {
    let backend = tb.kind().to_string();
    let nics = tb.nics();
    let bw_ops = (plan.bw_bytes / size).clamp(4, plan.bw_max_ops);
    let lat_ops = (plan.lat_bytes / size).clamp(2, plan.lat_max_ops);
    let (mut e_bw, mut r_bw) = (Vec::new(), Vec::new());
    let (mut e_lat, mut r_lat) = (Vec::new(), Vec::new());
    // Software providers progress only while polled: also measure the raw
    // loop with the target polled by its own thread, as the engine (and
    // any deployment with the target in another process) does.
    let split = matches!(tb.kind(), BackendKind::Libfabric(_));
    let mut s_bw = Vec::new();
    let mut h_bw = Vec::new();
    let split_target = tb.target_needs_polling();
    for _ in 0..cfg.rounds() {
        // weft: a fresh pair, warmed up with as many writes as the batch
        // (of at most 64 KiB), then measured, then shut down. The raw
        // baselines run on long-lived domains, and their "own thread" and
        // "hand-off" loops follow a full raw batch in the same round. A
        // pair warmed up with only a window of writes measured colder than
        // those (libfabric shm at 8 NICs, H200: 0.53-0.64 of raw with the
        // target on its own thread after 16 warm-up writes, 0.54-0.80
        // after 8192; why, e.g. fresh shm regions, is not measured).
        {
            let ep = rig.engines()?;
            ep.single_writes(size.min(64 << 10), bw_ops, plan.window, None)?;
            let te = ep.single_writes(size, bw_ops, plan.window, None)?;
            e_bw.push((size * bw_ops) as f64 / ns(te));
            for _ in 0..lat_ops {
                e_lat.push(ns(ep.single_writes(size, 1, 1, None)?) / 1e3);
            }
        }
        rig.raw(|raw| {
            let tr = raw_single(raw, size, bw_ops, plan.window, None)?;
            r_bw.push((size * bw_ops) as f64 / tr);
            if split {
                let ts = raw_single_as(raw, size, bw_ops, plan.window, None, RawMode::Split)?;
                s_bw.push((size * bw_ops) as f64 / ts);
            }
            for _ in 0..lat_ops {
                r_lat.push(raw_single(raw, size, 1, 1, None)? / 1e3);
            }
            Ok(())
        })?;
        let th = rig.raw_handoff(|raw| {
            raw_single_as(
                raw,
                size,
                bw_ops,
                plan.window,
                None,
                RawMode::Handoff { split_target },
            )
        })?;
        h_bw.push((size * bw_ops) as f64 / th);
    }
    let (eb, rb) = (median(&mut e_bw), median(&mut r_bw));
    // weft's bandwidth against one baseline.
    let bw_row = |base: f64, name: &str| {
        Row::new(
            BENCH,
            "single_write",
            &backend,
            nics,
            fmt_bytes(size),
            "bandwidth",
            "GB/s",
            eb,
            Some((base, name)),
        )
        .size(size)
    };
    let bw = bw_row(rb, RAW)
        .extra("weft_mops", eb * 1e3 / size as f64)
        .extra("raw_mops", rb * 1e3 / size as f64);
    let el = percentiles(&mut e_lat);
    let rl = percentiles(&mut r_lat);
    let lat = Row::new(
        BENCH,
        "single_write",
        &backend,
        nics,
        fmt_bytes(size),
        "latency p50",
        "us",
        el.p50,
        Some((rl.p50, RAW)),
    )
    .size(size)
    .extra("weft_p99_us", el.p99)
    .extra("raw_p99_us", rl.p99);
    let mut rows = vec![tcp_target(tb, bw)];
    if split {
        rows.push(bw_row(median(&mut s_bw), RAW_SPLIT));
    }
    rows.push(bw_row(median(&mut h_bw), RAW_HANDOFF));
    rows.push(lat);
    Ok(rows)
}

fn paged(
    cfg: &Config,
    plan: &P2pPlan,
    tb: &Testbed,
    rig: &mut Rig<'_>,
    page_len: u64,
    n: u64,
) -> Result<Vec<Row>, String> {
    let backend = tb.kind().to_string();
    let nics = tb.nics();
    let slots = (plan.paged_mem / page_len).clamp(1, n);
    let idx = |i: u64, mul: u64| u32::try_from((i * mul) % slots).unwrap_or(0);
    let sp = Pages {
        indices: (0..n).map(|i| idx(i, 1)).collect(),
        stride: page_len,
        offset: 0,
    };
    // A coprime multiplier scatters destination pages (when slots allow).
    let mul = if slots.is_multiple_of(7919) { 1 } else { 7919 };
    let dp = Pages {
        indices: (0..n).map(|i| idx(i, mul)).collect(),
        stride: page_len,
        offset: 0,
    };
    let submits = (plan.paged_pages / n).max(1);
    let lanes = rig.raw_pair().lanes();
    let mwl = rig.raw_pair().max_write_len();
    let per_page = plan_page(0, page_len, lanes, mwl, ShardConfig::default().align)
        .len()
        .max(1) as u64;
    let total_pages = submits * n;
    // Page j's pieces depend only on j % lanes.
    let lane_pieces: Vec<Vec<Piece>> = (0..lanes.max(1))
        .map(|j| plan_page(j, page_len, lanes, mwl, ShardConfig::default().align))
        .collect();
    // Submits in flight: 4 on the simulated fabric; on real transports at
    // most ~20 000 pages outstanding, so a slow software provider (shm runs
    // at a few k pages/s through the engine) stays inside the stall guard.
    let sub_window = if tb.kind().is_loopback() {
        4
    } else {
        (20_000 / n).clamp(1, 4)
    };
    let (mut e_rate, mut r_rate, mut h_rate, mut c_rate) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // WR `i` of the raw rounds: page `i / per_page` of the batch.
    let page_wr = |r: &RawPair, i: u64| -> Result<(usize, weft::WriteWr), String> {
        let page = i / per_page;
        let k = (i % per_page) as usize;
        let j = (page % n) as usize;
        let so = sp.page_offset(j).ok_or("src page")?;
        let dof = dp.page_offset(j).ok_or("dst page")?;
        let pieces = lane_pieces.get(j % lanes.max(1)).ok_or("lane")?;
        let p = pieces.get(k).ok_or("piece")?;
        Ok((
            p.nic,
            r.wr(i, p.nic, so + p.offset, dof + p.offset, p.len, None)?,
        ))
    };
    let split_target = tb.target_needs_polling();
    for _ in 0..cfg.rounds() {
        {
            let ep = rig.engines()?;
            // Warm-up: a window of the same submits (peers connected, the
            // worker's queues grown), not measured.
            ep.paged_writes(page_len, &sp, &dp, sub_window.min(submits), sub_window)?;
            let te = ep.paged_writes(page_len, &sp, &dp, submits, sub_window)?;
            e_rate.push(total_pages as f64 / ns(te) * 1e3); // Mpages/s
        }
        let window = (4 * n * per_page).min(1024 * lanes as u64);
        let t = rig.raw(|raw| raw.drive(total_pages * per_page, window, 0, page_wr))?;
        r_rate.push(total_pages as f64 / ns(t.all_done) * 1e3);
        // The same WRs, each submit's pages handed to a posting worker (at
        // most `sub_window` submits incomplete, as for weft); then again
        // with the page lists carried, as weft's submit copies them.
        for (carry, rates) in [
            (None, &mut h_rate),
            (Some((&sp.indices[..], &dp.indices[..])), &mut c_rate),
        ] {
            let t = rig.raw_handoff(|raw| {
                raw.drive_handoff(
                    submits,
                    n * per_page,
                    sub_window,
                    window,
                    0,
                    split_target,
                    carry,
                    page_wr,
                )
            })?;
            rates.push(total_pages as f64 / ns(t.all_done) * 1e3);
        }
    }
    let (em, rm, hm, cm) = (
        median(&mut e_rate),
        median(&mut r_rate),
        median(&mut h_rate),
        median(&mut c_rate),
    );
    let param = format!("{n} x {}", fmt_bytes(page_len));
    let gb = |mops: f64| mops * 1e6 * page_len as f64 / 1e9;
    // One row of this case: weft's `v` in `unit` against `base`.
    let row = |metric: &str, unit: &str, v: f64, base: (f64, &str)| {
        Row::new(
            BENCH,
            "paged_write",
            &backend,
            nics,
            param.clone(),
            metric,
            unit,
            v,
            Some(base),
        )
    };
    let rate_row = |base: (f64, &str)| {
        row("page rate", "Mops/s", em, base).extra("pages_per_batch", total_pages as f64)
    };
    let mut ops = rate_row((rm, RAW));
    if *tb.kind() == BackendKind::LoopbackNull && page_len <= 4096 {
        ops = ops.target(Target::at_least(em, 10.0, "Mops/s"));
    } else {
        ops = tcp_target(tb, ops);
    }
    let handoff = rate_row((hm, RAW_HANDOFF));
    let lists = rate_row((cm, RAW_HANDOFF_LISTS));
    let bw = tcp_target(tb, row("bandwidth", "GB/s", gb(em), (gb(rm), RAW)));
    Ok(vec![ops, handoff, lists, bw])
}

/// One imm-only WRITE, timed from its submit to the receiver's round flag
/// (set by its worker: no callback-thread hop); with `pause`, both engines
/// sit idle that long before the submit, the round armed before the pause
/// (`arm_early`) or right before the submit. The pair of paused rows
/// separates arming early from waking idle workers.
fn imm_once(
    ep: &EnginePair,
    imm: u32,
    pause: Option<Duration>,
    arm_early: bool,
) -> Result<f64, String> {
    let (od, fired) = OnDone::flag();
    if !arm_early {
        if let Some(p) = pause {
            idle_then_spin(p);
        }
    }
    ep.rx
        .expect_imm_count_with(imm, 1, od)
        .map_err(|e| e.to_string())?;
    if arm_early {
        if let Some(p) = pause {
            idle_then_spin(p);
        }
    }
    let t0 = Instant::now();
    ep.tx
        .submit_single_write(0, Some(imm), (&ep.src, 0), (&ep.dst, 0), OnDone::Ignore)
        .map_err(|e| e.to_string())?;
    wait_until(|| fired.is_done())?;
    Ok(ns(t0.elapsed()) / 1e3)
}

/// The bench thread sleeps `p` (the engines sit idle meanwhile), then
/// spins [`AWAKE`] before it goes on: what it times next starts on a
/// running thread in both `imm_once` variants, not straight out of a
/// sleep (without the spin the armed-before variant would submit straight
/// out of it, while the armed-after one has its arm in between). On the
/// H200 host the paused rows read 8–11 µs with it, and arming early is
/// ~2.5 % slower (docs/benchmarks.md, "Targets": the age of the arm
/// decides).
fn idle_then_spin(p: Duration) {
    std::thread::sleep(p);
    let t = Instant::now();
    while t.elapsed() < AWAKE {
        std::hint::spin_loop();
    }
}

/// How long [`idle_then_spin`] spins after its sleep.
const AWAKE: Duration = Duration::from_micros(20);

/// How long the receiver sits idle, with the round armed, before the
/// `imm_only` "after idle" WRITE is submitted: longer than a worker's spin
/// and yield phases, so a worker that slept while idle would show it.
const IMM_IDLE: Duration = Duration::from_millis(1);

fn imm_only(
    cfg: &Config,
    plan: &P2pPlan,
    tb: &Testbed,
    rig: &mut Rig<'_>,
) -> Result<Vec<Row>, String> {
    let ops = plan.lat_max_ops;
    let idle_ops = ops.min(100);
    let (mut e, mut idle, mut late, mut r) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..cfg.rounds() {
        let imm = {
            let ep = rig.engines()?;
            let imm = ep.rx.alloc_imm().map_err(|e| e.to_string())?;
            imm_once(&ep, imm, None, true)?; // warm-up
            for k in 0..ops {
                e.push(imm_once(&ep, imm, None, true)?);
                if k < idle_ops {
                    idle.push(imm_once(&ep, imm, Some(IMM_IDLE), true)?);
                    late.push(imm_once(&ep, imm, Some(IMM_IDLE), false)?);
                }
            }
            ep.rx.free_imm(imm);
            imm
        };
        rig.raw(|raw| {
            for _ in 0..ops {
                let t = raw.drive(1, 1, 1, |r, i| Ok((0, r.wr(i, 0, 0, 0, 0, Some(imm))?)))?;
                r.push(ns(t.imms_seen) / 1e3);
            }
            Ok(())
        })?;
    }
    let (ep50, ip, lp, rp) = (
        percentiles(&mut e),
        percentiles(&mut idle),
        percentiles(&mut late),
        percentiles(&mut r),
    );
    let row = |param: &str, p: &Percentiles| {
        Row::new(
            BENCH,
            "imm_only",
            &tb.kind().to_string(),
            tb.nics(),
            param,
            "latency p50",
            "us",
            p.p50,
            Some((rp.p50, RAW)),
        )
        .extra("weft_p99_us", p.p99)
        .extra("raw_p99_us", rp.p99)
    };
    Ok(vec![
        row("0 B + imm", &ep50),
        row("0 B + imm, 1 ms idle, armed before it", &ip),
        row("0 B + imm, 1 ms idle, armed after it", &lp),
    ])
}
