//! [`GpuInference`]: an inference rank's weight region in device memory,
//! registered with the rank's own engine, which counts the trainers'
//! immediates; and [`GpuTarget`], what a trainer needs to write into it
//! (from another process too: it serializes).

use std::sync::Arc;
use std::time::Duration;

use weft::{MrDesc, OnDone, Resources, TransferEngine};
use weft_cuda::{DeviceBuffer, Gpu};

use super::GpuError;
use crate::plan::Plan;

pub(super) const INFERENCE: &str = "inference";

/// Where a [`super::GpuTrainer`] writes one inference rank's weights: the
/// rank's registered region and the immediate its engine counts. Comes
/// from the inference process (untrusted: a trainer checks it against the
/// plan before writing).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuTarget {
    /// The inference rank of the plan.
    pub rank: u32,
    /// Its weight region (`plan.inference[rank].len` bytes).
    pub weights: MrDesc,
    /// The immediate every WRITE into it carries.
    pub imm: u32,
}

impl GpuTarget {
    /// The target as bytes (for a store or a pipe).
    pub fn encode(&self) -> Result<Vec<u8>, GpuError> {
        weft::encode(self).map_err(|e| GpuError::Invalid(format!("encoding a GPU target: {e}")))
    }

    /// A target from [`GpuTarget::encode`]'s bytes; anything else is
    /// [`GpuError::Invalid`].
    pub fn decode(bytes: &[u8]) -> Result<GpuTarget, GpuError> {
        weft::decode(bytes).map_err(|e| GpuError::Invalid(format!("a GPU target: {e}")))
    }

    /// Checks the target against `plan`: a rank it has, a region at least
    /// as long as the rank's.
    pub(super) fn check(&self, plan: &Plan) -> Result<(), GpuError> {
        let Some(r) = plan.inference.get(self.rank as usize) else {
            return Err(GpuError::Invalid(format!(
                "target names inference rank {} of {}",
                self.rank,
                plan.inference.len()
            )));
        };
        if self.weights.len < r.len {
            return Err(GpuError::Invalid(format!(
                "inference rank {}: a region of {} bytes for {}",
                self.rank, self.weights.len, r.len
            )));
        }
        Ok(())
    }
}

/// One inference rank's weights in device memory (see the module docs).
pub struct GpuInference {
    // The registration goes before the memory it covers.
    held: Resources,
    engine: Arc<TransferEngine>,
    target: GpuTarget,
    /// Immediates one update brings (one per WRITE piece).
    expected: u64,
    timeout: Duration,
    weights: DeviceBuffer,
}

impl std::fmt::Debug for GpuInference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuInference")
            .field("rank", &self.target.rank)
            .field("bytes", &self.weights.len())
            .field("expected", &self.expected)
            .finish_non_exhaustive()
    }
}

/// What one update writes into inference rank `rank`: every tensor's
/// bytes and scales, as `(offset, len)`, empty ones left out.
pub(super) fn ranges(plan: &Plan, rank: usize) -> Vec<(u64, u64)> {
    let mut ranges = Vec::new();
    for slot in plan.inference.get(rank).map_or(&[][..], |r| &r.tensors) {
        ranges.push(slot.data);
        ranges.extend(slot.scales);
    }
    ranges.retain(|&(_, len)| len > 0);
    ranges
}

impl GpuInference {
    /// Allocates inference rank `rank`'s weight region of `plan` on `gpu`,
    /// registers it with `engine` (whose domain group names `gpu`'s device,
    /// on a provider that registers GPU memory; every engine of the update
    /// has the same NIC count) and reserves the engine's last immediate.
    /// `timeout` bounds [`GpuInference::wait`].
    pub fn new(
        gpu: &Gpu,
        plan: &Plan,
        rank: u32,
        engine: Arc<TransferEngine>,
        timeout: Duration,
    ) -> Result<GpuInference, GpuError> {
        let Some(region) = plan.inference.get(rank as usize) else {
            return Err(GpuError::Invalid(format!(
                "inference rank {rank} not in the plan"
            )));
        };
        let weights = gpu
            .alloc(region.len.max(16) as usize)
            .map_err(GpuError::cuda("allocating the inference weights"))?;
        let mut held = Resources::new();
        // SAFETY: `weights` is a field of the returned value, declared
        // after `held`, and its Drop releases the registration before the
        // buffer is freed; on the error paths below `held` is dropped
        // (deregistering) before `weights`, declared earlier, is.
        let region_mr = unsafe { weights.region() };
        let (_, desc) = held
            .register(&engine, region_mr)
            .map_err(GpuError::engine(INFERENCE, "registering the weights"))?;
        let imm = engine.imm_capacity().saturating_sub(1);
        held.lease_imm_value(&engine, imm)
            .map_err(GpuError::engine(INFERENCE, "reserving the immediate"))?;
        let counts = engine
            .imm_counts(0)
            .map_err(GpuError::engine(INFERENCE, "immediate counts"))?;
        let expected = ranges(plan, rank as usize)
            .iter()
            .map(|&(_, l)| counts.single_write(l))
            .sum();
        Ok(GpuInference {
            held,
            engine,
            target: GpuTarget {
                rank,
                weights: desc,
                imm,
            },
            expected,
            timeout,
            weights,
        })
    }

    /// What trainers need to write here.
    pub fn target(&self) -> &GpuTarget {
        &self.target
    }

    /// Arms the round of one update: the returned waiter fires once every
    /// WRITE of it has landed (immediates that came before arming count).
    pub fn arm(&self) -> Result<UpdateRound, GpuError> {
        let (od, flag) = OnDone::flag();
        self.engine
            .expect_imm_count_with(self.target.imm, self.expected, od)
            .map_err(GpuError::engine(INFERENCE, "arming the weights round"))?;
        Ok(UpdateRound { flag })
    }

    /// Waits (up to the timeout given to [`GpuInference::new`]) for the
    /// round `r` armed.
    pub fn wait(&self, r: UpdateRound) -> Result<(), GpuError> {
        match r.flag.wait_timeout(self.timeout) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(GpuError::engine(INFERENCE, "weights round")(e)),
            None => Err(GpuError::Timeout {
                role: INFERENCE,
                what: "weights round".into(),
                waited_ms: self.timeout.as_millis() as u64,
            }),
        }
    }

    /// The whole weight region (device → host), laid out as
    /// `plan.inference[rank]` says.
    pub fn read(&self) -> Result<Vec<u8>, GpuError> {
        self.weights
            .to_vec()
            .map_err(GpuError::cuda("reading the inference weights"))
    }
}

/// One armed update round of a [`GpuInference`].
#[derive(Debug)]
pub struct UpdateRound {
    flag: Arc<weft::DoneFlag>,
}

impl Drop for GpuInference {
    fn drop(&mut self) {
        if let Err(e) = self.held.release() {
            tracing::debug!("GPU inference rank {}: releasing: {e}", self.target.rank);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{self, InferLayout, TrainLayout};
    use crate::{plan, PlanConfig};

    fn tiny_plan() -> Plan {
        // FSDP 4 → two inference ranks of one instance.
        let t = TrainLayout {
            fsdp: 4,
            pp: 1,
            ep: 1,
            tp: 1,
            replicas: 1,
        };
        let i = InferLayout {
            ranks: 2,
            instance: 2,
            attn_tp: 2,
            pp: 1,
        };
        let ml = models::build(&models::TINY_MOE, t, i).unwrap();
        plan(&ml, &PlanConfig::default()).unwrap()
    }

    fn target(rank: u32, len: u64) -> GpuTarget {
        GpuTarget {
            rank,
            weights: MrDesc {
                addr: 0x10_0000,
                len,
                rkeys: Vec::new(),
                incarnation: Default::default(),
            },
            imm: 65535,
        }
    }

    #[test]
    fn a_target_round_trips_and_garbage_is_refused() {
        let t = target(1, 4096);
        let b = t.encode().unwrap();
        assert_eq!(GpuTarget::decode(&b).unwrap(), t);
        assert!(matches!(
            GpuTarget::decode(&b[..b.len() - 1]),
            Err(GpuError::Invalid(_))
        ));
        assert!(matches!(
            GpuTarget::decode(&[0xff; 3]),
            Err(GpuError::Invalid(_))
        ));
    }

    #[test]
    fn a_target_the_plan_cannot_have_is_refused() {
        let p = tiny_plan();
        let len = p.inference[1].len;
        assert!(target(1, len).check(&p).is_ok());
        // A rank the plan does not have, a region too short for the rank.
        let e = target(2, len).check(&p).unwrap_err().to_string();
        assert!(e.contains("rank 2 of 2"), "{e}");
        let e = target(1, len - 1).check(&p).unwrap_err().to_string();
        assert!(e.contains(&format!("{} bytes for {len}", len - 1)), "{e}");
        // What one update writes lies inside the rank's region.
        let r = ranges(&p, 1);
        assert!(!r.is_empty());
        assert!(r.iter().all(|&(o, l)| l > 0 && o + l <= len));
    }
}
