//! The cross-thread queue hand-off floor (what `proxy` compares the
//! engine's submit → pickup against).
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion};
use std::time::Duration;
use weft_bench::floor::HandoffFloor;

fn bench(c: &mut Criterion) {
    let floor = HandoffFloor::new();
    c.bench_function(
        "queue_handoff/one-way (push -> pop on a spinning thread)",
        |b| {
            b.iter_custom(|iters| {
                let mut total = 0.0;
                for _ in 0..iters {
                    total += floor.once().unwrap_or(0.0);
                }
                Duration::from_nanos(total as u64)
            })
        },
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
