//! [`GpuInference`]: an inference rank's two weight buffers in device
//! memory, registered with the rank's own engine, which counts the
//! trainers' immediates; and [`GpuTarget`], what a trainer needs to write
//! into them (from another process too: it serializes).
//!
//! Version `v` goes into buffer `v % 2` with that buffer's immediate, so an
//! update that fails (a trainer died mid-write) leaves the other buffer,
//! the last good version, live; [`GpuInference::recover`] drops the failed
//! round's partial counts before the version is pushed again.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use weft::{MrDesc, OnDone, Resources, TransferEngine};
use weft_cuda::{DeviceBuffer, Gpu};

use super::GpuError;
use crate::plan::Plan;

pub(super) const INFERENCE: &str = "inference";

/// Where a [`super::GpuTrainer`] writes one inference rank's weights: the
/// rank's two registered buffers and the immediate its engine counts for
/// each. Comes from the inference process (untrusted: a trainer checks it
/// against the plan before writing).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuTarget {
    /// The inference rank of the plan.
    pub rank: u32,
    /// Its two weight buffers (`plan.inference[rank].len` bytes each):
    /// version `v` goes into `weights[v % 2]`.
    pub weights: [MrDesc; 2],
    /// The immediate every WRITE into `weights[i]` carries.
    pub imms: [u32; 2],
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

    /// The buffer version `version` goes into and its immediate.
    pub fn buffer(&self, version: u64) -> (&MrDesc, u32) {
        let i = (version % 2) as usize;
        (&self.weights[i], self.imms[i])
    }

    /// Checks the target against `plan`: a rank it has, buffers at least
    /// as long as the rank's region, two different immediates.
    pub(super) fn check(&self, plan: &Plan) -> Result<(), GpuError> {
        let Some(r) = plan.inference.get(self.rank as usize) else {
            return Err(GpuError::Invalid(format!(
                "target names inference rank {} of {}",
                self.rank,
                plan.inference.len()
            )));
        };
        if let Some(w) = self.weights.iter().find(|w| w.len < r.len) {
            return Err(GpuError::Invalid(format!(
                "inference rank {}: a buffer of {} bytes for {}",
                self.rank, w.len, r.len
            )));
        }
        if self.imms[0] == self.imms[1] {
            return Err(GpuError::Invalid(format!(
                "inference rank {}: both buffers count immediate {}",
                self.rank, self.imms[0]
            )));
        }
        Ok(())
    }
}

/// One inference rank's weights in device memory (see the module docs).
pub struct GpuInference {
    // The registrations go before the memory they cover.
    held: Resources,
    engine: Arc<TransferEngine>,
    target: GpuTarget,
    /// Immediates one update brings (one per WRITE piece).
    expected: u64,
    timeout: Duration,
    /// The version whose round completed last (its buffer is live).
    live: Mutex<Option<u64>>,
    weights: [DeviceBuffer; 2],
}

impl std::fmt::Debug for GpuInference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuInference")
            .field("rank", &self.target.rank)
            .field("bytes", &self.weights.len())
            .field("expected", &self.expected)
            .field("live", &self.live())
            .finish_non_exhaustive()
    }
}

/// Gaps of up to this many bytes between two tensors' ranges (the plan's
/// alignment padding) are written along with them: one WRITE per run of
/// tensors instead of one per tensor (each WRITE costs a copy launch and an
/// immediate).
pub(super) const MERGE_GAP: u64 = 4096;

/// What one update writes into inference rank `rank`: the runs of its
/// tensors' bytes and scales, as `(offset, len)` in offset order, ranges
/// at most [`MERGE_GAP`] apart merged (the padding between them goes too),
/// empty ones left out.
pub(super) fn ranges(plan: &Plan, rank: usize) -> Vec<(u64, u64)> {
    let mut ranges = Vec::new();
    for slot in plan.inference.get(rank).map_or(&[][..], |r| &r.tensors) {
        ranges.push(slot.data);
        ranges.extend(slot.scales);
    }
    ranges.retain(|&(_, len)| len > 0);
    ranges.sort_unstable();
    let mut runs: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (off, len) in ranges {
        match runs.last_mut() {
            Some((o, l)) if off <= (*o + *l).saturating_add(MERGE_GAP) => {
                *l = (*o + *l).max(off + len) - *o;
            }
            _ => runs.push((off, len)),
        }
    }
    runs
}

impl GpuInference {
    /// Allocates inference rank `rank`'s two weight buffers of `plan` on
    /// `gpu`, registers them with `engine` (whose domain group names
    /// `gpu`'s device, on a provider that registers GPU memory; every
    /// engine of the update has the same NIC count) and reserves the
    /// engine's last two immediates. `timeout` bounds
    /// [`GpuInference::wait`].
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
        let alloc = |i: usize| {
            gpu.alloc(region.len.max(16) as usize)
                .map_err(GpuError::cuda(format!("allocating inference buffer {i}")))
        };
        let weights = [alloc(0)?, alloc(1)?];
        let mut held = Resources::new();
        let mut register = |i: usize| {
            // SAFETY: `weights` is a field of the returned value, declared
            // after `held`, and its Drop releases the registrations before
            // the buffers are freed; on the error paths below `held` is
            // dropped (deregistering) before `weights`, declared earlier,
            // is.
            let mr = unsafe { weights[i].region() };
            held.register(&engine, mr)
                .map(|(_, desc)| desc)
                .map_err(GpuError::engine(
                    INFERENCE,
                    format!("registering buffer {i}"),
                ))
        };
        let descs = [register(0)?, register(1)?];
        let last = engine.imm_capacity().saturating_sub(1);
        let imms = [last, last.saturating_sub(1)];
        for imm in imms {
            held.lease_imm_value(&engine, imm)
                .map_err(GpuError::engine(
                    INFERENCE,
                    format!("reserving immediate {imm}"),
                ))?;
        }
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
                weights: descs,
                imms,
            },
            expected,
            timeout,
            live: Mutex::new(None),
            weights,
        })
    }

    /// What trainers need to write here.
    pub fn target(&self) -> &GpuTarget {
        &self.target
    }

    /// Arms the round of version `version`: the returned waiter fires
    /// once every WRITE of it has landed in buffer `version % 2`
    /// (immediates that came before arming count).
    pub fn arm(&self, version: u64) -> Result<UpdateRound, GpuError> {
        let (_, imm) = self.target.buffer(version);
        let (od, flag) = OnDone::flag();
        self.engine
            .expect_imm_count_with(imm, self.expected, od)
            .map_err(GpuError::engine(
                INFERENCE,
                format!("arming the round of version {version}"),
            ))?;
        Ok(UpdateRound { flag, version })
    }

    /// Waits (up to the timeout given to [`GpuInference::new`]) for the
    /// round `r` armed; on success its version is live. On failure the
    /// live version is untouched: call [`GpuInference::recover`] before
    /// the version is pushed again.
    pub fn wait(&self, r: UpdateRound) -> Result<(), GpuError> {
        let what = || format!("the round of version {}", r.version);
        match r.flag.wait_timeout(self.timeout) {
            Some(Ok(())) => {
                *self.live.lock() = Some(r.version);
                Ok(())
            }
            Some(Err(e)) => Err(GpuError::engine(INFERENCE, what())(e)),
            None => Err(GpuError::Timeout {
                role: INFERENCE,
                what: what(),
                waited_ms: self.timeout.as_millis() as u64,
            }),
        }
    }

    /// Drops the partial counts a failed round left (a dead trainer's
    /// WRITEs that landed) and fails a round still armed; the live
    /// version stays.
    pub fn recover(&self) {
        self.held.reset_imms();
    }

    /// The live version: the last whose round completed.
    pub fn live(&self) -> Option<u64> {
        *self.live.lock()
    }

    /// The live version and its buffer (device → host), laid out as
    /// `plan.inference[rank]` says; `None` before the first round.
    pub fn read(&self) -> Result<Option<(u64, Vec<u8>)>, GpuError> {
        let Some(v) = self.live() else {
            return Ok(None);
        };
        let bytes = self.weights[(v % 2) as usize]
            .to_vec()
            .map_err(GpuError::cuda(format!("reading version {v}")))?;
        Ok(Some((v, bytes)))
    }
}

/// One armed update round of a [`GpuInference`].
#[derive(Debug)]
pub struct UpdateRound {
    flag: Arc<weft::DoneFlag>,
    version: u64,
}

impl UpdateRound {
    /// The version the round brings.
    pub fn version(&self) -> u64 {
        self.version
    }
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
        let desc = |addr| MrDesc {
            addr,
            len,
            rkeys: Vec::new(),
            incarnation: Default::default(),
        };
        GpuTarget {
            rank,
            weights: [desc(0x10_0000), desc(0x20_0000)],
            imms: [65535, 65534],
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
        // Only the second buffer short; one immediate for both.
        let mut t = target(1, len);
        t.weights[1].len = len - 1;
        assert!(t.check(&p).is_err());
        let mut t = target(1, len);
        t.imms[1] = t.imms[0];
        let e = t.check(&p).unwrap_err().to_string();
        assert!(e.contains("both buffers"), "{e}");
        // Versions alternate buffers.
        let t = target(1, len);
        assert_eq!(t.buffer(4).0.addr, 0x10_0000);
        assert_eq!(t.buffer(7), (&t.weights[1], 65534));
        // What one update writes lies inside the rank's region, in runs
        // more than MERGE_GAP apart that cover every tensor's bytes.
        let r = ranges(&p, 1);
        assert!(!r.is_empty());
        assert!(r.iter().all(|&(o, l)| l > 0 && o + l <= len));
        assert!(r.windows(2).all(|w| w[1].0 > w[0].0 + w[0].1 + MERGE_GAP));
        let inside = |(o, l): (u64, u64)| r.iter().any(|&(ro, rl)| o >= ro && o + l <= ro + rl);
        for slot in &p.inference[1].tensors {
            assert!(inside(slot.data), "{:?}", slot.data);
            if let Some(s) = slot.scales {
                assert!(inside(s) || s.1 == 0, "{s:?}");
            }
        }
        assert!(
            r.len() < p.inference[1].tensors.len(),
            "runs merged: {}",
            r.len()
        );
    }
}
