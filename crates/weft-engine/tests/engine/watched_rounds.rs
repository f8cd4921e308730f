//! Rounds armed with the peers they wait on (`expect_imm_count_from`):
//! removing one of those peers fails the round with `PeerGone` naming it;
//! nothing else is touched.

use crate::common::*;
use weft_engine::{EngineError, OnDone, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};

fn three(fabric: &Fabric) -> Vec<TransferEngine> {
    (0..3)
        .map(|_| {
            let h = fabric.add_host(1);
            engine(fabric, h, 1, test_config(), false)
        })
        .collect()
}

/// `from` writes one 64-byte WRITE with `imm` into `to`'s buffer.
fn write_imm(
    from: &TransferEngine,
    to: &weft_engine::Registration,
    src: &weft_engine::Registration,
    imm: u32,
) {
    let (on, flag) = OnDone::flag();
    from.submit_single_write(64, Some(imm), (&src.handle(), 0), (to.desc(), 0), on)
        .unwrap();
    flag.wait_timeout(HANG).expect("write ends").unwrap();
}

#[test]
fn removing_a_watched_peer_fails_the_round_naming_it() {
    let _g = SeedGuard::new(3, "removing_a_watched_peer_fails_the_round_naming_it");
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(3));
    let e = three(&fabric);
    let (rx, a, b) = (&e[0], &e[1], &e[2]);
    let dst_buf = mem::zeroed(4096);
    let dst = rx.register(dst_buf.region()).unwrap();
    let src_buf = mem::patterned(3, 64);
    let src_a = a.register(src_buf.region()).unwrap();
    let imm = rx.lease_imm().unwrap();
    let (on, flag) = OnDone::flag();
    // Two writes from each of a and b are expected; a's arrive, b dies.
    rx.expect_imm_count_from(imm.value(), 4, &[a.main_address(), b.main_address()], on)
        .unwrap();
    write_imm(a, &dst, &src_a, imm.value());
    write_imm(a, &dst, &src_a, imm.value());
    assert!(flag
        .wait_timeout(std::time::Duration::from_millis(50))
        .is_none());
    rx.remove_peer(&b.main_address()).unwrap();
    let r = flag.wait_timeout(HANG).expect("round ends");
    match r {
        Err(EngineError::PeerGone {
            imm: v,
            peer,
            incarnation,
        }) => {
            assert_eq!(v, imm.value());
            assert_eq!(peer, b.main_address().nics[0]);
            assert_eq!(incarnation, b.incarnation());
        }
        other => panic!("expected PeerGone, got {other:?}"),
    }
    // a's two immediates are still counted, for the application to see.
    assert_eq!(rx.imm_pending(imm.value()), 2);
    for x in &e {
        x.shutdown();
    }
}

#[test]
fn a_fired_round_and_an_unwatched_later_round_are_untouched() {
    let fabric = Fabric::new_realtime(FabricConfig::ideal(4));
    let e = three(&fabric);
    let (rx, a, b) = (&e[0], &e[1], &e[2]);
    let dst_buf = mem::zeroed(4096);
    let dst = rx.register(dst_buf.region()).unwrap();
    let src_buf = mem::patterned(4, 64);
    let src_a = a.register(src_buf.region()).unwrap();
    let imm = rx.lease_imm().unwrap();
    let (on, first) = OnDone::flag();
    rx.expect_imm_count_from(imm.value(), 1, &[a.main_address()], on)
        .unwrap();
    write_imm(a, &dst, &src_a, imm.value());
    first.wait_timeout(HANG).expect("fires").unwrap();
    // A later round on the same value, not watched, waiting on b.
    let (on, later) = OnDone::flag();
    rx.expect_imm_count_with(imm.value(), 1, on).unwrap();
    // Removing a (whose round already fired) fails nothing.
    rx.remove_peer(&a.main_address()).unwrap();
    assert!(later
        .wait_timeout(std::time::Duration::from_millis(50))
        .is_none());
    assert!(rx.imm_armed(imm.value()));
    // And a watched round on another value is untouched by removing b.
    let other = rx.lease_imm().unwrap();
    let (on, watched_a) = OnDone::flag();
    rx.expect_imm_count_from(other.value(), 1, &[a.main_address()], on)
        .unwrap();
    // a was removed before this arm: the round fails at once.
    assert!(matches!(
        watched_a.wait_timeout(HANG).expect("ends"),
        Err(EngineError::PeerGone { .. })
    ));
    let (on, watched_b) = OnDone::flag();
    let third = rx.lease_imm().unwrap();
    rx.expect_imm_count_from(third.value(), 1, &[b.main_address()], on)
        .unwrap();
    rx.remove_peer(&a.main_address()).unwrap();
    assert!(watched_b
        .wait_timeout(std::time::Duration::from_millis(50))
        .is_none());
    rx.remove_peer(&b.main_address()).unwrap();
    assert!(matches!(
        watched_b.wait_timeout(HANG).expect("ends"),
        Err(EngineError::PeerGone { .. })
    ));
    for x in &e {
        x.shutdown();
    }
}

#[test]
fn a_watched_callback_round_reports_peer_gone() {
    let fabric = Fabric::new_realtime(FabricConfig::ideal(5));
    let e = three(&fabric);
    let (rx, a) = (&e[0], &e[1]);
    let imm = rx.lease_imm().unwrap();
    let (tx, got) = std::sync::mpsc::channel();
    rx.expect_imm_count_from(
        imm.value(),
        3,
        &[a.main_address()],
        OnDone::callback(move |r| {
            let _ = tx.send(r);
        }),
    )
    .unwrap();
    rx.remove_peer(&a.main_address()).unwrap();
    let r = got.recv_timeout(HANG).expect("callback runs");
    assert!(matches!(r, Err(EngineError::PeerGone { .. })), "{r:?}");
    for x in &e {
        x.shutdown();
    }
}
