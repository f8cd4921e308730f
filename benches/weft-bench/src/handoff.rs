//! The proxy path's design floor: the engine's threading with none of its
//! bookkeeping. The bench thread hands a scatter (its destinations already
//! resolved, as the engine's submit resolves them before its first stamp)
//! through a lock-free queue to a poster thread, which builds the WRITEs,
//! posts the first alone and then the rest (as the engine does), and polls
//! their completions. What it measures, push → first WR accepted and
//! push → all accepted, is what any engine with a worker thread between the
//! application and the NIC pays at least.

use crate::engines::STALL;
use crate::pin::PinGuard;
use crate::stats::ns;
use crossbeam_queue::ArrayQueue;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use weft::{Completion, Domain, LocalMr, LocalSlice, PeerId, RemoteSlice, Rkey, WrId, WriteWr};

/// One destination of a handed-off scatter.
#[derive(Debug, Clone, Copy)]
pub struct HandedDst {
    /// The target peer, as the poster's domain knows it.
    pub peer: PeerId,
    /// Offset of the bytes in the poster's registered source.
    pub src_offset: u64,
    /// Bytes to write.
    pub len: u64,
    /// Start of the target registration.
    pub base: u64,
    /// Its rkey.
    pub rkey: Rkey,
}

impl HandedDst {
    /// The WRITE to this destination from registration `src`.
    pub fn wr(&self, src: &LocalMr, id: WrId) -> WriteWr {
        WriteWr {
            wr: id,
            peer: self.peer,
            src: LocalSlice {
                mr: src.key,
                addr: src.addr + self.src_offset,
                len: self.len,
            },
            dst: RemoteSlice {
                base: self.base,
                offset: 0,
                rkey: self.rkey,
            },
            imm: None,
        }
    }
}

/// A scatter on its way to the poster: its destinations and when it was
/// pushed.
struct Job {
    pushed: Instant,
    dsts: Vec<HandedDst>,
}

/// When the poster got a scatter's WRITEs accepted, in ns after its push.
#[derive(Debug, Clone, Copy, Default)]
pub struct Posted {
    /// The first WRITE accepted.
    pub first_wr: f64,
    /// The last WRITE accepted.
    pub all_posted: f64,
}

/// The queue and the poster's answers, shared by the bench thread and the
/// poster.
struct Shared {
    q: ArrayQueue<Box<Job>>,
    /// Scatters completed (every WRITE reaped).
    acks: AtomicU64,
    last: Mutex<Result<Posted, String>>,
    stop: AtomicBool,
}

/// Runs `body` with a poster thread (pinned to `cpu`) that owns `rd` for
/// the duration; `body` hands scatters over with [`Poster::scatter`].
pub fn with_poster<R>(
    rd: &mut dyn Domain,
    src: &LocalMr,
    cpu: Option<usize>,
    body: impl FnOnce(&Poster<'_>) -> Result<R, String>,
) -> Result<R, String> {
    let shared = Shared {
        q: ArrayQueue::new(4),
        acks: AtomicU64::new(0),
        last: Mutex::new(Ok(Posted::default())),
        stop: AtomicBool::new(false),
    };
    std::thread::scope(|s| {
        let sh = &shared;
        let poster = s.spawn(move || {
            let _pin = PinGuard::new(cpu);
            poster_loop(rd, src, sh);
        });
        let r = body(&Poster { shared: sh });
        sh.stop.store(true, Ordering::Release);
        if poster.join().is_err() {
            return Err("raw hand-off poster panicked".into());
        }
        r
    })
}

/// The bench thread's handle on a running poster.
pub struct Poster<'a> {
    shared: &'a Shared,
}

impl Poster<'_> {
    /// Hands one scatter to `dsts` over, then waits, calling `progress`
    /// (the peers' side, where the backend needs it), until the poster
    /// reaped every WRITE. Returns when its WRITEs were accepted.
    pub fn scatter(
        &self,
        dsts: Vec<HandedDst>,
        mut progress: impl FnMut() -> Result<(), String>,
    ) -> Result<Posted, String> {
        let sh = self.shared;
        let before = sh.acks.load(Ordering::Acquire);
        // Allocated before the stamp, as the engine's request is.
        let mut job = Box::new(Job {
            pushed: Instant::now(),
            dsts,
        });
        let t0 = Instant::now();
        job.pushed = t0;
        while let Err(back) = sh.q.push(job) {
            job = back;
            std::hint::spin_loop();
        }
        while sh.acks.load(Ordering::Acquire) == before {
            progress()?;
            if t0.elapsed() > STALL {
                return Err("raw hand-off scatter stalled".into());
            }
        }
        sh.last
            .lock()
            .map_err(|_| "raw hand-off result poisoned".to_string())?
            .clone()
    }
}

/// The poster thread: one scatter at a time, posted and reaped.
fn poster_loop(rd: &mut dyn Domain, src: &LocalMr, sh: &Shared) {
    let max_batch = rd.capabilities().max_batch.max(1);
    let mut wrs: Vec<WriteWr> = Vec::new();
    let mut comps: Vec<Completion> = Vec::new();
    let mut next_wr = 1u64 << 40;
    let mut idle = 0u32;
    while !sh.stop.load(Ordering::Acquire) {
        let Some(job) = sh.q.pop() else {
            idle = idle.wrapping_add(1);
            if idle.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        };
        idle = 0;
        let r = post_one(rd, src, &job, max_batch, &mut wrs, &mut comps, &mut next_wr);
        drop(job);
        if let Ok(mut last) = sh.last.lock() {
            *last = r;
        }
        sh.acks.fetch_add(1, Ordering::Release);
    }
}

/// Builds and posts one scatter's WRITEs (the first alone), then reaps
/// them all.
fn post_one(
    rd: &mut dyn Domain,
    src: &LocalMr,
    job: &Job,
    max_batch: usize,
    wrs: &mut Vec<WriteWr>,
    comps: &mut Vec<Completion>,
    next_wr: &mut u64,
) -> Result<Posted, String> {
    // WRITE 0 is built and posted before the others are built, as the
    // engine plans and posts it.
    wrs.clear();
    let mut built = 0;
    let n = job.dsts.len();
    let mut done = 0usize;
    let mut reap = |rd: &mut dyn Domain, done: &mut usize| reap_writes(rd, comps, done);
    let mut posted = Posted::default();
    let mut off = 0;
    while off < n {
        // The first WRITE alone, as the engine posts it; then batches.
        let end = if off == 0 {
            1
        } else {
            (off + max_batch).min(n)
        };
        while built < end {
            *next_wr += 1;
            wrs.push(job.dsts[built].wr(src, WrId(*next_wr)));
            built += 1;
        }
        let before = off;
        match rd.post_writes(&wrs[off..end]) {
            Ok(k) => off += k,
            Err(e) if e.error.is_retryable() => off += e.posted,
            Err(e) => return Err(e.to_string()),
        }
        if before == 0 && off > 0 {
            posted.first_wr = ns(job.pushed.elapsed());
        }
        if off < end {
            reap(rd, &mut done)?;
        }
        if job.pushed.elapsed() > STALL {
            return Err("raw hand-off poster stalled while posting".into());
        }
    }
    posted.all_posted = ns(job.pushed.elapsed());
    while done < n {
        reap(rd, &mut done)?;
        if job.pushed.elapsed() > STALL {
            return Err(format!(
                "raw hand-off poster stalled: {done}/{n} WRITEs completed after 10 s"
            ));
        }
    }
    Ok(posted)
}

/// Polls `rd` once, counting its WRITE completions into `done`; a failed
/// WRITE is an error.
pub(crate) fn reap_writes(
    rd: &mut dyn Domain,
    comps: &mut Vec<Completion>,
    done: &mut usize,
) -> Result<(), String> {
    comps.clear();
    rd.poll(comps).map_err(|e| e.to_string())?;
    for c in comps.iter() {
        if let Completion::Write { result, .. } = c {
            result.as_ref().map_err(|e| e.to_string())?;
            *done += 1;
        }
    }
    Ok(())
}
