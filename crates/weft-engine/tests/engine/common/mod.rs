//! Shared helpers for the engine's loopback tests.
#![allow(dead_code, unused_imports)]

use std::sync::Arc;
use std::time::Duration;
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_loopback::{Fabric, HostId};

pub use weft_testkit::mem::{self, HostBufferExt};
pub use weft_testkit::{pattern_byte, seeds_or, wait_until, SeedGuard};
pub use weft_transport::HostBuffer;

/// Hang-detection bound of the threaded waits (not a timing assertion: it
/// only catches hangs).
pub const HANG: Duration = Duration::from_secs(120);

/// A test-friendly config: small queues to exercise backpressure.
pub fn test_config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.queue_capacity = 256;
    c.send_slots = 16;
    c.send_slot_len = 4096;
    c.imm_capacity = 4096;
    c.idle_sleep = Some(Duration::from_micros(500));
    c.idle_yields = 64;
    c
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
pub fn drive(fabric: &Fabric, engines: &[TransferEngine], done: impl FnMut() -> bool) {
    let step = || {
        let mut moved = false;
        for e in engines {
            moved |= e.progress();
        }
        moved || fabric.step()
    };
    weft_testkit::drive_until("engines", 3, step, done);
}
