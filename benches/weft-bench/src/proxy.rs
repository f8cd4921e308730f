//! `proxy`: the host-path breakdown of a scatter (paper Tables 8/9):
//! submit → enqueued → worker picked up → first WR accepted by the backend
//! → all WRs posted, as p50/p99/p99.9, for 8…128 peers. Interleaved with
//! three baselines: the backend's own posting of the same WRs (raw), a
//! bare cross-thread queue hand-off (the floor of submit → pickup), and the
//! raw posting behind that hand-off (the floor of any engine with a worker
//! thread, [`crate::handoff`]). The time the submit call itself takes on
//! the calling thread is reported for both scatter APIs: `submit_scatter`
//! (destinations checked and matched per call) and `submit_scatter_to`
//! (destinations checked once, `scatter_targets`).

use crate::backend::{BackendKind, Testbed};
use crate::engines::{engine_on, wait_until, Shutdown, STALL};
use crate::floor::HandoffFloor;
use crate::handoff::{self, HandedDst};
use crate::pin::{self, PinGuard, Placement};
use crate::report::{Breakdown, Row, Target};
use crate::stats::{ns, percentiles, Percentiles};
use crate::{Config, Progress};
use std::sync::Arc;
use std::time::Instant;
use weft::{Access, Completion, Domain, HostBuffer, PeerId, WrId, WriteWr};
use weft::{
    DoneCounter, GroupAddress, MrDesc, MrHandle, OnDone, ScatterDst, ScatterSlice, ScatterTargets,
    TransferEngine,
};

const BENCH: &str = "proxy";
/// The baseline of [`crate::handoff`].
const HANDOFF: &str = "raw behind a hand-off";
/// The baseline of the prepared scatter's submit call.
const PER_CALL: &str = "submit_scatter (destinations checked per call)";

/// Peer counts (Table 9 shape).
pub fn peer_counts(quick: bool) -> Vec<usize> {
    if quick {
        vec![8, 64]
    } else {
        vec![8, 16, 32, 64, 128]
    }
}

/// Bytes written to each peer by one scatter.
pub const SCATTER_LEN: u64 = 1024;

struct Peers {
    // Domains before buffers (drop order).
    domains: Vec<Box<dyn Domain>>,
    descs: Vec<MrDesc>,
    addrs: Vec<GroupAddress>,
    _bufs: Vec<HostBuffer>,
    /// Whether the peers' domains must be polled for WRITEs to them to
    /// complete (libfabric software providers progress only in
    /// `fi_cq_read`, on the target too).
    progress: bool,
    comps: Vec<Completion>,
}

impl Peers {
    fn len(&self) -> usize {
        self.domains.len()
    }

    /// Progresses the first `n` peers (no-op where the backend needs no
    /// target-side polling). Their completions (none expected: the
    /// scatters carry no immediate) are discarded.
    fn progress(&mut self, n: usize) -> Result<(), String> {
        if !self.progress {
            return Ok(());
        }
        for d in self.domains.iter_mut().take(n) {
            self.comps.clear();
            d.poll(&mut self.comps).map_err(|e| e.to_string())?;
        }
        // A sweep is n CQ reads (syscalls on tcp): give the engine's worker
        // the core between sweeps (2-core hosts).
        std::thread::yield_now();
        Ok(())
    }
}

/// Up to `n` scatter peers, each a fresh 1-NIC host of `tb` (for libfabric:
/// one more endpoint in this process). Stops at the first peer that cannot
/// be created and returns the peers made so far with the reason.
fn peers(tb: &Testbed, n: usize) -> (Peers, Option<String>) {
    let mut pe = Peers {
        domains: Vec::new(),
        descs: Vec::new(),
        addrs: Vec::new(),
        _bufs: Vec::new(),
        progress: tb.peers_need_progress(),
        comps: Vec::new(),
    };
    for k in 0..n {
        if let Err(why) = add_peer(tb, &mut pe) {
            return (
                pe,
                Some(format!(
                    "creating scatter peer {} of {n} failed: {why}",
                    k + 1
                )),
            );
        }
    }
    (pe, None)
}

fn add_peer(tb: &Testbed, pe: &mut Peers) -> Result<(), String> {
    let p = tb.host_with(1)?;
    let mut d = p.open(0).map_err(|e| e.to_string())?;
    let b = HostBuffer::new(SCATTER_LEN as usize).map_err(|e| e.to_string())?;
    let mr = d
        .register(&b.region(), Access::RemoteWrite)
        .map_err(|e| e.to_string())?;
    let a = d.local_addr().clone();
    pe.descs.push(MrDesc {
        addr: mr.addr,
        len: mr.len,
        rkeys: vec![(a.clone(), mr.rkey)],
        incarnation: Default::default(),
    });
    pe.addrs.push(GroupAddress {
        nics: vec![a],
        incarnation: Default::default(),
    });
    pe.domains.push(d);
    pe._bufs.push(b);
    Ok(())
}

/// Runs `proxy` on `kind`.
pub fn run(
    cfg: &Config,
    kind: &BackendKind,
    progress: &mut Progress,
) -> (Vec<Row>, Vec<Breakdown>) {
    let backend = kind.to_string();
    let counts = peer_counts(cfg.quick);
    if !cfg!(feature = "probe") {
        return (
            vec![Row::unavailable(
                BENCH,
                "scatter",
                &backend,
                1,
                "built without the `probe` feature (weft-engine/latency-probe)".into(),
            )],
            Vec::new(),
        );
    }
    match run_inner(cfg, kind, &counts, progress) {
        Ok(x) => x,
        Err(why) => (
            vec![Row::failed(BENCH, "scatter", &backend, 1, why)],
            Vec::new(),
        ),
    }
}

/// One stage's samples (ns).
#[derive(Default)]
struct Stages {
    enqueue: Vec<f64>,
    pickup: Vec<f64>,
    prepare: Vec<f64>,
    first_wr: Vec<f64>,
    post_rest: Vec<f64>,
    total: Vec<f64>,
}

#[cfg(feature = "probe")]
fn collect(eng: &TransferEngine, st: &mut Stages) -> usize {
    // The engine emits one record per transfer, after its last WR. Should
    // a transfer ever show up twice (an engine regression: a scatter's
    // first WRITE is posted before the rest is planned), keep the record
    // covering every WR and count the others: the JSON reports them as
    // `superseded_probe_records`, which must be 0.
    let mut last: std::collections::BTreeMap<weft::TransferId, weft::probe::Record> =
        std::collections::BTreeMap::new();
    let mut early = 0;
    for r in eng.take_probe_records() {
        match last.get(&r.transfer) {
            Some(prev) if prev.all_posted >= r.all_posted => early += 1,
            Some(_) => {
                early += 1;
                last.insert(r.transfer, r);
            }
            None => {
                last.insert(r.transfer, r);
            }
        }
    }
    for r in last.into_values() {
        let (Some(f), Some(a)) = (r.first_wr, r.all_posted) else {
            continue;
        };
        st.enqueue
            .push(ns(r.enqueued.saturating_duration_since(r.submit)));
        st.pickup
            .push(ns(r.pickup.saturating_duration_since(r.enqueued)));
        st.prepare.push(ns(f.saturating_duration_since(r.pickup)));
        st.first_wr.push(ns(f.saturating_duration_since(r.submit)));
        st.post_rest.push(ns(a.saturating_duration_since(f)));
        st.total.push(ns(a.saturating_duration_since(r.submit)));
    }
    early
}

#[cfg(not(feature = "probe"))]
fn collect(_eng: &TransferEngine, _st: &mut Stages) -> usize {
    0
}

fn us(p: Percentiles) -> Percentiles {
    Percentiles {
        n: p.n,
        p50: p.p50 / 1e3,
        p99: p.p99 / 1e3,
        p999: p.p999 / 1e3,
        mean: p.mean / 1e3,
    }
}

/// Scatters per round (weft, and as many raw postings).
fn per_round(cfg: &Config, kind: &BackendKind) -> usize {
    match (cfg.quick, kind.is_loopback()) {
        (true, true) => 200,
        (true, false) => 50,
        (false, true) => 2000,
        // Software transports complete a scatter in hundreds of µs to ms
        // (every peer's WRITE is delivery-complete): fewer samples.
        (false, false) => 500,
    }
}

/// The raw baseline of one scatter: posts `wrs` on `rd` (batched), then
/// waits for their completions while progressing the peers. Returns the
/// posting time in ns.
fn raw_scatter(
    rd: &mut dyn Domain,
    wrs: &[WriteWr],
    pe: &mut Peers,
    comps: &mut Vec<Completion>,
) -> Result<f64, String> {
    let n = wrs.len();
    let max_batch = rd.capabilities().max_batch.max(1);
    let mut done = 0;
    let mut reap = |rd: &mut dyn Domain, done: &mut usize| handoff::reap_writes(rd, comps, done);
    let t0 = Instant::now();
    let mut off = 0;
    while off < n {
        let end = (off + max_batch).min(n);
        match rd.post_writes(&wrs[off..end]) {
            Ok(k) => off += k,
            Err(e) if e.error.is_retryable() => off += e.posted,
            Err(e) => return Err(e.to_string()),
        }
        if off < end {
            // Send queue full: reap and progress the peers, then go on.
            reap(rd, &mut done)?;
            pe.progress(n)?;
        }
        if t0.elapsed() > STALL {
            return Err("raw scatter baseline stalled while posting".into());
        }
    }
    let posted = ns(t0.elapsed());
    let t1 = Instant::now();
    while done < n {
        reap(rd, &mut done)?;
        pe.progress(n)?;
        if t1.elapsed() > STALL {
            return Err(format!(
                "raw scatter baseline stalled: {done}/{n} WRITEs completed after 10 s"
            ));
        }
    }
    Ok(posted)
}

fn run_inner(
    cfg: &Config,
    kind: &BackendKind,
    counts: &[usize],
    progress: &mut Progress,
) -> Result<(Vec<Row>, Vec<Breakdown>), String> {
    let backend = kind.to_string();
    let tb = Testbed::new(kind, 1)?;
    let max_peers = counts.iter().copied().max().unwrap_or(8);
    let place = Placement::resolve(&cfg.pin)?;
    let placement = pin::label(place.as_ref());
    // The bench thread submits (and, on libfabric, progresses the peers).
    let _submitter = PinGuard::new(place.map(|p| p.submitter));
    let (mut pe, limit) = peers(&tb, max_peers);
    let src_buf = HostBuffer::new(SCATTER_LEN as usize * max_peers).map_err(|e| e.to_string())?;
    // One engine per round, alive only for that round's weft scatters (an
    // idle worker polls every 20 µs, on the CPU the raw posting uses).
    let new_engine = || -> Result<(Shutdown, MrHandle), String> {
        let eng = Shutdown(engine_on(
            &tb,
            place.map(|p| p.initiator),
            place.map(|p| p.tx_aux),
        )?);
        let (src, _) = eng.reg_mr(src_buf.region()).map_err(|e| e.to_string())?;
        Ok((eng, src))
    };
    // Setup errors show up before any row.
    drop(new_engine()?);
    // Raw sender on its own host.
    let mut raw = tb.raw_host()?;
    let rd = raw.first_mut().ok_or("no raw domain")?;
    let rsrc = rd
        .register(&src_buf.region(), Access::LocalOnly)
        .map_err(|e| e.to_string())?;
    let mut rpeers: Vec<PeerId> = Vec::new();
    for a in &pe.addrs {
        let addr = a.nics.first().ok_or("peer without NIC")?;
        rpeers.push(rd.add_peer(addr).map_err(|e| e.to_string())?);
    }
    let per_round = per_round(cfg, kind);
    let mut rows = Vec::new();
    let mut bds = Vec::new();
    let mut comps: Vec<Completion> = Vec::new();
    let mut next_wr = 0u64;
    for &n in counts {
        progress.step(&format!("proxy {backend} scatter to {n} peers"));
        if n > pe.len() {
            let why = limit.clone().unwrap_or_else(|| "too few peers".into());
            let mut row = Row::unavailable(
                BENCH,
                "scatter",
                &backend,
                1,
                format!(
                    "{n} peers in one process: only {} endpoints could be created ({why})",
                    pe.len()
                ),
            );
            row.param = format!("{n} peers");
            rows.push(row);
            continue;
        }
        let dsts: Vec<ScatterDst> = (0..n)
            .map(|j| ScatterDst {
                len: SCATTER_LEN,
                src_offset: j as u64 * SCATTER_LEN,
                dst: pe.descs[j].clone(),
                dst_offset: 0,
            })
            .collect();
        let slices: Vec<ScatterSlice> = dsts.iter().map(ScatterSlice::from).collect();
        // The destinations as the raw baselines see them: each raw scatter
        // is built from them, as the hand-off poster builds its WRs.
        let handed: Vec<HandedDst> = (0..n)
            .map(|j| HandedDst {
                peer: rpeers[j],
                src_offset: j as u64 * SCATTER_LEN,
                len: SCATTER_LEN,
                base: pe.descs[j].addr,
                rkey: pe.descs[j].rkeys[0].1,
            })
            .collect();
        let raw_wrs = |next_wr: &mut u64| -> Vec<WriteWr> {
            handed
                .iter()
                .map(|d| {
                    *next_wr += 1;
                    d.wr(&rsrc, WrId(*next_wr))
                })
                .collect()
        };
        let mut st = Stages::default();
        let mut early_records = 0usize;
        let mut raw_post = Vec::new();
        let mut floor_ns = Vec::new();
        let (mut h_first, mut h_all) = (Vec::new(), Vec::new());
        // Time in the submit call, per scatter: `submit_scatter`, and
        // `submit_scatter_to` with the same slices.
        let (mut call_plain, mut call_prepared) = (Vec::new(), Vec::new());
        let wrs = raw_wrs(&mut next_wr);
        {
            let _pin = PinGuard::new(place.map(|p| p.initiator));
            raw_scatter(rd.as_mut(), &wrs, &mut pe, &mut comps)
                .map_err(|e| format!("warm-up raw scatter to {n} peers: {e}"))?;
        }
        for _ in 0..cfg.rounds() {
            // weft, on this round's engine
            {
                let (eng, src) = new_engine()?;
                let group = eng
                    .add_peer_group(&pe.addrs[..n])
                    .map_err(|e| e.to_string())?;
                let targets = eng
                    .scatter_targets(&group, &pe.descs[..n])
                    .map_err(|e| e.to_string())?;
                let mut scatters = |count: usize,
                                    prepared: Option<&ScatterTargets>,
                                    calls: &mut Vec<f64>|
                 -> Result<(), String> {
                    let counter = Arc::new(DoneCounter::new());
                    let mut perr = None;
                    for i in 0..count as u64 {
                        let od = OnDone::counter(&counter);
                        let t = Instant::now();
                        match prepared {
                            Some(tg) => eng.submit_scatter_to(tg, od, None, &src, &slices),
                            None => eng.submit_scatter(&group, od, None, &src, &dsts),
                        }
                        .map_err(|e| e.to_string())?;
                        calls.push(ns(t.elapsed()));
                        wait_until(|| {
                            if let Err(e) = pe.progress(n) {
                                perr = Some(e);
                                return true;
                            }
                            counter.total() > i
                        })?;
                        if let Some(e) = perr.take() {
                            return Err(e);
                        }
                    }
                    if counter.failed() > 0 {
                        return Err(format!(
                            "scatter failed: {}",
                            counter
                                .first_error()
                                .map(|e| e.to_string())
                                .unwrap_or_default()
                        ));
                    }
                    Ok(())
                };
                // Warm-up: connections to new peers (tcp;ofi_rxm connects
                // lazily, on the first WRITE) are not part of the host path
                // measured.
                let mut discard = Vec::new();
                scatters(1, None, &mut discard)
                    .map_err(|e| format!("warm-up scatter to {n} peers: {e}"))?;
                scatters(1, Some(&targets), &mut discard)
                    .map_err(|e| format!("warm-up prepared scatter to {n} peers: {e}"))?;
                let _ = eng.take_probe_records_compat();
                // Two halves, each `submit_scatter` then the prepared API
                // (for its submit call only: its probe records are dropped,
                // the stages are `submit_scatter`'s), so that neither API
                // always runs on the warmer engine.
                for half in [per_round / 2, per_round - per_round / 2] {
                    scatters(half, None, &mut call_plain)?;
                    early_records += collect(&eng, &mut st);
                    scatters(half, Some(&targets), &mut call_prepared)?;
                    let _ = eng.take_probe_records_compat();
                }
            }
            // raw posting of the same WRs, on the worker's CPU
            {
                let _pin = PinGuard::new(place.map(|p| p.initiator));
                for _ in 0..per_round {
                    let wrs = raw_wrs(&mut next_wr);
                    raw_post.push(raw_scatter(rd.as_mut(), &wrs, &mut pe, &mut comps)?);
                }
            }
            // raw behind a hand-off: the bench thread (submitter's CPU)
            // hands each scatter to a poster on the worker's CPU
            handoff::with_poster(rd.as_mut(), &rsrc, place.map(|p| p.initiator), |poster| {
                // Warm-up, as weft's: the poster's start and first buffer
                // growth are not part of the host path measured.
                poster.scatter(handed.clone(), || pe.progress(n))?;
                for _ in 0..per_round {
                    let r = poster.scatter(handed.clone(), || pe.progress(n))?;
                    h_first.push(r.first_wr);
                    h_all.push(r.all_posted);
                }
                Ok(())
            })?;
            // floor: producer on the submitter's CPU, consumer on the
            // worker's; its thread lives for this phase only
            let floor = HandoffFloor::on(place.map(|p| p.initiator));
            for _ in 0..per_round {
                if let Some(v) = floor.once() {
                    floor_ns.push(v);
                }
            }
        }
        let p = |v: &mut Vec<f64>| us(percentiles(v));
        let (enq, pick, prep, first, rest, total) = (
            p(&mut st.enqueue),
            p(&mut st.pickup),
            p(&mut st.prepare),
            p(&mut st.first_wr),
            p(&mut st.post_rest),
            p(&mut st.total),
        );
        let rawp = p(&mut raw_post);
        let fl = p(&mut floor_ns);
        let (hf, ha) = (p(&mut h_first), p(&mut h_all));
        if first.n == 0 {
            return Err("no latency-probe records (engine built without latency-probe?)".into());
        }
        for (stage, q) in [
            ("submit -> enqueued", enq),
            ("enqueued -> picked up", pick),
            ("picked up -> first WR", prep),
            ("submit -> first WR", first),
            ("first WR -> all posted", rest),
            ("submit -> all posted", total),
            ("raw backend posting", rawp),
            ("queue hand-off floor", fl),
            ("raw behind a hand-off: push -> first WR", hf),
            ("raw behind a hand-off: push -> all posted", ha),
        ] {
            bds.push(Breakdown {
                backend: backend.clone(),
                peers: n,
                stage: stage.into(),
                n: q.n,
                p50_us: q.p50,
                p99_us: q.p99,
                p999_us: q.p999,
            });
        }
        let param = format!("{n} peers");
        // One row of this peer count: `metric` (µs) against `base`.
        let row = |metric: &str, v: f64, base: (f64, &str)| {
            Row::new(
                BENCH,
                "scatter",
                &backend,
                1,
                param.clone(),
                metric,
                "us",
                v,
                Some(base),
            )
        };
        rows.push(
            row(
                "submit->first WR p50",
                first.p50,
                (fl.p50, "queue hand-off floor"),
            )
            .target(Target::at_most(first.p50, 0.5, "us"))
            .extra("p99_us", first.p99)
            .extra("p999_us", first.p999),
        );
        rows.push(row("submit->first WR p50", first.p50, (hf.p50, HANDOFF)));
        rows.push(
            row(
                "enqueued->pickup p50",
                pick.p50,
                (fl.p50, "queue hand-off floor"),
            )
            .extra("p99_us", pick.p99)
            .extra("p999_us", pick.p999),
        );
        let overhead = total.p50 - rawp.p50;
        let mut all = row(
            "submit->all posted p50",
            total.p50,
            (rawp.p50, "raw backend posting"),
        )
        .extra("engine_overhead_us", overhead)
        .extra("superseded_probe_records", early_records as f64)
        .extra("p99_us", total.p99)
        .extra("p999_us", total.p999);
        if n == 64 {
            all = all.target(Target {
                text: "engine +<= 3 us".into(),
                met: overhead <= 3.0,
            });
        }
        rows.push(all);
        rows.push(
            row("submit->all posted p50", total.p50, (ha.p50, HANDOFF))
                .extra("engine_overhead_us", total.p50 - ha.p50),
        );
        let (cp, cq) = (p(&mut call_plain), p(&mut call_prepared));
        rows.push(
            row("submit call p50", cq.p50, (cp.p50, PER_CALL))
                .extra("p99_us", cq.p99)
                .extra("baseline_p99_us", cp.p99),
        );
    }
    drop(raw);
    drop(src_buf);
    let rows = rows.into_iter().map(|r| r.placed(&placement)).collect();
    Ok((rows, bds))
}

/// Drains probe records where the feature exists (no-op otherwise).
trait ProbeCompat {
    fn take_probe_records_compat(&self) -> usize;
}

impl ProbeCompat for TransferEngine {
    #[cfg(feature = "probe")]
    fn take_probe_records_compat(&self) -> usize {
        self.take_probe_records().len()
    }
    #[cfg(not(feature = "probe"))]
    fn take_probe_records_compat(&self) -> usize {
        0
    }
}
