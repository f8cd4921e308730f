//! [`Inference`]: the passive side — two registered weight buffers and one
//! ImmCounter round per step.

use std::sync::Arc;

use parking_lot::Mutex;
use weft::{DoneCounter, DoneFlag, HostBuffer, MrHandle, OnDone, Resources, TransferEngine};

use super::{eng, imm_count, Directory, ImmPlan, InferEndpoint, StepConfig};
use crate::plan::{Plan, TensorSlot};
use crate::RlError;

const ROLE: &str = "inference";

/// One inference rank.
pub struct Inference {
    engine: Arc<TransferEngine>,
    rank: u32,
    plan: Arc<Plan>,
    cfg: StepConfig,
    imms: ImmPlan,
    /// The registrations of `bufs` and the reserved immediates.
    held: Resources,
    bufs: [HostBuffer; 2],
    mrs: [MrHandle; 2],
    endpoint: InferEndpoint,
    expected: u64,
    live: Mutex<Option<u64>>,
}

impl Inference {
    /// Registers the two weight buffers once and reserves the plan's
    /// immediates.
    pub fn new(
        engine: Arc<TransferEngine>,
        rank: u32,
        plan: Arc<Plan>,
        cfg: StepConfig,
    ) -> Result<Inference, RlError> {
        let region = plan
            .inference
            .get(rank as usize)
            .ok_or(RlError::UnknownRank { role: ROLE, rank })?;
        let buf = || {
            HostBuffer::new(region.len.max(1) as usize)
                .map_err(|e| RlError::Buffer(format!("inference {rank} weights: {e}")))
        };
        let bufs = [buf()?, buf()?];
        let mut held = Resources::new();
        let (m0, d0) = held.register(&engine, bufs[0].region()).map_err(eng(
            ROLE,
            rank,
            "registering buffer 0",
        ))?;
        let (m1, d1) = held.register(&engine, bufs[1].region()).map_err(eng(
            ROLE,
            rank,
            "registering buffer 1",
        ))?;
        let imms = ImmPlan::new(&plan, engine.imm_capacity())?;
        imms.reserve(&engine, &mut held, ROLE, rank)?;
        let counts = engine
            .imm_counts(0)
            .map_err(eng(ROLE, rank, "imm counts"))?;
        let expected = plan
            .writes_to(rank)
            .map(|(_, x)| imm_count(&counts, x))
            .sum();
        Ok(Inference {
            engine,
            rank,
            plan,
            cfg,
            imms,
            held,
            bufs,
            mrs: [m0, m1],
            endpoint: InferEndpoint { weights: [d0, d1] },
            expected,
            live: Mutex::new(None),
        })
    }

    /// What trainers need of this rank.
    pub fn endpoint(&self) -> InferEndpoint {
        self.endpoint.clone()
    }

    /// Immediates one step delivers here (computed from the plan).
    pub fn expected(&self) -> u64 {
        self.expected
    }

    /// Arms the round of version `version` (before the trainers start, or
    /// at any time: early arrivals count).
    pub fn begin(&self, version: u64) -> Result<Arc<DoneFlag>, RlError> {
        let imm = self.imms.weights[(version % 2) as usize];
        let (od, flag) = OnDone::flag();
        self.engine
            .expect_imm_count_with(imm, self.expected, od)
            .map_err(eng(ROLE, self.rank, format!("arming version {version}")))?;
        Ok(flag)
    }

    /// Waits for the round armed by [`Self::begin`]; on success makes the
    /// buffer live and acknowledges to every trainer. On failure the live
    /// buffer is untouched.
    pub fn finish(&self, flag: &DoneFlag, version: u64, dir: &Directory) -> Result<(), RlError> {
        let phase = format!("version {version}");
        match flag.wait_timeout(self.cfg.timeout) {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(eng(ROLE, self.rank, phase)(e)),
            None => {
                return Err(RlError::Timeout {
                    role: ROLE,
                    rank: self.rank,
                    phase,
                    waited_ms: self.cfg.timeout.as_millis() as u64,
                })
            }
        }
        *self.live.lock() = Some(version);
        let sent = Arc::new(DoneCounter::new());
        for t in &dir.trainers {
            self.engine
                .submit_single_write(
                    0,
                    Some(self.imms.ack),
                    (&self.mrs[0], 0),
                    (&t.arena, 0),
                    OnDone::counter(&sent),
                )
                .map_err(eng(ROLE, self.rank, "ack"))?;
        }
        // Acks to dead trainers fail; the version is live regardless.
        let _ = sent.wait_for_timeout(dir.trainers.len() as u64, self.cfg.timeout);
        Ok(())
    }

    /// [`Self::begin`] + [`Self::finish`].
    pub fn step(&self, version: u64, dir: &Directory) -> Result<(), RlError> {
        let f = self.begin(version)?;
        self.finish(&f, version, dir)
    }

    /// The live version, if any.
    pub fn live(&self) -> Option<u64> {
        *self.live.lock()
    }

    /// The live weights: `(version, buffer)`; read tensors at the plan's
    /// offsets ([`Self::tensors`]).
    pub fn weights(&self) -> Option<(u64, &HostBuffer)> {
        self.live().map(|v| (v, &self.bufs[(v % 2) as usize]))
    }

    /// Where each tensor lives in a buffer.
    pub fn tensors(&self) -> &[TensorSlot] {
        &self.plan.inference[self.rank as usize].tensors
    }

    /// Clears partial counts after a failed step.
    pub fn recover(&self) -> Result<(), RlError> {
        self.held.reset_imms();
        Ok(())
    }
}

impl Drop for Inference {
    /// Deregisters the buffers before they are freed; frees the immediates.
    fn drop(&mut self) {
        if let Err(e) = self.held.release() {
            tracing::debug!(rank = self.rank, "inference: releasing: {e}");
        }
    }
}

impl std::fmt::Debug for Inference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inference")
            .field("rank", &self.rank)
            .field("live", &self.live())
            .finish_non_exhaustive()
    }
}
