//! Sharding plans: the pure functions the worker runs per submit.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use weft::shard::{plan_page, plan_scatter_dst, plan_single_write};
use weft::{ScatterMode, ShardConfig};

fn bench(c: &mut Criterion) {
    let cfg = ShardConfig::default();
    let mut g = c.benchmark_group("shard_plan");
    g.bench_function("single_write 4 KiB x1 lane", |b| {
        b.iter(|| plan_single_write(black_box(4096), 1, 1 << 30, 0, &cfg))
    });
    g.bench_function("single_write 64 MiB x4 lanes", |b| {
        b.iter(|| plan_single_write(black_box(64 << 20), 4, 1 << 30, 0, &cfg))
    });
    g.bench_function("single_write 64 MiB x4 lanes, 1 MiB max_write_len", |b| {
        b.iter(|| plan_single_write(black_box(64 << 20), 4, 1 << 20, 0, &cfg))
    });
    g.bench_function("page 32 KiB", |b| {
        b.iter(|| plan_page(black_box(17), 32 << 10, 4, 1 << 30, cfg.align))
    });
    g.bench_function("scatter 64 peers by-peer", |b| {
        b.iter(|| {
            (0..64)
                .map(|j| {
                    plan_scatter_dst(j, black_box(7168), 2, 1 << 30, ScatterMode::ByPeer, &cfg)
                        .len()
                })
                .sum::<usize>()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
