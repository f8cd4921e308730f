//! The Rust side of `python/bench/overhead.py`: the same operations as the
//! Python benchmark, on the same kind of engine (`loopback-null`, 1 NIC),
//! timed the same way, so the two distributions differ by the binding only.
//! Prints one JSON object per measurement on stdout.
//!
//! `overhead_rs [ITERS]` (default 20000).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{DomainGroupSpec, HostBuffer, OnDone, ProviderConfig, TransferEngine};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn report(op: &str, mut us: Vec<f64>) {
    let (p50, p99, p999) = (pct(&mut us, 0.5), pct(&mut us, 0.99), pct(&mut us, 0.999));
    println!(
        "{{\"op\": \"{op}\", \"lang\": \"rust\", \"n\": {}, \"p50_us\": {p50:.3}, \"p99_us\": {p99:.3}, \"p999_us\": {p999:.3}}}",
        us.len()
    );
}

fn engine(backend: &weft::Backend) -> Res<TransferEngine> {
    Ok(TransferEngine::builder()
        .group(DomainGroupSpec::new(backend.host()?, vec![0]))
        .build()?)
}

fn main() -> Res<()> {
    let iters: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(20_000);
    let backend = weft::provider_with(&"loopback-null".parse()?, &ProviderConfig::default())?;
    let (a, b) = (engine(&backend)?, engine(&backend)?);
    let src = HostBuffer::new(4096)?;
    let dst = HostBuffer::new(4096)?;
    let (h, _) = a.reg_mr(src.region())?;
    let (_, desc) = b.reg_mr(dst.region())?;

    // 1. The submit call itself (batches of 1000, drained in between).
    let done = Arc::new(AtomicU64::new(0));
    let mut submit = Vec::with_capacity(iters);
    let mut issued = 0u64;
    while submit.len() < iters {
        for _ in 0..1000.min(iters - submit.len()) {
            let d = Arc::clone(&done);
            let t0 = Instant::now();
            a.submit_single_write(
                64,
                None,
                (&h, 0),
                (&desc, 0),
                OnDone::callback(move |_| {
                    d.fetch_add(1, Ordering::Release);
                }),
            )?;
            submit.push(t0.elapsed().as_secs_f64() * 1e6);
            issued += 1;
        }
        while done.load(Ordering::Acquire) < issued {
            std::hint::spin_loop();
        }
    }
    report("submit_single_write", submit);

    // 2. Submit to callback entry, one transfer in flight.
    let (tx, rx) = mpsc::channel::<Instant>();
    let mut lat = Vec::with_capacity(iters);
    for _ in 0..iters {
        let tx = tx.clone();
        let t0 = Instant::now();
        a.submit_single_write(
            64,
            None,
            (&h, 0),
            (&desc, 0),
            OnDone::callback(move |_| {
                let _ = tx.send(Instant::now());
            }),
        )?;
        let t1 = rx.recv_timeout(Duration::from_secs(10))?;
        lat.push((t1 - t0).as_secs_f64() * 1e6);
    }
    report("submit_to_callback", lat);

    // 3. UVM watcher: host store to callback entry.
    let (wtx, wrx) = mpsc::channel::<Instant>();
    let w = a.alloc_uvm_watcher(move |_, _| {
        let _ = wtx.send(Instant::now());
    });
    let mut wl = Vec::with_capacity(iters);
    for i in 1..=iters as u64 {
        let t0 = Instant::now();
        w.word().store(i, Ordering::Release);
        let t1 = wrx.recv_timeout(Duration::from_secs(10))?;
        wl.push((t1 - t0).as_secs_f64() * 1e6);
    }
    report("watcher_store_to_callback", wl);
    drop(w);
    a.shutdown();
    b.shutdown();
    Ok(())
}
