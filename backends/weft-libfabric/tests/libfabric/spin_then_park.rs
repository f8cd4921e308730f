//! `PollPolicy::SpinThenPark` on libfabric's software-progress providers:
//! a sending worker whose WRs are in flight keeps polling (yielding) for
//! `EngineConfig::inflight_spin` past its last progress, as the policy's
//! docs say, rather than parking for `idle_sleep` between polls. On these
//! providers its own WRITE completes only while it polls, so each park
//! would hold every WRITE back by a whole `idle_sleep`.
//!
//! The sender parks for 5 s when truly idle and spins for 1 µs; the
//! receiver busy-polls (it has nothing in flight, so under the same policy
//! it would park and hold the WRITEs back itself). The WRITEs start after
//! more than `inflight_spin` of idleness, so an in-flight window measured
//! from a stale progress stamp has already run out.

use std::time::Duration;

use weft_engine::{EngineConfig, OnDone, PollPolicy, TransferEngine};
use weft_testkit::mem::{self, HostBufferExt};

/// The sender's park when idle: a WRITE waited this long means it parked.
const IDLE_SLEEP: Duration = Duration::from_secs(5);
/// How long each WRITE may take (a park would take `IDLE_SLEEP`).
const PER_WRITE: Duration = Duration::from_millis(2500);

fn engine(name: &str, poll: PollPolicy) -> Option<TransferEngine> {
    let cfg = {
        let mut c = EngineConfig::default();
        c.poll = poll;
        c.idle_sleep = Some(IDLE_SLEEP);
        c.inflight_spin = Duration::from_millis(100);
        // Never sleep in the wait fds (tcp has them): only the park is
        // under test.
        c.idle_block_after = None;
        c
    };
    crate::common::one_nic_engine(name, cfg)
}

fn in_flight_writes_are_polled(name: &str) {
    let spin = PollPolicy::SpinThenPark {
        spin: Duration::from_micros(1),
    };
    let (Some(a), Some(b)) = (engine(name, spin), engine(name, PollPolicy::Busy)) else {
        return;
    };
    let len = 64 << 10;
    let src = mem::patterned(9, len);
    let dst = mem::zeroed(len);
    let (smr, _) = a.reg_mr(src.region()).unwrap();
    let (_dmr, ddesc) = b.reg_mr(dst.region()).unwrap();
    // Connect (the first WRITE may wait for the peer's address exchange).
    let (on, f) = OnDone::flag();
    a.submit_single_write(len as u64, None, (&smr, 0), (&ddesc, 0), on)
        .unwrap();
    f.wait_timeout(Duration::from_secs(30))
        .expect("first write")
        .unwrap();
    // Longer than `inflight_spin` with nothing to do.
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..4 {
        let (on, f) = OnDone::flag();
        a.submit_single_write(len as u64, None, (&smr, 0), (&ddesc, 0), on)
            .unwrap();
        f.wait_timeout(PER_WRITE)
            .unwrap_or_else(|| panic!("{name}: write {i} waited for the sender's park"))
            .unwrap();
    }
    assert_eq!(dst.bytes(0, len), src.bytes(0, len), "{name}: bytes");
    a.shutdown();
    b.shutdown();
}

#[test]
fn shm_in_flight_writes_are_polled() {
    in_flight_writes_are_polled("shm");
}

#[test]
fn tcp_in_flight_writes_are_polled() {
    in_flight_writes_are_polled("tcp");
}
