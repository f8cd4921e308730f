//! `TransferEngine::remove_peer` in manual mode over the loopback fabric
//! (step mode): WRs waiting for send-queue room fail at once with
//! `PeerRemoved`, posted ones still resolve exactly once, the peer's
//! addresses and peer groups are refused from then on, other peers are
//! unaffected, and the resolved peer count goes back to its baseline.

use crate::common::*;
use std::sync::Arc;
use weft_engine::{EngineError, MrDesc, MrHandle, OnDone, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};
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

/// A newer incarnation at the same NIC address (what a restarted process
/// that got its predecessor's address looks like; here the same process
/// with its incarnation bumped in the descriptor) implicitly replaces the
/// old one: the old one's queued WRs fail with `PeerRemoved` (never
/// posted), its descriptor, older ones, its group address and peer groups
/// with it are refused from then on, an immediate aimed at it is never
/// delivered (the round armed for the new one fires exactly once, on the
/// new one's write), and the new incarnation works with fresh domain state.
#[test]
fn a_newer_incarnation_at_the_same_address_replaces_the_old() {
    for seed in seeds_or([51, 52, 53]) {
        let _g = SeedGuard::new(seed, "a_newer_incarnation_replaces_the_old");
        let Trio {
            fabric,
            ea,
            eb,
            ec,
            src,
            bd,
            sh,
            _cd,
            bdesc: old_desc,
            cdesc,
        } = trio(seed);
        assert!(
            ea.incarnation() != eb.incarnation() && eb.incarnation() != ec.incarnation(),
            "seed {seed}: incarnations differ"
        );
        assert_eq!(old_desc.incarnation, eb.incarnation());
        let (old_addr, caddr) = (eb.main_address(), ec.main_address());
        assert_eq!(old_addr.incarnation, eb.incarnation());
        let newer = weft_transport::Incarnation(eb.incarnation().0 + 1);
        let mut new_desc = old_desc.clone();
        new_desc.incarnation = newer;
        let mut new_addr = old_addr.clone();
        new_addr.incarnation = newer;
        let mut older_desc = old_desc.clone();
        older_desc.incarnation = weft_transport::Incarnation(eb.incarnation().0 - 1);
        let engines = [ea.clone(), eb.clone(), ec.clone()];

        let (od, f) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 0), (&cdesc, 0), od)
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        let baseline = peers(&ea);
        let group = ea
            .add_peer_group(&[caddr.clone(), old_addr.clone()])
            .unwrap();
        assert_eq!(peers(&ea), baseline + 1, "seed {seed}");

        // Eight writes to the old incarnation: one posted, seven queued;
        // then one to the new incarnation replaces the old.
        let mut flags = Vec::new();
        for k in 0..8u64 {
            let (od, f) = OnDone::flag();
            ea.submit_single_write(4096, None, (&sh, k * 4096), (&old_desc, k * 4096), od)
                .unwrap();
            flags.push(f);
        }
        ea.progress();
        assert!(ea.stats().groups[0].pending_wrs >= 6, "seed {seed}");
        let (od, fnew) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 0), (&new_desc, 8 * 4096), od)
            .unwrap();
        ea.progress();
        let failed = flags
            .iter()
            .filter(|f| matches!(f.result(), Some(Err(ref e)) if is_removed_transport(e)))
            .count();
        assert!(
            failed >= 7,
            "seed {seed}: {failed} of 8 queued writes to the old incarnation failed at its replacement"
        );
        drive(&fabric, &engines, || {
            fnew.is_done() && flags.iter().all(|f| f.is_done())
        });
        assert!(
            matches!(fnew.result(), Some(Ok(()))),
            "seed {seed}: write to the new incarnation: {:?}",
            fnew.result()
        );
        assert_eq!(
            bd.read(8 * 4096, 4096).unwrap(),
            src.read(0, 4096).unwrap(),
            "seed {seed}: the new incarnation's write landed"
        );
        assert_eq!(
            peers(&ea),
            baseline + 1,
            "seed {seed}: the old peer was freed"
        );

        // An immediate aimed at the old incarnation never arrives: the
        // round armed at B fires once, on the new incarnation's write.
        let imm = eb.alloc_imm().unwrap();
        let (od, round) = OnDone::flag();
        eb.expect_imm_count_with(imm, 1, od).unwrap();
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
        newest.incarnation = weft_transport::Incarnation(newer.0 + 1);
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
