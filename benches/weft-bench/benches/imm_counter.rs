//! ImmCounter: immediates counted by a receiving engine until a round fires.
//!
//! The counter itself (`ImmTable`) is private to weft-engine, so this goes
//! through the public API: a sender engine posts N immediate-carrying
//! 64-byte WRITEs (one paged submit) over the loopback null backend, the
//! receiver's `expect_imm_count(imm, N)` fires. Reported per immediate
//! (criterion throughput = elements), it is the per-arrival cost of the
//! receive path (poll → ImmCounter increment → fire) plus the sender's
//! posting. `weft-bench imm` runs the same next to its raw baseline.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use weft::{OnDone, Pages};
use weft_bench::engines::{wait_until, EnginePair};
use weft_bench::{BackendKind, Testbed};

fn bench(c: &mut Criterion) {
    let Ok(tb) = Testbed::new(&BackendKind::LoopbackNull, 1) else {
        return;
    };
    let n: u64 = 4096;
    let Ok(ep) = EnginePair::new(&tb, (n * 64) as usize, (n * 64) as usize) else {
        return;
    };
    let Ok(imm) = ep.rx.alloc_imm() else { return };
    let pg = Pages {
        indices: (0..n as u32).collect(),
        stride: 64,
        offset: 0,
    };
    let mut g = c.benchmark_group("imm_counter");
    g.throughput(Throughput::Elements(n));
    g.bench_function("4096 arrivals -> one round fires", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let fired = Arc::new(AtomicBool::new(false));
                let f2 = Arc::clone(&fired);
                if ep
                    .rx
                    .expect_imm_count(imm, n, move |_| f2.store(true, Ordering::Release))
                    .is_err()
                {
                    break;
                }
                if ep
                    .tx
                    .submit_paged_writes(
                        64,
                        Some(imm),
                        (&ep.src, &pg),
                        (&ep.dst, &pg),
                        OnDone::Ignore,
                    )
                    .is_err()
                {
                    break;
                }
                if wait_until(|| fired.load(Ordering::Acquire)).is_err() {
                    break;
                }
            }
            start.elapsed()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
