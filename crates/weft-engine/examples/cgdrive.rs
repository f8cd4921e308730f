//! A driver for counting the engine's instructions per operation under
//! callgrind (deterministic: manual mode, one thread). `cgdrive single N`:
//! N 64 B WRITEs, one at a time, each with an `OnDone` flag; `cgdrive paged
//! N`: N paged writes of 10 000 pages of 1 KiB (`CGDRIVE_PAGES` sets the count;
//! `CGDRIVE_NICS` the NICs of each engine's one group, default 1). The receiver is a manual
//! engine that is never driven: the null fabric completes WRs at the
//! sender's poll. `cgdrive tsingle N` times the single WRITE with a worker
//! thread on the sender instead, and `cgdrive tcount N` N of them with 16 outstanding,
//! counted by one `DoneCounter` (as `weft-bench p2p` drives them).
//! `cgdrive rawpaged N` is the baseline of `paged`: the
//! same pages posted straight to the fabric's domains and polled, one
//! submit's pages at a time, page `j` on NIC `j % nics` (no engine);
//! `cgdrive rawsingle N` is the baseline of `single`: one 64 B WRITE posted
//! straight to the fabric and polled until it completes, N times.
//! `cgdrive scatter N`: N scatters of 1 KiB to each of `CGDRIVE_PEERS`
//! peers (default 64; each a 1-NIC host with a raw domain, as in
//! `weft-bench proxy`), one at a time; `cgdrive rawscatter N` posts the same
//! WRITEs straight to a domain, in `max_batch` batches, and polls until all
//! complete; `cgdrive pscatter N` makes the same scatters through
//! destinations checked once (`scatter_targets`, `submit_scatter_to`).
//! Per-op cost: run two values of N and divide the
//! difference, so that setup cancels:
//!
//! ```sh
//! cargo build --release -p weft-engine --example cgdrive
//! valgrind --tool=callgrind --dump-instr=no target/release/examples/cgdrive single 2000
//! valgrind --tool=callgrind --dump-instr=no target/release/examples/cgdrive single 12000
//! ```

use std::sync::Arc;
use weft_engine::{
    DomainGroupSpec, DoneCounter, GroupAddress, OnDone, Pages, ScatterSlice, TransferEngine,
};
use weft_loopback::{Fabric, FabricConfig, LoopbackDomain};
use weft_transport::{
    Access, Completion, Domain, HostBuffer, LocalMr, MrDesc, PeerId, RemoteSlice, ScatterDst, WrId,
    WriteWr,
};

fn engine(fabric: &Fabric, manual: bool, nics: usize) -> TransferEngine {
    let host = fabric.add_host(nics);
    let b = TransferEngine::builder().group(DomainGroupSpec::new(
        Arc::new(fabric.provider(host)),
        (0..nics).collect::<Vec<usize>>(),
    ));
    let b = if manual { b.manual() } else { b };
    b.build().expect("engine")
}

/// The number in environment variable `name`, `default` when unset or not
/// a number, clamped to `1..=max`.
fn env_num(name: &str, default: u32, max: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
        .clamp(1, max)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let what = args.next().unwrap_or_else(|| "single".into());
    let n: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let fabric = Fabric::new_realtime(FabricConfig::null());
    let manual = !what.starts_with('t');
    // `CGDRIVE_NICS` NICs per engine, one group (default 1).
    let nics = env_num("CGDRIVE_NICS", 1, weft_engine::MAX_NICS as u32) as usize;
    let tx = engine(&fabric, manual, nics);
    // The receiver is never driven, in every mode: the null fabric
    // completes WRs at the sender's poll.
    let rx = engine(&fabric, true, nics);
    // The buffers live until the end of `main`, after shutdown.
    let src = HostBuffer::new(16 << 20).expect("src buffer");
    let dst = HostBuffer::new(16 << 20).expect("dst buffer");
    let (src_mr, _) = tx.reg_mr(src.region()).expect("reg src");
    let (_, desc) = rx.reg_mr(dst.region()).expect("reg dst");
    let mut iters = 0u64;
    // One warm-up op so that lazy setup is outside the loop.
    let warm = 1;
    match what.as_str() {
        "single" => {
            for _ in 0..(n + warm) {
                let (od, flag) = OnDone::flag();
                tx.submit_single_write(64, None, (&src_mr, 0), (&desc, 0), od)
                    .expect("submit");
                while !flag.is_done() {
                    tx.progress();
                    iters += 1;
                }
                assert!(flag.result().expect("done").is_ok());
            }
        }
        "paged" => {
            let counter = Arc::new(DoneCounter::new());
            // `CGDRIVE_PAGES` pages per submit (default 10 000).
            let np = env_num("CGDRIVE_PAGES", 10_000, 16_000);
            let pages = Pages {
                indices: (0..np).map(|i| (i * 7) % np).collect(),
                stride: 1024,
                offset: 0,
            };
            for i in 0..(n + warm) {
                tx.submit_paged_writes(
                    1024,
                    None,
                    (&src_mr, &pages),
                    (&desc, &pages),
                    OnDone::counter(&counter),
                )
                .expect("submit");
                while counter.total() < i + 1 {
                    tx.progress();
                    iters += 1;
                }
            }
            assert_eq!(counter.failed(), 0);
        }
        "tsingle" => {
            // Threaded engines: submit one 64 B WRITE, wait on its flag.
            for _ in 0..warm {
                let (od, flag) = OnDone::flag();
                tx.submit_single_write(64, None, (&src_mr, 0), (&desc, 0), od)
                    .expect("submit");
                assert!(flag.wait().is_ok());
            }
            let t = std::time::Instant::now();
            for _ in 0..n {
                let (od, flag) = OnDone::flag();
                tx.submit_single_write(64, None, (&src_mr, 0), (&desc, 0), od)
                    .expect("submit");
                assert!(flag.wait().is_ok());
            }
            let e = t.elapsed();
            println!("tsingle: {:.0} ns/op", e.as_nanos() as f64 / n as f64);
        }
        "tcount" => {
            // Threaded engines: 64 B WRITEs, 16 outstanding, one counter.
            let counter = Arc::new(DoneCounter::new());
            let window = 16;
            let t = std::time::Instant::now();
            for i in 0..(n + warm) {
                while i - counter.total() >= window {
                    std::hint::spin_loop();
                }
                tx.submit_single_write(
                    64,
                    None,
                    (&src_mr, 0),
                    (&desc, 0),
                    OnDone::counter(&counter),
                )
                .expect("submit");
            }
            while counter.total() < n + warm {
                std::hint::spin_loop();
            }
            let e = t.elapsed();
            assert_eq!(counter.failed(), 0);
            println!(
                "tcount: {:.0} ns/op",
                e.as_nanos() as f64 / (n + warm) as f64
            );
        }
        "rawpaged" => {
            let np = u64::from(env_num("CGDRIVE_PAGES", 10_000, 16_000));
            iters = raw_paged(&fabric, nics, n + warm, (np, 1024), &src, &dst);
        }
        "rawsingle" => {
            iters = raw_paged(&fabric, nics, n + warm, (1, 64), &src, &dst);
        }
        "scatter" | "rawscatter" | "pscatter" => {
            iters = scatter(&fabric, &tx, &src, n + warm, &what);
        }
        _ => panic!("single|paged|tsingle|tcount|rawpaged|rawsingle|scatter|rawscatter|pscatter"),
    }
    println!("{what}: {n} ops (+{warm} warm-up), {iters} progress calls");
    tx.shutdown();
    rx.shutdown();
}

/// Posts `wrs` to `d` in batches of `batch` until it takes no more (a
/// full send queue); returns how many it took. A non-retryable error
/// panics.
fn post_batches(d: &mut impl Domain, wrs: &[WriteWr], batch: usize) -> usize {
    let mut off = 0;
    while off < wrs.len() {
        let end = (off + batch).min(wrs.len());
        let k = match d.post_writes(&wrs[off..end]) {
            Ok(k) => k,
            Err(e) if e.error.is_retryable() => e.posted,
            Err(e) => panic!("raw post failed: {}", e.error),
        };
        off += k;
        if off < end {
            break;
        }
    }
    off
}

/// Polls `d` once; returns its WRITE completions (all must be successful).
fn reap_writes(d: &mut impl Domain, comps: &mut Vec<Completion>) -> u64 {
    comps.clear();
    d.poll(comps).expect("poll");
    let mut done = 0;
    for c in comps.iter() {
        if let Completion::Write { result, .. } = c {
            assert!(result.is_ok(), "raw WRITE failed");
            done += 1;
        }
    }
    done
}

/// One NIC of [`raw_paged`]: the sender's and receiver's domains, the
/// source registration, the receiver's region, and the WRs of the current
/// submit with how many of them are posted.
struct Lane {
    a: LoopbackDomain,
    _b: LoopbackDomain,
    src: LocalMr,
    dst: LocalMr,
    peer: PeerId,
    batch: usize,
    wrs: Vec<WriteWr>,
    posted: usize,
}

/// `submits` rounds of `np` WRITEs of `page_len` bytes each (`pages`) on
/// fresh hosts' NICs, posted in batches per NIC and polled until all
/// complete; returns the number of poll rounds.
fn raw_paged(
    fabric: &Fabric,
    nics: usize,
    submits: u64,
    (np, page_len): (u64, u64),
    src: &HostBuffer,
    dst: &HostBuffer,
) -> u64 {
    let (ha, hb) = (fabric.add_host(nics), fabric.add_host(nics));
    let (pa, pb) = (fabric.provider(ha), fabric.provider(hb));
    let mut lanes = Vec::new();
    for nic in 0..nics {
        let mut a = pa.open_loopback(nic).expect("open a");
        let mut b = pb.open_loopback(nic).expect("open b");
        let s = a.register(&src.region(), Access::LocalOnly).expect("reg a");
        let d = b
            .register(&dst.region(), Access::RemoteWrite)
            .expect("reg b");
        let peer = a.add_peer(&b.local_addr().clone()).expect("peer");
        let batch = a.capabilities().max_batch.max(1);
        lanes.push(Lane {
            a,
            _b: b,
            src: s,
            dst: d,
            peer,
            batch,
            wrs: Vec::new(),
            posted: 0,
        });
    }
    let mut comps = Vec::new();
    let mut polls = 0u64;
    for k in 0..submits {
        for j in 0..np {
            let page = (j * 7) % np;
            let lane = &mut lanes[(j as usize) % nics];
            lane.wrs.push(WriteWr {
                wr: WrId(k * np + j),
                peer: lane.peer,
                src: lane
                    .src
                    .slice(page * page_len, page_len)
                    .expect("src slice"),
                dst: RemoteSlice {
                    base: lane.dst.addr,
                    offset: page * page_len,
                    rkey: lane.dst.rkey,
                },
                imm: None,
            });
        }
        let mut done = 0u64;
        while done < np {
            for lane in lanes.iter_mut() {
                lane.posted += post_batches(&mut lane.a, &lane.wrs[lane.posted..], lane.batch);
                if lane.posted == lane.wrs.len() {
                    lane.wrs.clear();
                    lane.posted = 0;
                }
            }
            for lane in lanes.iter_mut() {
                done += reap_writes(&mut lane.a, &mut comps);
            }
            polls += 1;
        }
    }
    polls
}

/// Bytes of each scatter destination.
const SCATTER_LEN: u64 = 1024;

/// `rounds` scatters of [`SCATTER_LEN`] bytes to each of `CGDRIVE_PEERS`
/// raw 1-NIC peer hosts: through `tx` (`how` `scatter`; `pscatter`: to
/// destinations checked once) or posted straight to a fresh domain
/// (`rawscatter`). Returns the number of poll rounds.
fn scatter(fabric: &Fabric, tx: &TransferEngine, src: &HostBuffer, rounds: u64, how: &str) -> u64 {
    let peers = env_num("CGDRIVE_PEERS", 64, 1024) as usize;
    let mut doms = Vec::new();
    let mut descs = Vec::new();
    let mut addrs = Vec::new();
    let bufs: Vec<HostBuffer> = (0..peers)
        .map(|_| HostBuffer::new(SCATTER_LEN as usize).expect("peer buffer"))
        .collect();
    for b in &bufs {
        let h = fabric.add_host(1);
        let mut d = fabric.provider(h).open_loopback(0).expect("open peer");
        let mr = d
            .register(&b.region(), Access::RemoteWrite)
            .expect("reg peer");
        let a = d.local_addr().clone();
        descs.push(MrDesc {
            addr: mr.addr,
            len: mr.len,
            rkeys: vec![(a.clone(), mr.rkey)],
            incarnation: Default::default(),
        });
        addrs.push(GroupAddress {
            nics: vec![a],
            incarnation: Default::default(),
        });
        doms.push(d);
    }
    let mut polls = 0u64;
    if how == "rawscatter" {
        let h = fabric.add_host(1);
        let mut d = fabric.provider(h).open_loopback(0).expect("open raw");
        let s = d
            .register(&src.region(), Access::LocalOnly)
            .expect("reg raw src");
        let ids: Vec<_> = addrs
            .iter()
            .map(|a| d.add_peer(&a.nics[0]).expect("raw peer"))
            .collect();
        let batch = d.capabilities().max_batch.max(1);
        let mut comps = Vec::new();
        let mut wrs = Vec::with_capacity(peers);
        for r in 0..rounds {
            wrs.clear();
            for (j, (peer, desc)) in ids.iter().zip(&descs).enumerate() {
                wrs.push(WriteWr {
                    wr: WrId(r * peers as u64 + j as u64),
                    peer: *peer,
                    src: s
                        .slice(j as u64 * SCATTER_LEN, SCATTER_LEN)
                        .expect("src slice"),
                    dst: RemoteSlice {
                        base: desc.addr,
                        offset: 0,
                        rkey: desc.rkeys[0].1,
                    },
                    imm: None,
                });
            }
            let (mut off, mut done) = (0usize, 0u64);
            while done < peers as u64 {
                off += post_batches(&mut d, &wrs[off..], batch);
                done += reap_writes(&mut d, &mut comps);
                polls += 1;
            }
        }
    } else {
        let (src_mr, _) = tx.reg_mr(src.region()).expect("reg scatter src");
        let group = tx.add_peer_group(&addrs).expect("peer group");
        let dsts: Vec<ScatterDst> = descs
            .iter()
            .enumerate()
            .map(|(j, desc)| ScatterDst {
                len: SCATTER_LEN,
                src_offset: j as u64 * SCATTER_LEN,
                dst: desc.clone(),
                dst_offset: 0,
            })
            .collect();
        let targets = tx.scatter_targets(&group, &descs).expect("targets");
        let slices: Vec<ScatterSlice> = dsts.iter().map(ScatterSlice::from).collect();
        let counter = Arc::new(DoneCounter::new());
        for r in 0..rounds {
            let od = OnDone::counter(&counter);
            if how == "pscatter" {
                tx.submit_scatter_to(&targets, od, None, &src_mr, &slices)
            } else {
                tx.submit_scatter(&group, od, None, &src_mr, &dsts)
            }
            .expect("scatter");
            while counter.total() < r + 1 {
                tx.progress();
                polls += 1;
            }
        }
        assert_eq!(counter.failed(), 0, "{:?}", counter.first_error());
    }
    drop(doms);
    polls
}
