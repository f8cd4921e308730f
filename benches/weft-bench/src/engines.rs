//! A sender and a receiver TransferEngine on two fresh hosts of a testbed.

use crate::backend::Testbed;
use crate::pin::{PinGuard, Placement};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::HostBuffer;
use weft::{
    DomainGroupSpec, DoneCounter, EngineConfig, EngineError, MrDesc, MrHandle, OnDone, Pages,
    PollPolicy, TransferEngine,
};

/// The engine settings the benchmarks use: defaults, except a worker that
/// never sleeps longer than 20 µs when idle. `WEFT_BENCH_IDLE_SLEEP_US=N`
/// sets that sleep (0: never sleep, spin/yield only); `WEFT_BENCH_POLL`
/// the [`PollPolicy`] (`adaptive`, `busy`, `spin:<µs>` for spin-then-park);
/// `WEFT_BENCH_BLOCK_AFTER_US=N|off` `EngineConfig::idle_block_after`;
/// `WEFT_BENCH_MAX_INFLIGHT=N` `EngineConfig::max_inflight_per_nic`;
/// `WEFT_BENCH_PROGRESS_SPINS=N` `EngineConfig::progress_spins`;
/// `WEFT_BENCH_MAX_PENDING=N` `EngineConfig::max_pending_wrs`;
/// `WEFT_BENCH_CALLER_POSTS=0|1` `EngineConfig::caller_posts`.
pub fn bench_config() -> EngineConfig {
    let poll = match std::env::var("WEFT_BENCH_POLL")
        .ok()
        .as_deref()
        .map(str::trim)
    {
        Some("busy") => PollPolicy::Busy,
        Some(s) if s.starts_with("spin:") => s[5..]
            .parse::<u64>()
            .map(|us| PollPolicy::SpinThenPark {
                spin: Duration::from_micros(us),
            })
            .unwrap_or_default(),
        _ => PollPolicy::Adaptive,
    };
    let idle_sleep = match env_num::<u64>("WEFT_BENCH_IDLE_SLEEP_US") {
        Some(0) => None,
        Some(us) => Some(Duration::from_micros(us)),
        None => Some(Duration::from_micros(20)),
    };
    let defaults = EngineConfig::default();
    let block_after_off =
        std::env::var("WEFT_BENCH_BLOCK_AFTER_US").is_ok_and(|v| v.trim() == "off");
    let idle_block_after = if block_after_off {
        None
    } else {
        env_num::<u64>("WEFT_BENCH_BLOCK_AFTER_US")
            .map(Duration::from_micros)
            .or(defaults.idle_block_after)
    };
    let max_inflight_per_nic =
        env_num::<usize>("WEFT_BENCH_MAX_INFLIGHT").unwrap_or(defaults.max_inflight_per_nic);
    let progress_spins =
        env_num::<u32>("WEFT_BENCH_PROGRESS_SPINS").unwrap_or(defaults.progress_spins);
    let max_pending_wrs =
        env_num::<usize>("WEFT_BENCH_MAX_PENDING").unwrap_or(defaults.max_pending_wrs);
    let mut c = defaults;
    c.idle_sleep = idle_sleep;
    c.poll = poll;
    c.progress_spins = progress_spins;
    c.max_pending_wrs = max_pending_wrs;
    c.idle_block_after = idle_block_after;
    c.max_inflight_per_nic = max_inflight_per_nic;
    if let Some(v) = env_num::<u8>("WEFT_BENCH_CALLER_POSTS") {
        c.caller_posts = v != 0;
    }
    c
}

/// The receiving engine's configuration: [`bench_config`], with its idle
/// sleep from `WEFT_BENCH_RX_IDLE_SLEEP_US` when set (an experiment knob:
/// how much a receiver that polls the loopback fabric's one lock while
/// idle costs the sender; rows that need the receiver to poll, immediates
/// and software providers, then wait that long).
fn receiver_config() -> EngineConfig {
    let mut cfg = bench_config();
    if let Some(us) = env_num::<u64>("WEFT_BENCH_RX_IDLE_SLEEP_US") {
        cfg.idle_sleep = (us > 0).then(|| Duration::from_micros(us));
    }
    cfg
}

/// The number in environment variable `name`, if set and a number.
fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// Builds one engine over a fresh host of `tb` with all its NICs.
pub fn engine(tb: &Testbed) -> Result<TransferEngine, String> {
    engine_on(tb, None, None)
}

/// [`engine`], its worker pinned to `worker` and its callback and watcher
/// threads to `aux` (they inherit the affinity of the thread that builds
/// the engine, which is pinned to `aux` meanwhile); `None`: not pinned by
/// the bench.
pub fn engine_on(
    tb: &Testbed,
    worker: Option<usize>,
    aux: Option<usize>,
) -> Result<TransferEngine, String> {
    engine_with(tb, worker, aux, bench_config())
}

/// [`engine_on`] with `cfg` instead of [`bench_config`].
fn engine_with(
    tb: &Testbed,
    worker: Option<usize>,
    aux: Option<usize>,
    cfg: EngineConfig,
) -> Result<TransferEngine, String> {
    let p = tb.host()?;
    let mut spec = DomainGroupSpec::new(p, (0..tb.nics()).collect::<Vec<_>>());
    if let Some(cpu) = worker {
        spec = spec.cpu(cpu);
    }
    let _pin = PinGuard::new(aux);
    TransferEngine::builder()
        .group(spec)
        .config(cfg)
        .build()
        .map_err(|e| e.to_string())
}

/// The source and destination buffers of an [`EnginePair`], kept across
/// the pairs built for successive rounds.
pub struct PairBuffers {
    src: HostBuffer,
    dst: HostBuffer,
}

impl PairBuffers {
    /// `src_len` and `dst_len` bytes.
    pub fn new(src_len: usize, dst_len: usize) -> Result<Self, String> {
        Ok(PairBuffers {
            src: HostBuffer::new(src_len).map_err(|e| e.to_string())?,
            dst: HostBuffer::new(dst_len).map_err(|e| e.to_string())?,
        })
    }
}

/// Sender and receiver engines with a registered source (sender) and
/// destination (receiver) buffer.
pub struct EnginePair {
    /// The sender.
    pub tx: TransferEngine,
    /// The receiver.
    pub rx: TransferEngine,
    /// Source registration on `tx`.
    pub src: MrHandle,
    /// Destination descriptor (registered on `rx`).
    pub dst: MrDesc,
    _bufs: Arc<PairBuffers>,
    live: Option<Arc<AtomicUsize>>,
}

impl Drop for EnginePair {
    fn drop(&mut self) {
        // Before the buffers go (they drop after this body).
        self.tx.shutdown();
        self.rx.shutdown();
        if let Some(l) = &self.live {
            l.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn e2s(e: EngineError) -> String {
    e.to_string()
}

impl EnginePair {
    /// Two engines on fresh hosts of `tb`.
    pub fn new(tb: &Testbed, src_len: usize, dst_len: usize) -> Result<Self, String> {
        Self::on(tb, &Arc::new(PairBuffers::new(src_len, dst_len)?), None)
    }

    /// Two engines on fresh hosts of `tb` over `bufs`, placed as `place`
    /// says (sender worker on `initiator`, receiver worker on `target`,
    /// each engine's other threads on its aux CPU).
    pub fn on(
        tb: &Testbed,
        bufs: &Arc<PairBuffers>,
        place: Option<&Placement>,
    ) -> Result<Self, String> {
        let tx = engine_on(tb, place.map(|p| p.initiator), place.map(|p| p.tx_aux))?;
        let rx = match engine_with(
            tb,
            place.map(|p| p.target),
            place.map(|p| p.rx_aux),
            receiver_config(),
        ) {
            Ok(rx) => rx,
            Err(e) => {
                tx.shutdown();
                return Err(e);
            }
        };
        let regs = tx
            .reg_mr(bufs.src.region())
            .and_then(|(src, _)| rx.reg_mr(bufs.dst.region()).map(|(_, dst)| (src, dst)));
        match regs {
            Ok((src, dst)) => Ok(EnginePair {
                tx,
                rx,
                src,
                dst,
                _bufs: Arc::clone(bufs),
                live: None,
            }),
            Err(e) => {
                tx.shutdown();
                rx.shutdown();
                Err(e2s(e))
            }
        }
    }

    /// Counts this pair in `live` until it drops.
    pub fn counted(mut self, live: &Arc<AtomicUsize>) -> Self {
        live.fetch_add(1, Ordering::SeqCst);
        self.live = Some(Arc::clone(live));
        self
    }

    /// `count` single writes of `len` bytes, at most `window` outstanding.
    pub fn single_writes(
        &self,
        len: u64,
        count: u64,
        window: u64,
        imm: Option<u32>,
    ) -> Result<Duration, String> {
        let counter = Arc::new(DoneCounter::new());
        let start = Instant::now();
        for i in 0..count {
            wait_until(|| i - counter.total() < window.max(1))?;
            self.tx
                .submit_single_write(
                    len,
                    imm,
                    (&self.src, 0),
                    (&self.dst, 0),
                    OnDone::counter(&counter),
                )
                .map_err(e2s)?;
        }
        wait_until(|| counter.total() >= count)?;
        let t = start.elapsed();
        check(&counter)?;
        Ok(t)
    }

    /// `count` paged-write submits of `src`→`dst` pages, `window` outstanding.
    pub fn paged_writes(
        &self,
        page_len: u64,
        src: &Pages,
        dst: &Pages,
        count: u64,
        window: u64,
    ) -> Result<Duration, String> {
        let counter = Arc::new(DoneCounter::new());
        let start = Instant::now();
        for i in 0..count {
            wait_until(|| i - counter.total() < window.max(1))?;
            self.tx
                .submit_paged_writes(
                    page_len,
                    None,
                    (&self.src, src),
                    (&self.dst, dst),
                    OnDone::counter(&counter),
                )
                .map_err(e2s)?;
        }
        wait_until(|| counter.total() >= count)?;
        let t = start.elapsed();
        check(&counter)?;
        Ok(t)
    }
}

fn check(c: &DoneCounter) -> Result<(), String> {
    if c.failed() > 0 {
        return Err(format!(
            "{} transfers failed, first: {}",
            c.failed(),
            c.first_error().map(|e| e.to_string()).unwrap_or_default()
        ));
    }
    Ok(())
}

/// How long a benchmark waits for progress before reporting a stall.
pub const STALL: Duration = Duration::from_secs(10);

/// Spins (yielding) until `f()`, failing after [`STALL`].
///
/// Not `weft_testkit::wait_until`: this runs inside measured loops, so it
/// spins instead of sleeping, and a stall is a reported benchmark error, not
/// a test panic (weft-testkit is a dev-dependency only).
pub fn wait_until(mut f: impl FnMut() -> bool) -> Result<(), String> {
    let start = Instant::now();
    let mut spins = 0u32;
    while !f() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            std::thread::yield_now();
            if start.elapsed() > STALL {
                return Err("timed out after 10 s waiting for completions".into());
            }
        } else {
            std::hint::spin_loop();
        }
    }
    Ok(())
}

/// Shuts its engine down when dropped (before buffers declared earlier go).
#[derive(Debug)]
pub struct Shutdown(pub TransferEngine);

impl std::ops::Deref for Shutdown {
    type Target = TransferEngine;
    fn deref(&self) -> &TransferEngine {
        &self.0
    }
}

impl Drop for Shutdown {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}
