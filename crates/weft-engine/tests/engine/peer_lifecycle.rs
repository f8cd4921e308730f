//! `TransferEngine::remove_peer` in manual mode over the loopback fabric
//! (step mode): WRs waiting for send-queue room fail at once with
//! `PeerRemoved`, posted ones still resolve exactly once, the peer's
//! addresses and peer groups are refused from then on, other peers are
//! unaffected, and the resolved peer count goes back to its baseline.

use crate::common::*;
use std::sync::Arc;
use weft_engine::{EngineError, MrDesc, MrHandle, OnDone, TransferEngine};
use weft_loopback::{Fabric, FabricConfig, HostId};
use weft_transport::{HostBuffer, TransportError};

fn peers(e: &weft_engine::TransferEngine) -> u64 {
    e.stats().groups[0].nics.iter().map(|n| n.peers).sum()
}

fn is_removed_transport(e: &EngineError) -> bool {
    matches!(e, EngineError::Transport { .. })
        && matches!(e.transport(), Some(TransportError::PeerRemoved { .. }))
}

/// Three engines A, B, C (one NIC each, manual mode) on a step-mode
/// adversarial fabric with one WR in flight per NIC (the rest of a batch
/// waits for send-queue room); A's source buffer and B's and C's
/// destination buffers registered. Destructure it binding every buffer
/// (no `..`): a buffer left in the temporary would be freed while
/// registered.
struct Trio {
    fabric: Fabric,
    hb: HostId,
    ea: TransferEngine,
    eb: TransferEngine,
    ec: TransferEngine,
    src: Arc<HostBuffer>,
    bd: Arc<HostBuffer>,
    _cd: Arc<HostBuffer>,
    sh: MrHandle,
    bdesc: MrDesc,
    cdesc: MrDesc,
}

fn trio(seed: u64) -> Trio {
    let fabric = Fabric::new(FabricConfig {
        max_inflight: 1,
        ..FabricConfig::adversarial(seed)
    });
    let (a, b, c) = (fabric.add_host(1), fabric.add_host(1), fabric.add_host(1));
    let ea = engine(&fabric, a, 1, test_config(), true);
    let eb = engine(&fabric, b, 1, test_config(), true);
    let ec = engine(&fabric, c, 1, test_config(), true);
    let src = Arc::new(mem::patterned(seed, 1 << 16));
    let (bd, cd) = (
        Arc::new(mem::zeroed(1 << 16)),
        Arc::new(mem::zeroed(1 << 16)),
    );
    let (sh, _) = ea.reg_mr(src.region()).unwrap();
    let (_, bdesc) = eb.reg_mr(bd.region()).unwrap();
    let (_, cdesc) = ec.reg_mr(cd.region()).unwrap();
    Trio {
        fabric,
        hb: b,
        ea,
        eb,
        ec,
        src,
        bd,
        _cd: cd,
        sh,
        bdesc,
        cdesc,
    }
}

#[test]
fn remove_peer_fails_queued_work_and_refuses_the_old_incarnation() {
    for seed in seeds_or([41, 42, 43]) {
        let _g = SeedGuard::new(seed, "remove_peer_fails_queued_work");
        let Trio {
            fabric,
            hb: _,
            ea,
            eb,
            ec,
            src: _src,
            bd: _bd,
            _cd,
            sh,
            bdesc,
            cdesc,
        } = trio(seed);
        let (baddr, caddr) = (eb.main_address(), ec.main_address());
        let engines = [ea.clone(), eb.clone(), ec.clone()];

        // C is resolved first: the baseline.
        let (od, f) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 0), (&cdesc, 0), od)
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(matches!(f.result(), Some(Ok(()))), "seed {seed}");
        let baseline = peers(&ea);
        let group = ea.add_peer_group(&[caddr.clone(), baddr.clone()]).unwrap();
        assert_eq!(peers(&ea), baseline + 1, "seed {seed}");

        // Eight writes to B: the first is posted, the rest wait for room.
        let mut flags = Vec::new();
        for k in 0..8u64 {
            let (od, f) = OnDone::flag();
            ea.submit_single_write(4096, Some(7), (&sh, k * 4096), (&bdesc, k * 4096), od)
                .unwrap();
            flags.push(f);
        }
        ea.progress();
        assert!(ea.stats().groups[0].pending_wrs >= 6, "seed {seed}");
        ea.remove_peer(&baddr).unwrap();
        ea.remove_peer(&baddr).unwrap(); // a no-op
                                         // The queued ones failed at once, without the fabric moving.
        let failed = flags
            .iter()
            .filter(|f| matches!(f.result(), Some(Err(ref e)) if is_removed_transport(e)))
            .count();
        assert!(
            failed >= 7,
            "seed {seed}: {failed} of 8 failed at the removal"
        );
        ea.progress(); // publishes the stats
        assert_eq!(ea.stats().groups[0].pending_wrs, 0, "seed {seed}");
        // The posted one resolves too (it may have landed: B is alive).
        drive(&fabric, &engines, || flags.iter().all(|f| f.is_done()));
        assert_eq!(peers(&ea), baseline, "seed {seed}: peers after the removal");

        // B's addresses and the peer group are refused from now on.
        let (od, f) = OnDone::flag();
        ea.submit_single_write(64, None, (&sh, 0), (&bdesc, 0), od)
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        match f.result() {
            Some(Err(e)) => assert!(e.is_peer_removed() && is_removed_transport(&e), "{e}"),
            r => panic!("seed {seed}: write to a removed peer: {r:?}"),
        }
        let (od, f) = OnDone::flag();
        let dsts = [cdesc.clone(), bdesc.clone()];
        match ea.submit_barrier(&group, od, 9, &dsts) {
            Err(e) => assert!(e.is_peer_removed(), "seed {seed}: {e}"),
            Ok(_) => {
                drive(&fabric, &engines, || f.is_done());
                match f.result() {
                    Some(Err(e @ EngineError::PeerRemoved { member: 1, .. })) => {
                        assert!(e.is_peer_removed())
                    }
                    r => panic!("seed {seed}: barrier with a removed member: {r:?}"),
                }
            }
        }
        let (od, f) = OnDone::flag();
        ea.submit_send(&baddr, b"hi", od).unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(
            matches!(f.result(), Some(Err(ref e)) if is_removed_transport(e)),
            "seed {seed}: send to a removed peer: {:?}",
            f.result()
        );

        // C is unaffected, and a new group with it works.
        let (od, f) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 4096), (&cdesc, 4096), od)
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(matches!(f.result(), Some(Ok(()))), "seed {seed}");
        let g2 = ea.add_peer_group(std::slice::from_ref(&caddr)).unwrap();
        let (od, f) = OnDone::flag();
        ea.submit_barrier(&g2, od, 9, std::slice::from_ref(&cdesc))
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(matches!(f.result(), Some(Ok(()))), "seed {seed}");
        for e in &engines {
            e.shutdown();
        }
    }
}

/// Progresses every engine and steps the fabric until nothing moves.
fn settle(fabric: &Fabric, engines: &[weft_engine::TransferEngine]) {
    for _ in 0..100_000 {
        let mut moved = false;
        for e in engines {
            moved |= e.progress();
        }
        if !moved && !fabric.step() {
            return;
        }
    }
    panic!("the engines never settled");
}

/// Kills B's host (its engine shut down: its domains closed), brings it
/// back at the same NIC addresses with a fresh engine — a new, newer
/// incarnation — and registers a fresh destination buffer there.
fn restart_b_in_place(
    fabric: &Fabric,
    hb: HostId,
    eb: &TransferEngine,
) -> (TransferEngine, Arc<HostBuffer>, MrDesc) {
    eb.shutdown();
    fabric.revive_host(hb).unwrap();
    let eb2 = engine(fabric, hb, 1, test_config(), true);
    assert!(eb2.incarnation() > eb.incarnation());
    assert_eq!(eb2.main_address().nics, eb.main_address().nics);
    let bd2 = Arc::new(mem::zeroed(1 << 16));
    let (_, desc) = eb2.reg_mr(bd2.region()).unwrap();
    (eb2, bd2, desc)
}

/// B is killed with writes to it queued at A; a write to it fails with
/// `PeerUnreachable` (the transport's word that it is gone); B comes back
/// at the same NIC addresses as a new incarnation. The first write to the
/// new incarnation's descriptor replaces the old one: the old one's
/// queued WRs fail with `PeerRemoved` (never posted), its descriptor, older
/// ones, its group address and peer groups with it are refused from then
/// on, an immediate aimed at it is never delivered (the round armed for
/// the new one fires exactly once, on the new one's write), nothing aimed
/// at it lands in the new process, and the new incarnation works with
/// fresh domain state.
#[test]
fn a_newer_incarnation_replaces_one_the_transport_reported_unreachable() {
    for seed in seeds_or([51, 52, 53]) {
        let _g = SeedGuard::new(seed, "a_newer_incarnation_replaces_the_old");
        let Trio {
            fabric,
            hb,
            ea,
            eb,
            ec,
            src,
            bd: _bd,
            sh,
            _cd,
            bdesc: old_desc,
            cdesc,
        } = trio(seed);
        let (old_addr, caddr) = (eb.main_address(), ec.main_address());
        let mut older_desc = old_desc.clone();
        older_desc.incarnation = weft_transport::Incarnation(eb.incarnation().0 - 1);

        let (od, f) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 0), (&cdesc, 0), od)
            .unwrap();
        drive(&fabric, &[ea.clone(), eb.clone(), ec.clone()], || {
            f.is_done()
        });
        let baseline = peers(&ea);
        let group = ea
            .add_peer_group(&[caddr.clone(), old_addr.clone()])
            .unwrap();
        assert_eq!(peers(&ea), baseline + 1, "seed {seed}");

        // Eight writes to B: one posted, seven queued. B dies; A polls
        // until the posted one failed with `PeerUnreachable`.
        let mut flags = Vec::new();
        for k in 0..8u64 {
            let (od, f) = OnDone::flag();
            ea.submit_single_write(4096, None, (&sh, k * 4096), (&old_desc, k * 4096), od)
                .unwrap();
            flags.push(f);
        }
        ea.progress();
        assert!(ea.stats().groups[0].pending_wrs >= 6, "seed {seed}");
        fabric.kill_host(hb);
        let survivors = [ea.clone(), ec.clone()];
        drive(&fabric, &survivors, || flags.iter().any(|f| f.is_done()));
        let unreachable = flags
            .iter()
            .filter_map(|f| f.result())
            .filter(|r| {
                matches!(r, Err(e) if matches!(e.transport(), Some(TransportError::PeerUnreachable { .. })))
            })
            .count();
        assert!(unreachable >= 1, "seed {seed}: no write failed unreachable");
        let queued = flags.iter().filter(|f| !f.is_done()).count();
        assert!(queued >= 5, "seed {seed}: {queued} writes still queued");

        let (eb2, bd2, new_desc) = restart_b_in_place(&fabric, hb, &eb);
        let new_addr = eb2.main_address();
        let engines = [ea.clone(), eb2.clone(), ec.clone()];
        let (od, fnew) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 0), (&new_desc, 8 * 4096), od)
            .unwrap();
        ea.progress();
        let failed = flags
            .iter()
            .filter(|f| matches!(f.result(), Some(Err(ref e)) if is_removed_transport(e)))
            .count();
        assert!(
            failed >= queued - 1,
            "seed {seed}: {failed} of {queued} queued writes to the old incarnation failed at its replacement"
        );
        drive(&fabric, &engines, || {
            fnew.is_done() && flags.iter().all(|f| f.is_done())
        });
        assert!(
            matches!(fnew.result(), Some(Ok(()))),
            "seed {seed}: write to the new incarnation: {:?}",
            fnew.result()
        );
        assert!(
            flags.iter().all(|f| matches!(f.result(), Some(Err(_)))),
            "seed {seed}: a write aimed at the dead incarnation succeeded"
        );
        assert_eq!(
            bd2.read(8 * 4096, 4096).unwrap(),
            src.read(0, 4096).unwrap(),
            "seed {seed}: the new incarnation's write landed"
        );
        assert!(
            bd2.read(0, 8 * 4096).unwrap().iter().all(|&b| b == 0),
            "seed {seed}: a write aimed at the old incarnation landed in the new process"
        );
        assert_eq!(
            peers(&ea),
            baseline + 1,
            "seed {seed}: the old peer was freed"
        );

        // An immediate aimed at the old incarnation never arrives: the
        // round armed at B's new incarnation fires once, on its own write.
        let imm = eb2.alloc_imm().unwrap();
        let (od, round) = OnDone::flag();
        eb2.expect_imm_count_with(imm, 1, od).unwrap();
        for d in [&old_desc, &older_desc] {
            let (od, f) = OnDone::flag();
            ea.submit_single_write(64, Some(imm), (&sh, 0), (d, 0), od)
                .unwrap();
            drive(&fabric, &engines, || f.is_done());
            match f.result() {
                Some(Err(e)) => assert!(e.is_peer_removed() && is_removed_transport(&e), "{e}"),
                r => panic!("seed {seed}: write to a replaced incarnation: {r:?}"),
            }
        }
        settle(&fabric, &engines);
        assert!(!round.is_done(), "seed {seed}: a refused immediate arrived");
        let (od, f) = OnDone::flag();
        ea.submit_single_write(64, Some(imm), (&sh, 0), (&new_desc, 0), od)
            .unwrap();
        drive(&fabric, &engines, || f.is_done() && round.is_done());
        assert!(matches!(f.result(), Some(Ok(()))), "seed {seed}");
        assert!(matches!(round.result(), Some(Ok(()))), "seed {seed}");

        // Peer groups with the old incarnation are refused; so are sends
        // to its address and new groups naming it. The new one works.
        let (od, f) = OnDone::flag();
        match ea.submit_barrier(&group, od, 9, &[cdesc.clone(), old_desc.clone()]) {
            Err(e) => assert!(e.is_peer_removed(), "seed {seed}: {e}"),
            Ok(_) => {
                drive(&fabric, &engines, || f.is_done());
                assert!(
                    matches!(
                        f.result(),
                        Some(Err(EngineError::PeerRemoved { member: 1, .. }))
                    ),
                    "seed {seed}: barrier with a replaced member: {:?}",
                    f.result()
                );
            }
        }
        let (od, f) = OnDone::flag();
        ea.submit_send(&old_addr, b"hi", od).unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(
            matches!(f.result(), Some(Err(ref e)) if is_removed_transport(e)),
            "seed {seed}: send to a replaced incarnation: {:?}",
            f.result()
        );
        assert!(
            ea.add_peer_group(&[caddr.clone(), old_addr.clone()])
                .is_err_and(|e| e.is_peer_removed()),
            "seed {seed}: a new group with the replaced incarnation"
        );
        let g2 = ea
            .add_peer_group(&[caddr.clone(), new_addr.clone()])
            .unwrap();
        let (od, f) = OnDone::flag();
        ea.submit_barrier(&g2, od, 9, &[cdesc.clone(), new_desc.clone()])
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(
            matches!(f.result(), Some(Ok(()))),
            "seed {seed}: {:?}",
            f.result()
        );

        // Removing the new incarnation refuses it too; an even newer one
        // at the same address is accepted again.
        ea.remove_peer(&new_addr).unwrap();
        assert_eq!(peers(&ea), baseline, "seed {seed}");
        let (od, f) = OnDone::flag();
        ea.submit_single_write(64, None, (&sh, 0), (&new_desc, 0), od)
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(
            matches!(f.result(), Some(Err(ref e)) if is_removed_transport(e)),
            "seed {seed}: write to a removed incarnation: {:?}",
            f.result()
        );
        let mut newest = new_desc.clone();
        newest.incarnation = weft_transport::Incarnation(new_desc.incarnation.0 + 1);
        let (od, f) = OnDone::flag();
        ea.submit_single_write(64, None, (&sh, 0), (&newest, 0), od)
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(
            matches!(f.result(), Some(Ok(()))),
            "seed {seed}: {:?}",
            f.result()
        );
        for e in &engines {
            e.shutdown();
        }
    }
}

/// B restarts at the same NIC addresses while A has nothing in flight to
/// it, so the transport never tells A that the old incarnation ended. The
/// new incarnation's descriptor is refused with `IncarnationUnproven`
/// (naming the address and both incarnations; nothing is sent) until the
/// application removes the old incarnation; then it works. A write with
/// the old descriptor reaches the new process, whose keys refuse it: that
/// is no proof either (a damaged descriptor of a live peer gets the same
/// answer).
#[test]
fn an_unconfirmed_restart_is_refused_until_the_old_incarnation_is_removed() {
    for seed in seeds_or([54, 55]) {
        let _g = SeedGuard::new(seed, "an_unconfirmed_restart_is_refused");
        let Trio {
            fabric,
            hb,
            ea,
            eb,
            ec,
            src,
            bd: _bd,
            sh,
            _cd,
            bdesc: old_desc,
            cdesc: _,
        } = trio(seed);
        let old_addr = eb.main_address();
        let (od, f) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 0), (&old_desc, 0), od)
            .unwrap();
        drive(&fabric, &[ea.clone(), eb.clone(), ec.clone()], || {
            f.is_done()
        });
        assert!(matches!(f.result(), Some(Ok(()))), "seed {seed}");
        fabric.kill_host(hb);
        let (eb2, bd2, new_desc) = restart_b_in_place(&fabric, hb, &eb);
        let engines = [ea.clone(), eb2.clone(), ec.clone()];
        for _ in 0..2 {
            let (od, f) = OnDone::flag();
            ea.submit_single_write(4096, None, (&sh, 0), (&new_desc, 0), od)
                .unwrap();
            drive(&fabric, &engines, || f.is_done());
            match f.result() {
                Some(Err(EngineError::IncarnationUnproven {
                    peer, named, live, ..
                })) => {
                    assert_eq!(peer, old_addr.nics[0], "seed {seed}");
                    assert_eq!((named, live), (eb2.incarnation(), eb.incarnation()));
                }
                r => panic!("seed {seed}: an unconfirmed restart: {r:?}"),
            }
            let (od, f) = OnDone::flag();
            ea.submit_single_write(4096, None, (&sh, 0), (&old_desc, 4096), od)
                .unwrap();
            drive(&fabric, &engines, || f.is_done());
            assert!(
                matches!(f.result(), Some(Err(ref e)) if !e.is_peer_removed()),
                "seed {seed}: the old descriptor at the new process: {:?}",
                f.result()
            );
        }
        assert!(bd2.read(0, 1 << 16).unwrap().iter().all(|&b| b == 0));
        ea.remove_peer(&old_addr).unwrap();
        let (od, f) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 0), (&new_desc, 0), od)
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(
            matches!(f.result(), Some(Ok(()))),
            "seed {seed}: {:?}",
            f.result()
        );
        assert_eq!(bd2.read(0, 4096).unwrap(), src.read(0, 4096).unwrap());
        for e in &engines {
            e.shutdown();
        }
    }
}
