//! Scale prediction in simulated time (no clock, no sleeping), driven by
//! the same [`Plan`] the real pipeline executes.
//!
//! [`simulate`] runs two predictions side by side:
//!
//! - **Over the loopback fabric** (module `fabric`): every trainer and inference
//!   rank is a simulated host of one step-mode loopback
//!   [`weft::loopback::Fabric`] with `nics` NICs of `nic_gbps` (its
//!   [`weft::loopback::NicModel`] charges each WRITE its serialisation on
//!   the sender's link, the latency, and its serialisation on the
//!   receiver's link, so incast serialises at the receivers). Each trainer
//!   posts exactly the plan's WRITEs (its units' runs, split across NICs as
//!   the engine's sharding does, one WR per page for paged runs) in its
//!   mesh groups' order, wave by wave, with the pipeline's barriers (zero-
//!   length WRITEIMMs to every other rank of the group) between waves;
//!   waves overlap as the real pipeline runs them (two arena halves: a
//!   trainer enters a wave once the previous one is posted and the last
//!   wave staged in the same half completed); inference ranks count
//!   their immediates (count computed from the plan) and then acknowledge
//!   every trainer with a zero-length WRITEIMM, as the real protocol does;
//!   the update time is when the last trainer has every acknowledgement.
//!   The unshard's gathers between nodes are WRITEs on the fabric too
//!   (module `gather`): they share the NICs with the weight WRITEs, and a
//!   writer quantises a wave's staged units only once they arrived. The
//!   rest is charged as modelled durations between the posts (like
//!   weft-moe's `HostModel`): the gathers inside a node (NVLink, which the
//!   fabric does not have), quantisation / fusion per staged unit, and
//!   `submit_us` of host time per submit (one proxy lane per rank).
//! - **The event-level cost model** ([`cost_model`]) as a cross-check: the
//!   same plan costed wave by wave from byte counts (see its docs).
//!
//! **Why this shape** (the options weighed): the plan moves ~1.4 TB
//! (Kimi-K2) from 256 trainers into 128 inference ranks, so real memory
//! behind the registrations is out of the question, and 384 full
//! `TransferEngine`s (each with its threads) on 2 cores would be slow and
//! not deterministic. The fabric therefore runs in its **timing-only**
//! profile ([`weft::loopback::FabricConfig::timing`]: the NIC model and
//! step-mode delivery with every check at post and arrival, but no payload
//! copy, and registrations with no memory behind them,
//! `LoopbackDomain::register_virtual`), and a thin deterministic driver
//! here posts each rank's WRITE stream on its `Domain`s directly,
//! interleaving its own modelled work with the fabric's events
//! (`Fabric::next_event_at`) and polling only the domains that have
//! completions (`Fabric::take_ready`). Byte scaling (all sizes and rates
//! divided by one factor) was rejected: it needs real memory anyway, it
//! shrinks latency and per-WRITE costs relative to bandwidth unless they
//! are scaled too, and the plan's offsets and page lengths do not divide
//! evenly (rounding changes the WRITE sizes).
//!
//! The plan's gathers are strided boxes (Kimi-K2: 1.1 M transfers of
//! ~7.9 M pages), too many events to post one by one: a source's
//! cross-node gathers into one writer in one wave go out as WRITEs of their
//! summed bytes (at most 8 MiB each); the per-transfer host cost is
//! charged as submits.
//!
//! Model error to keep in mind: the NIC model is store-and-forward per
//! WRITE (a WRITE is received only after it was fully sent), which adds
//! one WRITE's serialisation (≤ 168 µs for an 8 MiB unit at 400 Gb/s) to
//! every wave's critical path; times are whole nanoseconds (truncated per
//! WRITE); fabric congestion beyond the per-link serialisation, PCIe and
//! the paper's host→device copy are not modelled.
//!
//! The Rank0 prediction is the cost model's (trainer 0 gathers everything,
//! quantises alone, one link into inference rank 0, which scatters).

mod fabric;
mod gather;
mod model;

pub use model::{cost_model, ModelReport};

use crate::meta::ModelLayout;
use crate::plan::Plan;
use crate::RlError;

/// Microseconds as whole simulated nanoseconds (negative: 0).
fn ns(us: f64) -> u64 {
    (us * 1000.0).max(0.0) as u64
}

/// Hardware and software costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// Bandwidth of one NIC, Gbit/s (400: ConnectX-7 or 2×200 EFA per GPU).
    pub nic_gbps: f64,
    /// NICs per GPU.
    pub nics: u32,
    /// NVLink bandwidth per GPU, GB/s (H100/H200: 450 per direction).
    pub nvlink_gbs: f64,
    /// GPUs per node (trainer `r` is on node `r / gpus_per_node`).
    pub gpus_per_node: u32,
    /// bf16 → fp8 quantisation throughput per GPU, GB/s of bf16 input.
    pub quant_gbs: f64,
    /// Fixed cost of one quantise / fuse kernel.
    pub kernel_us: f64,
    /// Host cost of one WRITE submit.
    pub submit_us: f64,
    /// One-way latency.
    pub latency_us: f64,
    /// One barrier among a group's ranks (cost model only: the fabric
    /// simulation sends the barrier's messages).
    pub barrier_us: f64,
    /// Fabric seed.
    pub seed: u64,
    /// Extra delay per WRITE on the fabric, uniform in `[0, jitter_us]`
    /// from the seeded RNG (0: the plain NIC model).
    pub jitter_us: f64,
    /// Waves overlap as the real pipeline runs them (two arena halves: a
    /// trainer starts wave k+1 once wave k is posted and wave k-1's WRITEs
    /// completed); `false` models one wave at a time, for comparison.
    pub pipelined: bool,
}

impl SimConfig {
    /// Every number in its range: bandwidths finite and positive, at least
    /// one NIC (at most 64) and one GPU per node, times finite and not
    /// negative. [`simulate`] checks it first.
    pub fn validate(&self) -> Result<(), RlError> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let time = |x: f64| x.is_finite() && x >= 0.0;
        RlError::check(
            positive(self.nic_gbps),
            "nic_gbps",
            self.nic_gbps,
            "a finite bandwidth above 0",
        )?;
        RlError::check(
            (1..=64).contains(&self.nics),
            "nics",
            self.nics,
            "1 to 64 NICs per GPU",
        )?;
        RlError::check(
            positive(self.nvlink_gbs),
            "nvlink_gbs",
            self.nvlink_gbs,
            "a finite bandwidth above 0",
        )?;
        RlError::check(
            self.gpus_per_node >= 1,
            "gpus_per_node",
            self.gpus_per_node,
            "at least 1",
        )?;
        RlError::check(
            positive(self.quant_gbs),
            "quant_gbs",
            self.quant_gbs,
            "a finite throughput above 0",
        )?;
        for (field, v) in [
            ("kernel_us", self.kernel_us),
            ("submit_us", self.submit_us),
            ("latency_us", self.latency_us),
            ("barrier_us", self.barrier_us),
            ("jitter_us", self.jitter_us),
        ] {
            RlError::check(time(v), field, v, "a finite time of 0 or more")?;
        }
        Ok(())
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            nic_gbps: 400.0,
            nics: 1,
            nvlink_gbs: 450.0,
            gpus_per_node: 8,
            quant_gbs: 1000.0,
            kernel_us: 10.0,
            submit_us: 5.0,
            latency_us: 5.0,
            barrier_us: 50.0,
            seed: 1,
            jitter_us: 0.0,
            pipelined: true,
        }
    }
}

/// What [`simulate`] predicts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SimReport {
    /// P2P update time over the fabric, seconds: from the first post to
    /// the last trainer holding every inference rank's acknowledgement.
    pub p2p_s: f64,
    /// On the rank that finished last: modelled unshard time, seconds.
    pub unshard_s: f64,
    /// On that rank: modelled quantisation / fusion time.
    pub quant_s: f64,
    /// On that rank: the rest of its waves (submits, WRITEs until they
    /// completed) and the final acknowledgements.
    pub write_s: f64,
    /// On that rank: waiting at barriers.
    pub wait_s: f64,
    /// Bytes into inference ÷ aggregate bandwidth (the tighter of the two
    /// sides), seconds.
    pub bound_s: f64,
    /// Rank0 baseline (cost model), seconds.
    pub rank0_s: f64,
    /// Bytes into inference memory.
    pub bytes: u64,
    /// WRs posted on the fabric (WRITEs, barrier and acknowledgement
    /// messages).
    pub wrs: u64,
    /// Fabric events processed.
    pub events: u64,
    /// The cost model's prediction (cross-check).
    pub model: ModelReport,
}

/// Runs the fabric simulation and the cost model.
pub fn simulate(m: &ModelLayout, plan: &Plan, cfg: &SimConfig) -> Result<SimReport, RlError> {
    cfg.validate()?;
    let model = cost_model(m, plan, cfg);
    let f = fabric::run(m, plan, cfg)?;
    Ok(SimReport {
        p2p_s: f.update_ns as f64 * 1e-9,
        unshard_s: f.parts[0] as f64 * 1e-9,
        quant_s: f.parts[1] as f64 * 1e-9,
        write_s: f.parts[2] as f64 * 1e-9,
        wait_s: f.parts[3] as f64 * 1e-9,
        bound_s: model.bound_s,
        rank0_s: model.rank0_s,
        bytes: model.bytes,
        wrs: f.wrs,
        events: f.events,
        model,
    })
}
