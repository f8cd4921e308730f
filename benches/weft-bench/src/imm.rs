//! `imm`: ImmCounter throughput (immediates counted per second until a
//! round of N fires) against the raw backend counting the same immediates,
//! and early-arrival handling (all N arrive before `expect_imm_count`; the
//! round must fire at arm time, exactly once) against the hand-off floor.

use crate::backend::{BackendKind, Testbed};
use crate::engines::{wait_until, EnginePair};
use crate::floor::{HandoffFloor, WakeFloor};
use crate::pin::Placement;
use crate::raw::RawPair;
use crate::report::Row;
use crate::rig::Rig;
use crate::stats::{median, ns, percentiles};
use crate::{Config, Progress};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{OnDone, Pages};

const BENCH: &str = "imm";
/// Payload of each counted WRITE.
pub const IMM_WRITE_LEN: u64 = 64;

/// When a round's callback ran, written once by the callback thread and
/// read by a spinning waiter without a lock (a mutex the waiter keeps
/// taking would slow the callback that needs it; the floor has none).
struct FiredCell {
    base: Instant,
    /// 0: not fired; else nanoseconds since `base` plus one.
    at_ns: AtomicU64,
    /// 0: not fired; 1: fired once, ok; 2: failed or fired twice.
    state: AtomicU8,
}

type Fired = Arc<FiredCell>;

fn arm(ep: &EnginePair, imm: u32, count: u64) -> Result<Fired, String> {
    let fired: Fired = Arc::new(FiredCell {
        base: Instant::now(),
        at_ns: AtomicU64::new(0),
        state: AtomicU8::new(0),
    });
    let f2 = Arc::clone(&fired);
    ep.rx
        .expect_imm_count(imm, count, move |r| {
            let at = f2.base.elapsed().as_nanos() as u64 + 1;
            // A second firing would be a bug: remember it.
            let again = f2.at_ns.load(Ordering::Acquire) != 0;
            f2.state
                .store(if r.is_ok() && !again { 1 } else { 2 }, Ordering::Relaxed);
            f2.at_ns.store(at, Ordering::Release);
        })
        .map_err(|e| e.to_string())?;
    Ok(fired)
}

/// One counted round's WRITEs: a paged write of `IMM_WRITE_LEN`-byte
/// pages `pg`, each with immediate `imm`.
fn submit_counted(ep: &EnginePair, imm: u32, pg: &Pages) -> Result<(), String> {
    ep.tx
        .submit_paged_writes(
            IMM_WRITE_LEN,
            Some(imm),
            (&ep.src, pg),
            (&ep.dst, pg),
            OnDone::Ignore,
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn fired_at(f: &Fired) -> Option<(Instant, bool)> {
    let at = f.at_ns.load(Ordering::Acquire);
    (at != 0).then(|| {
        (
            f.base + Duration::from_nanos(at - 1),
            f.state.load(Ordering::Relaxed) == 1,
        )
    })
}

/// Runs `imm` on `kind` (1 NIC).
pub fn run(cfg: &Config, kind: &BackendKind, progress: &mut Progress) -> Vec<Row> {
    let backend = kind.to_string();
    progress.step(&format!("imm {backend} counter throughput"));
    let tb = match Testbed::new(kind, 1) {
        Ok(t) => t,
        Err(why) => {
            progress.step("");
            return vec![Row::unavailable(BENCH, "all", &backend, 1, why)];
        }
    };
    let n: u64 = if cfg.quick { 10_000 } else { 100_000 };
    let mem = (n * IMM_WRITE_LEN).min(16 << 20);
    let setup = Placement::resolve(&cfg.pin)
        .and_then(|place| Rig::new(&tb, mem as usize, mem as usize, place));
    let mut rig = match setup {
        Ok(x) => x,
        Err(why) => {
            progress.step("");
            return vec![Row::failed(BENCH, "setup", &backend, 1, why)];
        }
    };
    let placement = rig.label();
    let mut rows = Vec::new();
    match throughput(cfg, &mut rig, &backend, n, mem) {
        Ok(rs) => rows.extend(rs.into_iter().map(|r| r.placed(&placement))),
        Err(why) => {
            rows.push(Row::failed(BENCH, "counter_throughput", &backend, 1, why).placed(&placement))
        }
    }
    progress.step(&format!("imm {backend} early arrivals"));
    for flag in [false, true] {
        match early(cfg, &rig, &backend, flag) {
            Ok(rs) => rows.extend(rs.into_iter().map(|r| r.placed(&placement))),
            Err(why) => {
                rows.push(Row::failed(BENCH, "early_arrival", &backend, 1, why).placed(&placement))
            }
        }
    }
    rows
}

fn pages(n: u64, mem: u64) -> Pages {
    let slots = (mem / IMM_WRITE_LEN).max(1);
    Pages {
        indices: (0..n)
            .map(|i| u32::try_from(i % slots).unwrap_or(0))
            .collect(),
        stride: IMM_WRITE_LEN,
        offset: 0,
    }
}

fn throughput(
    cfg: &Config,
    rig: &mut Rig<'_>,
    backend: &str,
    n: u64,
    mem: u64,
) -> Result<Vec<Row>, String> {
    let pg = pages(n, mem);
    let slots = (mem / IMM_WRITE_LEN).max(1);
    let (mut e, mut r, mut rs) = (Vec::new(), Vec::new(), Vec::new());
    let mut expect = 0;
    for _ in 0..cfg.rounds() {
        // weft, on a pair that lives for this round only.
        let imm = {
            let ep = rig.engines()?;
            let imm = ep.rx.alloc_imm().map_err(|e| e.to_string())?;
            let counts = ep.tx.imm_counts(0).map_err(|e| e.to_string())?;
            expect = counts.paged_writes(IMM_WRITE_LEN, n);
            // Warm-up: one round (pools grown, peer connected).
            for measured in [false, true] {
                let fired = arm(&ep, imm, expect)?;
                let t0 = Instant::now();
                submit_counted(&ep, imm, &pg)?;
                wait_until(|| fired_at(&fired).is_some())?;
                let (t, ok) = fired_at(&fired).ok_or("not fired")?;
                if !ok {
                    return Err("round failed or fired twice".into());
                }
                if measured {
                    e.push(expect as f64 / ns(t.saturating_duration_since(t0)) * 1e3);
                }
            }
            // Let stragglers settle before the value is released.
            std::thread::sleep(Duration::from_millis(5));
            ep.rx.free_imm(imm);
            imm
        };
        // The raw loop twice: on one thread (initiator and target polled
        // in turn), and with the target polled by a thread of its own, as
        // the engine's two workers (one per engine) split the work.
        for (split, out) in [(false, &mut r), (true, &mut rs)] {
            let t = rig.raw(|raw| {
                let lanes = raw.lanes();
                let gen = |rp: &RawPair, i: u64| {
                    let off = (i % slots) * IMM_WRITE_LEN;
                    let lane = (i % lanes as u64) as usize;
                    Ok((lane, rp.wr(i, lane, off, off, IMM_WRITE_LEN, Some(imm))?))
                };
                if split {
                    raw.drive_split(n, 1024, n, gen)
                } else {
                    raw.drive(n, 1024, n, gen)
                }
            })?;
            out.push(n as f64 / ns(t.imms_seen) * 1e3);
        }
    }
    let (em, rm, rsm) = (median(&mut e), median(&mut r), median(&mut rs));
    let row = |base: f64, what: &'static str| {
        Row::new(
            BENCH,
            "counter_throughput",
            backend,
            1,
            format!("{expect} x {IMM_WRITE_LEN} B"),
            "imm completions",
            "M/s",
            em,
            Some((base, what)),
        )
    };
    Ok(vec![
        row(rm, "raw backend"),
        row(rsm, "raw, target on own thread"),
    ])
}

/// A round reported by [`OnDone::flag`]: set by the thread that fires it
/// (for early arrivals, the arming thread itself), no callback-thread hop.
fn arm_flag(ep: &EnginePair, imm: u32, count: u64) -> Result<Arc<weft::DoneFlag>, String> {
    let (od, flag) = OnDone::flag();
    ep.rx
        .expect_imm_count_with(imm, count, od)
        .map_err(|e| e.to_string())?;
    Ok(flag)
}

/// Early arrivals: all `n` immediates are counted before the round is
/// armed; arm → fire as the application sees it, through a callback (on the
/// callback thread, idle while the arrivals streamed in: one thread wake-up
/// under the default poll policy) or a flag (`flag`).
///
/// Each round: `reps` early rounds on an engine pair that lives for them
/// only, then `reps` hand-offs of the floor (its consumer on the receiver's
/// aux CPU, where the callback thread runs; its thread lives for them only),
/// and for callbacks `reps` wake-ups of a thread blocked in a channel
/// receive on that CPU ([`WakeFloor`]): a second row, the same weft number
/// against the design's own floor, after the floor's short idle (200 µs);
/// and a third, wake-ups after as long an idle as the callback thread had
/// before each of this round's callbacks (the median since the previous
/// callback fired), since a CPU left idle longer sleeps deeper.
fn early(cfg: &Config, rig: &Rig<'_>, backend: &str, flag: bool) -> Result<Vec<Row>, String> {
    let n: u64 = if cfg.quick { 100 } else { 1000 };
    let reps = if cfg.quick { 10 } else { 50 };
    let pg = pages(n, n * IMM_WRITE_LEN);
    let mut expect = 0;
    let (mut lat, mut fl, mut wake) = (Vec::new(), Vec::new(), Vec::new());
    let (mut wake_same, mut idles) = (Vec::new(), Vec::new());
    for _ in 0..cfg.rounds() {
        // When the previous callback of this round ran: the callback
        // thread has been idle since.
        let mut last_fire: Option<Instant> = None;
        let mut round_idles = Vec::new();
        let ep = rig.engines()?;
        let imm = ep.rx.alloc_imm().map_err(|e| e.to_string())?;
        let counts = ep.tx.imm_counts(0).map_err(|e| e.to_string())?;
        expect = counts.paged_writes(IMM_WRITE_LEN, n);
        for _ in 0..reps {
            submit_counted(&ep, imm, &pg)?;
            wait_until(|| ep.rx.imm_pending(imm) >= expect)?;
            let t0 = Instant::now();
            let t = if flag {
                let f = arm_flag(&ep, imm, expect)?;
                wait_until(|| f.is_done())?;
                let t = Instant::now();
                if !matches!(f.result(), Some(Ok(()))) {
                    return Err("early-arrival round failed".into());
                }
                t
            } else {
                let fired = arm(&ep, imm, expect)?;
                wait_until(|| fired_at(&fired).is_some())?;
                let (t, ok) = fired_at(&fired).ok_or("not fired")?;
                if !ok {
                    return Err("early-arrival round failed or fired twice".into());
                }
                if let Some(prev) = last_fire {
                    round_idles.push(ns(t0.saturating_duration_since(prev)));
                }
                last_fire = Some(t);
                t
            };
            if ep.rx.imm_pending(imm) != 0 || ep.rx.imm_armed(imm) {
                return Err(format!(
                    "after firing: {} arrivals pending, armed={} (expected 0, false)",
                    ep.rx.imm_pending(imm),
                    ep.rx.imm_armed(imm)
                ));
            }
            lat.push(ns(t.saturating_duration_since(t0)) / 1e3);
        }
        ep.rx.free_imm(imm);
        drop(ep);
        let floor = HandoffFloor::on(rig.placement().map(|p| p.rx_aux));
        for _ in 0..reps {
            if let Some(v) = floor.once() {
                fl.push(v / 1e3);
            }
        }
        drop(floor);
        if !flag {
            let w = WakeFloor::on(rig.placement().map(|p| p.rx_aux));
            for _ in 0..reps {
                if let Some(v) = w.once() {
                    wake.push(v / 1e3);
                }
            }
            if !round_idles.is_empty() {
                let idle = median(&mut round_idles);
                idles.push(idle / 1e3);
                let idle = Duration::from_nanos(idle as u64);
                for _ in 0..reps {
                    if let Some(v) = w.once_after(idle) {
                        wake_same.push(v / 1e3);
                    }
                }
            }
        }
    }
    let (p, f) = (percentiles(&mut lat), percentiles(&mut fl));
    let row = |base: f64, name: &str| {
        Row::new(
            BENCH,
            "early_arrival",
            backend,
            1,
            format!(
                "{expect} arrived before arm, {}",
                if flag { "flag" } else { "callback" }
            ),
            "arm->fire p50",
            "us",
            p.p50,
            Some((base, name)),
        )
        .extra("p99_us", p.p99)
        .extra("rounds_fired_exactly_once", p.n as f64)
    };
    let mut rows = vec![row(f.p50, "queue hand-off floor")];
    if !wake.is_empty() {
        rows.push(row(percentiles(&mut wake).p50, "thread wake-up floor"));
    }
    if !wake_same.is_empty() {
        rows.push(
            row(
                percentiles(&mut wake_same).p50,
                "thread wake-up floor, same idle",
            )
            .extra("callback_idle_us", median(&mut idles)),
        );
    }
    Ok(rows)
}
