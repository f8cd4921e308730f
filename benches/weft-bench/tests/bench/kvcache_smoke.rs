//! Smoke test of `weft-bench kvcache` in quick mode: both shapes measured
//! on loopback with a baseline and a ratio, loopback-null reported
//! unavailable. Structure only, never timings.

use weft_bench::{BackendKind, Config, Status, Suite};

#[test]
fn quick_kvcache_rows() {
    let mut cfg = Config::new(Suite::Kvcache, true);
    cfg.backends = vec![BackendKind::Loopback, BackendKind::LoopbackNull];
    cfg.rounds = Some(1);
    let rep = weft_bench::run(&cfg);
    for case in ["qwen3_235b_tp4", "deepseek_v3_mla"] {
        for metric in ["throughput", "requests"] {
            let r = rep
                .rows
                .iter()
                .find(|r| r.backend == "loopback" && r.case == case && r.metric == metric)
                .unwrap_or_else(|| panic!("no {case} {metric} row: {:#?}", rep.rows));
            assert_eq!(r.status, Status::Ok, "{case} {metric}");
            assert!(r.measured.is_some_and(|m| m > 0.0));
            assert!(r.baseline.is_some_and(|b| b > 0.0));
            assert!(r.ratio.is_some());
        }
    }
    let null: Vec<_> = rep
        .rows
        .iter()
        .filter(|r| r.backend == "loopback-null")
        .collect();
    assert_eq!(null.len(), 1);
    assert!(matches!(null[0].status, Status::Unavailable(_)));
}
