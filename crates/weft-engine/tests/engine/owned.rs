//! Owned resources: a `Registration` deregisters its memory and an
//! `ImmLease` returns its value when dropped, explicit releases report
//! errors, and neither keeps its engine alive.

use crate::common::*;
use weft_engine::{EngineError, OnDone};
use weft_loopback::{Fabric, FabricConfig};

fn pair(fabric: &Fabric) -> (weft_engine::TransferEngine, weft_engine::TransferEngine) {
    let a = fabric.add_host(1);
    let b = fabric.add_host(1);
    (
        engine(fabric, a, 1, test_config(), false),
        engine(fabric, b, 1, test_config(), false),
    )
}

#[test]
fn dropped_registration_refuses_writes_into_it() {
    let _g = SeedGuard::new(7, "dropped_registration_refuses_writes_into_it");
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(7));
    let (a, b) = pair(&fabric);
    let src = mem::patterned(7, 4096);
    let dst = mem::zeroed(4096);
    let s = a.register(src.region()).unwrap();
    let d = b.register(dst.region()).unwrap();
    let desc = d.desc().clone();

    // Live: the write lands.
    let (on, flag) = OnDone::flag();
    a.submit_single_write(4096, None, (&s.handle(), 0), (&desc, 0), on)
        .unwrap();
    flag.wait_timeout(HANG).expect("write finishes").unwrap();
    assert_eq!(dst.read(0, 4096), src.read(0, 4096));

    // Dropped: the target's keys are gone, the next write fails.
    drop(d);
    let (on, flag) = OnDone::flag();
    a.submit_single_write(4096, None, (&s.handle(), 0), (&desc, 0), on)
        .unwrap();
    let r = flag.wait_timeout(HANG).expect("write finishes");
    assert!(r.is_err(), "write into a dropped registration: {r:?}");

    // Explicit release of a live registration reports success; after
    // shutdown there is nothing left to release.
    let h = s.handle();
    s.release().unwrap();
    assert!(
        matches!(
            a.unreg_mr(h),
            Err(EngineError::StaleMr { .. }) | Err(EngineError::InvalidArgument { .. })
        ),
        "the handle is gone after release"
    );
    let late = a.register(src.region()).unwrap();
    a.shutdown();
    late.release().unwrap();
    b.shutdown();
}

#[test]
fn dropped_lease_returns_its_value() {
    let fabric = Fabric::new_realtime(FabricConfig::ideal(1));
    let (a, b) = pair(&fabric);
    let lease = a.lease_imm().unwrap();
    let v = lease.value();
    assert!(matches!(a.lease_imm_value(v), Err(EngineError::ImmInUse { imm }) if imm == v));
    drop(lease);
    // The most recently returned value is handed out next.
    let again = a.lease_imm().unwrap();
    assert_eq!(again.value(), v);
    drop(again);
    let reserved = a.lease_imm_value(v).unwrap();
    assert_eq!(reserved.value(), v);
    reserved.release().unwrap();
    a.shutdown();
    b.shutdown();
}

#[test]
fn releasing_an_armed_lease_fails_the_round_and_says_so() {
    let fabric = Fabric::new_realtime(FabricConfig::ideal(1));
    let (a, b) = pair(&fabric);
    let lease = b.lease_imm().unwrap();
    let (on, flag) = OnDone::flag();
    b.expect_imm_count_with(lease.value(), 1, on).unwrap();
    let r = lease.release();
    assert!(
        matches!(r, Err(EngineError::InvalidArgument { .. })),
        "{r:?}"
    );
    let round = flag.wait_timeout(HANG).expect("round ends");
    assert!(round.is_err(), "the armed round fails: {round:?}");
    a.shutdown();
    b.shutdown();
}

#[test]
fn guards_do_not_keep_the_engine_alive() {
    let fabric = Fabric::new_realtime(FabricConfig::ideal(1));
    let (a, b) = pair(&fabric);
    let buf = mem::zeroed(64);
    let reg = b.register(buf.region()).unwrap();
    let lease = b.lease_imm().unwrap();
    // The last engine handle goes: its threads stop; the guards find
    // nothing to release and do not panic.
    drop(b);
    reg.release().unwrap();
    lease.release().unwrap();
    a.shutdown();
}

#[test]
fn no_immediate_is_handed_out_after_shutdown() {
    let fabric = Fabric::new_realtime(FabricConfig::ideal(1));
    let (a, b) = pair(&fabric);
    let held = a.lease_imm().unwrap();
    assert!(!a.is_shut_down());
    a.shutdown();
    assert!(a.is_shut_down());
    assert_eq!(a.alloc_imm(), Err(EngineError::ShutDown));
    assert_eq!(a.reserve_imm(7), Err(EngineError::ShutDown));
    assert!(matches!(a.lease_imm(), Err(EngineError::ShutDown)));
    assert!(matches!(a.lease_imm_value(7), Err(EngineError::ShutDown)));
    // A value taken before shutdown is still returned without error.
    held.release().unwrap();
    b.shutdown();
}
