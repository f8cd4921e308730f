//! A profiling driver for the engine's hot path (not a benchmark with
//! baselines: `weft-bench` is). Runs paged writes and scatters over the
//! loopback fabric's null mode so that a profiler (`perf record -g`) sees
//! engine cost only.
//!
//! ```sh
//! cargo build --release -p weft-engine --example hotpath
//! perf record -g target/release/examples/hotpath paged 200
//! perf record -g target/release/examples/hotpath scatter 20000
//! ```
//!
//! `paged N`: N paged writes of `HOTPATH_PAGES` 1 KiB pages (default
//! 10 000), 4 in flight, from and to engines of `HOTPATH_NICS` NICs
//! (default 1).

use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_engine::{
    DomainGroupSpec, DoneCounter, EngineConfig, GroupAddress, MrDesc, OnDone, Pages, ScatterDst,
    TransferEngine,
};
use weft_loopback::{Fabric, FabricConfig};
use weft_transport::{Access, HostBuffer, Incarnation, Provider};

fn engine(fabric: &Fabric, nics: usize) -> TransferEngine {
    let host = fabric.add_host(nics);
    TransferEngine::builder()
        .group(DomainGroupSpec::new(
            Arc::new(fabric.provider(host)),
            (0..nics).collect::<Vec<usize>>(),
        ))
        .config({
            let mut c = EngineConfig::default();
            c.idle_sleep = Some(Duration::from_micros(20));
            c
        })
        .build()
        .expect("engine")
}

fn main() {
    let mut args = std::env::args().skip(1);
    let what = args.next().unwrap_or_else(|| "paged".into());
    let n: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(100);
    let fabric = Fabric::new_realtime(FabricConfig::null());
    let env = |name: &str, default: u32, max: u32| {
        std::env::var(name)
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
            .unwrap_or(default)
            .clamp(1, max)
    };
    let nics = env("HOTPATH_NICS", 1, weft_engine::MAX_NICS as u32) as usize;
    let tx = engine(&fabric, nics);
    // The buffers live until the end of `main`, after shutdown.
    let src = HostBuffer::new(16 << 20).expect("src buffer");
    let (src_mr, _) = tx.reg_mr(src.region()).expect("reg src");
    let counter = Arc::new(DoneCounter::new());
    let start = Instant::now();
    let mut dst_bufs: Vec<HostBuffer> = Vec::new();
    let mut rxs = Vec::new();
    let mut domains = Vec::new();
    let ops = match what.as_str() {
        "paged" => {
            let rx = engine(&fabric, nics);
            dst_bufs.push(HostBuffer::new(16 << 20).expect("dst buffer"));
            let (_, desc) = rx.reg_mr(dst_bufs[0].region()).expect("reg dst");
            let np = env("HOTPATH_PAGES", 10_000, 16_000);
            let pages = Pages {
                indices: (0..np).map(|i| (i * 7) % np).collect(),
                stride: 1024,
                offset: 0,
            };
            for i in 0..n {
                while i - counter.total() >= 4 {
                    std::hint::spin_loop();
                }
                tx.submit_paged_writes(
                    1024,
                    None,
                    (&src_mr, &pages),
                    (&desc, &pages),
                    OnDone::counter(&counter),
                )
                .expect("submit");
            }
            rxs.push(rx);
            n * u64::from(np)
        }
        _ => {
            let mut addrs = Vec::new();
            let mut dsts = Vec::new();
            for _ in 0..64 {
                // Receivers are bare domains: the null fabric completes
                // WRs at the sender's poll, so only the sender's engine runs.
                let host = fabric.add_host(1);
                let mut d = fabric.provider(host).open(0).expect("domain");
                dst_bufs.push(HostBuffer::new(1 << 16).expect("dst buffer"));
                let last = dst_bufs.len() - 1;
                let mr = d
                    .register(&dst_bufs[last].region(), Access::RemoteWrite)
                    .expect("reg dst");
                let a = d.local_addr().clone();
                addrs.push(GroupAddress {
                    nics: vec![a.clone()],
                    incarnation: Incarnation::default(),
                });
                dsts.push(ScatterDst {
                    len: 1024,
                    src_offset: 0,
                    dst: MrDesc {
                        addr: mr.addr,
                        len: mr.len,
                        rkeys: vec![(a, mr.rkey)],
                        incarnation: Incarnation::default(),
                    },
                    dst_offset: 0,
                });
                domains.push(d);
            }
            let h = tx.add_peer_group(&addrs).expect("peer group");
            for i in 0..n {
                while i - counter.total() >= 16 {
                    std::hint::spin_loop();
                }
                tx.submit_scatter(&h, OnDone::counter(&counter), None, &src_mr, &dsts)
                    .expect("scatter");
            }
            n * 64
        }
    };
    counter.wait_for(n);
    let t = start.elapsed();
    assert_eq!(counter.failed(), 0, "{:?}", counter.first_error());
    println!(
        "{what}: {ops} WRs in {:.3} s = {:.2} M WRs/s",
        t.as_secs_f64(),
        ops as f64 / t.as_secs_f64() / 1e6
    );
    tx.shutdown();
    drop(domains);
    for rx in rxs {
        rx.shutdown();
    }
}
