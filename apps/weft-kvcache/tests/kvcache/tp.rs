//! Tensor-parallel mismatch (prefill TP ≠ decode TP: heads split and
//! merged) and MLA (replicated latent, prefill ranks matched to decode
//! ranks at random), byte-exact over the adversarial loopback fabric.

use crate::common::*;
use std::sync::Arc;
use std::time::Duration;
use weft::loopback::{Fabric, FabricConfig};
use weft_kvcache::tp::rank_heads;
use weft_kvcache::{Decoder, Prefiller, Route, TpShape};
use weft_testkit::{seeds_or, SeedGuard};

const PAGES: u32 = 24;

/// Runs `prompts` prompts through every decode rank of `shape` and checks
/// every decode rank's heads byte for byte. Returns, per decode rank, the
/// prefill ranks that served it.
fn run(shape: TpShape, seed: u64, prompts: u64) -> Vec<Vec<u32>> {
    let fabric = Fabric::new_realtime(FabricConfig {
        max_write_len: 4096,
        ..FabricConfig::adversarial(seed)
    });
    let ph = shape.prefill_heads_per_rank().unwrap();
    let dh = shape.decode_heads_per_rank().unwrap();
    let mut apps = Vec::new();
    let mut pengines = Vec::new();
    for r in 0..shape.prefill_tp {
        let e = engine(&fabric, fabric.add_host(1), 1);
        let l = layout(3, ph, 1024, 512, PAGES);
        let cache = Arc::new(Cache::new(l));
        let pre = Arc::new(Prefiller::new(e.clone(), l, cache.regions(), kv_config()).unwrap());
        let heads = rank_heads(shape.kv_heads, shape.prefill_tp, r).unwrap();
        apps.push(PrefillApp::start(pre, cache, heads, Signal::Mixed, None));
        pengines.push(e);
    }
    let plan = shape.plan(seed).unwrap();
    let mut decs = Vec::new();
    for (d, srcs) in plan.iter().enumerate() {
        let e = engine(&fabric, fabric.add_host(1), 1);
        let l = layout(3, dh, 1024, 512, PAGES);
        let cache = Cache::new(l);
        let dec = Decoder::new(e.clone(), l, cache.regions(), kv_config()).unwrap();
        let ids: Vec<_> = pengines
            .iter()
            .map(|p| dec.add_prefiller(p.main_address()))
            .collect();
        let route = Route::from_plan(srcs, &ids).unwrap();
        let heads = rank_heads(shape.kv_heads, shape.decode_tp, d as u32).unwrap();
        decs.push((e, cache, dec, route, heads));
    }
    for k in 0..prompts {
        let ps = seed * 1000 + k;
        let n = 1 + ((seed + k) % 7) as u32;
        let reqs: Vec<_> = decs
            .iter()
            .map(|(_, _, dec, route, _)| {
                let lease = dec.alloc(n).unwrap();
                let h = dec.request(route, &lease, &ps.to_le_bytes()).unwrap();
                (lease, h)
            })
            .collect();
        for ((lease, h), (_, cache, dec, _, heads)) in reqs.into_iter().zip(&decs) {
            h.wait()
                .unwrap_or_else(|e| panic!("seed {seed} {shape:?}: {e}"));
            check_request(cache, heads, lease.pages(), lease.tail_slot(), ps)
                .unwrap_or_else(|e| panic!("seed {seed} {shape:?} prompt {k}: {e}"));
            dec.free(lease);
        }
    }
    for (e, _, dec, _, _) in &decs {
        dec.shutdown();
        e.shutdown();
    }
    for (mut a, e) in apps.into_iter().zip(pengines) {
        a.stop();
        a.pre.shutdown(Duration::from_secs(1));
        e.shutdown();
    }
    plan.iter()
        .map(|s| s.iter().map(|x| x.prefill_rank).collect())
        .collect()
}

#[test]
fn prefill_tp8_to_decode_tp4_merges_heads() {
    for seed in seeds_or([1, 2]) {
        let _g = SeedGuard::new(seed, "tp8_to_tp4");
        let shape = TpShape {
            kv_heads: 8,
            prefill_tp: 8,
            decode_tp: 4,
        };
        let served = run(shape, seed, 3);
        assert!(served.iter().all(|s| s.len() == 2), "{served:?}");
    }
}

#[test]
fn prefill_tp4_to_decode_tp8_splits_heads() {
    for seed in seeds_or([3, 4]) {
        let _g = SeedGuard::new(seed, "tp4_to_tp8");
        let shape = TpShape {
            kv_heads: 8,
            prefill_tp: 4,
            decode_tp: 8,
        };
        let served = run(shape, seed, 3);
        assert!(served.iter().all(|s| s.len() == 1), "{served:?}");
    }
}

#[test]
fn qwen3_like_replicated_heads_tp4_to_tp8() {
    // 4 KV heads over decode TP8: each head on two decode ranks
    for seed in seeds_or([5]) {
        let _g = SeedGuard::new(seed, "qwen3_tp4_to_tp8");
        let shape = TpShape {
            kv_heads: 4,
            prefill_tp: 4,
            decode_tp: 8,
        };
        run(shape, seed, 2);
    }
}

#[test]
fn mla_latent_is_matched_to_spread_prefill_ranks() {
    for seed in seeds_or([6, 7]) {
        let _g = SeedGuard::new(seed, "mla");
        let shape = TpShape {
            kv_heads: 1,
            prefill_tp: 4,
            decode_tp: 4,
        };
        let served = run(shape, seed, 3);
        let mut ranks: Vec<u32> = served.iter().map(|s| s[0]).collect();
        ranks.sort_unstable();
        assert_eq!(
            ranks,
            vec![0, 1, 2, 3],
            "each prefill rank serves one decode rank"
        );
    }
}
