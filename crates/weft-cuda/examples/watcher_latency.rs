//! Watcher latency on a real GPU: how long from "the kernel may bump the
//! word" until the observer has seen the new value.
//!
//! Method (host clock only, no cross-clock assumptions): for event `i` the
//! host launches `weft_gated_inc` (directly, or as a replay of a captured
//! CUDA graph). The kernel announces `i` in a host-mapped `armed` word and
//! spins on a host-mapped `gate`; once the host sees `armed == i` (so launch
//! latency is excluded) it takes `t0` and raises `gate = i` (release
//! store). The kernel sees the gate, bumps the host-mapped watcher word to
//! `i` (`st.release.sys`, or `st.relaxed.sys` in the `relaxed` rows, which
//! also poll the gate with relaxed instead of acquire loads), and the observer takes `t1` when it sees `i`.
//! `t1 - t0` is a full CPU→GPU→CPU round trip:
//! - `floor`: the main thread itself spins on the word (no watcher) — the
//!   hardware round trip;
//! - `enginespin` / `enginedefault`: the weft engine's UVM watcher thread
//!   polls the word (through `TransferEngine::watch_word`) and its
//!   `cb(old, new)` stamps `t1` (what a KvCache prefiller's callback sees);
//!   `enginespin` sets the engine's idle policy to spin forever,
//!   `enginedefault` keeps the default (spin, yield, then 200 µs sleeps).
//!
//! The watcher's own cost is `enginespin - floor` (exact, same clock). The
//! one-way GPU-write→callback latency is estimated as `floor/2 + (enginespin -
//! floor)`: the only assumption is that the bare round trip splits evenly
//! between its two PCIe legs.
//!
//! Usage: `watcher_latency [EVENTS] [--json PATH] [--pin MAIN,WATCHER]` (default 100000 events per
//! case, after 2000 warm-up events).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use weft_cuda::{Gpu, Graph, HostFlag, Kernels, ProbeOrdering, Stream, WatchWord};
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};

const TIMEOUT_NS: u64 = 5_000_000_000;
const WARMUP: usize = 2000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Launch {
    Direct,
    Graph,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Observer {
    /// The main thread spins on the word itself.
    Floor,
    /// The engine's watcher thread, configured to spin (never yield/sleep).
    EngineSpin,
    /// The engine's watcher with the default idle policy (spin 64, yield
    /// 256, then sleep 200 µs).
    EngineDefault,
}

struct Case {
    stream: Stream,
    gate: HostFlag,
    armed: HostFlag,
    word: WatchWord,
    graph: Option<Graph>,
}

fn case(
    gpu: &Gpu,
    k: &Kernels,
    launch: Launch,
    ord: ProbeOrdering,
) -> Result<Case, Box<dyn std::error::Error>> {
    let stream = gpu.stream()?;
    let (gate, armed, word) = (gpu.host_flag()?, gpu.host_flag()?, gpu.watch_word()?);
    let graph = if launch == Launch::Graph {
        stream.begin_capture()?;
        k.gated_inc(&stream, &gate, &armed, &word, 1, TIMEOUT_NS, ord)?;
        Some(stream.end_capture()?)
    } else {
        None
    };
    Ok(Case {
        stream,
        gate,
        armed,
        word,
        graph,
    })
}

fn run(
    gpu: &Gpu,
    k: &Kernels,
    launch: Launch,
    observer: Observer,
    ord: ProbeOrdering,
    events: usize,
) -> Result<Vec<u64>, Box<dyn std::error::Error>> {
    let c = case(gpu, k, launch, ord)?;
    let base = Instant::now();
    // Slot the observer writes: (value seen, ns since base when seen).
    let seen_val = Arc::new(AtomicU64::new(0));
    let seen_ns = Arc::new(AtomicU64::new(0));
    let pin_watcher = PIN.get().map(|p| p.1);
    let _engine_watch = match observer {
        Observer::Floor => None,
        Observer::EngineSpin | Observer::EngineDefault => {
            let mut cfg = EngineConfig::default();
            if observer == Observer::EngineSpin {
                cfg.idle_spins = u32::MAX;
                cfg.idle_yields = 0;
                cfg.idle_sleep = None;
            }
            let fabric = Fabric::new_realtime(FabricConfig::null());
            let host = fabric.add_host(1);
            let engine = TransferEngine::builder()
                .group(DomainGroupSpec::new(
                    Arc::new(fabric.provider(host)),
                    vec![0],
                ))
                .config(cfg)
                .build()?;
            let (v, t) = (seen_val.clone(), seen_ns.clone());
            let mut pinned = false;
            // SAFETY: the watch word outlives the watcher: `_engine_watch` is
            // declared after `c` and so dropped before it.
            let w = unsafe {
                engine.watch_word(c.word.host_ptr(), move |_old, new| {
                    let now = base.elapsed().as_nanos() as u64;
                    if !pinned {
                        // Runs on the engine's watcher thread: pin it once.
                        if let Some(cpu) = pin_watcher {
                            pin(cpu);
                        }
                        pinned = true;
                    }
                    t.store(now, Ordering::Release);
                    v.store(new, Ordering::Release);
                })
            };
            Some((w, engine))
        }
    };
    let total = WARMUP + events;
    let mut out = Vec::with_capacity(events);
    for i in 1..=total as u64 {
        match &c.graph {
            Some(g) => g.launch(&c.stream)?,
            None => k.gated_inc(&c.stream, &c.gate, &c.armed, &c.word, 1, TIMEOUT_NS, ord)?,
        }
        while c.armed.value() < i {
            std::hint::spin_loop();
        }
        let t0 = base.elapsed().as_nanos() as u64;
        c.gate.raise(i);
        let t1 = match observer {
            Observer::Floor => {
                while c.word.value() < i {
                    std::hint::spin_loop();
                }
                base.elapsed().as_nanos() as u64
            }
            Observer::EngineSpin | Observer::EngineDefault => {
                while seen_val.load(Ordering::Acquire) < i {
                    std::hint::spin_loop();
                }
                seen_ns.load(Ordering::Acquire)
            }
        };
        if i as usize > WARMUP {
            out.push(t1.saturating_sub(t0));
        }
    }
    c.stream.synchronize()?;
    if let Some((w, engine)) = _engine_watch {
        drop(w);
        engine.shutdown();
    }
    Ok(out)
}

/// `--pin MAIN,WATCHER`: CPUs for the main thread and the watcher thread.
static PIN: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();

fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays in its
    // bounds for cpu < CPU_SETSIZE (checked); pid 0 means this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                eprintln!("could not pin to CPU {cpu}");
            }
        }
    }
}

struct Stats {
    n: usize,
    min: u64,
    p50: u64,
    p90: u64,
    p99: u64,
    p999: u64,
    max: u64,
    mean: f64,
}

fn stats(mut v: Vec<u64>) -> Stats {
    v.sort_unstable();
    let q = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize];
    Stats {
        n: v.len(),
        min: v[0],
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
        p999: q(0.999),
        max: v[v.len() - 1],
        mean: v.iter().sum::<u64>() as f64 / v.len() as f64,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut events = 100_000usize;
    let mut json = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => json = args.next(),
            "--pin" => {
                let v = args.next().unwrap_or_default();
                let (m, w) = v.split_once(',').ok_or("--pin MAIN,WATCHER")?;
                let _ = PIN.set((m.parse()?, w.parse()?));
            }
            n => events = n.parse()?,
        }
    }
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("watcher_latency: no usable GPU, nothing measured: {e}");
            return Ok(());
        }
    };
    let k = gpu.kernels()?;
    if let Some((m, w)) = PIN.get() {
        pin(*m);
        println!("pinned: main thread on CPU {m}, watcher thread on CPU {w}");
    }
    println!(
        "device: {} (cc {:?}), driver {:?}, {events} events per case after {WARMUP} warm-up",
        gpu.name(),
        gpu.compute_capability(),
        weft_cuda::probe()?
    );
    println!(
        "{:<14} {:<7} {:<8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}   (ns, round trip t1-t0)",
        "observer", "launch", "ordering", "n", "min", "p50", "p90", "p99", "p99.9", "max", "mean"
    );
    let observers = [
        Observer::Floor,
        Observer::EngineSpin,
        Observer::EngineDefault,
    ];
    let mut rows = Vec::new();
    for (oname, ord) in [
        ("strong", ProbeOrdering::STRONG),
        ("relaxed", ProbeOrdering::RELAXED),
    ] {
        for obs in observers {
            for launch in [Launch::Direct, Launch::Graph] {
                let s = stats(run(&gpu, &k, launch, obs, ord, events)?);
                let (o, l) = (
                    format!("{obs:?}").to_lowercase(),
                    format!("{launch:?}").to_lowercase(),
                );
                println!(
                    "{o:<14} {l:<7} {oname:<8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8.0}",
                    s.n, s.min, s.p50, s.p90, s.p99, s.p999, s.max, s.mean
                );
                rows.push(format!(
                    "{{\"observer\":\"{o}\",\"launch\":\"{l}\",\"ordering\":\"{oname}\",\"n\":{},\"min\":{},\"p50\":{},\"p90\":{},\"p99\":{},\"p999\":{},\"max\":{},\"mean\":{:.1}}}",
                    s.n, s.min, s.p50, s.p90, s.p99, s.p999, s.max, s.mean
                ));
            }
        }
    }
    if let Some(p) = json {
        std::fs::write(p, format!("[{}]\n", rows.join(",\n")))?;
    }
    Ok(())
}
