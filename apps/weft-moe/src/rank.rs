//! [`MoeRank`]: the blocking CPU driver. It runs the [`RankCore`] of one
//! rank on the calling thread (which plays the host proxy) and executes its
//! actions on a [`TransferEngine`] with host buffers ([`crate::exec`]),
//! blocking on every wait the core asks for.
//!
//! Per step: `dispatch` (route scatter, private scatter after BAR_C of the
//! previous step, ROUTE round, plan, overflow writes, DISPATCH round,
//! unpack, BAR_D) then `combine` (pack, BAR_D round, combine scatter,
//! COMBINE round, weighted sum, BAR_C). Own submits are waited for before
//! the buffers they read are overwritten.

use crate::config::{Dims, MoeConfig};
use crate::core::{Action, Event, RankCore};
use crate::error::{MoeError, Phase};
use crate::exec::{CombineIo, DispatchIo, HostExec, RankInfo};
use crate::expert::{ExpertTokens, RankInput, TopkWeights};
use crate::imm::{ExpectedCounts, ImmValues};
use crate::plan::StepPlan;
use crate::routes::count_pairs;
use std::collections::VecDeque;
use std::sync::Arc;
use weft::TransferEngine;

/// A step between `dispatch` and `combine`: what `combine` needs. Opaque.
#[derive(Debug, Clone)]
pub struct Layout {
    step: u64,
    rank: u32,
    /// The [`MoeRank`] that made it (process-unique).
    owner: u64,
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

    /// The step's expected immediate counts at this rank.
    pub fn counts(&self) -> ExpectedCounts {
        self.counts
    }
}

/// One rank of a MoE group on a [`TransferEngine`], CPU data path. Buffers
/// are allocated and registered once ([`MoeRank::prepare`]); every MoE
/// layer then calls [`MoeRank::dispatch`] and [`MoeRank::combine`].
pub struct MoeRank {
    /// Process-unique: a layout is accepted only by the rank that made it.
    id: u64,
    core: RankCore,
    exec: HostExec,
    poisoned: bool,
    info: RankInfo,
    released: bool,
    /// bf16 weights converted for the combine (reused across steps).
    weights_f32: Vec<f32>,
    /// Top-k ids renumbered for the active group (masked configs; reused).
    ids_active: Vec<u32>,
}

impl std::fmt::Debug for MoeRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeRank")
            .field("rank", &self.core.rank())
            .field("step", &self.core.step())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

/// Feeds `ev` and every event that follows from it to `core`, running the
/// actions (`data` runs the data operations) and blocking on each wait,
/// until the core reports `Finished`.
fn drive(
    core: &mut RankCore,
    exec: &mut HostExec,
    ev: Event,
    mut data: impl FnMut(&mut HostExec, &Action, &RankCore) -> Result<(), MoeError>,
) -> Result<(), MoeError> {
    let mut q = VecDeque::from([ev]);
    while let Some(ev) = q.pop_front() {
        for a in core.on(ev)? {
            match &a {
                Action::Wait(w) => q.push_back(exec.block(w)?),
                Action::Finished(_) => {}
                Action::PackDispatch
                | Action::Unpack
                | Action::PackCombine
                | Action::WeightedSum => data(exec, &a, core)?,
                _ => {
                    if let Some(e) = exec.net(&a, core)? {
                        q.push_back(e);
                    }
                }
            }
        }
    }
    Ok(())
}

impl MoeRank {
    /// Validates `cfg`, allocates and registers the buffers and reserves
    /// the five immediates. Returns the rank and the info to send peers.
    /// `rank` is the rank in the whole group, masked ranks included (a
    /// masked rank itself is [`MoeError::Masked`]).
    pub fn prepare(
        engine: Arc<TransferEngine>,
        cfg: &MoeConfig,
        rank: u32,
    ) -> Result<(MoeRank, RankInfo), MoeError> {
        let (exec, info, ic) = HostExec::prepare(engine, cfg, rank)?;
        // The protocol numbers the active ranks only (`rank` is global).
        let core = RankCore::new(exec.dims.clone(), exec.rank, exec.imms, ic);
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let me = MoeRank {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            core,
            exec,
            poisoned: false,
            info: info.clone(),
            released: false,
            weights_f32: Vec::new(),
            ids_active: Vec::new(),
        };
        Ok((me, info))
    }

    /// Connects to every rank (`all[s]` is rank s's info, self included;
    /// with masked ranks, the active ranks' infos in rank order): checks
    /// the infos and adds the peer group in rotated order. Once only: a
    /// second call is [`MoeError::OutOfOrder`].
    pub fn connect(&mut self, all: &[RankInfo]) -> Result<(), MoeError> {
        if self.exec.peers.is_some() {
            return Err(MoeError::OutOfOrder {
                expected: "one connect per rank",
            });
        }
        let mask = self.exec.dims.mask.clone();
        self.exec
            .connect(&self.info, all)
            .map_err(|e| mask.globalise(e))
    }

    /// The validated shape.
    pub fn dims(&self) -> &Dims {
        &self.exec.dims
    }

    /// The reserved immediate values.
    pub fn imms(&self) -> ImmValues {
        self.exec.imms
    }

    /// Steps completed (dispatch and combine).
    pub fn step(&self) -> u64 {
        self.core.step()
    }

    /// The protocol state machine (read only).
    pub fn core(&self) -> &RankCore {
        &self.core
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

    /// Dispatches this rank's tokens; returns the rows for the local experts
    /// and the layout `combine` needs.
    pub fn dispatch(&mut self, input: &RankInput<'_>) -> Result<(ExpertTokens, Layout), MoeError> {
        let mut tokens = ExpertTokens::default();
        let layout = self.dispatch_into(input, &mut tokens)?;
        Ok((tokens, layout))
    }

    /// [`MoeRank::dispatch`] into the caller's `tokens`: its vectors are
    /// cleared and refilled, their capacity reused, so a caller that keeps
    /// one `ExpertTokens` across steps allocates nothing once it is large
    /// enough. Returns the layout `combine` needs. On an error `tokens`
    /// holds nothing meaningful.
    ///
    /// With masked ranks (`MoeConfig::masked`) the ids name the whole
    /// group's experts: pairs for a masked rank's experts are dropped, and
    /// `tokens.source_rank` gives whole-group ranks.
    pub fn dispatch_into(
        &mut self,
        input: &RankInput<'_>,
        tokens: &mut ExpertTokens,
    ) -> Result<Layout, MoeError> {
        if self.exec.dims.mask.is_empty() {
            return self.dispatch_active(input, tokens);
        }
        let mut ids = std::mem::take(&mut self.ids_active);
        let d = &self.exec.dims;
        let r = d
            .mask
            .map_ids(d.local, d.topk, input.topk_ids, &mut ids)
            .and_then(|()| {
                let active = RankInput {
                    topk_ids: &ids,
                    ..*input
                };
                self.dispatch_active(&active, tokens)
            });
        self.ids_active = ids;
        let mask = &self.exec.dims.mask;
        // Errors about a peer name it by its whole-group rank too.
        let layout = r.map_err(|e| mask.globalise(e))?;
        mask.globalise_ranks(&mut tokens.source_rank);
        Ok(layout)
    }

    /// [`MoeRank::dispatch_into`] with ids of the active group.
    fn dispatch_active(
        &mut self,
        input: &RankInput<'_>,
        tokens: &mut ExpertTokens,
    ) -> Result<Layout, MoeError> {
        if self.poisoned {
            return Err(MoeError::Poisoned);
        }
        if !self.core.idle() {
            return Err(MoeError::OutOfOrder {
                expected: "combine",
            });
        }
        if self.exec.peers.is_none() {
            return Err(MoeError::NotConnected);
        }
        input.check(&self.exec.dims)?;
        let pairs = count_pairs(&self.exec.dims, input.topk_ids)?;
        let mut io = DispatchIo {
            input: *input,
            pairs: &pairs,
            tokens,
            unpacked: false,
        };
        let ev = Event::Dispatch {
            row: pairs.row.clone(),
        };
        let r = drive(&mut self.core, &mut self.exec, ev, |x, a, c| {
            x.data_dispatch(a, c, &mut io)
        });
        self.poison(r)?;
        let (true, Some(plan), Some(counts)) =
            (io.unpacked, self.core.plan().cloned(), self.core.counts())
        else {
            self.poisoned = true;
            return Err(MoeError::OutOfOrder {
                expected: "a finished dispatch",
            });
        };
        let layout = Layout {
            step: self.core.step(),
            rank: self.core.rank(),
            owner: self.id,
            plan,
            slots: pairs.slots,
            weights: input.topk_weights.to_vec(),
            counts,
        };
        Ok(layout)
    }

    /// Sends the expert outputs (one `hidden`-element row per row of the
    /// step's [`ExpertTokens`]) back and returns this rank's combined tokens,
    /// weighted with the `topk_weights` given to `dispatch`.
    pub fn combine(&mut self, expert_outputs: &[u8], layout: &Layout) -> Result<Vec<u8>, MoeError> {
        self.combine_with_weights(expert_outputs, layout, &layout.weights)
    }

    /// [`MoeRank::combine`] with the weights given now (`T_r · R`,
    /// token-major, f32 or bf16: [`TopkWeights`]; DeepEP's API passes them
    /// to combine, not to dispatch) instead of those given to `dispatch`.
    pub fn combine_with_weights<'w>(
        &mut self,
        expert_outputs: &[u8],
        layout: &Layout,
        weights: impl Into<TopkWeights<'w>>,
    ) -> Result<Vec<u8>, MoeError> {
        let mut out = vec![0; self.combined_len(layout)];
        self.combine_into(expert_outputs, layout, weights, &mut out)?;
        Ok(out)
    }

    /// Bytes of the combined tokens of `layout`'s step (`T_r` rows of
    /// `hidden` elements of the output type): the size `combine_into`
    /// wants.
    pub fn combined_len(&self, layout: &Layout) -> usize {
        crate::pack::combined_len(&self.exec.dims, layout.slots.len())
    }

    /// [`MoeRank::combine_with_weights`] into the caller's `out`, exactly
    /// [`MoeRank::combined_len`] bytes (else `Shape`, checked before
    /// anything is sent): no allocation for the result.
    pub fn combine_into<'w>(
        &mut self,
        expert_outputs: &[u8],
        layout: &Layout,
        weights: impl Into<TopkWeights<'w>>,
        out: &mut [u8],
    ) -> Result<(), MoeError> {
        let weights = weights.into();
        let mut scratch = std::mem::take(&mut self.weights_f32);
        let r = self.combine_f32(expert_outputs, layout, weights.as_f32(&mut scratch), out);
        self.weights_f32 = scratch;
        r
    }

    /// [`MoeRank::combine_into`] with f32 weights.
    fn combine_f32(
        &mut self,
        expert_outputs: &[u8],
        layout: &Layout,
        weights: &[f32],
        out: &mut [u8],
    ) -> Result<(), MoeError> {
        let want = self.combined_len(layout);
        if out.len() != want {
            return Err(MoeError::Shape {
                what: "combine output",
                got: out.len() as u64,
                want: want as u64,
            });
        }
        if weights.len() != layout.slots.len() {
            return Err(MoeError::Shape {
                what: "topk_weights",
                got: weights.len() as u64,
                want: layout.slots.len() as u64,
            });
        }
        if self.poisoned {
            return Err(MoeError::Poisoned);
        }
        if !self.core.in_step() {
            return Err(MoeError::OutOfOrder {
                expected: "dispatch",
            });
        }
        if layout.step != self.core.step()
            || layout.rank != self.core.rank()
            || layout.owner != self.id
        {
            return Err(MoeError::StaleLayout {
                layout_step: layout.step,
                step: self.core.step(),
            });
        }
        let want = layout.plan.combine().len() as u64 * self.exec.dims.out_row_bytes();
        if expert_outputs.len() as u64 != want {
            return Err(MoeError::Shape {
                what: "expert outputs",
                got: expert_outputs.len() as u64,
                want,
            });
        }
        let mut io = CombineIo {
            outputs: expert_outputs,
            slots: &layout.slots,
            weights,
            out,
            summed: false,
        };
        let r = drive(&mut self.core, &mut self.exec, Event::Combine, |x, a, c| {
            x.data_combine(a, c, &mut io)
        });
        self.poison(r)?;
        if !io.summed {
            self.poisoned = true;
            return Err(MoeError::OutOfOrder {
                expected: "a finished combine",
            });
        }
        Ok(())
    }

    /// Waits for the last BAR_C round and the own submits, then frees the
    /// immediates and unregisters the buffers.
    pub fn shutdown(mut self) -> Result<(), MoeError> {
        let mut res = Ok(());
        if !self.poisoned {
            if let Some(w) = self.core.shutdown_wait() {
                res = self.exec.block(&w).map(|_| ());
            }
            if res.is_ok() {
                res = self
                    .exec
                    .block(&crate::core::Wait::Submits(Phase::BarrierC))
                    .map(|_| ());
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
        self.exec.release()
    }
}

impl Drop for MoeRank {
    /// Unregisters the buffers before they are freed (a rank dropped
    /// without [`MoeRank::shutdown`]).
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            tracing::warn!(rank = self.core.rank(), error = %e, "MoE rank dropped: release failed");
        }
    }
}
