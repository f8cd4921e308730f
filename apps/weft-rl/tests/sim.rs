//! The scale model: never below the bandwidth bound, Rank0 slower than
//! P2P, deterministic.

use weft_rl::models::{self, InferLayout, TrainLayout};
use weft_rl::sim::{simulate, SimConfig};
use weft_rl::{plan, PlanConfig};

#[test]
fn p2p_prediction_respects_the_bound_and_beats_rank0() {
    for (name, t, i) in [
        (
            "tiny-moe",
            TrainLayout {
                fsdp: 2,
                pp: 1,
                ep: 2,
            },
            InferLayout {
                ranks: 2,
                instance: 2,
                attn_tp: 2,
            },
        ),
        (
            "tiny-mla",
            TrainLayout {
                fsdp: 4,
                pp: 2,
                ep: 2,
            },
            InferLayout {
                ranks: 8,
                instance: 2,
                attn_tp: 2,
            },
        ),
        (
            "tiny-moe",
            TrainLayout {
                fsdp: 8,
                pp: 2,
                ep: 4,
            },
            InferLayout {
                ranks: 16,
                instance: 4,
                attn_tp: 2,
            },
        ),
    ] {
        let m = models::model(name).unwrap();
        let ml = models::build(&m, t, i).unwrap();
        let cfg = PlanConfig {
            unit_bytes: 32 << 10,
            watermark: 256 << 10,
            ..PlanConfig::default()
        };
        let p = plan(&ml, &cfg).unwrap();
        let sc = SimConfig::default();
        let r = simulate(&ml, &p, &sc);
        assert!(r.p2p_s >= r.bound_s, "{name}: {r:?}");

        assert_eq!(r, simulate(&ml, &p, &sc));
        // More NICs never make it slower.
        let r2 = simulate(&ml, &p, &SimConfig { nics: 2, ..sc });
        assert!(r2.p2p_s <= r.p2p_s, "{name}: {r2:?} vs {r:?}");
    }
}

/// DeepSeek-V3's shapes, 4 layers, at the paper's 256 -> 128 layout: the
/// single-link Rank0 path is far slower than P2P.
#[test]
fn rank0_loses_at_scale() {
    let m = weft_rl::models::ModelConfig {
        layers: 4,
        ..models::DEEPSEEK_V3
    };
    let (t, i) = models::paper_layout(&models::DEEPSEEK_V3);
    let ml = models::build(&m, t, i).unwrap();
    let p = plan(&ml, &PlanConfig::default()).unwrap();
    let r = simulate(&ml, &p, &SimConfig::default());
    assert!(r.p2p_s >= r.bound_s, "{r:?}");
    assert!(r.rank0_s > 10.0 * r.p2p_s, "{r:?}");
}
