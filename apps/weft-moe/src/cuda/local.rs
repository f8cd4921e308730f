//! [`LocalGroup`], the baseline without an engine: N ranks on one GPU, each
//! with its own buffers, and one proxy thread per rank that runs the
//! protocol between them with its own device-to-device copies (the moves the engine's scatter, single writes
//! and barriers make on a real fabric, with the same offsets from the same
//! [`StepPlan`]).
//!
//! Per step k, the proxy of rank r:
//! 1. sees `counted ≥ k`, writes its route row into every peer's mapped
//!    route buffer (row r) and counts it there ("ROUTE");
//! 2. sees `packed ≥ k`; per peer d, after d finished the weighted sum of
//!    step k−1 (BAR_C), copies the private part (≤ P slots); once all rows
//!    arrived it builds the [`StepPlan`] and copies the overflow parts;
//!    counts each peer's arrival ("DISPATCH");
//! 3. when all N−1 peers' data has arrived, raises `dispatch_ready = k`;
//! 4. sees `unpacked ≥ k` and publishes it (BAR_D);
//! 5. sees `combine_packed ≥ k`; per remote source s, after s unpacked
//!    (BAR_D), copies s's combine rows back; counts the arrival ("COMBINE");
//! 6. when all N−1 have arrived, raises `combine_ready = k`;
//! 7. sees `summed ≥ k` and publishes it (BAR_C).
//!
//! Every completion is counted, never inferred from ordering.
//!
//! Hardware queues: each rank's receive path waits in a one-block kernel
//! while its proxy's copies run on another stream. CUDA maps streams onto
//! `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues (default 8); with more
//! streams than queues, a copy can sit behind another rank's waiting kernel
//! in the same queue until that kernel times out. Set
//! `CUDA_DEVICE_MAX_CONNECTIONS=32` in the environment before the process
//! first touches CUDA when running more than 3 ranks on one GPU.

use super::{GpuError, GpuRank, ProxyGroup};
use crate::config::Dims;
use crate::error::Phase;
use crate::plan::{member_rank, StepPlan};
use crate::routes::RouteMatrix;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weft_cuda::{Gpu, Stream};

/// Host timestamps one proxy took during one step.
#[derive(Debug, Clone, Copy)]
pub struct ProxyTimes {
    /// The step (from 1).
    pub step: u64,
    /// The proxy saw the `counted` signal.
    pub counted_seen: Instant,
    /// The first transfer left: [`LocalGroup`] wrote the first route row
    /// into a peer's route buffer; [`super::EngineGroup`] returned from its
    /// first engine submit of the step (the route scatter, handed to the
    /// engine's queue). Equal to `counted_seen` with one rank.
    pub first_write: Instant,
    /// The proxy saw the `packed` signal.
    pub packed_seen: Instant,
    /// `dispatch_ready` was raised.
    pub dispatch_ready: Instant,
    /// The proxy saw the `combine_packed` signal.
    pub combine_packed_seen: Instant,
    /// `combine_ready` was raised.
    pub combine_ready: Instant,
}

#[derive(Default)]
struct Counters {
    routes_in: AtomicU64,
    dispatch_in: AtomicU64,
    combine_in: AtomicU64,
    unpacked: AtomicU64,
    summed: AtomicU64,
}

struct Shared {
    dims: Dims,
    ranks: Vec<Arc<GpuRank>>,
    counters: Vec<Counters>,
    stop: AtomicBool,
    timeout: Duration,
    times: Vec<Mutex<Vec<ProxyTimes>>>,
}

/// N ranks on one GPU with a proxy thread each (see the module docs).
pub struct LocalGroup {
    shared: Arc<Shared>,
    threads: Vec<(u32, JoinHandle<Result<(), GpuError>>)>,
}

impl std::fmt::Debug for LocalGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalGroup")
            .field("ranks", &self.shared.dims.ranks)
            .finish()
    }
}

impl LocalGroup {
    /// Allocates `dims.ranks` ranks on `gpu` and starts their proxies. A
    /// proxy that waits longer than `timeout` for a signal or a peer stops
    /// with [`GpuError::Timeout`].
    pub fn new(gpu: &Gpu, dims: &Dims, timeout: Duration) -> Result<LocalGroup, GpuError> {
        let ranks = (0..dims.ranks)
            .map(|r| GpuRank::new(gpu, dims, r).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = Arc::new(Shared {
            dims: dims.clone(),
            counters: (0..dims.ranks).map(|_| Counters::default()).collect(),
            times: (0..dims.ranks).map(|_| Mutex::new(Vec::new())).collect(),
            ranks,
            stop: AtomicBool::new(false),
            timeout,
        });
        let mut threads = Vec::new();
        for r in 0..dims.ranks {
            let stream = gpu
                .stream()
                .map_err(GpuError::cuda(Some(r), Phase::Setup))?;
            let sh = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("moe-proxy-{r}"))
                .spawn(move || Proxy { sh, r, stream }.run())
                .map_err(|e| GpuError::Proxy {
                    rank: r,
                    what: format!("spawning the proxy thread: {e}"),
                })?;
            threads.push((r, h));
        }
        Ok(LocalGroup { shared, threads })
    }

    fn stop_all(&mut self) -> Result<(), GpuError> {
        self.shared.stop.store(true, Ordering::Release);
        let mut first = Ok(());
        for (r, h) in self.threads.drain(..) {
            let res = h.join().unwrap_or_else(|_| {
                Err(GpuError::Proxy {
                    rank: r,
                    what: "proxy thread panicked".into(),
                })
            });
            if first.is_ok() {
                first = res;
            }
        }
        first
    }
}

impl ProxyGroup for LocalGroup {
    fn rank(&self, r: u32) -> Option<&Arc<GpuRank>> {
        self.shared.ranks.get(r as usize)
    }

    fn take_times(&self, r: u32) -> Vec<ProxyTimes> {
        self.shared
            .times
            .get(r as usize)
            .map(|m| std::mem::take(&mut *m.lock()))
            .unwrap_or_default()
    }

    fn healthy(&self) -> bool {
        self.threads.iter().all(|(_, h)| !h.is_finished())
    }

    fn shutdown(mut self: Box<Self>) -> Result<(), GpuError> {
        self.stop_all()
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        if let Err(e) = self.stop_all() {
            tracing::warn!(%e, "MoE proxy failed");
        }
    }
}

struct Proxy {
    sh: Arc<Shared>,
    r: u32,
    stream: Stream,
}

impl Proxy {
    /// Spins until `ready()`; `Ok(false)` when the group is stopping.
    fn wait(
        &self,
        phase: Phase,
        what: &'static str,
        ready: impl Fn() -> bool,
    ) -> Result<bool, GpuError> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if ready() {
                return Ok(true);
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                if self.sh.stop.load(Ordering::Acquire) {
                    return Ok(false);
                }
                if start.elapsed() > self.sh.timeout {
                    return Err(GpuError::Timeout {
                        rank: self.r,
                        phase,
                        what,
                        waited: start.elapsed(),
                    });
                }
            }
        }
    }

    /// Copies `len` bytes of the own send buffer to `dst`'s receive buffer.
    fn copy(
        &self,
        dst: &GpuRank,
        dst_off: u64,
        src_off: u64,
        len: u64,
        ph: Phase,
    ) -> Result<(), GpuError> {
        let me = &self.sh.ranks[self.r as usize];
        let cast = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        self.stream
            .copy_d2d(&dst.recv, cast(dst_off), &me.send, cast(src_off), cast(len))
            .map_err(GpuError::cuda(Some(self.r), ph))
    }

    fn sync(&self, phase: Phase) -> Result<(), GpuError> {
        self.stream
            .synchronize()
            .map_err(GpuError::cuda(Some(self.r), phase))
    }

    fn run(self) -> Result<(), GpuError> {
        let res = self.steps();
        if let Err(e) = &res {
            tracing::error!(rank = self.r, %e, "MoE proxy stopped");
        }
        res
    }

    fn steps(&self) -> Result<(), GpuError> {
        let sh = &*self.sh;
        let dims = &sh.dims;
        let (n, r) = (dims.ranks, self.r);
        let me = &sh.ranks[r as usize];
        let c = &sh.counters;
        let peers: Vec<u32> = (0..n.saturating_sub(1) as usize)
            .map(|j| member_rank(n, r, j))
            .collect();
        let row_len = dims.route_row_len() as usize;
        let mut row = vec![0u8; row_len];
        let mut all = vec![0u8; dims.route_buf_len() as usize];
        let peers_n = u64::from(n - 1);
        for k in 1u64.. {
            // 1. ROUTE
            if !self.wait(Phase::Route, "counted signal", || {
                me.sig_counted.value() >= k
            })? {
                return Ok(());
            }
            let counted_seen = Instant::now();
            me.route
                .read(r as usize * row_len, &mut row)
                .map_err(GpuError::cuda(Some(r), Phase::Route))?;
            let mut first_write = counted_seen;
            for (j, &d) in peers.iter().enumerate() {
                sh.ranks[d as usize]
                    .route
                    .write(r as usize * row_len, &row)
                    .map_err(GpuError::cuda(Some(r), Phase::Route))?;
                c[d as usize].routes_in.fetch_add(1, Ordering::AcqRel);
                if j == 0 {
                    first_write = Instant::now();
                }
            }
            // 2. DISPATCH: private parts (after BAR_C of step k-1), then the
            //    plan and the overflow parts.
            if !self.wait(Phase::Dispatch, "packed signal", || {
                me.sig_packed.value() >= k
            })? {
                return Ok(());
            }
            let packed_seen = Instant::now();
            let own: Vec<u32> = row
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let mut seg = vec![0u64; n as usize];
            let mut acc = 0u64;
            for d in 0..n {
                seg[d as usize] = acc;
                acc += u64::from(crate::plan::n_to_rank(dims, &own, d));
            }
            let p = u64::from(dims.private);
            for &d in &peers {
                if !self.wait(Phase::BarrierC, "peer's weighted sum (BAR_C)", || {
                    c[d as usize].summed.load(Ordering::Acquire) >= k - 1
                })? {
                    return Ok(());
                }
                let cnt = u64::from(crate::plan::n_to_rank(dims, &own, d)).min(p);
                self.copy(
                    &sh.ranks[d as usize],
                    dims.private_offset(r),
                    seg[d as usize] * dims.b_in,
                    cnt * dims.b_in,
                    Phase::Dispatch,
                )?;
            }
            if !self.wait(Phase::Route, "route rows", || {
                c[r as usize].routes_in.load(Ordering::Acquire) >= k * peers_n
            })? {
                return Ok(());
            }
            me.route
                .read(0, &mut all)
                .map_err(GpuError::cuda(Some(r), Phase::Route))?;
            let rows: Vec<Vec<u32>> = all
                .chunks_exact(row_len)
                .map(|rw| {
                    rw.chunks_exact(4)
                        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect()
                })
                .collect();
            let m = RouteMatrix::from_rows(dims, &rows)?;
            let plan = StepPlan::new(dims, r, &m)?;
            for (d, dest) in plan.dests().iter().enumerate() {
                if let Some(o) = dest.overflow {
                    self.copy(
                        &sh.ranks[d],
                        dims.contig_offset() + u64::from(o.dst_slot) * dims.b_in,
                        u64::from(o.src_slot) * dims.b_in,
                        u64::from(o.len) * dims.b_in,
                        Phase::Dispatch,
                    )?;
                }
            }
            self.sync(Phase::Dispatch)?;
            for &d in &peers {
                c[d as usize].dispatch_in.fetch_add(1, Ordering::AcqRel);
            }
            // 3. all data in: release the unpack kernel.
            if !self.wait(Phase::Dispatch, "peers' dispatch data", || {
                c[r as usize].dispatch_in.load(Ordering::Acquire) >= k * peers_n
            })? {
                return Ok(());
            }
            me.dispatch_ready.raise(k);
            let dispatch_ready = Instant::now();
            // 4. BAR_D
            if !self.wait(Phase::BarrierD, "unpacked signal", || {
                me.sig_unpacked.value() >= k
            })? {
                return Ok(());
            }
            c[r as usize].unpacked.store(k, Ordering::Release);
            // 5. COMBINE
            if !self.wait(Phase::Combine, "combine-packed signal", || {
                me.sig_cpacked.value() >= k
            })? {
                return Ok(());
            }
            let combine_packed_seen = Instant::now();
            for cs in plan.combine_sends() {
                let s = cs.rank as usize;
                if !self.wait(Phase::BarrierD, "peer's unpack (BAR_D)", || {
                    c[s].unpacked.load(Ordering::Acquire) >= k
                })? {
                    return Ok(());
                }
                self.copy(
                    &sh.ranks[s],
                    u64::from(cs.dst_slot) * dims.b_out,
                    u64::from(cs.src_slot) * dims.b_out,
                    u64::from(cs.len) * dims.b_out,
                    Phase::Combine,
                )?;
            }
            self.sync(Phase::Combine)?;
            for cs in plan.combine_sends() {
                c[cs.rank as usize]
                    .combine_in
                    .fetch_add(1, Ordering::AcqRel);
            }
            // 6. all combine rows in: release the weighted sum.
            if !self.wait(Phase::Combine, "peers' combine data", || {
                c[r as usize].combine_in.load(Ordering::Acquire) >= k * peers_n
            })? {
                return Ok(());
            }
            me.combine_ready.raise(k);
            let combine_ready = Instant::now();
            // 7. BAR_C
            if !self.wait(Phase::BarrierC, "summed signal", || {
                me.sig_summed.value() >= k
            })? {
                return Ok(());
            }
            c[r as usize].summed.store(k, Ordering::Release);
            sh.times[r as usize].lock().push(ProxyTimes {
                step: k,
                counted_seen,
                first_write,
                packed_seen,
                dispatch_ready,
                combine_packed_seen,
                combine_ready,
            });
        }
        Ok(())
    }
}
