//! CPU time of this process and of the engine's threads, from
//! `/proc/self/task/*/schedstat` (nanoseconds on a CPU, per thread).
//!
//! Threads are read while they live: take both samples of a measurement
//! while the threads it charges exist (an engine is shut down only after
//! its second sample). On a system without `/proc` every reading is `None`
//! and the rows that need it say so.

use std::time::{Duration, Instant};

/// On-CPU nanoseconds of this process's live threads; with `prefixes`,
/// only the threads whose name (`comm`, at most 15 bytes) starts with one
/// of them.
pub fn threads_cpu_ns(prefixes: Option<&[&str]>) -> Option<u64> {
    let dir = std::fs::read_dir("/proc/self/task").ok()?;
    let mut total = 0u64;
    let mut any = false;
    for e in dir.flatten() {
        let p = e.path();
        if let Some(pre) = prefixes {
            let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
            if !pre.iter().any(|x| comm.trim_end().starts_with(x)) {
                continue;
            }
        }
        let Ok(s) = std::fs::read_to_string(p.join("schedstat")) else {
            continue;
        };
        if let Some(v) = s
            .split_whitespace()
            .next()
            .and_then(|f| f.parse::<u64>().ok())
        {
            total = total.saturating_add(v);
            any = true;
        }
    }
    (any || prefixes.is_some()).then_some(total)
}

/// Name prefixes of the threads a `TransferEngine` starts (workers,
/// callback thread, UVM watcher; `comm` keeps 15 bytes of a name). Not
/// `weft-` alone: that would also match this binary's main thread.
pub const ENGINE_THREADS: &[&str] = &["weft-worker-", "weft-callbacks", "weft-uvm-watch"];

/// A CPU-time sample: the whole process and the engine's threads.
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    at: Instant,
    process: Option<u64>,
    engine: Option<u64>,
}

/// CPU used between two samples.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuUse {
    /// Wall time between the samples.
    pub wall: Duration,
    /// On-CPU time of all threads of the process (ns).
    pub process_ns: Option<u64>,
    /// On-CPU time of the engine's threads (ns).
    pub engine_ns: Option<u64>,
}

impl CpuSample {
    /// Samples now.
    pub fn now() -> Self {
        CpuSample {
            at: Instant::now(),
            process: threads_cpu_ns(None),
            engine: threads_cpu_ns(Some(ENGINE_THREADS)),
        }
    }

    /// CPU used since `self`.
    pub fn since(&self) -> CpuUse {
        let now = CpuSample::now();
        CpuUse {
            wall: now.at.saturating_duration_since(self.at),
            process_ns: now
                .process
                .zip(self.process)
                .map(|(b, a)| b.saturating_sub(a)),
            engine_ns: now
                .engine
                .zip(self.engine)
                .map(|(b, a)| b.saturating_sub(a)),
        }
    }
}

impl CpuUse {
    /// Engine CPU as a fraction of one core over the wall time.
    pub fn engine_cores(&self) -> Option<f64> {
        let w = self.wall.as_secs_f64();
        self.engine_ns
            .filter(|_| w > 0.0)
            .map(|ns| ns as f64 / 1e9 / w)
    }

    /// Process CPU as a fraction of one core over the wall time.
    pub fn process_cores(&self) -> Option<f64> {
        let w = self.wall.as_secs_f64();
        self.process_ns
            .filter(|_| w > 0.0)
            .map(|ns| ns as f64 / 1e9 / w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_thread_is_charged() {
        let s = CpuSample::now();
        let t0 = Instant::now();
        let mut x = 0u64;
        while t0.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let u = s.since();
        // Only where /proc exists; then the busy loop must show up.
        if let Some(ns) = u.process_ns {
            assert!(ns > 0, "no CPU charged for a busy loop");
        }
        assert!(u.wall >= Duration::from_millis(30));
    }
}
