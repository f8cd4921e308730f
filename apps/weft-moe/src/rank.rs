//! [`MoeRank`]: the blocking CPU driver. It runs the protocol of one rank on
//! the calling thread (which plays the host proxy) over a
//! [`TransferEngine`], with host buffers.
//!
//! Per step: `dispatch` (route scatter, private scatter after BAR_C of the
//! previous step, ROUTE round, plan, overflow writes, DISPATCH round,
//! unpack, BAR_D) then `combine` (pack, BAR_D round, combine scatter,
//! COMBINE round, weighted sum, BAR_C). Own submits are waited for before
//! the buffers they read are overwritten.

use crate::config::{Dims, MoeConfig};
use crate::error::{MoeError, Phase};
use crate::expert::{ExpertTokens, RankInput};
use crate::imm::{ExpectedCounts, ImmValues, COMBINE_MODE, DISPATCH_MODE};
use crate::pack;
use crate::plan::{member_rank, CombineSlot, StepPlan};
use crate::routes::{count_pairs, row_to_le_bytes, RouteMatrix};
use std::sync::Arc;
use weft::{
    DoneCounter, DoneFlag, GroupAddress, HostBuffer, Imm, ImmCounts, MrDesc, MrHandle, OnDone,
    PeerGroupHandle, ScatterDst, TransferEngine,
};

/// What a rank tells its peers (exchanged out of band before `connect`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    /// The rank.
    pub rank: u32,
    /// Its engine's group-0 address.
    pub addr: GroupAddress,
    /// Its route buffer.
    pub route: MrDesc,
    /// Its receive buffer.
    pub recv: MrDesc,
    /// Hash of the shape and immediate values; must match on every rank.
    pub config_hash: u64,
}

struct Peers {
    group: PeerGroupHandle,
    /// Per member j: route and receive descriptors.
    route: Vec<MrDesc>,
    recv: Vec<MrDesc>,
}

/// A step between `dispatch` and `combine`: what `combine` needs. Opaque.
#[derive(Debug, Clone)]
pub struct Layout {
    step: u64,
    rank: u32,
    plan: Arc<StepPlan>,
    slots: Vec<u32>,
    weights: Vec<f32>,
    counts: ExpectedCounts,
}

impl Layout {
    /// The step the layout belongs to.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The step's plan at this rank.
    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }
}

struct Bufs {
    route: HostBuffer,
    send: HostBuffer,
    recv: HostBuffer,
    route_h: MrHandle,
    send_h: MrHandle,
    recv_h: MrHandle,
}

/// One rank of a MoE group on a [`TransferEngine`], CPU data path.
pub struct MoeRank {
    engine: Arc<TransferEngine>,
    dims: Dims,
    rank: u32,
    imms: ImmValues,
    ic: ImmCounts,
    bufs: Bufs,
    peers: Option<Peers>,
    done: Arc<DoneCounter>,
    submitted: u64,
    step: u64,
    in_step: bool,
    bar_c: Option<Arc<DoneFlag>>,
    bar_d: Option<Arc<DoneFlag>>,
    poisoned: bool,
    info: RankInfo,
    timeout: std::time::Duration,
    released: bool,
}

impl std::fmt::Debug for MoeRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeRank")
            .field("rank", &self.rank)
            .field("step", &self.step)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

fn fnv(h: u64, v: u64) -> u64 {
    v.to_le_bytes()
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

fn eng(phase: Phase) -> impl Fn(weft::EngineError) -> MoeError {
    move |source| MoeError::Engine { phase, source }
}

impl MoeRank {
    /// Validates `cfg`, allocates and registers the buffers and reserves
    /// the five immediates. Returns the rank and the info to send peers.
    pub fn prepare(
        engine: Arc<TransferEngine>,
        cfg: &MoeConfig,
        rank: u32,
    ) -> Result<(MoeRank, RankInfo), MoeError> {
        let dims = cfg.validate()?;
        if rank >= dims.ranks {
            return Err(MoeError::NoSuchRank {
                rank,
                ranks: dims.ranks,
            });
        }
        let imms = ImmValues::for_instance(dims.instance, engine.imm_capacity())?;
        let ic = engine.imm_counts(0).map_err(eng(Phase::Setup))?;
        let alloc = |len: u64| {
            HostBuffer::new(len as usize).map_err(|e| MoeError::Alloc {
                bytes: len,
                reason: e.to_string(),
            })
        };
        let (route, send, recv) = (
            alloc(dims.route_buf_len())?,
            alloc(dims.send_buf_len)?,
            alloc(dims.recv_buf_len)?,
        );
        let reg = |b: &HostBuffer| engine.reg_mr(b.region()).map_err(eng(Phase::Setup));
        let (route_h, route_d) = reg(&route)?;
        let (send_h, _) = reg(&send)?;
        let (recv_h, recv_d) = reg(&recv)?;
        let mut reserved = Vec::new();
        for v in imms.all() {
            if let Err(e) = engine.reserve_imm(v) {
                for r in reserved {
                    engine.free_imm(r);
                }
                return Err(MoeError::Engine {
                    phase: Phase::Setup,
                    source: e,
                });
            }
            reserved.push(v);
        }
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for v in [
            u64::from(cfg.ranks),
            u64::from(cfg.experts),
            u64::from(cfg.topk),
            u64::from(cfg.max_tokens),
            u64::from(cfg.token_bytes),
            u64::from(cfg.hidden),
            u64::from(cfg.out_dtype.size()),
            u64::from(cfg.private_tokens),
            u64::from(imms.route),
        ] {
            h = fnv(h, v);
        }
        let info = RankInfo {
            rank,
            addr: engine.main_address(),
            route: route_d,
            recv: recv_d,
            config_hash: h,
        };
        let me = MoeRank {
            engine,
            dims,
            rank,
            imms,
            ic,
            bufs: Bufs {
                route,
                send,
                recv,
                route_h,
                send_h,
                recv_h,
            },
            peers: None,
            done: Arc::new(DoneCounter::new()),
            submitted: 0,
            step: 0,
            in_step: false,
            bar_c: None,
            bar_d: None,
            poisoned: false,
            info: info.clone(),
            timeout: cfg.step_timeout,
            released: false,
        };
        Ok((me, info))
    }

    /// Connects to every rank (`all[s]` is rank s's info, self included):
    /// checks the infos and adds the peer group in rotated order.
    pub fn connect(&mut self, all: &[RankInfo]) -> Result<(), MoeError> {
        let n = self.dims.ranks;
        if all.len() != n as usize {
            return Err(MoeError::Shape {
                what: "rank infos",
                got: all.len() as u64,
                want: u64::from(n),
            });
        }
        for (s, i) in all.iter().enumerate() {
            let bad = |what: String| MoeError::PeerInfo {
                rank: s as u32,
                what,
            };
            if i.rank != s as u32 {
                return Err(bad(format!("info at index {s} names rank {}", i.rank)));
            }
            if i.config_hash != self.info.config_hash {
                return Err(bad("config hash differs (shape, P or immediates)".into()));
            }
            if i.recv.len < self.dims.recv_buf_len || i.route.len < self.dims.route_buf_len() {
                return Err(bad("buffers shorter than the shape needs".into()));
            }
        }
        let members: Vec<&RankInfo> = (0..n.saturating_sub(1) as usize)
            .map(|j| &all[member_rank(n, self.rank, j) as usize])
            .collect();
        let addrs: Vec<GroupAddress> = members.iter().map(|i| i.addr.clone()).collect();
        let group = self
            .engine
            .add_peer_group(&addrs)
            .map_err(eng(Phase::Setup))?;
        self.peers = Some(Peers {
            group,
            route: members.iter().map(|i| i.route.clone()).collect(),
            recv: members.iter().map(|i| i.recv.clone()).collect(),
        });
        Ok(())
    }

    /// The validated shape.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// The reserved immediate values.
    pub fn imms(&self) -> ImmValues {
        self.imms
    }

    /// Steps completed (dispatch and combine).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Any error once a step has touched the engine (a round armed, a
    /// transfer submitted) leaves this rank and its peers out of step:
    /// every later call returns [`MoeError::Poisoned`]. Misuse caught before
    /// that (shapes, call order, connection) does not poison.
    fn poison<T>(&mut self, r: Result<T, MoeError>) -> Result<T, MoeError> {
        if r.is_err() {
            self.poisoned = true;
        }
        r
    }

    fn on_done(&mut self) -> OnDone {
        self.submitted += 1;
        OnDone::counter(&self.done)
    }

    /// Waits until every own submit resolved (their sources may be reused).
    fn wait_submits(&self, phase: Phase) -> Result<(), MoeError> {
        if !self.done.wait_for_timeout(self.submitted, self.timeout) {
            return Err(MoeError::SubmitTimeout {
                phase,
                submitted: self.submitted,
                done: self.done.total(),
            });
        }
        match self.done.first_error() {
            Some(source) => Err(MoeError::Engine { phase, source }),
            None => Ok(()),
        }
    }

    /// Arms a round of `count` immediates `imm`, reporting to a flag.
    fn arm(&self, phase: Phase, imm: Imm, count: u64) -> Result<Arc<DoneFlag>, MoeError> {
        let (od, flag) = OnDone::flag();
        self.engine
            .expect_imm_count_with(imm, count, od)
            .map_err(eng(phase))?;
        Ok(flag)
    }

    /// Waits for an armed round.
    fn wait_round(
        &self,
        phase: Phase,
        imm: Imm,
        count: u64,
        flag: &DoneFlag,
    ) -> Result<(), MoeError> {
        match flag.wait_timeout(self.timeout) {
            Some(Ok(())) => Ok(()),
            Some(Err(source)) => Err(MoeError::Engine { phase, source }),
            None => Err(MoeError::Timeout {
                phase,
                imm,
                expected: count,
                pending: self.engine.imm_pending(imm),
            }),
        }
    }

    /// Dispatches this rank's tokens; returns the rows for the local experts
    /// and the layout `combine` needs.
    pub fn dispatch(&mut self, input: &RankInput<'_>) -> Result<(ExpertTokens, Layout), MoeError> {
        if self.poisoned {
            return Err(MoeError::Poisoned);
        }
        if self.in_step {
            return Err(MoeError::OutOfOrder {
                expected: "combine",
            });
        }
        if self.peers.is_none() {
            return Err(MoeError::NotConnected);
        }
        input.check(&self.dims)?;
        let r = self.dispatch_inner(input);
        self.poison(r)
    }

    fn dispatch_inner(
        &mut self,
        input: &RankInput<'_>,
    ) -> Result<(ExpertTokens, Layout), MoeError> {
        let d = self.dims.clone();
        let n = d.ranks;
        let me = self.rank;
        let pairs = count_pairs(&d, input.topk_ids)?;
        let ic = self.ic;
        let route_count = ExpectedCounts::route(&d, &ic);
        let route_flag = self.arm(Phase::Route, self.imms.route, route_count)?;
        // H2: the previous step's submits read route row `me` and send_buf.
        self.wait_submits(Phase::Route)?;
        let row_len = d.route_row_len();
        let mut row = vec![0u8; row_len as usize];
        row_to_le_bytes(&pairs.row, &mut row);
        let row_off = u64::from(me) * row_len;
        self.bufs.route.write(row_off as usize, &row);
        let Some(peers) = self.peers.as_ref() else {
            return Err(MoeError::NotConnected);
        };
        let group = peers.group.clone();
        let route_dsts: Vec<ScatterDst> = peers
            .route
            .iter()
            .map(|dst| ScatterDst {
                len: row_len,
                src_offset: row_off,
                dst: dst.clone(),
                dst_offset: row_off,
            })
            .collect();
        let recv_descs = peers.recv.clone();
        if n > 1 {
            let od = self.on_done();
            self.engine
                .submit_scatter_mode(
                    &group,
                    od,
                    Some(self.imms.route),
                    &self.bufs.route_h,
                    &route_dsts,
                    DISPATCH_MODE,
                )
                .map_err(eng(Phase::Route))?;
        }
        // Pack the token rows.
        let mut send_local = vec![0u8; (d.max_pairs() * d.b_in) as usize];
        pack::pack_dispatch(&d, input, &pairs, &mut send_local)?;
        let used = pairs.slots.len() * d.b_in as usize;
        self.bufs.send.write(0, &send_local[..used]);
        // H3: peers finished summing the previous combine.
        if let Some(f) = self.bar_c.take() {
            self.wait_round(Phase::BarrierC, self.imms.bar_c, u64::from(n - 1), &f)?;
        }
        // Private scatter (every member gets an entry, possibly empty).
        let mut seg = vec![0u32; n as usize];
        let mut acc = 0u32;
        for (dd, s) in seg.iter_mut().enumerate() {
            *s = acc;
            acc += crate::plan::n_to_rank(&d, &pairs.row, dd as u32);
        }
        if d.private > 0 && n > 1 {
            let dsts: Vec<ScatterDst> = recv_descs
                .iter()
                .enumerate()
                .map(|(j, dst)| {
                    let to = member_rank(n, me, j) as usize;
                    let cnt = crate::plan::n_to_rank(&d, &pairs.row, to as u32).min(d.private);
                    ScatterDst {
                        len: u64::from(cnt) * d.b_in,
                        src_offset: u64::from(seg[to]) * d.b_in,
                        dst: dst.clone(),
                        dst_offset: d.private_offset(me),
                    }
                })
                .collect();
            let od = self.on_done();
            self.engine
                .submit_scatter_mode(
                    &group,
                    od,
                    Some(self.imms.dispatch),
                    &self.bufs.send_h,
                    &dsts,
                    DISPATCH_MODE,
                )
                .map_err(eng(Phase::Dispatch))?;
        }
        // Routes.
        self.wait_round(Phase::Route, self.imms.route, route_count, &route_flag)?;
        let all = self
            .bufs
            .route
            .read(0, d.route_buf_len() as usize)
            .unwrap_or_default();
        let mut m = RouteMatrix::new(&d);
        for s in 0..n {
            if s == me {
                m.set_row(&d, s, &pairs.row)?;
            } else {
                let off = (u64::from(s) * row_len) as usize;
                let bytes = all.get(off..off + row_len as usize).unwrap_or(&[]);
                m.set_row_le_bytes(&d, s, bytes)?;
            }
        }
        let plan = StepPlan::new(&d, me, &m)?;
        let counts = ExpectedCounts::for_step(&d, &plan, &ic);
        let dispatch_flag = self.arm(Phase::Dispatch, self.imms.dispatch, counts.dispatch)?;
        // Overflow writes.
        for (to, dest) in plan.dests().iter().enumerate() {
            let Some(o) = dest.overflow else { continue };
            let Some(j) = crate::plan::member_index(n, me, to as u32) else {
                continue;
            };
            let od = self.on_done();
            self.engine
                .submit_single_write(
                    u64::from(o.len) * d.b_in,
                    Some(self.imms.dispatch),
                    (&self.bufs.send_h, u64::from(o.src_slot) * d.b_in),
                    (
                        &recv_descs[j],
                        d.contig_offset() + u64::from(o.dst_slot) * d.b_in,
                    ),
                    od,
                )
                .map_err(eng(Phase::Dispatch))?;
        }
        self.wait_round(
            Phase::Dispatch,
            self.imms.dispatch,
            counts.dispatch,
            &dispatch_flag,
        )?;
        // Unpack (own rows from the local copy of send_buf).
        let recv_used = d.contig_offset() + plan.contig_used() * d.b_in;
        let recv_local = self
            .bufs
            .recv
            .read(0, recv_used as usize)
            .unwrap_or_default();
        let tokens = pack::unpack(&d, &plan, &send_local, &recv_local)?;
        // BAR_D: this rank no longer reads its receive buffer.
        if n > 1 {
            self.bar_d = Some(self.arm(Phase::BarrierD, self.imms.bar_d, counts.barrier)?);
            let od = self.on_done();
            self.engine
                .submit_barrier(&group, od, self.imms.bar_d, &recv_descs)
                .map_err(eng(Phase::BarrierD))?;
        }
        self.in_step = true;
        let layout = Layout {
            step: self.step,
            rank: me,
            plan: Arc::new(plan),
            slots: pairs.slots,
            weights: input.topk_weights.to_vec(),
            counts,
        };
        Ok((tokens, layout))
    }

    /// Sends the expert outputs (one `hidden`-element row per row of the
    /// step's [`ExpertTokens`]) back and returns this rank's combined tokens.
    pub fn combine(&mut self, expert_outputs: &[u8], layout: &Layout) -> Result<Vec<u8>, MoeError> {
        if self.poisoned {
            return Err(MoeError::Poisoned);
        }
        if !self.in_step {
            return Err(MoeError::OutOfOrder {
                expected: "dispatch",
            });
        }
        if layout.step != self.step || layout.rank != self.rank {
            return Err(MoeError::StaleLayout {
                layout_step: layout.step,
                step: self.step,
            });
        }
        let want = layout.plan.combine().len() as u64 * self.dims.out_row_bytes();
        if expert_outputs.len() as u64 != want {
            return Err(MoeError::Shape {
                what: "expert outputs",
                got: expert_outputs.len() as u64,
                want,
            });
        }
        let r = self.combine_inner(expert_outputs, layout);
        let r = self.poison(r);
        if r.is_ok() {
            self.in_step = false;
            self.step += 1;
        }
        r
    }

    fn combine_inner(
        &mut self,
        expert_outputs: &[u8],
        layout: &Layout,
    ) -> Result<Vec<u8>, MoeError> {
        let d = self.dims.clone();
        let n = d.ranks;
        let plan = &layout.plan;
        let ob = d.out_row_bytes() as usize;
        let send_rows: u64 = plan.combine_sends().iter().map(|c| u64::from(c.len)).sum();
        let mut send_local = vec![0u8; (send_rows * d.b_out) as usize];
        let own_rows = layout.slots.len() as u64;
        let mut recv_local = vec![0u8; (own_rows * d.b_out) as usize];
        pack::pack_combine(&d, plan, expert_outputs, &mut send_local, &mut recv_local)?;
        let combine_flag = self.arm(Phase::Combine, self.imms.combine, layout.counts.combine)?;
        // H2: the dispatch submits read send_buf.
        self.wait_submits(Phase::Combine)?;
        self.bufs.send.write(0, &send_local);
        for c in plan.combine() {
            if let CombineSlot::Recv(x) = *c {
                let off = (u64::from(x) * d.b_out) as usize;
                let row = recv_local.get(off..off + ob).ok_or(MoeError::Shape {
                    what: "own combine rows",
                    got: recv_local.len() as u64,
                    want: (off + ob) as u64,
                })?;
                self.bufs.recv.write(off, row);
            }
        }
        let Some(peers) = self.peers.as_ref() else {
            return Err(MoeError::NotConnected);
        };
        let group = peers.group.clone();
        let recv_descs = peers.recv.clone();
        // H1: every peer finished unpacking (reading its receive buffer).
        if let Some(f) = self.bar_d.take() {
            self.wait_round(Phase::BarrierD, self.imms.bar_d, layout.counts.barrier, &f)?;
        }
        if n > 1 {
            let dsts: Vec<ScatterDst> = plan
                .combine_sends()
                .iter()
                .zip(&recv_descs)
                .map(|(c, dst)| ScatterDst {
                    len: u64::from(c.len) * d.b_out,
                    src_offset: u64::from(c.src_slot) * d.b_out,
                    dst: dst.clone(),
                    dst_offset: u64::from(c.dst_slot) * d.b_out,
                })
                .collect();
            let od = self.on_done();
            self.engine
                .submit_scatter_mode(
                    &group,
                    od,
                    Some(self.imms.combine),
                    &self.bufs.send_h,
                    &dsts,
                    COMBINE_MODE,
                )
                .map_err(eng(Phase::Combine))?;
        }
        self.wait_round(
            Phase::Combine,
            self.imms.combine,
            layout.counts.combine,
            &combine_flag,
        )?;
        let y = self
            .bufs
            .recv
            .read(0, (own_rows * d.b_out) as usize)
            .unwrap_or_default();
        let out = pack::weighted_sum(&d, &layout.slots, &layout.weights, &y)?;
        // BAR_C: this rank no longer reads its combine region.
        if n > 1 {
            self.bar_c = Some(self.arm(Phase::BarrierC, self.imms.bar_c, layout.counts.barrier)?);
            let od = self.on_done();
            self.engine
                .submit_barrier(&group, od, self.imms.bar_c, &recv_descs)
                .map_err(eng(Phase::BarrierC))?;
        }
        Ok(out)
    }

    /// Waits for the last BAR_C round and the own submits, then frees the
    /// immediates and unregisters the buffers.
    pub fn shutdown(mut self) -> Result<(), MoeError> {
        let mut res = Ok(());
        if !self.poisoned {
            if let Some(f) = self.bar_c.take() {
                let n = u64::from(self.dims.ranks.saturating_sub(1));
                res = self.wait_round(Phase::BarrierC, self.imms.bar_c, n, &f);
            }
            if res.is_ok() {
                res = self.wait_submits(Phase::BarrierC);
            }
        }
        let rel = self.release();
        res.and(rel)
    }

    /// Frees the immediates and unregisters the buffers (once).
    fn release(&mut self) -> Result<(), MoeError> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        for v in self.imms.all() {
            self.engine.free_imm(v);
        }
        let b = &self.bufs;
        let mut res = Ok(());
        for h in [b.route_h, b.send_h, b.recv_h] {
            if let Err(source) = self.engine.unreg_mr(h) {
                if res.is_ok() {
                    res = Err(MoeError::Engine {
                        phase: Phase::Setup,
                        source,
                    });
                }
            }
        }
        res
    }
}

impl Drop for MoeRank {
    /// Unregisters the buffers before they are freed (a rank dropped
    /// without [`MoeRank::shutdown`]).
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            tracing::warn!(rank = self.rank, error = %e, "MoE rank dropped: release failed");
        }
    }
}
