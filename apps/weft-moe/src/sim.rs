//! [`SimCluster`]: every rank of a group in one thread, each a manual-mode
//! engine on one step-mode loopback [`Fabric`], all driven by the same
//! [`RankCore`] and host executor as [`crate::MoeRank`]. Deterministic for
//! a fabric seed, and time is simulated, never slept.
//!
//! Two uses: adversarial correctness runs (an adversarial fabric profile,
//! [`HostModel::zero`]) over many ranks in one process, and a latency
//! model: with a [`HostModel`] each action is charged a cost on one of two
//! lanes per rank, the *device* lane (count, pack, unpack, combine pack,
//! weighted sum; in order) and the *proxy* lane (submits, charged
//! `submit + per_wr · WRs` before the WRs are posted). A proxy action waits
//! for the device work before it; device work does not wait for the proxy.
//! An action runs on the fabric once simulated time has reached the end of
//! its cost; the fabric's NIC model ([`weft::loopback::NicModel`]) does the
//! rest.

use crate::config::MoeConfig;
use crate::core::{Action, Event, RankCore, Wait};
use crate::error::MoeError;
use crate::exec::{CombineIo, DispatchIo, HostExec, RankInfo};
use crate::expert::{ExpertTokens, RankInput};
use crate::imm::{COMBINE_MODE, DISPATCH_MODE};
use crate::routes::{count_pairs, CountedPairs};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use weft::loopback::{Fabric, FabricConfig, HostId, NicModel};
use weft::{DomainGroupSpec, ImmCounts, TransferEngine};

/// Costs charged per action (all zero: [`HostModel::zero`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HostModel {
    /// Counting the pairs and writing the route row (device lane).
    pub count: Duration,
    /// Packing the token rows (device lane).
    pub pack: Duration,
    /// Building the step plan from the routes (proxy lane).
    pub plan: Duration,
    /// Unpacking into the expert layout (device lane).
    pub unpack: Duration,
    /// Combine pack (device lane).
    pub combine_pack: Duration,
    /// Weighted sum (device lane).
    pub combine_sum: Duration,
    /// Per submit, until its first WR can be posted (proxy lane).
    pub submit: Duration,
    /// Per posted WR (proxy lane).
    pub per_wr: Duration,
}

impl HostModel {
    /// Every cost zero (correctness runs).
    pub fn zero() -> HostModel {
        HostModel::default()
    }
}

/// How to build a [`SimCluster`].
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The fabric (step mode is used whatever it says about realtime).
    pub fabric: FabricConfig,
    /// NICs per rank (one engine group over all of them).
    pub nics: usize,
    /// Every NIC's model.
    pub nic: NicModel,
    /// Host/device costs.
    pub host: HostModel,
    /// Time step while a rank has a charged action pending (smaller is
    /// more exact and slower).
    pub tick: Duration,
}

/// Simulated times of one step at one rank (nanoseconds of fabric time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankTimes {
    /// Dispatch call.
    pub dispatch_start: u64,
    /// Unpack done (the expert layout is ready).
    pub unpacked: u64,
    /// Combine call.
    pub combine_start: u64,
    /// Weighted sum done.
    pub summed: u64,
}

/// How [`SimCluster::run_steps`] paces the ranks.
#[derive(Debug, Clone, Default)]
pub struct RunOpts {
    /// Per rank: how late each of its phases starts.
    pub delays: Vec<Duration>,
    /// Phases start together on every rank (see [`SimCluster::run_steps`]).
    pub synchronized: bool,
}

/// What one step of [`SimCluster::run_steps`] produced.
#[derive(Debug, Clone)]
pub struct SimStep {
    /// Per rank: the expert layout.
    pub tokens: Vec<ExpertTokens>,
    /// Per rank: the combined tokens.
    pub combined: Vec<Vec<u8>>,
    /// Per rank: the times.
    pub times: Vec<RankTimes>,
}

#[derive(Default)]
struct Owned {
    tokens: Vec<u8>,
    ids: Vec<u32>,
    weights: Vec<f32>,
}

struct SimRank {
    core: RankCore,
    exec: HostExec,
    ic: ImmCounts,
    queue: VecDeque<(Action, u64)>,
    dev_free: u64,
    proxy_free: u64,
    dev_done: u64,
    last: u64,
    input: Owned,
    pairs: Option<CountedPairs>,
    tokens: Option<ExpertTokens>,
    outputs: Vec<u8>,
    combined: Option<Vec<u8>>,
    times: RankTimes,
    finished: bool,
}

/// N ranks on one simulated fabric, driven on the calling thread.
pub struct SimCluster {
    fabric: Fabric,
    engines: Vec<Arc<TransferEngine>>,
    hosts: Vec<HostId>,
    ranks: Vec<SimRank>,
    host: HostModel,
    tick: u64,
    /// Waits are answered without feeding the cores (shutdown).
    draining: bool,
}

impl std::fmt::Debug for SimCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCluster")
            .field("ranks", &self.ranks.len())
            .field("now", &self.fabric.now().as_nanos())
            .finish()
    }
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl SimCluster {
    /// Builds the fabric, one manual engine per rank, prepares and connects
    /// every rank.
    pub fn new(cfg: &MoeConfig, sim: &SimConfig) -> Result<SimCluster, MoeError> {
        let dims = cfg.validate()?;
        let fabric = Fabric::new(FabricConfig {
            nic: sim.nic,
            ..sim.fabric.clone()
        });
        let mut engines = Vec::new();
        let mut hosts = Vec::new();
        let mut ranks = Vec::new();
        let mut infos: Vec<RankInfo> = Vec::new();
        if let Some(&m) = dims.mask.masked().first() {
            return Err(MoeError::Config(crate::ConfigError::BadMask {
                rank: m,
                why: "the simulation runs whole groups",
            }));
        }
        for r in 0..dims.ranks {
            let host = fabric.add_host_with(sim.nics, sim.nic);
            let p = Arc::new(fabric.provider(host));
            let engine = Arc::new(
                TransferEngine::builder()
                    .group(DomainGroupSpec::new(p, (0..sim.nics).collect::<Vec<_>>()))
                    .manual()
                    .build()
                    .map_err(|source| MoeError::Engine {
                        phase: crate::Phase::Setup,
                        source,
                    })?,
            );
            let (exec, info, ic) = HostExec::prepare(engine.clone(), cfg, r)?;
            let core = RankCore::new(dims.clone(), r, exec.imms, ic);
            infos.push(info);
            engines.push(engine);
            hosts.push(host);
            ranks.push(SimRank {
                core,
                exec,
                ic,
                queue: VecDeque::new(),
                dev_free: 0,
                proxy_free: 0,
                dev_done: 0,
                last: 0,
                input: Owned::default(),
                pairs: None,
                tokens: None,
                outputs: Vec::new(),
                combined: None,
                times: RankTimes::default(),
                finished: false,
            });
        }
        for (r, rank) in ranks.iter_mut().enumerate() {
            rank.exec.connect(&infos[r], &infos)?;
        }
        Ok(SimCluster {
            fabric,
            engines,
            hosts,
            ranks,
            host: sim.host,
            tick: ns(sim.tick).max(1),
            draining: false,
        })
    }

    /// The fabric (rules, stats, kill a host).
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The engines, by rank.
    pub fn engines(&self) -> &[Arc<TransferEngine>] {
        &self.engines
    }

    /// The fabric hosts, by rank.
    pub fn hosts(&self) -> &[HostId] {
        &self.hosts
    }

    /// The reserved immediates (equal on every rank).
    pub fn imms(&self) -> Option<crate::ImmValues> {
        self.ranks.first().map(|r| r.exec.imms)
    }

    /// Runs `steps.len()` steps (MoE layers) on every rank; `steps[k][r]`
    /// is rank r's input of step k. When rank r's dispatch of step k is
    /// done, `expert(r, k, tokens)` gives its expert outputs and its combine
    /// starts; when the combine is done, the next step's dispatch starts.
    /// Every phase of rank r starts `opts.delays[r]` late (default 0). With
    /// `opts.synchronized`, a phase starts on every rank only once every
    /// rank finished the previous one (for timing each phase alone);
    /// otherwise each rank runs ahead as soon as it can, as a serving loop
    /// does (which is what the barriers are there for).
    pub fn run_steps(
        &mut self,
        steps: &[Vec<RankInput<'_>>],
        opts: &RunOpts,
        mut expert: impl FnMut(u32, usize, &ExpertTokens) -> Vec<u8>,
    ) -> Result<Vec<SimStep>, MoeError> {
        let n = self.ranks.len();
        for ins in steps {
            if ins.len() != n {
                return Err(MoeError::Shape {
                    what: "inputs",
                    got: ins.len() as u64,
                    want: n as u64,
                });
            }
        }
        let mut out: Vec<SimStep> = (0..steps.len())
            .map(|_| SimStep {
                tokens: vec![ExpertTokens::default(); n],
                combined: vec![Vec::new(); n],
                times: vec![RankTimes::default(); n],
            })
            .collect();
        if steps.is_empty() {
            return Ok(out);
        }
        let delay = |r: usize| opts.delays.get(r).map_or(0, |&d| ns(d));
        let total = 2 * steps.len();
        // Phase index per rank: 2k = dispatch of step k, 2k+1 = its combine.
        let mut phase = vec![0usize; n];
        let t0 = self.fabric.now().as_nanos();
        for (r, input) in steps[0].iter().enumerate() {
            self.start(r, input, t0 + delay(r), &mut out[0].times[r])?;
        }
        let mut idle = 0u32;
        loop {
            let moved = self.progress()?;
            let now = self.fabric.now().as_nanos();
            let mut advanced = false;
            let all_done = self
                .ranks
                .iter()
                .zip(&phase)
                .all(|(rk, &p)| rk.finished || p >= total);
            for r in 0..n {
                if !self.ranks[r].finished || phase[r] >= total {
                    continue;
                }
                if opts.synchronized && !all_done {
                    break;
                }
                advanced = true;
                let (k, p) = (phase[r] / 2, phase[r]);
                let rank = &mut self.ranks[r];
                rank.finished = false;
                if p % 2 == 0 {
                    let t = rank.tokens.take().ok_or(MoeError::OutOfOrder {
                        expected: "a finished dispatch",
                    })?;
                    out[k].times[r].unpacked = rank.times.unpacked;
                    rank.outputs = expert(r as u32, k, &t);
                    out[k].tokens[r] = t;
                    let start = now + delay(r);
                    out[k].times[r].combine_start = start;
                    rank.combined = None;
                    self.feed_at(r, Event::Combine, start)?;
                } else {
                    out[k].combined[r] = rank.combined.take().ok_or(MoeError::OutOfOrder {
                        expected: "a finished combine",
                    })?;
                    out[k].times[r].summed = rank.times.summed;
                    if k + 1 < steps.len() {
                        let start = now + delay(r);
                        self.start(r, &steps[k + 1][r], start, &mut out[k + 1].times[r])?;
                    }
                }
                phase[r] += 1;
            }
            if phase.iter().all(|&p| p >= total) {
                return Ok(out);
            }
            if moved || advanced {
                idle = 0;
            } else if !self.advance_time() {
                idle += 1;
                if idle > 3 {
                    return Err(self.stuck());
                }
            }
        }
    }

    /// Starts a dispatch of `input` on rank `r` at time `start`.
    fn start(
        &mut self,
        r: usize,
        input: &RankInput<'_>,
        start: u64,
        times: &mut RankTimes,
    ) -> Result<(), MoeError> {
        let rank = &mut self.ranks[r];
        input.check(rank.core.dims())?;
        let pairs = count_pairs(rank.core.dims(), input.topk_ids)?;
        let row = pairs.row.clone();
        rank.input = Owned {
            tokens: input.tokens.to_vec(),
            ids: input.topk_ids.to_vec(),
            weights: input.topk_weights.to_vec(),
        };
        rank.pairs = Some(pairs);
        rank.tokens = None;
        rank.finished = false;
        times.dispatch_start = start;
        rank.dev_free = rank.dev_free.max(start);
        rank.proxy_free = rank.proxy_free.max(start);
        rank.dev_done = rank.dev_done.max(start);
        rank.last = rank.last.max(start);
        self.feed_at(r, Event::Dispatch { row }, start)
    }

    /// One step on every rank, phases synchronized (see
    /// [`SimCluster::run_steps`]).
    pub fn step(
        &mut self,
        inputs: &[RankInput<'_>],
        mut expert: impl FnMut(u32, &ExpertTokens) -> Vec<u8>,
    ) -> Result<SimStep, MoeError> {
        let opts = RunOpts {
            delays: Vec::new(),
            synchronized: true,
        };
        let mut v = self.run_steps(&[inputs.to_vec()], &opts, |r, _, t| expert(r, t))?;
        v.pop().ok_or(MoeError::OutOfOrder {
            expected: "one step",
        })
    }

    /// Waits for every rank's last BAR_C round and own submits, then
    /// releases the buffers and immediates and shuts the engines down.
    pub fn shutdown(mut self) -> Result<(), MoeError> {
        self.draining = true;
        for r in 0..self.ranks.len() {
            let rank = &mut self.ranks[r];
            rank.queue.clear();
            rank.finished = false;
            if let Some(w) = rank.core.shutdown_wait() {
                rank.queue.push_back((Action::Wait(w), 0));
            }
            rank.queue
                .push_back((Action::Wait(Wait::Submits(crate::Phase::BarrierC)), 0));
            rank.queue
                .push_back((Action::Finished(crate::Phase::BarrierC), 0));
        }
        self.run()?;
        let mut res = Ok(());
        for rank in &mut self.ranks {
            let r = rank.exec.release();
            if res.is_ok() {
                res = r;
            }
        }
        for e in &self.engines {
            e.shutdown();
        }
        res
    }

    /// Feeds `ev` to rank `r` at time `at` and queues its actions with
    /// their lane times.
    fn feed_at(&mut self, r: usize, ev: Event, at: u64) -> Result<(), MoeError> {
        let h = self.host;
        let rank = &mut self.ranks[r];
        let routes = matches!(ev, Event::Routes(_));
        let actions = rank.core.on(ev)?;
        let mut proxy_extra = if routes { ns(h.plan) } else { 0 };
        for a in actions {
            let members = u64::from(rank.core.dims().ranks.saturating_sub(1));
            let (dev, cost) = match &a {
                Action::WriteRouteRow { .. } => (true, ns(h.count)),
                Action::PackDispatch => (true, ns(h.pack)),
                Action::Unpack => (true, ns(h.unpack)),
                Action::PackCombine => (true, ns(h.combine_pack)),
                Action::WeightedSum => (true, ns(h.combine_sum)),
                Action::RouteScatter { entries, .. } | Action::PrivateScatter { entries, .. } => {
                    let wrs: u64 = entries
                        .iter()
                        .map(|e| rank.ic.scatter_dst(e.len, DISPATCH_MODE))
                        .sum();
                    (false, ns(h.submit) + wrs * ns(h.per_wr))
                }
                Action::CombineScatter { entries, .. } => {
                    let wrs: u64 = entries
                        .iter()
                        .map(|e| rank.ic.scatter_dst(e.len, COMBINE_MODE))
                        .sum();
                    (false, ns(h.submit) + wrs * ns(h.per_wr))
                }
                Action::OverflowWrite { entry, .. } => (
                    false,
                    ns(h.submit) + rank.ic.single_write(entry.len) * ns(h.per_wr),
                ),
                Action::Barrier { .. } => (false, ns(h.submit) + members * ns(h.per_wr)),
                Action::Arm { .. } | Action::ReadRoutes | Action::Wait(_) => (false, 0),
                Action::Finished(_) => (true, 0),
            };
            let when = if dev {
                let done = rank.dev_free.max(at) + cost;
                rank.dev_free = done;
                rank.dev_done = done;
                if matches!(a, Action::Finished(_)) {
                    done.max(rank.proxy_free)
                } else {
                    done
                }
            } else {
                let done = rank.proxy_free.max(at).max(rank.dev_done) + cost + proxy_extra;
                proxy_extra = 0;
                rank.proxy_free = done;
                done
            };
            rank.last = rank.last.max(when);
            rank.queue.push_back((a, rank.last));
        }
        Ok(())
    }

    /// Runs queued actions that are due; returns whether any ran.
    fn run_due(&mut self) -> Result<bool, MoeError> {
        let now = self.fabric.now().as_nanos();
        let mut moved = false;
        for r in 0..self.ranks.len() {
            loop {
                let rank = &mut self.ranks[r];
                let Some((a, at)) = rank.queue.front() else {
                    break;
                };
                if *at > now {
                    break;
                }
                if let Action::Wait(w) = a {
                    let w = *w;
                    match rank.exec.poll(&w) {
                        None => break,
                        Some(ev) => {
                            let ev = ev?;
                            rank.queue.pop_front();
                            moved = true;
                            if !self.draining {
                                self.feed_at(r, ev, now)?;
                            }
                            continue;
                        }
                    }
                }
                let Some((a, _)) = rank.queue.pop_front() else {
                    break;
                };
                moved = true;
                if let Some(ev) = self.exec(r, &a, now)? {
                    self.feed_at(r, ev, now)?;
                }
            }
        }
        Ok(moved)
    }

    fn exec(&mut self, r: usize, a: &Action, now: u64) -> Result<Option<Event>, MoeError> {
        let rank = &mut self.ranks[r];
        match a {
            Action::PackDispatch | Action::Unpack => {
                let Some(pairs) = rank.pairs.as_ref() else {
                    return Err(MoeError::OutOfOrder {
                        expected: "a dispatch",
                    });
                };
                let mut tokens = ExpertTokens::default();
                let mut io = DispatchIo {
                    input: RankInput {
                        tokens: &rank.input.tokens,
                        topk_ids: &rank.input.ids,
                        topk_weights: &rank.input.weights,
                    },
                    pairs,
                    tokens: &mut tokens,
                    unpacked: false,
                };
                let res = rank.exec.data_dispatch(a, &rank.core, &mut io);
                if io.unpacked {
                    rank.tokens = Some(tokens);
                    rank.times.unpacked = now;
                }
                res?;
            }
            Action::PackCombine | Action::WeightedSum => {
                let Some(pairs) = rank.pairs.as_ref() else {
                    return Err(MoeError::OutOfOrder {
                        expected: "a dispatch",
                    });
                };
                let mut out = match a {
                    Action::WeightedSum => {
                        vec![0; crate::pack::combined_len(&rank.exec.dims, pairs.slots.len())]
                    }
                    _ => Vec::new(),
                };
                let mut io = CombineIo {
                    outputs: &rank.outputs,
                    slots: &pairs.slots,
                    weights: &rank.input.weights,
                    out: &mut out,
                    summed: false,
                };
                rank.exec.data_combine(a, &rank.core, &mut io)?;
                if io.summed {
                    rank.combined = Some(out);
                    rank.times.summed = now;
                }
            }
            Action::Finished(_) => rank.finished = true,
            _ => return rank.exec.net(a, &rank.core),
        }
        Ok(None)
    }

    /// Progresses every engine and runs the due actions; returns whether
    /// anything moved.
    fn progress(&mut self) -> Result<bool, MoeError> {
        let mut moved = false;
        for e in &self.engines {
            moved |= e.progress();
        }
        moved |= self.run_due()?;
        Ok(moved)
    }

    /// Moves simulated time: by at most one tick while an action is
    /// charged, else to the next fabric event. Returns whether time moved.
    fn advance_time(&mut self) -> bool {
        let now = self.fabric.now().as_nanos();
        let next = self
            .ranks
            .iter()
            .filter_map(|r| match r.queue.front() {
                Some((Action::Wait(_), _)) | None => None,
                Some((_, at)) => Some(*at),
            })
            .min();
        if let Some(at) = next {
            let dt = at.saturating_sub(now).clamp(1, self.tick);
            self.fabric.advance(Duration::from_nanos(dt));
            true
        } else {
            self.fabric.step()
        }
    }

    /// Drives until every rank finished (shutdown).
    fn run(&mut self) -> Result<(), MoeError> {
        let mut idle = 0u32;
        loop {
            let moved = self.progress()?;
            if self.ranks.iter().all(|r| r.finished) {
                return Ok(());
            }
            if moved || self.advance_time() {
                idle = 0;
            } else {
                idle += 1;
                if idle > 3 {
                    return Err(self.stuck());
                }
            }
        }
    }

    /// The error for a simulation that can no longer move: the first
    /// rank's unmet wait.
    fn stuck(&self) -> MoeError {
        for rank in &self.ranks {
            if let Some((Action::Wait(w), _)) = rank.queue.front() {
                return match *w {
                    Wait::Round { phase, imm, count } => MoeError::Timeout {
                        phase,
                        imm,
                        expected: count,
                        pending: rank.exec.engine.imm_pending(imm),
                    },
                    Wait::Submits(phase) => MoeError::SubmitTimeout {
                        phase,
                        submitted: 0,
                        done: 0,
                    },
                };
            }
        }
        MoeError::OutOfOrder {
            expected: "progress (the simulation went idle)",
        }
    }
}
