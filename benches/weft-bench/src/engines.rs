//! A sender and a receiver TransferEngine on two fresh hosts of a testbed.

use crate::backend::Testbed;
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
/// `WEFT_BENCH_BLOCK_AFTER_US=N|off` `EngineConfig::idle_block_after`.
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
    let idle_sleep = match std::env::var("WEFT_BENCH_IDLE_SLEEP_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        Some(0) => None,
        Some(us) => Some(Duration::from_micros(us)),
        None => Some(Duration::from_micros(20)),
    };
    let idle_block_after = match std::env::var("WEFT_BENCH_BLOCK_AFTER_US").ok() {
        Some(v) if v.trim() == "off" => None,
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map(Duration::from_micros)
            .ok()
            .or(EngineConfig::default().idle_block_after),
        None => EngineConfig::default().idle_block_after,
    };
    EngineConfig {
        idle_sleep,
        poll,
        idle_block_after,
        ..EngineConfig::default()
    }
}

/// Builds one engine over a fresh host of `tb` with all its NICs.
pub fn engine(tb: &Testbed) -> Result<TransferEngine, String> {
    let p = tb.host()?;
    TransferEngine::builder()
        .group(DomainGroupSpec::new(p, (0..tb.nics()).collect::<Vec<_>>()))
        .config(bench_config())
        .build()
        .map_err(|e| e.to_string())
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
    _src_buf: HostBuffer,
    _dst_buf: HostBuffer,
}

impl Drop for EnginePair {
    fn drop(&mut self) {
        // Before the buffers go (they drop after this body).
        self.tx.shutdown();
        self.rx.shutdown();
    }
}

fn e2s(e: EngineError) -> String {
    e.to_string()
}

impl EnginePair {
    /// Two engines on fresh hosts of `tb`.
    pub fn new(tb: &Testbed, src_len: usize, dst_len: usize) -> Result<Self, String> {
        let tx = engine(tb)?;
        let rx = engine(tb)?;
        let src_buf = HostBuffer::new(src_len).map_err(|e| e.to_string())?;
        let dst_buf = HostBuffer::new(dst_len).map_err(|e| e.to_string())?;
        let (src, _) = tx.reg_mr(src_buf.region()).map_err(e2s)?;
        let (_, dst) = rx.reg_mr(dst_buf.region()).map_err(e2s)?;
        Ok(EnginePair {
            tx,
            rx,
            src,
            dst,
            _src_buf: src_buf,
            _dst_buf: dst_buf,
        })
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
