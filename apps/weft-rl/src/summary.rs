//! [`Summary`]: what a plan moves, where, and how evenly.

use std::fmt;

use weft::{shard, ShardConfig};

use crate::meta::ModelLayout;
use crate::plan::{Plan, Xfer};

/// Min / mean / max of a load vector.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Smallest.
    pub min: u64,
    /// Mean.
    pub mean: f64,
    /// Largest.
    pub max: u64,
}

impl Spread {
    /// Of `v` (zeros for an empty vector).
    pub fn of(v: &[u64]) -> Spread {
        let min = v.iter().copied().min().unwrap_or(0);
        let max = v.iter().copied().max().unwrap_or(0);
        let mean = if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<u64>() as f64 / v.len() as f64
        };
        Spread { min, mean, max }
    }
    /// `max / mean` (1 = perfectly even).
    pub fn imbalance(&self) -> f64 {
        if self.mean > 0.0 {
            self.max as f64 / self.mean
        } else {
            1.0
        }
    }
}

/// The routing summary `weft-rl plan` prints.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Parameters (elements).
    pub params: u64,
    /// Training-side bytes (bf16, one copy).
    pub train_bytes: u64,
    /// Bytes landing in inference memory per step (all ranks).
    pub inference_bytes: u64,
    /// Work units.
    pub units: usize,
    /// Single writes / paged writes into inference memory.
    pub single_writes: u64,
    /// Paged writes (and their pages).
    pub paged_writes: (u64, u64),
    /// Unshard traffic between trainers (bytes, transfers).
    pub gather: (u64, u64),
    /// Submits the trainers make for the unshard (small pieces into one
    /// writer share a paged submit: [`crate::plan::gather_posts`]).
    pub gather_submits: u64,
    /// Bytes each trainer writes to inference.
    pub trainer: Spread,
    /// Bytes each trainer NIC carries (engine sharding applied).
    pub trainer_nic: Spread,
    /// Bytes each inference rank receives.
    pub inference: Spread,
    /// Mesh groups and total waves.
    pub groups: (usize, usize),
    /// Arena bytes per trainer.
    pub arena: u64,
}

fn nic_bytes(out: &mut [u64], rr: &mut usize, x: &Xfer, nics: usize, cfg: &ShardConfig) {
    let r = &x.dst;
    if x.is_single() {
        for p in shard::plan_single_write(r.bytes(), nics, u64::MAX, *rr, cfg) {
            out[p.nic] += p.len;
        }
        *rr += 1;
    } else {
        for i in 0..r.count as usize {
            out[i % nics] += r.page_len;
        }
    }
}

impl Summary {
    /// Summarises `plan` for trainers with `nics` NICs each.
    pub fn of(m: &ModelLayout, plan: &Plan, nics: usize) -> Summary {
        let nics = nics.max(1);
        let cfg = ShardConfig::default();
        let mut single = 0;
        let mut paged = (0, 0);
        let mut gather = (0, 0);
        let mut inf = vec![0u64; plan.inference.len()];
        let mut nic = vec![0u64; plan.trainers.len() * nics];
        let mut rr = vec![0usize; plan.trainers.len()];
        for u in &plan.units {
            for d in &u.dests {
                for x in d.xfers() {
                    if x.is_single() {
                        single += 1;
                    } else {
                        paged.0 += 1;
                        paged.1 += x.dst.count;
                    }
                    inf[d.inf as usize] += x.dst.bytes();
                    let w = u.writer as usize;
                    nic_bytes(
                        &mut nic[w * nics..(w + 1) * nics],
                        &mut rr[w],
                        x,
                        nics,
                        &cfg,
                    );
                }
            }
            for g in &u.gathers {
                gather.0 += g.xfer.src.bytes();
                gather.1 += 1;
            }
        }
        Summary {
            params: crate::models::param_count(m),
            train_bytes: m
                .params
                .iter()
                .map(|p| p.rows * p.cols * p.dtype.size())
                .sum(),
            inference_bytes: plan.inference_bytes(),
            units: plan.units.len(),
            single_writes: single,
            paged_writes: paged,
            gather,
            gather_submits: (0..plan.groups.len())
                .flat_map(|g| (0..plan.groups[g].waves.len()).map(move |k| (g, k)))
                .map(|(g, k)| plan.gather_posts(g, k).len() as u64)
                .sum(),
            trainer: Spread::of(&plan.trainer_load()),
            trainer_nic: Spread::of(&nic),
            inference: Spread::of(&inf),
            groups: (
                plan.groups.len(),
                plan.groups.iter().map(|g| g.waves.len()).sum(),
            ),
            arena: plan.arena_len,
        }
    }
}

/// `x` bytes as GB / MB.
pub fn human(x: f64) -> String {
    if x >= 1e9 {
        format!("{:.2} GB", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.2} MB", x / 1e6)
    } else {
        format!("{:.1} kB", x / 1e3)
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sp = |s: &Spread| {
            format!(
                "min {} / mean {} / max {} (max/mean {:.3})",
                human(s.min as f64),
                human(s.mean),
                human(s.max as f64),
                s.imbalance()
            )
        };
        writeln!(
            f,
            "parameters          {:.1} B ({} bf16 on the trainers)",
            self.params as f64 / 1e9,
            human(self.train_bytes as f64)
        )?;
        writeln!(
            f,
            "into inference      {} per step",
            human(self.inference_bytes as f64)
        )?;
        writeln!(f, "units               {}", self.units)?;
        writeln!(
            f,
            "writes              {} single, {} paged ({} pages)",
            self.single_writes, self.paged_writes.0, self.paged_writes.1
        )?;
        writeln!(
            f,
            "unshard traffic     {} in {} transfers ({} submits)",
            human(self.gather.0 as f64),
            self.gather.1,
            self.gather_submits
        )?;
        writeln!(f, "per trainer         {}", sp(&self.trainer))?;
        writeln!(f, "per trainer NIC     {}", sp(&self.trainer_nic))?;
        writeln!(f, "per inference rank  {}", sp(&self.inference))?;
        writeln!(
            f,
            "mesh groups         {} ({} waves)",
            self.groups.0, self.groups.1
        )?;
        write!(
            f,
            "arena per trainer   2 x {} (two halves: waves overlap)",
            human(self.arena as f64)
        )
    }
}
