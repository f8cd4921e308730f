//! `weft-bench rl`: RL weight transfer at the paper's scale, predicted by
//! weft-rl's scale simulation over the real routing plan of each model:
//! every trainer's WRITEs of the plan posted over the timing-only loopback
//! fabric (400 Gb/s NIC model, simulated time), P2P next to the Rank0
//! baseline of the same model and plan; target: the paper's 1.2–2.0 s.
//! Extras: the bytes ÷ aggregate-bandwidth bound and the event-level cost
//! model's prediction (cross-check). Each model takes a few seconds of
//! planning and simulation on 2 cores (quick: Kimi-K2 only).

use weft_rl::models::{self, DEEPSEEK_V3, KIMI_K2, QWEN3_235B};
use weft_rl::sim::{simulate, SimConfig};
use weft_rl::{plan, PlanConfig};

use crate::{Config, Row, Target};

const CASE: &str = "update (simulated)";
const BACKEND: &str = "loopback model";

/// One row per model (quick: Kimi-K2 only).
pub fn run(cfg: &Config) -> Vec<Row> {
    let ms = if cfg.quick {
        vec![KIMI_K2]
    } else {
        vec![KIMI_K2, DEEPSEEK_V3, QWEN3_235B]
    };
    let sc = SimConfig::default();
    ms.iter()
        .map(|m| {
            let (t, i) = models::paper_layout(m);
            let r = models::build(m, t, i)
                .and_then(|ml| plan(&ml, &PlanConfig::default()).map(|p| (ml, p)))
                .and_then(|(ml, p)| simulate(&ml, &p, &sc));
            match r {
                Ok(r) => Row::new(
                    "rl",
                    CASE,
                    BACKEND,
                    sc.nics as usize,
                    format!("{} {}->{}", m.name, t.ranks(), i.ranks),
                    "update time",
                    "s",
                    r.p2p_s,
                    Some((r.rank0_s, "Rank0, same plan")),
                )
                .target(Target::at_most(r.p2p_s, 2.0, "s (paper 1.2-2.0)"))
                .extra("bound_s", r.bound_s)
                .extra("cost_model_s", r.model.p2p_s)
                .extra("fabric_wrs", r.wrs as f64),
                Err(e) => Row::failed("rl", CASE, BACKEND, sc.nics as usize, e.to_string()),
            }
        })
        .collect()
}
