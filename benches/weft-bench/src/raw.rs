//! The raw baseline: the backend's domains driven directly, without the
//! engine, on the bench thread (post, poll initiator, poll target); or, in
//! [`RawPair::drive_handoff`], on a worker thread fed by the bench thread
//! through a queue: the engine's threading with none of its bookkeeping.

use crate::backend::Testbed;
use crate::engines::STALL;
use crate::pin::PinGuard;
use crossbeam_queue::ArrayQueue;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use weft::{
    Access, Completion, Domain, HostBuffer, LocalMr, PeerId, RemoteSlice, TransportError, WrId,
    WriteWr,
};

/// Initiator domains (one per lane) and target domains, lane `i` writing
/// from `a[i]` to `b[i]`, with one registered source and destination buffer.
pub struct RawPair {
    /// Initiator domains, one per NIC.
    a: Vec<Box<dyn Domain>>,
    /// Target domains, one per NIC.
    b: Vec<Box<dyn Domain>>,
    peers: Vec<PeerId>,
    src: Vec<LocalMr>,
    dst: Vec<LocalMr>,
    pending: Vec<VecDeque<WriteWr>>,
    max_batch: Vec<usize>,
    comps: Vec<Completion>,
    poll_target: bool,
    /// CPU of the target poller thread of [`RawPair::drive_split`].
    target_cpu: Option<usize>,
    /// CPU of the worker thread of [`RawPair::drive_handoff`].
    worker_cpu: Option<usize>,
    // Dropped after the domains (field order).
    _src_buf: HostBuffer,
    _dst_buf: HostBuffer,
}

/// When a [`RawPair::drive`] finished.
#[derive(Debug, Clone, Copy)]
pub struct DriveTimes {
    /// All WRITE completions seen at the initiator.
    pub all_done: Duration,
    /// The requested number of immediates seen at the target.
    pub imms_seen: Duration,
}

fn err(e: TransportError) -> String {
    e.to_string()
}

impl RawPair {
    /// Opens two fresh hosts of `tb` and registers `src_len` / `dst_len`
    /// bytes on every lane.
    pub fn new(tb: &Testbed, src_len: usize, dst_len: usize) -> Result<Self, String> {
        let mut a = tb.raw_host()?;
        let mut b = tb.raw_host()?;
        let src_buf = HostBuffer::new(src_len).map_err(|e| e.to_string())?;
        let dst_buf = HostBuffer::new(dst_len).map_err(|e| e.to_string())?;
        let mut peers = Vec::new();
        let mut src = Vec::new();
        let mut dst = Vec::new();
        let mut max_batch = Vec::new();
        for (da, db) in a.iter_mut().zip(b.iter_mut()) {
            src.push(
                da.register(&src_buf.region(), Access::LocalOnly)
                    .map_err(err)?,
            );
            dst.push(
                db.register(&dst_buf.region(), Access::RemoteWrite)
                    .map_err(err)?,
            );
            peers.push(da.add_peer(&db.local_addr().clone()).map_err(err)?);
            max_batch.push(da.capabilities().max_batch.max(1));
        }
        let lanes = a.len();
        Ok(RawPair {
            a,
            b,
            peers,
            src,
            dst,
            pending: (0..lanes).map(|_| VecDeque::new()).collect(),
            max_batch,
            comps: Vec::new(),
            poll_target: tb.target_needs_polling(),
            target_cpu: None,
            worker_cpu: None,
            _src_buf: src_buf,
            _dst_buf: dst_buf,
        })
    }

    /// Pins the target poller thread of [`RawPair::drive_split`] to `cpu`
    /// (`None`: not pinned).
    pub fn set_target_cpu(&mut self, cpu: Option<usize>) {
        self.target_cpu = cpu;
    }

    /// Pins the worker thread of [`RawPair::drive_handoff`] to `cpu`
    /// (`None`: not pinned).
    pub fn set_worker_cpu(&mut self, cpu: Option<usize>) {
        self.worker_cpu = cpu;
    }

    /// Lanes (NICs).
    pub fn lanes(&self) -> usize {
        self.a.len()
    }

    /// Smallest `max_write_len` of the initiator domains.
    pub fn max_write_len(&self) -> u64 {
        self.a
            .iter()
            .map(|d| d.capabilities().max_write_len)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// A WRITE of `len` bytes on `lane` from source offset `so` to
    /// destination offset `dof`.
    pub fn wr(
        &self,
        id: u64,
        lane: usize,
        so: u64,
        dof: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<WriteWr, String> {
        let (Some(s), Some(d), Some(p)) =
            (self.src.get(lane), self.dst.get(lane), self.peers.get(lane))
        else {
            return Err(format!("no lane {lane}"));
        };
        let src = s
            .slice(so, len)
            .ok_or_else(|| format!("source slice {so}+{len} outside buffer"))?;
        if dof.checked_add(len).is_none_or(|e| e > d.len) {
            return Err(format!("destination slice {dof}+{len} outside buffer"));
        }
        Ok(WriteWr {
            wr: WrId(id),
            peer: *p,
            src,
            dst: RemoteSlice {
                base: d.addr,
                offset: dof,
                rkey: d.rkey,
            },
            imm,
        })
    }

    /// Posts `total` WRs produced by `gen(i) -> (lane, wr)`, keeping at most
    /// `window` outstanding, batching per lane, until every WRITE completed
    /// and `want_imms` immediates were seen at the target.
    pub fn drive(
        &mut self,
        total: u64,
        window: u64,
        want_imms: u64,
        gen: impl FnMut(&Self, u64) -> Result<(usize, WriteWr), String>,
    ) -> Result<DriveTimes, String> {
        self.drive_inner(total, window, want_imms, gen, None, None)
    }

    /// [`RawPair::drive`] with the target domains polled by a second
    /// thread instead of between the initiator's posts and polls: what the
    /// initiator sees when the target progresses on its own (as it does in
    /// its own process), and how the engine splits the work. For backends
    /// whose targets need polling ([`Testbed::target_needs_polling`]).
    pub fn drive_split(
        &mut self,
        total: u64,
        window: u64,
        want_imms: u64,
        gen: impl FnMut(&Self, u64) -> Result<(usize, WriteWr), String>,
    ) -> Result<DriveTimes, String> {
        self.drive_split_fed(total, window, want_imms, gen, None)
    }

    /// The engine's threading without the engine: the bench thread (the
    /// caller, where it is pinned) hands `requests` request numbers, one at
    /// a time, through a lock-free queue to a worker thread (on the CPU of
    /// [`RawPair::set_worker_cpu`]) that generates each request's `per` WRs
    /// with `gen`, posts and polls them as [`RawPair::drive`] does (with
    /// `split`, as [`RawPair::drive_split`]: the target on a thread of its
    /// own). At most `req_window` requests are handed over and not yet
    /// complete, and at most `wr_window` WRs outstanding, as the engine's
    /// submitter and worker keep them. Times run from the worker's clock
    /// start, which the bench thread waits for before its first hand-off,
    /// to the worker's last completion (weft's rows end when the bench
    /// thread sees it: one cross-thread notification more, well under 0.1 %
    /// of a run).
    ///
    /// With `carry`, each request also carries copies of the two lists
    /// (written on the bench thread, as a paged submit copies its page
    /// lists into the request), which the worker reads through: the data
    /// an engine's hand-off moves across cores besides the request itself.
    /// The list buffers go back to the bench thread for reuse, so the
    /// allocator's cross-thread costs are left out (glibc's arena lock
    /// made a malloc here / free there pattern cost more than the copies).
    #[allow(clippy::too_many_arguments)]
    pub fn drive_handoff(
        &mut self,
        requests: u64,
        per: u64,
        req_window: u64,
        wr_window: u64,
        want_imms: u64,
        split: bool,
        carry: Option<(&[u32], &[u32])>,
        gen: impl FnMut(&Self, u64) -> Result<(usize, WriteWr), String> + Send,
    ) -> Result<DriveTimes, String> {
        let per = per.max(1);
        let req_window = req_window.max(1);
        let feed = Feed {
            q: ArrayQueue::new(usize::try_from(req_window).unwrap_or(usize::MAX)),
            spare: ArrayQueue::new(
                usize::try_from(req_window)
                    .unwrap_or(usize::MAX)
                    .saturating_mul(2)
                    .saturating_add(2),
            ),
            per,
            done: AtomicU64::new(0),
            started: AtomicBool::new(false),
            failed: AtomicBool::new(false),
        };
        let cpu = self.worker_cpu;
        let total = requests * per;
        std::thread::scope(|s| {
            let feed = &feed;
            let worker = std::thread::Builder::new()
                .name("raw-handoff".into())
                .spawn_scoped(s, move || {
                    let _pin = PinGuard::new(cpu);
                    let _unwind = FailOnUnwind(feed);
                    let r = if split {
                        self.drive_split_fed(total, wr_window, want_imms, gen, Some(feed))
                    } else {
                        self.drive_inner(total, wr_window, want_imms, gen, None, Some(feed))
                    };
                    if r.is_err() {
                        feed.failed.store(true, Ordering::Release);
                    }
                    r
                })
                .map_err(|e| format!("spawning the raw hand-off worker: {e}"))?;
            let fed = feed.hand_over(requests, req_window, carry);
            let r = worker
                .join()
                .unwrap_or_else(|_| Err("raw hand-off worker panicked".into()));
            r.and_then(|t| fed.map(|()| t))
        })
    }

    /// [`RawPair::drive_split`], optionally fed (see [`RawPair::drive_handoff`]).
    fn drive_split_fed(
        &mut self,
        total: u64,
        window: u64,
        want_imms: u64,
        gen: impl FnMut(&Self, u64) -> Result<(usize, WriteWr), String>,
        feed: Option<&Feed>,
    ) -> Result<DriveTimes, String> {
        let mut targets = std::mem::take(&mut self.b);
        let stop = AtomicBool::new(false);
        let imms = AtomicU64::new(0);
        let cpu = self.target_cpu;
        let r = std::thread::scope(|s| {
            let poller = std::thread::Builder::new()
                .name("raw-target".into())
                .spawn_scoped(s, || -> Result<(), String> {
                    let _pin = PinGuard::new(cpu);
                    let mut comps = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let mut n = 0;
                        for d in targets.iter_mut() {
                            comps.clear();
                            n += d.poll(&mut comps).map_err(err)?;
                            let k = comps
                                .iter()
                                .filter(|c| matches!(c, Completion::Imm { .. }))
                                .count() as u64;
                            imms.fetch_add(k, Ordering::Relaxed);
                        }
                        if n == 0 {
                            std::thread::yield_now();
                        }
                    }
                    Ok(())
                })
                .map_err(|e| format!("spawning the raw target poller: {e}"))?;
            let r = self.drive_inner(total, window, want_imms, gen, Some(&imms), feed);
            stop.store(true, Ordering::Relaxed);
            let polled = poller
                .join()
                .unwrap_or_else(|_| Err("target poller panicked".into()));
            r.and_then(|t| polled.map(|()| t))
        });
        self.b = targets;
        r
    }

    /// The drive loop; with `split_imms` the targets are polled elsewhere
    /// and their immediates counted there; with `feed`, only the WRs of
    /// requests handed over so far are generated, and completions are
    /// published back.
    fn drive_inner(
        &mut self,
        total: u64,
        window: u64,
        want_imms: u64,
        mut gen: impl FnMut(&Self, u64) -> Result<(usize, WriteWr), String>,
        split_imms: Option<&AtomicU64>,
        feed: Option<&Feed>,
    ) -> Result<DriveTimes, String> {
        let start = Instant::now();
        if let Some(f) = feed {
            // The bench thread hands nothing over before this stamp.
            f.started.store(true, Ordering::Release);
        }
        let window = window.max(1);
        let (mut generated, mut done, mut imms) = (0u64, 0u64, 0u64);
        let mut all_done = None;
        let mut imms_seen = (want_imms == 0).then(Duration::default);
        // WRs that may be generated: all of them, or those of the requests
        // handed over so far.
        let mut avail = if feed.is_some() { 0 } else { total };
        loop {
            if let Some(f) = feed {
                while let Some((_, a, b)) = f.q.pop() {
                    // Read what the request carried, as a planner would,
                    // then hand the buffers back.
                    let sum = a.iter().chain(&b).fold(0u32, |s, &x| s.wrapping_add(x));
                    std::hint::black_box(sum);
                    for v in [a, b] {
                        if v.capacity() > 0 {
                            let _ = f.spare.push(v);
                        }
                    }
                    avail += f.per;
                }
            }
            while generated < total.min(avail) && generated - done < window {
                let (lane, wr) = gen(self, generated)?;
                self.pending
                    .get_mut(lane)
                    .ok_or_else(|| format!("no lane {lane}"))?
                    .push_back(wr);
                generated += 1;
            }
            for (lane, d) in self.a.iter_mut().enumerate() {
                let q = &mut self.pending[lane];
                while !q.is_empty() {
                    let n = q.len().min(self.max_batch[lane]);
                    let batch = &q.make_contiguous()[..n];
                    let posted = match d.post_writes(batch) {
                        Ok(k) => k,
                        Err(e) if e.error.is_retryable() => e.posted,
                        Err(e) => return Err(e.to_string()),
                    };
                    q.drain(..posted);
                    if posted < n {
                        break;
                    }
                }
            }
            let done_before = done;
            for d in self.a.iter_mut() {
                self.comps.clear();
                d.poll(&mut self.comps).map_err(err)?;
                for c in &self.comps {
                    match c {
                        Completion::Write { result: Ok(()), .. } => done += 1,
                        Completion::Write { wr, result: Err(e) } => {
                            return Err(format!("raw WRITE {wr:?} failed: {e}"))
                        }
                        Completion::Imm { .. } => {}
                        _ => {}
                    }
                }
            }
            if let Some(f) = feed {
                f.done.store(done, Ordering::Release);
            }
            if let Some(n) = split_imms {
                imms = n.load(Ordering::Relaxed);
                if done == done_before {
                    // Like the engine's workers: with the target on another
                    // thread, an initiator that never yields can hold the
                    // core the target's thread needs (and spin on a
                    // provider lock that thread holds, preempted).
                    std::thread::yield_now();
                }
            } else if self.poll_target || want_imms > 0 {
                for d in self.b.iter_mut() {
                    self.comps.clear();
                    d.poll(&mut self.comps).map_err(err)?;
                    imms += self
                        .comps
                        .iter()
                        .filter(|c| matches!(c, Completion::Imm { .. }))
                        .count() as u64;
                }
            }
            if imms_seen.is_none() && imms >= want_imms {
                imms_seen = Some(start.elapsed());
            }
            if all_done.is_none() && done >= total {
                all_done = Some(start.elapsed());
            }
            if let (Some(a), Some(i)) = (all_done, imms_seen) {
                return Ok(DriveTimes {
                    all_done: a,
                    imms_seen: i,
                });
            }
            if start.elapsed() > STALL {
                return Err(format!(
                    "raw baseline stalled: {done}/{total} writes, {imms}/{want_imms} immediates after 10 s"
                ));
            }
        }
    }
}

/// What the bench thread and the worker of [`RawPair::drive_handoff`]
/// share: the request queue and the completion count.
struct Feed {
    /// Request numbers handed over, not yet taken by the worker, with the
    /// lists they carry (empty: none).
    q: ArrayQueue<(u64, Vec<u32>, Vec<u32>)>,
    /// Carried list buffers the worker handed back, for reuse.
    spare: ArrayQueue<Vec<u32>>,
    /// WRs per request.
    per: u64,
    /// WRITEs completed, published by the worker after each poll.
    done: AtomicU64,
    /// The worker runs (the bench thread starts handing over then).
    started: AtomicBool,
    /// The worker gave up (the bench thread stops handing over).
    failed: AtomicBool,
}

/// Marks its feed failed when the worker unwinds, so the bench thread
/// stops handing over at once rather than at the stall limit.
struct FailOnUnwind<'a>(&'a Feed);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.failed.store(true, Ordering::Release);
        }
    }
}

impl Feed {
    /// `list` copied into a handed-back buffer (a new one at first).
    fn copy(&self, list: &[u32]) -> Vec<u32> {
        let mut v = self.spare.pop().unwrap_or_default();
        v.clear();
        v.extend_from_slice(list);
        v
    }

    /// The bench thread's side: hands over `requests` request numbers,
    /// keeping at most `req_window` requests incomplete, each with fresh
    /// copies of the `carry` lists.
    fn hand_over(
        &self,
        requests: u64,
        req_window: u64,
        carry: Option<(&[u32], &[u32])>,
    ) -> Result<(), String> {
        let start = Instant::now();
        let mut spins = 0u32;
        let mut wait = |what: &str| -> Result<(), String> {
            if self.failed.load(Ordering::Acquire) {
                return Err("raw hand-off worker failed".into());
            }
            if start.elapsed() > STALL {
                return Err(format!("raw hand-off stalled waiting for {what}"));
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            Ok(())
        };
        while !self.started.load(Ordering::Acquire) {
            wait("the worker to start")?;
        }
        for r in 0..requests {
            // Request `r` may go once request `r - req_window` completed.
            while (r + 1).saturating_sub(req_window) * self.per > self.done.load(Ordering::Acquire)
            {
                wait("completions")?;
            }
            let mut item = match carry {
                Some((a, b)) => (r, self.copy(a), self.copy(b)),
                None => (r, Vec::new(), Vec::new()),
            };
            while let Err(back) = self.q.push(item) {
                item = back;
                wait("room in the queue")?;
            }
        }
        Ok(())
    }
}
