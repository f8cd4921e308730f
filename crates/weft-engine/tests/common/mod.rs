//! Shared helpers for the engine's loopback tests.
#![allow(dead_code)]

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_loopback::{Fabric, HostId};
use weft_transport::{Device, MemRegion};

/// Prints the seed if the test panics while this guard is alive.
pub struct SeedGuard(pub u64, pub &'static str);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "*** {} failed with seed {} (rerun: WEFT_SEED={})",
                self.1, self.0, self.0
            );
        }
    }
}

/// Seeds to run: `WEFT_SEED` if set, else the given defaults.
pub fn seeds(default: &[u64]) -> Vec<u64> {
    match std::env::var("WEFT_SEED").ok().and_then(|s| s.parse().ok()) {
        Some(s) => vec![s],
        None => default.to_vec(),
    }
}

/// A heap buffer only accessed through raw pointers (NICs write into it).
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain heap allocation accessed through raw pointers only.
unsafe impl Send for HostBuf {}
// SAFETY: see Send.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    pub fn new(len: usize) -> Self {
        let b: Box<[u8]> = vec![0u8; len.max(1)].into_boxed_slice();
        let ptr = NonNull::new(Box::into_raw(b).cast::<u8>()).expect("non-null");
        Self {
            ptr,
            len: len.max(1),
        }
    }

    pub fn filled(len: usize, f: impl Fn(usize) -> u8) -> Self {
        let b = Self::new(len);
        let v: Vec<u8> = (0..len).map(f).collect();
        b.write(0, &v);
        b
    }

    pub fn region(&self) -> MemRegion {
        // SAFETY: the buffer lives until `self` is dropped, which every test
        // does only after shutting its engines down.
        unsafe { MemRegion::new(self.ptr, self.len, Device::Host) }
    }

    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        let mut v = vec![0u8; len];
        // SAFETY: in bounds; concurrent NIC writes may race, which the tests
        // only do after the ImmCounter/on_done said the bytes are final.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len) };
        v
    }

    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: in bounds; see `read`.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.as_ptr().add(off), data.len()) };
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: allocated in `new` from a boxed slice of exactly this length.
        drop(unsafe { Box::from_raw(slice) });
    }
}

/// Deterministic content for byte `i` of stream `tag`.
pub fn pat(tag: u64, i: usize) -> u8 {
    let x =
        (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ tag.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x >> 29) as u8
}

/// A test-friendly config: small queues to exercise backpressure.
pub fn test_config() -> EngineConfig {
    EngineConfig {
        queue_capacity: 256,
        send_slots: 16,
        send_slot_len: 4096,
        imm_capacity: 4096,
        idle_sleep: Some(Duration::from_micros(500)),
        idle_yields: 64,
        ..EngineConfig::default()
    }
}

/// An engine on `host` with one group over all its `nics` NICs.
pub fn engine(
    fabric: &Fabric,
    host: HostId,
    nics: usize,
    cfg: EngineConfig,
    manual: bool,
) -> TransferEngine {
    let p = Arc::new(fabric.provider(host));
    let mut b = TransferEngine::builder()
        .group(DomainGroupSpec::new(p, (0..nics).collect::<Vec<_>>()))
        .config(cfg);
    if manual {
        b = b.manual();
    }
    b.build().expect("engine builds")
}

/// Step-mode driver: progresses every engine, stepping the fabric when
/// nothing moved, until `done()`. Panics if everything is idle first.
pub fn drive(fabric: &Fabric, engines: &[TransferEngine], mut done: impl FnMut() -> bool) {
    let mut idle_rounds = 0;
    loop {
        if done() {
            return;
        }
        let mut moved = false;
        for e in engines {
            moved |= e.progress();
        }
        if !moved {
            if !fabric.step() {
                idle_rounds += 1;
                assert!(idle_rounds < 3, "simulation idle before the condition held");
            } else {
                idle_rounds = 0;
            }
        } else {
            idle_rounds = 0;
        }
    }
}

/// Threaded-mode wait: polls `cond` (yielding) and fails after a generous
/// hang-detection limit (not a timing assertion: it only catches hangs).
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "hang: {what} never happened"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}
