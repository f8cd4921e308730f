//! [`RankCore`]: the protocol of one rank as a pure, clock-free state
//! machine. It takes [`Event`]s (a step starts, own submits resolved, a
//! round fired, the routes were read) and returns [`Action`]s (arm a round,
//! submit a scatter/write/barrier, run a device operation, wait for
//! something). It never touches an engine, memory or a clock, so every
//! driver shares it: the blocking CPU driver ([`crate::MoeRank`]), the
//! step-mode simulation ([`crate::sim`]) and a GPU proxy.
//!
//! Offsets and lengths in actions are bytes into the rank's own buffers
//! (`route_buf`, `send_buf`, `recv_buf`, design §1.1) and into the peer's
//! buffers of the same layout; peers are peer-group member indices (member
//! j is rank `(rank + 1 + j) % N`, [`crate::member_rank`]).
//!
//! The order of actions closes the hazards of the design (§1.6): own
//! submits are waited for before route row / `send_buf` are rewritten (H2),
//! the private and overflow writes of step k+1 come after BAR_C of step k
//! (H3, even when nothing is sent), the combine scatter comes after BAR_D
//! and always has an entry for every peer (H1, H4).

use crate::config::Dims;
use crate::error::{MoeError, Phase};
use crate::imm::{ExpectedCounts, ImmValues};
use crate::plan::{member_rank, n_to_rank, StepPlan};
use crate::routes::RouteMatrix;
use std::sync::Arc;
use weft::{Imm, ImmCounts};

/// One scatter entry: `len` bytes from own buffer offset `src_offset` to
/// member `member`'s buffer at `dst_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Peer-group member index.
    pub member: usize,
    /// Bytes (0 is a valid entry: it still carries its immediate).
    pub len: u64,
    /// Offset in the own source buffer.
    pub src_offset: u64,
    /// Offset in the member's destination buffer.
    pub dst_offset: u64,
}

/// Something the core waits for before it can go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Every own submit so far resolved ([`Event::SubmitsDone`]).
    Submits(Phase),
    /// An armed round fired ([`Event::RoundFired`]).
    Round {
        /// The round.
        phase: Phase,
        /// Its immediate.
        imm: Imm,
        /// The count it was armed with (for diagnostics).
        count: u64,
    },
}

/// What a driver must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `expect_imm_count(imm, count)`; the driver reports the firing as
    /// [`Event::RoundFired`]`(phase)` when a later [`Action::Wait`] asks.
    Arm {
        /// The round.
        phase: Phase,
        /// Its immediate.
        imm: Imm,
        /// Arrivals to wait for.
        count: u64,
    },
    /// Write the own route row (the counts given with
    /// [`Event::Dispatch`]) into `route_buf` at `offset`, little endian.
    WriteRouteRow {
        /// Byte offset of row `rank`.
        offset: u64,
    },
    /// Scatter from `route_buf` into every member's `route_buf` with
    /// immediate `imm`, [`crate::DISPATCH_MODE`].
    RouteScatter {
        /// The ROUTE immediate.
        imm: Imm,
        /// One entry per member.
        entries: Vec<Entry>,
    },
    /// Count-and-pack's pack half: token rows into their send-order slots
    /// of `send_buf` ([`crate::pack::pack_dispatch`]).
    PackDispatch,
    /// Scatter from `send_buf` into every member's private region with
    /// immediate `imm`, [`crate::DISPATCH_MODE`].
    PrivateScatter {
        /// The DISPATCH immediate.
        imm: Imm,
        /// One entry per member (zero-length ones included).
        entries: Vec<Entry>,
    },
    /// Read the N×E route matrix out of `route_buf` and report it with
    /// [`Event::Routes`] (the own row is taken from the counts, not read).
    ReadRoutes,
    /// One write from `send_buf` into a member's contiguous region with
    /// immediate `imm`.
    OverflowWrite {
        /// The DISPATCH immediate.
        imm: Imm,
        /// The write.
        entry: Entry,
    },
    /// Gather the received rows (and the own segment from `send_buf`) into
    /// the expert layout ([`crate::pack::unpack`] with [`RankCore::plan`]).
    Unpack,
    /// `submit_barrier` to every member's `recv_buf` with immediate `imm`.
    Barrier {
        /// [`Phase::BarrierD`] or [`Phase::BarrierC`].
        phase: Phase,
        /// Its immediate.
        imm: Imm,
    },
    /// Expert outputs into `send_buf` (remote sources) and into the own
    /// `recv_buf` combine slots ([`crate::pack::pack_combine`]).
    PackCombine,
    /// Scatter from `send_buf` into every member's combine region with
    /// immediate `imm`, [`crate::COMBINE_MODE`].
    CombineScatter {
        /// The COMBINE immediate.
        imm: Imm,
        /// One entry per member (zero-length ones included).
        entries: Vec<Entry>,
    },
    /// Weighted sum of the rows in the own combine region
    /// ([`crate::pack::weighted_sum`]).
    WeightedSum,
    /// Block on this until it holds, then feed the matching event.
    Wait(Wait),
    /// The dispatch (its [`Phase::Dispatch`]) or the combine
    /// ([`Phase::Combine`]) of the step is complete.
    Finished(Phase),
}

/// Inputs of the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Start a step's dispatch; `row` is the own count per expert n(r→e).
    Dispatch {
        /// Pairs per expert (E entries).
        row: Vec<u32>,
    },
    /// Every own submit so far resolved (answer to [`Wait::Submits`]).
    SubmitsDone,
    /// A round fired (answer to [`Wait::Round`]).
    RoundFired(Phase),
    /// The route matrix (answer to [`Action::ReadRoutes`]).
    Routes(RouteMatrix),
    /// Start the step's combine (after the dispatch finished).
    Combine,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    DispatchSubmits,
    BarC,
    Route,
    Routes,
    Dispatch,
    InStep,
    CombineSubmits,
    BarD,
    Combine,
}

impl State {
    fn expects(self) -> &'static str {
        match self {
            State::Idle => "dispatch",
            State::DispatchSubmits | State::CombineSubmits => "own submits done",
            State::BarC => "BAR_C round",
            State::Route => "ROUTE round",
            State::Routes => "route matrix",
            State::Dispatch => "DISPATCH round",
            State::InStep => "combine",
            State::BarD => "BAR_D round",
            State::Combine => "COMBINE round",
        }
    }
}

/// The protocol of one rank (design §1.4-1.6) as a state machine. See the
/// module docs.
#[derive(Debug, Clone)]
pub struct RankCore {
    dims: Dims,
    rank: u32,
    imms: ImmValues,
    ic: ImmCounts,
    state: State,
    step: u64,
    row: Vec<u32>,
    plan: Option<Arc<StepPlan>>,
    counts: Option<ExpectedCounts>,
    bar_c_armed: bool,
    bar_d_armed: bool,
}

impl RankCore {
    /// A core for `rank` of the group `dims` describes, using the reserved
    /// immediates `imms` and the engine's immediate counts `ic` (of group 0;
    /// equal on every rank).
    pub fn new(dims: Dims, rank: u32, imms: ImmValues, ic: ImmCounts) -> RankCore {
        RankCore {
            dims,
            rank,
            imms,
            ic,
            state: State::Idle,
            step: 0,
            row: Vec::new(),
            plan: None,
            counts: None,
            bar_c_armed: false,
            bar_d_armed: false,
        }
    }

    /// The shape.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// The rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Steps completed (dispatch and combine).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Whether the dispatch of the current step finished and its combine has
    /// not started.
    pub fn in_step(&self) -> bool {
        self.state == State::InStep
    }

    /// Whether no step is in progress.
    pub fn idle(&self) -> bool {
        self.state == State::Idle
    }

    /// The current step's plan, once the routes are in.
    pub fn plan(&self) -> Option<&Arc<StepPlan>> {
        self.plan.as_ref()
    }

    /// The current step's expected counts, once the routes are in.
    pub fn counts(&self) -> Option<ExpectedCounts> {
        self.counts
    }

    /// The own route row of the current step.
    pub fn row(&self) -> &[u32] {
        &self.row
    }

    /// What a clean shutdown must wait for: the last BAR_C round (peers no
    /// longer read what this rank wrote, and nothing is headed here).
    pub fn shutdown_wait(&self) -> Option<Wait> {
        self.bar_c_armed.then(|| self.round(Phase::BarrierC))
    }

    fn n(&self) -> u32 {
        self.dims.ranks
    }

    fn imm(&self, phase: Phase) -> Imm {
        match phase {
            Phase::Route => self.imms.route,
            Phase::Dispatch => self.imms.dispatch,
            Phase::BarrierD => self.imms.bar_d,
            Phase::Combine => self.imms.combine,
            Phase::BarrierC | Phase::Setup => self.imms.bar_c,
        }
    }

    fn count(&self, phase: Phase) -> u64 {
        let c = self.counts;
        match phase {
            Phase::Route => ExpectedCounts::route(&self.dims, &self.ic),
            Phase::Dispatch => c.map_or(0, |c| c.dispatch),
            Phase::Combine => c.map_or(0, |c| c.combine),
            _ => u64::from(self.n().saturating_sub(1)) * self.ic.barrier(),
        }
    }

    fn arm(&self, phase: Phase) -> Action {
        Action::Arm {
            phase,
            imm: self.imm(phase),
            count: self.count(phase),
        }
    }

    fn round(&self, phase: Phase) -> Wait {
        Wait::Round {
            phase,
            imm: self.imm(phase),
            count: self.count(phase),
        }
    }

    fn members(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        let (n, r) = (self.n(), self.rank);
        (0..n.saturating_sub(1) as usize).map(move |j| (j, member_rank(n, r, j)))
    }

    /// Feeds one event; returns the actions to run in order. The list ends
    /// with an [`Action::Wait`] (feed the matching event next), with
    /// [`Action::ReadRoutes`] (feed [`Event::Routes`]) or with
    /// [`Action::Finished`]. An event the core does not expect now is
    /// [`MoeError::OutOfOrder`] and changes nothing.
    pub fn on(&mut self, ev: Event) -> Result<Vec<Action>, MoeError> {
        let mut out = Vec::new();
        match (self.state, ev) {
            (State::Idle, Event::Dispatch { row }) => {
                if row.len() != self.dims.experts as usize {
                    return Err(MoeError::Shape {
                        what: "route row",
                        got: row.len() as u64,
                        want: u64::from(self.dims.experts),
                    });
                }
                self.row = row;
                self.plan = None;
                self.counts = None;
                out.push(self.arm(Phase::Route));
                out.push(Action::Wait(Wait::Submits(Phase::Route)));
                self.state = State::DispatchSubmits;
            }
            (State::DispatchSubmits, Event::SubmitsDone) => {
                let row_len = self.dims.route_row_len();
                let offset = u64::from(self.rank) * row_len;
                out.push(Action::WriteRouteRow { offset });
                if self.n() > 1 {
                    let entries = self
                        .members()
                        .map(|(member, _)| Entry {
                            member,
                            len: row_len,
                            src_offset: offset,
                            dst_offset: offset,
                        })
                        .collect();
                    out.push(Action::RouteScatter {
                        imm: self.imms.route,
                        entries,
                    });
                }
                out.push(Action::PackDispatch);
                if self.bar_c_armed {
                    out.push(Action::Wait(self.round(Phase::BarrierC)));
                    self.state = State::BarC;
                } else {
                    self.private(&mut out);
                }
            }
            (State::BarC, Event::RoundFired(Phase::BarrierC)) => {
                self.bar_c_armed = false;
                self.private(&mut out);
            }
            (State::Route, Event::RoundFired(Phase::Route)) => {
                out.push(Action::ReadRoutes);
                self.state = State::Routes;
            }
            (State::Routes, Event::Routes(mut m)) => {
                m.set_row(&self.dims, self.rank, &self.row)?;
                let plan = StepPlan::new(&self.dims, self.rank, &m)?;
                self.counts = Some(ExpectedCounts::for_step(&self.dims, &plan, &self.ic));
                out.push(self.arm(Phase::Dispatch));
                let b_in = self.dims.b_in;
                for (member, to) in self.members() {
                    let Some(o) = plan.dests().get(to as usize).and_then(|d| d.overflow) else {
                        continue;
                    };
                    out.push(Action::OverflowWrite {
                        imm: self.imms.dispatch,
                        entry: Entry {
                            member,
                            len: u64::from(o.len) * b_in,
                            src_offset: u64::from(o.src_slot) * b_in,
                            dst_offset: self.dims.contig_offset() + u64::from(o.dst_slot) * b_in,
                        },
                    });
                }
                self.plan = Some(Arc::new(plan));
                out.push(Action::Wait(self.round(Phase::Dispatch)));
                self.state = State::Dispatch;
            }
            (State::Dispatch, Event::RoundFired(Phase::Dispatch)) => {
                out.push(Action::Unpack);
                if self.n() > 1 {
                    out.push(self.arm(Phase::BarrierD));
                    out.push(Action::Barrier {
                        phase: Phase::BarrierD,
                        imm: self.imms.bar_d,
                    });
                    self.bar_d_armed = true;
                }
                out.push(Action::Finished(Phase::Dispatch));
                self.state = State::InStep;
            }
            (State::InStep, Event::Combine) => {
                out.push(self.arm(Phase::Combine));
                out.push(Action::Wait(Wait::Submits(Phase::Combine)));
                self.state = State::CombineSubmits;
            }
            (State::CombineSubmits, Event::SubmitsDone) => {
                out.push(Action::PackCombine);
                if self.bar_d_armed {
                    out.push(Action::Wait(self.round(Phase::BarrierD)));
                    self.state = State::BarD;
                } else {
                    self.combine_scatter(&mut out);
                }
            }
            (State::BarD, Event::RoundFired(Phase::BarrierD)) => {
                self.bar_d_armed = false;
                self.combine_scatter(&mut out);
            }
            (State::Combine, Event::RoundFired(Phase::Combine)) => {
                out.push(Action::WeightedSum);
                if self.n() > 1 {
                    out.push(self.arm(Phase::BarrierC));
                    out.push(Action::Barrier {
                        phase: Phase::BarrierC,
                        imm: self.imms.bar_c,
                    });
                    self.bar_c_armed = true;
                }
                out.push(Action::Finished(Phase::Combine));
                self.step += 1;
                self.state = State::Idle;
            }
            (s, _) => {
                return Err(MoeError::OutOfOrder {
                    expected: s.expects(),
                })
            }
        }
        Ok(out)
    }

    /// The private scatter (after BAR_C of the previous step), then the
    /// ROUTE wait.
    fn private(&mut self, out: &mut Vec<Action>) {
        let d = &self.dims;
        if d.private > 0 && self.n() > 1 {
            let mut seg = vec![0u32; self.n() as usize];
            let mut acc = 0u32;
            for (to, s) in seg.iter_mut().enumerate() {
                *s = acc;
                acc += n_to_rank(d, &self.row, to as u32);
            }
            let entries = self
                .members()
                .map(|(member, to)| {
                    let cnt = n_to_rank(d, &self.row, to).min(d.private);
                    Entry {
                        member,
                        len: u64::from(cnt) * d.b_in,
                        src_offset: u64::from(seg[to as usize]) * d.b_in,
                        dst_offset: d.private_offset(self.rank),
                    }
                })
                .collect();
            out.push(Action::PrivateScatter {
                imm: self.imms.dispatch,
                entries,
            });
        }
        out.push(Action::Wait(self.round(Phase::Route)));
        self.state = State::Route;
    }

    /// The combine scatter (after BAR_D), then the COMBINE wait.
    fn combine_scatter(&mut self, out: &mut Vec<Action>) {
        let b_out = self.dims.b_out;
        if self.n() > 1 {
            if let Some(plan) = &self.plan {
                let entries = plan
                    .combine_sends()
                    .iter()
                    .enumerate()
                    .map(|(member, c)| Entry {
                        member,
                        len: u64::from(c.len) * b_out,
                        src_offset: u64::from(c.src_slot) * b_out,
                        dst_offset: u64::from(c.dst_slot) * b_out,
                    })
                    .collect();
                out.push(Action::CombineScatter {
                    imm: self.imms.combine,
                    entries,
                });
            }
        }
        out.push(Action::Wait(self.round(Phase::Combine)));
        self.state = State::Combine;
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
