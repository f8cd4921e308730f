//! The proxy of an [`EngineRank`](super::EngineRank): one rank whose data
//! moves over a real [`weft::TransferEngine`], on any provider that
//! registers GPU memory (the same-host backend `nvlink` with the GPU's peer
//! memory, libfabric with FI_HMEM, or the simulated fabric with a CUDA
//! copier in tests).
//!
//! Each rank's proxy thread runs the same [`RankCore`] as the CPU driver
//! ([`crate::MoeRank`]) and the simulation ([`crate::sim`]); only the
//! executor differs. The rank's GPU send and receive buffers and its
//! host-mapped route buffer are registered with its engine; the proxy posts
//! the route scatter, the private scatter, the overflow writes, the barriers
//! and the combine scatter the core asks for, arms every round with
//! `expect_imm_count` and waits for the counts the receiver computed. The
//! core's device operations map onto the kernels' signal words and flags:
//!
//! | core action | proxy |
//! |---|---|
//! | (step start) | waits for `counted ≥ k`, reads the own route row the count kernel wrote into the mapped route buffer, feeds it as [`Event::Dispatch`] |
//! | `WriteRouteRow` | nothing: the count kernel wrote the row |
//! | `PackDispatch` | waits for `packed ≥ k` |
//! | `ReadRoutes` | reads the peers' rows from the mapped route buffer |
//! | `Unpack` | waits for its own submits, raises `dispatch_ready = k`, waits for `unpacked ≥ k` |
//! | `Finished(Dispatch)` | feeds [`Event::Combine`] |
//! | `PackCombine` | waits for `combine_packed ≥ k` |
//! | `WeightedSum` | waits for its own submits, raises `combine_ready = k`, waits for `summed ≥ k` |
//!
//! Raising a flag only after the own submits resolved keeps the source
//! buffers safe on the GPU side: the kernel after the dispatch-recv wait
//! (`combine_pack`) rewrites `send_buf`, and the kernels after the
//! combine-recv wait (the next step's count and pack) rewrite the route row
//! and `send_buf`; both are stream-ordered behind the flag. The receive
//! side needs nothing extra: the core sends BAR_D only after `unpacked`
//! (nothing lands in `recv_buf` before it) and BAR_C only after `summed`.
//!
//! Kernels must be launched in the usual per-rank order on one stream
//! (dispatch-send, dispatch-recv, combine-send, combine-recv, ...), directly
//! or as replayed CUDA graphs.

use super::{GpuError, GpuRank, ProxyTimes};
use crate::config::Dims;
use crate::core::{Action, Entry, Event, RankCore, Wait};
use crate::error::{MoeError, Phase};
use crate::exec::Peers;
use crate::imm::{COMBINE_MODE, DISPATCH_MODE};
use crate::routes::RouteMatrix;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{DoneCounter, DoneFlag, Imm, MrHandle, OnDone, Resources, ScatterMode, TransferEngine};
use weft_cuda::WatchWord;

/// How long a wait for the caller spins before it naps between checks.
const IDLE_AFTER: Duration = Duration::from_millis(10);
/// The nap (the latency an idle rank's next step may pay).
const IDLE_NAP: Duration = Duration::from_micros(50);

/// Per-step timestamps a proxy keeps until its owner takes them.
const MAX_TIMES: usize = 4096;

/// What a rank's proxy shares with its owner ([`super::EngineRank`]).
pub(crate) struct RankShared {
    pub(crate) dims: Dims,
    pub(crate) rank: Arc<GpuRank>,
    pub(crate) stop: AtomicBool,
    pub(crate) timeout: Duration,
    pub(crate) times: Mutex<Vec<ProxyTimes>>,
}

pub(crate) fn eng(rank: u32, phase: Phase) -> impl Fn(weft::EngineError) -> GpuError {
    move |source| {
        tracing::debug!(rank, ?phase, %source, "engine call failed");
        GpuError::Moe(MoeError::Engine { phase, source })
    }
}

fn phase_index(p: Phase) -> usize {
    match p {
        Phase::Setup => 0,
        Phase::Route => 1,
        Phase::Dispatch => 2,
        Phase::BarrierD => 3,
        Phase::Combine => 4,
        Phase::BarrierC => 5,
    }
}

/// One rank's engine side: handles, peers, own-submit counter, armed rounds.
pub(crate) struct Net {
    engine: Arc<TransferEngine>,
    rank: u32,
    /// route, send, recv.
    handles: [MrHandle; 3],
    /// The registrations behind `handles` and the reserved immediates.
    held: Resources,
    /// The members: peer group, receive descriptors, scatter targets.
    peers: Peers,
    done: Arc<DoneCounter>,
    submitted: u64,
    flags: [Option<Arc<DoneFlag>>; 6],
    /// Whether a WR was submitted since the flag was last cleared.
    posted: bool,
}

impl Net {
    /// Rank `rank`'s engine side after `connect`: its registrations and
    /// immediates (`held`) and its checked members.
    pub(crate) fn new(
        engine: Arc<TransferEngine>,
        rank: u32,
        handles: [MrHandle; 3],
        held: Resources,
        peers: Peers,
    ) -> Net {
        Net {
            engine,
            rank,
            handles,
            held,
            peers,
            done: Arc::new(DoneCounter::new()),
            submitted: 0,
            flags: Default::default(),
            posted: false,
        }
    }

    fn on_done(&mut self) -> OnDone {
        self.submitted += 1;
        self.posted = true;
        OnDone::counter(&self.done)
    }

    fn scatter(
        &mut self,
        phase: Phase,
        imm: Imm,
        entries: &[Entry],
        route: bool,
        mode: ScatterMode,
    ) -> Result<(), GpuError> {
        let slices = crate::exec::scatter_slices(entries)?;
        let od = self.on_done();
        let (targets, src) = if route {
            (&self.peers.route_targets, &self.handles[0])
        } else {
            (&self.peers.recv_targets, &self.handles[1])
        };
        self.engine
            .submit_scatter_to_mode(targets, od, Some(imm), src, &slices, mode)
            .map_err(eng(self.rank, phase))?;
        Ok(())
    }

    /// Runs an engine action of the core.
    fn run(&mut self, a: &Action) -> Result<(), GpuError> {
        match a {
            Action::Arm { phase, imm, count } => {
                let (od, flag) = OnDone::flag();
                self.engine
                    .expect_imm_count_with(*imm, *count, od)
                    .map_err(eng(self.rank, *phase))?;
                self.flags[phase_index(*phase)] = Some(flag);
            }
            Action::RouteScatter { imm, entries } => {
                self.scatter(Phase::Route, *imm, entries, true, DISPATCH_MODE)?
            }
            Action::PrivateScatter { imm, entries } => {
                self.scatter(Phase::Dispatch, *imm, entries, false, DISPATCH_MODE)?
            }
            Action::CombineScatter { imm, entries } => {
                self.scatter(Phase::Combine, *imm, entries, false, COMBINE_MODE)?
            }
            Action::OverflowWrite { imm, entry } => {
                let dst = self
                    .peers
                    .recv
                    .get(entry.member)
                    .ok_or(MoeError::Shape {
                        what: "overflow member",
                        got: entry.member as u64,
                        want: self.peers.recv.len() as u64,
                    })?
                    .clone();
                let od = self.on_done();
                self.engine
                    .submit_single_write(
                        entry.len,
                        Some(*imm),
                        (&self.handles[1], entry.src_offset),
                        (&dst, entry.dst_offset),
                        od,
                    )
                    .map_err(eng(self.rank, Phase::Dispatch))?;
            }
            Action::Barrier { phase, imm } => {
                let od = self.on_done();
                self.engine
                    .submit_barrier(&self.peers.group, od, *imm, &self.peers.recv)
                    .map_err(eng(self.rank, *phase))?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether `w` holds: `None` if not yet, else the event (or the error).
    fn poll(&self, w: &Wait) -> Option<Result<Event, GpuError>> {
        let err = |phase, source| Err(GpuError::Moe(MoeError::Engine { phase, source }));
        match *w {
            Wait::Submits(phase) => {
                if self.done.total() < self.submitted {
                    return None;
                }
                Some(match self.done.first_error() {
                    Some(source) => err(phase, source),
                    None => Ok(Event::SubmitsDone),
                })
            }
            Wait::Round { phase, .. } => {
                let r = self.flags[phase_index(phase)].as_ref()?.result()?;
                Some(match r {
                    Ok(()) => Ok(Event::RoundFired(phase)),
                    Err(source) => err(phase, source),
                })
            }
        }
    }

    /// What timing out on `w` means.
    fn timeout_error(&self, w: &Wait) -> GpuError {
        match *w {
            Wait::Submits(phase) => MoeError::SubmitTimeout {
                phase,
                submitted: self.submitted,
                done: self.done.total(),
            }
            .into(),
            Wait::Round { phase, imm, count } => MoeError::Timeout {
                phase,
                imm,
                expected: count,
                pending: self.engine.imm_pending(imm),
            }
            .into(),
        }
    }

    /// Frees the immediates and deregisters the buffers.
    fn release(&mut self) -> Result<(), GpuError> {
        self.held.release().map_err(eng(self.rank, Phase::Setup))
    }
}

/// One rank's proxy: runs its [`RankCore`] on its thread (module docs).
pub(crate) struct Proxy {
    pub(crate) core: RankCore,
    pub(crate) sh: Arc<RankShared>,
    pub(crate) r: u32,
    pub(crate) net: Net,
}

/// Why a wait ended without its condition.
enum Stop {
    /// The group is stopping.
    Stopped,
    /// The wait took longer than the group's timeout.
    TimedOut,
}

impl Proxy {
    /// Spins until `ready()` returns a value (yielding the core now and
    /// then: a GPU host runs a proxy and engine workers per rank).
    /// `bounded` waits (peers' rounds, the rank's own kernels) end with
    /// `TimedOut` after the group's timeout; the others wait for the
    /// caller as long as it takes (the next step's launch, the combine's
    /// launch after the experts ran), sleeping [`IDLE_NAP`] between checks
    /// once they have waited [`IDLE_AFTER`].
    fn spin<T>(
        &self,
        stoppable: bool,
        bounded: bool,
        mut ready: impl FnMut() -> Option<T>,
    ) -> Result<T, Stop> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(v) = ready() {
                return Ok(v);
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                if stoppable && self.sh.stop.load(Ordering::Acquire) {
                    return Err(Stop::Stopped);
                }
                let waited = start.elapsed();
                if bounded && waited > self.sh.timeout {
                    return Err(Stop::TimedOut);
                }
                if !bounded && waited > IDLE_AFTER {
                    std::thread::sleep(IDLE_NAP);
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Waits for a kernel's signal word to reach `k` (`bounded`: see
    /// [`Proxy::spin`]); `Ok(false)` when the group is stopping.
    fn signal(
        &self,
        word: &WatchWord,
        phase: Phase,
        what: &'static str,
        k: u64,
        bounded: bool,
    ) -> Result<bool, GpuError> {
        let start = Instant::now();
        match self.spin(true, bounded, || (word.value() >= k).then_some(())) {
            Ok(()) => Ok(true),
            Err(Stop::Stopped) => Ok(false),
            Err(Stop::TimedOut) => Err(GpuError::Timeout {
                rank: self.r,
                phase,
                what,
                waited: start.elapsed(),
            }),
        }
    }

    /// Waits for a core wait; `Ok(None)` when the group is stopping.
    fn wait(&self, w: &Wait, stoppable: bool) -> Result<Option<Event>, GpuError> {
        match self.spin(stoppable, true, || self.net.poll(w)) {
            Ok(r) => r.map(Some),
            Err(Stop::Stopped) => Ok(None),
            Err(Stop::TimedOut) => Err(self.net.timeout_error(w)),
        }
    }

    /// Reads the peers' route rows out of the mapped route buffer.
    fn read_routes(&self) -> Result<Event, GpuError> {
        let me = &self.sh.rank;
        let d = &self.sh.dims;
        let mut all = vec![0u8; d.route_buf_len() as usize];
        me.route
            .read(0, &mut all)
            .map_err(GpuError::cuda(Some(self.r), Phase::Route))?;
        let row_len = d.route_row_len() as usize;
        let mut m = RouteMatrix::new(d);
        for s in 0..d.ranks {
            if s == self.r {
                continue;
            }
            let off = s as usize * row_len;
            let bytes = all.get(off..off + row_len).unwrap_or(&[]);
            m.set_row_le_bytes(d, s, bytes)?;
        }
        Ok(Event::Routes(m))
    }

    pub(crate) fn run(mut self) -> Result<(), GpuError> {
        let res = self.steps();
        if let Err(e) = &res {
            tracing::error!(rank = self.r, %e, "MoE engine proxy stopped");
        }
        // Only a proxy stopped between steps ends cleanly; one stopped in
        // the middle of a step (a failed caller) just deregisters.
        let fin = if res.is_ok() && self.core.idle() {
            self.finish()
        } else {
            Ok(())
        };
        let rel = self.net.release();
        res.and(fin).and(rel)
    }

    /// A clean end: the last BAR_C round (peers no longer read or write
    /// this rank's buffers) and the own submits.
    fn finish(&self) -> Result<(), GpuError> {
        if let Some(w) = self.core.shutdown_wait() {
            self.wait(&w, false)?;
        }
        self.wait(&Wait::Submits(Phase::BarrierC), false)?;
        Ok(())
    }

    fn steps(&mut self) -> Result<(), GpuError> {
        let me = self.sh.rank.clone();
        let d = self.sh.dims.clone();
        let row_len = d.route_row_len() as usize;
        let mut row = vec![0u8; row_len];
        for k in 1u64.. {
            // The next step comes when the caller launches it: no bound.
            if !self.signal(&me.sig_counted, Phase::Route, "counted signal", k, false)? {
                return Ok(());
            }
            let counted_seen = Instant::now();
            me.route
                .read(self.r as usize * row_len, &mut row)
                .map_err(GpuError::cuda(Some(self.r), Phase::Route))?;
            let counts: Vec<u32> = row
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let mut t = ProxyTimes {
                step: k,
                counted_seen,
                first_write: counted_seen,
                packed_seen: counted_seen,
                dispatch_ready: counted_seen,
                combine_packed_seen: counted_seen,
                combine_ready: counted_seen,
            };
            self.net.posted = false;
            let mut q = VecDeque::from([Event::Dispatch { row: counts }]);
            while let Some(ev) = q.pop_front() {
                for a in self.core.on(ev)? {
                    if !self.act(&a, k, &mut t, &mut q)? {
                        return Ok(());
                    }
                }
            }
            let mut times = self.sh.times.lock();
            // Bounded: a long-running rank whose owner never takes them
            // keeps the latest steps only.
            if times.len() >= MAX_TIMES {
                times.drain(..MAX_TIMES / 2);
            }
            times.push(t);
        }
        Ok(())
    }

    /// Runs one action; `Ok(false)` when the group is stopping.
    fn act(
        &mut self,
        a: &Action,
        k: u64,
        t: &mut ProxyTimes,
        q: &mut VecDeque<Event>,
    ) -> Result<bool, GpuError> {
        let me = self.sh.rank.clone();
        match a {
            Action::Wait(w) => match self.wait(w, true)? {
                Some(e) => q.push_back(e),
                None => return Ok(false),
            },
            Action::WriteRouteRow { .. } => {}
            Action::PackDispatch => {
                let ok = self.signal(&me.sig_packed, Phase::Dispatch, "packed signal", k, true)?;
                t.packed_seen = Instant::now();
                return Ok(ok);
            }
            Action::ReadRoutes => q.push_back(self.read_routes()?),
            Action::Unpack => {
                if self.wait(&Wait::Submits(Phase::Dispatch), true)?.is_none() {
                    return Ok(false);
                }
                me.dispatch_ready.raise(k);
                t.dispatch_ready = Instant::now();
                return self.signal(
                    &me.sig_unpacked,
                    Phase::BarrierD,
                    "unpacked signal",
                    k,
                    true,
                );
            }
            Action::Finished(Phase::Dispatch) => q.push_back(Event::Combine),
            Action::Finished(_) => {}
            Action::PackCombine => {
                let ok =
                    // After the experts: the caller decides when.
                    self.signal(&me.sig_cpacked, Phase::Combine, "combine-packed signal", k, false)?;
                t.combine_packed_seen = Instant::now();
                return Ok(ok);
            }
            Action::WeightedSum => {
                if self.wait(&Wait::Submits(Phase::Combine), true)?.is_none() {
                    return Ok(false);
                }
                me.combine_ready.raise(k);
                t.combine_ready = Instant::now();
                return self.signal(&me.sig_summed, Phase::BarrierC, "summed signal", k, true);
            }
            _ => {
                let first = !self.net.posted;
                self.net.run(a)?;
                if first && self.net.posted {
                    t.first_write = Instant::now();
                }
            }
        }
        Ok(true)
    }
}
