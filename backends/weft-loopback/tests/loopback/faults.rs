//! Rejections, injected faults, dead peers, RNR, flow control, validation.

use crate::common::*;
use std::sync::Arc;
use weft_loopback::{parse_addr, Action, Fabric, FabricConfig, HostId, OpKind, Rule};
use weft_transport::{
    Access, Completion, Device, DeviceCopy, Domain, MemRegion, NetAddr, Provider,
    RemoteAccessReason, RemoteSlice, Rkey, TransportError, WrId, WriteWr,
};

fn reason(r: &Result<(), TransportError>) -> Option<RemoteAccessReason> {
    match r {
        Err(TransportError::RemoteAccess { reason, .. }) => Some(*reason),
        _ => None,
    }
}

/// Posts one write with the given destination, runs to idle, returns the
/// initiator's result and the target's completions.
fn one_write(
    fabric: &Fabric,
    a: &mut weft_loopback::LoopbackDomain,
    b: &mut weft_loopback::LoopbackDomain,
    src: weft_transport::LocalSlice,
    dst: RemoteSlice,
) -> (Result<(), TransportError>, Vec<Completion>) {
    let peer = a.add_peer(b.local_addr()).unwrap();
    a.post_write(&WriteWr {
        wr: WrId(1),
        peer,
        src,
        dst,
        imm: Some(42),
    })
    .unwrap();
    fabric.run_until_idle();
    let ca = poll_all(a);
    let w = write_results(&ca);
    assert_eq!(w.len(), 1, "{ca:?}");
    (w[0].1.clone(), poll_all(b))
}

#[test]
fn remote_access_violations_write_nothing() {
    for_seeds(0..5, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let ha = fabric.add_host(1);
        let hb = fabric.add_host(2);
        let mut a = fabric.open(ha, 0).unwrap();
        let mut b = fabric.open(hb, 0).unwrap();
        let mut b1 = fabric.open(hb, 1).unwrap();
        let src = mem::patterned(5, 100_000);
        let dst = mem::filled(100_000, 0);
        let ro = mem::filled(4096, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let md_other_nic = b1.register(&dst.region(), Access::RemoteWrite).unwrap();
        let mro = b.register(&ro.region(), Access::LocalOnly).unwrap();
        let s = |len| ms.slice(0, len).unwrap();

        // Out of bounds: one byte past the end, and offset overflow.
        let (r, cb) = one_write(&fabric, &mut a, &mut b, s(100_000), remote(&md, 1));
        assert_eq!(
            reason(&r),
            Some(RemoteAccessReason::OutOfBounds),
            "seed {seed}: {r:?}"
        );
        assert!(cb.is_empty(), "seed {seed}: {cb:?}");
        let (r, _) = one_write(&fabric, &mut a, &mut b, s(10), remote(&md, u64::MAX - 4));
        assert_eq!(
            reason(&r),
            Some(RemoteAccessReason::OutOfBounds),
            "seed {seed}"
        );
        let huge = RemoteSlice {
            base: u64::MAX,
            offset: u64::MAX,
            rkey: md.rkey,
        };
        let (r, _) = one_write(&fabric, &mut a, &mut b, s(0), huge);
        assert_eq!(
            reason(&r),
            Some(RemoteAccessReason::OutOfBounds),
            "seed {seed}"
        );
        // Unknown key, and the key of the other NIC of the same host.
        let bogus = RemoteSlice {
            rkey: Rkey(12345),
            ..remote(&md, 0)
        };
        let (r, _) = one_write(&fabric, &mut a, &mut b, s(10), bogus);
        assert_eq!(
            reason(&r),
            Some(RemoteAccessReason::UnknownKey),
            "seed {seed}"
        );
        let (r, _) = one_write(&fabric, &mut a, &mut b, s(10), remote(&md_other_nic, 0));
        assert_eq!(
            reason(&r),
            Some(RemoteAccessReason::UnknownKey),
            "seed {seed}"
        );
        // lkey presented as rkey.
        let lkey_as_rkey = RemoteSlice {
            rkey: Rkey(md.key.0),
            ..remote(&md, 0)
        };
        let (r, _) = one_write(&fabric, &mut a, &mut b, s(10), lkey_as_rkey);
        assert_eq!(
            reason(&r),
            Some(RemoteAccessReason::UnknownKey),
            "seed {seed}"
        );
        // Local-only region.
        let (r, cb) = one_write(&fabric, &mut a, &mut b, s(100), remote(&mro, 0));
        assert_eq!(
            reason(&r),
            Some(RemoteAccessReason::NotWritable),
            "seed {seed}"
        );
        assert!(cb.is_empty(), "seed {seed}");

        assert!(
            dst.snapshot().iter().all(|&x| x == 0),
            "seed {seed}: bytes written"
        );
        assert!(
            ro.snapshot().iter().all(|&x| x == 0),
            "seed {seed}: bytes written"
        );

        // Deregistered after post, before arrival.
        let peer = a.add_peer(b.local_addr()).unwrap();
        a.post_write(&WriteWr {
            wr: WrId(2),
            peer,
            src: s(100_000),
            dst: remote(&md, 0),
            imm: Some(1),
        })
        .unwrap();
        b.deregister(md.key).unwrap();
        fabric.run_until_idle();
        let w = write_results(&poll_all(&mut a));
        assert_eq!(w.len(), 1, "seed {seed}");
        assert_eq!(
            reason(&w[0].1),
            Some(RemoteAccessReason::UnknownKey),
            "seed {seed}"
        );
        assert!(
            poll_all(&mut b).is_empty(),
            "seed {seed}: imm of failed write"
        );
        assert!(
            dst.snapshot().iter().all(|&x| x == 0),
            "seed {seed}: bytes written"
        );
        drop((a, b, b1));
    });
}

#[test]
fn post_time_validation() {
    with_seed(0, || {
        let fabric = Fabric::new(FabricConfig::adversarial(0));
        let (mut a, b) = pair(&fabric);
        let src = mem::patterned(1, 1000);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        let base = WriteWr {
            wr: WrId(1),
            peer,
            src: ms.slice(0, 10).unwrap(),
            dst: RemoteSlice {
                base: 0,
                offset: 0,
                rkey: Rkey(0),
            },
            imm: None,
        };
        // Local slice outside its registration.
        let mut bad = base;
        bad.src.len = 2000;
        assert!(matches!(
            a.post_write(&bad),
            Err(TransportError::LocalAccess { .. })
        ));
        // Unknown local key.
        let mut bad = base;
        bad.src.mr = weft_transport::MrKey(999_999);
        assert!(matches!(
            a.post_write(&bad),
            Err(TransportError::LocalAccess { .. })
        ));
        // Unknown peer handle.
        let mut bad = base;
        bad.peer = weft_transport::PeerId(77);
        assert!(matches!(
            a.post_write(&bad),
            Err(TransportError::InvalidArgument { .. })
        ));
        // Batch stops at the bad WR.
        let e = a.post_writes(&[base, base, bad, base]).unwrap_err();
        assert_eq!(e.posted, 2);
        // Malformed address.
        assert!(matches!(
            a.add_peer(&NetAddr(vec![1, 2, 3])),
            Err(TransportError::InvalidArgument { .. })
        ));
        // add_peer is idempotent.
        assert_eq!(a.add_peer(b.local_addr()).unwrap(), peer);
        // Send too long / recv outside registration.
        let mut cfg = FabricConfig::adversarial(0);
        cfg.max_send_len = 8;
        let f2 = Fabric::new(cfg);
        let (mut c, d) = pair(&f2);
        let buf = mem::filled(100, 0);
        let mc = c.register(&buf.region(), Access::LocalOnly).unwrap();
        let p = c.add_peer(d.local_addr()).unwrap();
        assert!(matches!(
            c.post_send(WrId(1), p, mc.slice(0, 9).unwrap()),
            Err(TransportError::InvalidArgument { .. })
        ));
        let mut outside = mc.slice(0, 100).unwrap();
        outside.addr += 1;
        assert!(matches!(
            c.post_recv(WrId(1), outside),
            Err(TransportError::LocalAccess { .. })
        ));
        // Deregistering twice.
        c.deregister(mc.key).unwrap();
        assert!(matches!(
            c.deregister(mc.key),
            Err(TransportError::LocalAccess { .. })
        ));
        drop((a, b, c, d));
    });
}

#[test]
fn address_encoding_and_unknown_nic() {
    with_seed(4, || {
        let fabric = Fabric::new(FabricConfig::adversarial(4));
        let (mut a, b) = pair(&fabric);
        assert_eq!(parse_addr(b.local_addr()), Some((HostId(1), 0)));
        assert_eq!(parse_addr(&NetAddr(vec![0; 8])), None);
        let nowhere = Fabric::nic_addr(HostId(55), 3);
        assert_eq!(parse_addr(&nowhere), Some((HostId(55), 3)));
        let peer = a.add_peer(&nowhere).unwrap();
        let src = mem::filled(64, 1);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        a.post_write(&WriteWr {
            wr: WrId(3),
            peer,
            src: ms.slice(0, 64).unwrap(),
            dst: RemoteSlice {
                base: 0,
                offset: 0,
                rkey: Rkey(1),
            },
            imm: Some(1),
        })
        .unwrap();
        a.post_send(WrId(4), peer, ms.slice(0, 8).unwrap()).unwrap();
        fabric.run_until_idle();
        let c = poll_all(&mut a);
        assert_eq!(c.len(), 2, "{c:?}");
        for x in &c {
            match x {
                Completion::Write { result, .. } | Completion::Send { result, .. } => {
                    assert!(
                        matches!(result, Err(TransportError::PeerUnreachable { .. })),
                        "{x:?}"
                    )
                }
                other => panic!("{other:?}"),
            }
        }
        drop((a, b));
    });
}

#[test]
fn fail_rule_injects_error_and_writes_nothing() {
    for_seeds(0..5, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (mut a, mut b) = pair(&fabric);
        let rule = fabric.add_rule(Rule::new(Action::Fail).kind(OpKind::Write).imm(7).first(2));
        let src = mem::patterned(1, 4000);
        let dst = mem::filled(4000, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        let wr = |i: u64, imm| WriteWr {
            wr: WrId(i),
            peer,
            src: ms.slice(i * 1000, 1000).unwrap(),
            dst: remote(&md, i * 1000),
            imm: Some(imm),
        };
        // Two imm-7 writes fail, the third imm-7 and the imm-8 pass.
        a.post_writes(&[wr(0, 7), wr(1, 8), wr(2, 7), wr(3, 7)])
            .unwrap();
        fabric.run_until_idle();
        let mut w = write_results(&poll_all(&mut a));
        w.sort_by_key(|x| x.0);
        assert!(
            matches!(w[0].1, Err(TransportError::Failed { .. })),
            "seed {seed}: {w:?}"
        );
        assert!(w[1].1.is_ok(), "seed {seed}");
        assert!(
            matches!(w[2].1, Err(TransportError::Failed { .. })),
            "seed {seed}"
        );
        assert!(w[3].1.is_ok(), "seed {seed}");
        assert_eq!(fabric.rule_hits(rule), 2);
        let mut im = imms(&poll_all(&mut b));
        im.sort();
        assert_eq!(im, vec![7, 8], "seed {seed}");
        let got = dst.snapshot();
        let want = src.snapshot();
        assert!(got[..1000].iter().all(|&x| x == 0), "seed {seed}");
        assert_eq!(got[1000..2000], want[1000..2000], "seed {seed}");
        assert!(got[2000..3000].iter().all(|&x| x == 0), "seed {seed}");
        assert_eq!(got[3000..], want[3000..], "seed {seed}");
        // First match wins: a Pass rule before a Fail shields everything.
        fabric.clear_rules();
        fabric.add_rule(Rule::new(Action::Pass).kind(OpKind::Send));
        fabric.add_rule(Rule::new(Action::Fail));
        let rb = mem::filled(100, 0);
        let mr = b.register(&rb.region(), Access::LocalOnly).unwrap();
        b.post_recv(WrId(9), mr.slice(0, 100).unwrap()).unwrap();
        a.post_send(WrId(10), peer, ms.slice(0, 10).unwrap())
            .unwrap();
        a.post_write(&wr(0, 1)).unwrap();
        fabric.run_until_idle();
        let c = poll_all(&mut a);
        assert!(
            c.contains(&Completion::Send {
                wr: WrId(10),
                result: Ok(())
            }),
            "seed {seed}: {c:?}"
        );
        assert!(matches!(
            write_results(&c)[0].1,
            Err(TransportError::Failed { .. })
        ));
        drop((a, b));
    });
}

#[test]
fn partition_fails_after_retry_limit() {
    for_seeds(0..3, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (mut a, mut b) = pair(&fabric);
        fabric.add_rule(Rule::new(Action::DropAll).to_host(b.host()));
        let src = mem::patterned(1, 5000);
        let dst = mem::filled(5000, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let (r, cb) = one_write(
            &fabric,
            &mut a,
            &mut b,
            ms.slice(0, 5000).unwrap(),
            remote(&md, 0),
        );
        assert!(
            matches!(r, Err(TransportError::PeerUnreachable { .. })),
            "seed {seed}: {r:?}"
        );
        assert!(cb.is_empty(), "seed {seed}");
        assert!(dst.snapshot().iter().all(|&x| x == 0), "seed {seed}");
        let cfg = fabric.config();
        let min = cfg.retransmit_delay * (cfg.retry_limit + 1);
        assert!(fabric.now().as_duration() >= min, "seed {seed}");
        drop((a, b));
    });
}

#[test]
fn kill_host_fails_pending_and_later_ops() {
    for_seeds(0..5, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let ha = fabric.add_host(1);
        let hb = fabric.add_host(1);
        let hc = fabric.add_host(1);
        let mut a = fabric.open(ha, 0).unwrap();
        let mut b = fabric.open(hb, 0).unwrap();
        let mut c = fabric.open(hc, 0).unwrap();
        let src = mem::patterned(1, 1 << 20);
        let db = mem::filled(1 << 20, 0);
        let dc = mem::filled(1 << 20, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let mb = b.register(&db.region(), Access::RemoteWrite).unwrap();
        let mc = c.register(&dc.region(), Access::RemoteWrite).unwrap();
        let pb = a.add_peer(b.local_addr()).unwrap();
        let pc = a.add_peer(c.local_addr()).unwrap();
        let w = |i: u64, peer, mr: &weft_transport::LocalMr| WriteWr {
            wr: WrId(i),
            peer,
            src: ms.slice(0, 1 << 20).unwrap(),
            dst: remote(mr, 0),
            imm: Some(i as u32),
        };
        a.post_writes(&[w(1, pb, &mb), w(2, pc, &mc)]).unwrap();
        b.post_recv(WrId(5), mb.slice(0, 10).unwrap()).unwrap();
        fabric.step();
        fabric.kill_host(hb);
        assert!(!fabric.is_alive(hb, 0));
        // Pending op to b fails at once (no further stepping needed).
        let now = poll_all(&mut a);
        assert_eq!(write_results(&now).len(), 1, "seed {seed}: {now:?}");
        assert!(matches!(
            write_results(&now)[0],
            (1, Err(TransportError::PeerUnreachable { .. }))
        ));
        // Later ops to b fail too; c is unaffected.
        a.post_write(&w(3, pb, &mb)).unwrap();
        fabric.run_until_idle();
        let mut rest = write_results(&poll_all(&mut a));
        rest.sort_by_key(|x| x.0);
        assert!(rest[0] == (2, Ok(())), "seed {seed}: {rest:?}");
        assert!(
            matches!(rest[1], (3, Err(TransportError::PeerUnreachable { .. }))),
            "seed {seed}"
        );
        assert_eq!(dc.snapshot(), src.snapshot(), "seed {seed}");
        assert_eq!(imms(&poll_all(&mut c)), vec![2]);
        // The dead NIC's own domain.
        let mut out = Vec::new();
        assert!(matches!(
            b.poll(&mut out),
            Err(TransportError::NicDown { .. })
        ));
        assert!(matches!(
            b.post_write(&w(4, pb, &mb)),
            Err(TransportError::NicDown { .. })
        ));
        assert!(matches!(
            b.register(&db.region(), Access::RemoteWrite),
            Err(TransportError::NicDown { .. })
        ));
        b.deregister(mb.key).unwrap();
        assert!(matches!(
            fabric.open(hb, 0),
            Err(TransportError::InvalidArgument { .. }) | Err(TransportError::NicDown { .. })
        ));
        assert!(
            fabric.revive_host(hb).is_err(),
            "seed {seed}: revived with a domain still open"
        );
        drop(b);
        assert!(matches!(
            fabric.open(hb, 0),
            Err(TransportError::NicDown { .. })
        ));
        // Revived at the same address (a restarted process): fresh state;
        // the old incarnation's key matches nothing, new ones work.
        assert!(fabric.revive_host(hc).is_err(), "seed {seed}: a live host");
        fabric.revive_host(hb).unwrap();
        assert!(fabric.is_alive(hb, 0));
        let mut b2 = fabric.open(hb, 0).unwrap();
        assert_eq!(b2.local_addr(), &Fabric::nic_addr(hb, 0));
        a.remove_peer(pb).unwrap();
        let pb2 = a.add_peer(b2.local_addr()).unwrap();
        a.post_write(&w(6, pb2, &mb)).unwrap();
        fabric.run_until_idle();
        let old = write_results(&poll_all(&mut a));
        assert!(
            matches!(old[..], [(6, Err(TransportError::RemoteAccess { .. }))]),
            "seed {seed}: old key after the revival: {old:?}"
        );
        assert!(imms(&poll_all(&mut b2)).is_empty(), "seed {seed}");
        let mb2 = b2.register(&db.region(), Access::RemoteWrite).unwrap();
        a.post_write(&w(7, pb2, &mb2)).unwrap();
        fabric.run_until_idle();
        assert_eq!(write_results(&poll_all(&mut a)), vec![(7, Ok(()))]);
        assert_eq!(imms(&poll_all(&mut b2)), vec![7], "seed {seed}");
        assert_eq!(db.snapshot(), src.snapshot(), "seed {seed}");
        drop((a, b2, c));
    });
}

#[test]
fn kill_dst_rule_kills_target() {
    with_seed(8, || {
        let fabric = Fabric::new(FabricConfig::adversarial(8));
        let (mut a, mut b) = pair(&fabric);
        let src = mem::patterned(1, 1000);
        let dst = mem::filled(1000, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        let rule = fabric.add_rule(Rule::new(Action::KillDst).imm(3));
        let w = |i: u64| WriteWr {
            wr: WrId(i),
            peer,
            src: ms.slice(0, 1000).unwrap(),
            dst: remote(&md, 0),
            imm: Some(i as u32),
        };
        a.post_writes(&[w(1), w(2), w(3), w(4)]).unwrap();
        fabric.run_until_idle();
        assert!(!fabric.is_alive(b.host(), 0));
        assert!(!fabric.is_alive(b.host(), 1));
        assert_eq!(fabric.rule_hits(rule), 1);
        let r = write_results(&poll_all(&mut a));
        assert_eq!(r.len(), 4);
        assert!(
            r.iter()
                .all(|(_, r)| matches!(r, Err(TransportError::PeerUnreachable { .. }))),
            "{r:?}"
        );
        drop((a, b));
    });
}

#[test]
fn closing_a_domain_fails_peers_ops_and_reopen_works() {
    with_seed(2, || {
        let fabric = Fabric::new(FabricConfig::adversarial(2));
        let (mut a, b) = pair(&fabric);
        let hb = b.host();
        let src = mem::patterned(1, 1 << 16);
        let dst = mem::filled(1 << 16, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let mut b = b;
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        assert!(matches!(
            fabric.open(hb, 0),
            Err(TransportError::InvalidArgument { .. })
        ));
        a.post_write(&WriteWr {
            wr: WrId(1),
            peer,
            src: ms.slice(0, 1 << 16).unwrap(),
            dst: remote(&md, 0),
            imm: None,
        })
        .unwrap();
        drop(b);
        let r = write_results(&poll_all(&mut a));
        assert!(
            matches!(r[..], [(1, Err(TransportError::PeerUnreachable { .. }))]),
            "{r:?}"
        );
        // Reopen: old keys are gone, new registration works.
        let mut b = fabric.open(hb, 0).unwrap();
        a.post_write(&WriteWr {
            wr: WrId(2),
            peer,
            src: ms.slice(0, 1 << 16).unwrap(),
            dst: remote(&md, 0),
            imm: None,
        })
        .unwrap();
        fabric.run_until_idle();
        let r = write_results(&poll_all(&mut a));
        assert!(
            matches!(
                r[0].1,
                Err(TransportError::RemoteAccess {
                    reason: RemoteAccessReason::UnknownKey,
                    ..
                })
            ),
            "{r:?}"
        );
        let md2 = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        a.post_write(&WriteWr {
            wr: WrId(3),
            peer,
            src: ms.slice(0, 1 << 16).unwrap(),
            dst: remote(&md2, 0),
            imm: Some(1),
        })
        .unwrap();
        fabric.run_until_idle();
        assert_eq!(write_results(&poll_all(&mut a)), vec![(3, Ok(()))]);
        assert_eq!(imms(&poll_all(&mut b)), vec![1]);
        assert_eq!(dst.snapshot(), src.snapshot());
        drop((a, b));
    });
}

#[test]
fn rnr_wait_then_deliver_timeout_and_too_long() {
    for_seeds(0..5, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (mut a, mut b) = pair(&fabric);
        let src = mem::patterned(1, 1000);
        let rb = mem::filled(1000, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let mr = b.register(&rb.region(), Access::LocalOnly).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        // Waits, then a late post_recv delivers it.
        a.post_send(WrId(1), peer, ms.slice(0, 100).unwrap())
            .unwrap();
        fabric.advance(fabric.config().rnr_timeout / 2);
        assert!(poll_all(&mut a).is_empty(), "seed {seed}");
        assert_eq!(fabric.stats().rnr_waits, 1, "seed {seed}");
        b.post_recv(WrId(2), mr.slice(0, 500).unwrap()).unwrap();
        fabric.run_until_idle();
        assert_eq!(
            poll_all(&mut a),
            vec![Completion::Send {
                wr: WrId(1),
                result: Ok(())
            }]
        );
        assert_eq!(
            poll_all(&mut b),
            vec![Completion::Recv {
                wr: WrId(2),
                result: Ok(100),
                from: Some(a.local_addr().clone()),
            }]
        );
        assert_eq!(rb.snapshot()[..100], src.snapshot()[..100], "seed {seed}");
        // Never a buffer: ReceiverNotReady after the timeout.
        a.post_send(WrId(3), peer, ms.slice(0, 100).unwrap())
            .unwrap();
        fabric.run_until_idle();
        let c = poll_all(&mut a);
        assert!(
            matches!(
                c[..],
                [Completion::Send {
                    wr: WrId(3),
                    result: Err(TransportError::ReceiverNotReady { .. })
                }]
            ),
            "seed {seed}: {c:?}"
        );
        assert!(fabric.now().as_duration() >= fabric.config().rnr_timeout);
        // Buffer too small: MessageTooLong, the buffer stays posted.
        b.post_recv(WrId(4), mr.slice(0, 50).unwrap()).unwrap();
        a.post_send(WrId(5), peer, ms.slice(0, 100).unwrap())
            .unwrap();
        fabric.run_until_idle();
        let c = poll_all(&mut a);
        assert!(
            matches!(
                c[..],
                [Completion::Send {
                    wr: WrId(5),
                    result: Err(TransportError::MessageTooLong {
                        len: 100,
                        capacity: 50,
                        ..
                    })
                }]
            ),
            "seed {seed}: {c:?}"
        );
        assert!(poll_all(&mut b).is_empty());
        a.post_send(WrId(6), peer, ms.slice(0, 50).unwrap())
            .unwrap();
        fabric.run_until_idle();
        assert_eq!(
            poll_all(&mut b),
            vec![Completion::Recv {
                wr: WrId(4),
                result: Ok(50),
                from: Some(a.local_addr().clone()),
            }]
        );
        // Deregistration flushes posted buffers.
        b.post_recv(WrId(7), mr.slice(0, 50).unwrap()).unwrap();
        b.deregister(mr.key).unwrap();
        let c = poll_all(&mut b);
        assert!(
            matches!(
                c[..],
                [Completion::Recv {
                    wr: WrId(7),
                    result: Err(TransportError::LocalAccess { .. }),
                    from: None,
                }]
            ),
            "{c:?}"
        );
        drop((a, b));
    });
}

#[test]
fn flow_control_queue_full_and_short_counts() {
    with_seed(6, || {
        let mut cfg = FabricConfig::adversarial(6);
        cfg.max_inflight = 5;
        cfg.max_batch = 3;
        cfg.max_recvs = 2;
        let fabric = Fabric::new(cfg);
        let (mut a, mut b) = pair(&fabric);
        assert_eq!(a.capabilities().max_inflight, 5);
        assert!(!a.capabilities().ordered);
        let src = mem::patterned(1, 100);
        let dst = mem::filled(100, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        let w = WriteWr {
            wr: WrId(0),
            peer,
            src: ms.slice(0, 10).unwrap(),
            dst: remote(&md, 0),
            imm: None,
        };
        assert_eq!(a.post_writes(&[w; 10]).unwrap(), 3); // max_batch
        assert_eq!(a.post_writes(&[w; 10]).unwrap(), 2); // max_inflight
        assert_eq!(a.post_writes(&[w; 10]).unwrap(), 0);
        assert!(matches!(
            a.post_write(&w),
            Err(TransportError::QueueFull { .. })
        ));
        assert!(matches!(
            a.post_send(WrId(1), peer, ms.slice(0, 1).unwrap()),
            Err(TransportError::QueueFull { .. })
        ));
        b.post_recv(WrId(1), md.slice(0, 1).unwrap()).unwrap();
        b.post_recv(WrId(2), md.slice(0, 1).unwrap()).unwrap();
        assert!(matches!(
            b.post_recv(WrId(3), md.slice(0, 1).unwrap()),
            Err(TransportError::QueueFull { .. })
        ));
        fabric.run_until_idle();
        // Completed but not yet polled: the slots are still taken.
        assert_eq!(a.post_writes(&[w; 2]).unwrap(), 0);
        assert_eq!(write_results(&poll_all(&mut a)).len(), 5);
        assert_eq!(a.post_writes(&[w; 2]).unwrap(), 2);
        drop((a, b));
    });
}

/// A DeviceCopy that treats "CUDA" memory as host memory (for testing the
/// plumbing) and counts calls.
struct FakeCuda(std::sync::atomic::AtomicU64);

impl DeviceCopy for FakeCuda {
    fn copy(
        &self,
        dst: u64,
        _: Device,
        src: u64,
        _: Device,
        len: u64,
    ) -> Result<(), TransportError> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the fabric guarantees both spans lie in live registrations;
        // in this test those are host buffers owned by `HostBuffer`s.
        unsafe {
            std::ptr::copy(
                src as usize as *const u8,
                dst as usize as *mut u8,
                len as usize,
            )
        };
        Ok(())
    }
}

#[test]
fn device_memory_needs_device_copy() {
    with_seed(1, || {
        let fabric = Fabric::new(FabricConfig::adversarial(1));
        let (mut a, mut b) = pair(&fabric);
        let gpu = mem::filled(4096, 0);
        // SAFETY: the memory is owned by `gpu`, which outlives the domains.
        let region = unsafe { MemRegion::new(gpu.region().ptr(), 4096, Device::Cuda(0)) };
        assert!(matches!(
            b.register(&region, Access::RemoteWrite),
            Err(TransportError::Unsupported { .. })
        ));
        let fake = Arc::new(FakeCuda(Default::default()));
        fabric.set_device_copy(fake.clone());
        let md = b.register(&region, Access::RemoteWrite).unwrap();
        let src = mem::patterned(3, 4096);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let (r, cb) = one_write(
            &fabric,
            &mut a,
            &mut b,
            ms.slice(0, 4096).unwrap(),
            remote(&md, 0),
        );
        assert_eq!(r, Ok(()));
        assert_eq!(imms(&cb), vec![42]);
        assert!(fake.0.load(std::sync::atomic::Ordering::Relaxed) >= 1);
        assert_eq!(gpu.snapshot(), src.snapshot());
        drop((a, b));
    });
}

#[test]
fn provider_lists_and_opens_nics() {
    with_seed(0, || {
        let fabric = Fabric::new(FabricConfig::adversarial(0));
        let h = fabric.add_host(3);
        let p = fabric.provider(h);
        assert_eq!(p.name(), "loopback");
        let nics = p.nics().unwrap();
        assert_eq!(nics.len(), 3);
        assert_eq!(nics[2].addr, Fabric::nic_addr(h, 2));
        let d = p.open(2).unwrap();
        assert_eq!(d.info(), &nics[2]);
        assert!(p.open(3).is_err());
        assert!(p.open(2).is_err());
        drop(d);
        assert!(p.open(2).is_ok());
    });
}

#[test]
fn kill_one_nic_leaves_the_other_nic_of_the_host_working() {
    for_seeds(0..3, |seed| {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let ha = fabric.add_host(1);
        let hb = fabric.add_host(2);
        let mut a = fabric.open(ha, 0).unwrap();
        let mut b0 = fabric.open(hb, 0).unwrap();
        let mut b1 = fabric.open(hb, 1).unwrap();
        let src = mem::patterned(1, 50_000);
        let dst = mem::filled(50_000, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let m0 = b0.register(&dst.region(), Access::RemoteWrite).unwrap();
        let m1 = b1.register(&dst.region(), Access::RemoteWrite).unwrap();
        let p0 = a.add_peer(b0.local_addr()).unwrap();
        let p1 = a.add_peer(b1.local_addr()).unwrap();
        let w = |i: u64, peer, mr: &weft_transport::LocalMr| WriteWr {
            wr: WrId(i),
            peer,
            src: ms.slice(0, 50_000).unwrap(),
            dst: remote(mr, 0),
            imm: Some(i as u32),
        };
        a.post_writes(&[w(0, p0, &m0), w(1, p1, &m1)]).unwrap();
        fabric.kill_nic(hb, 0);
        fabric.run_until_idle();
        let mut r = write_results(&poll_all(&mut a));
        r.sort_by_key(|x| x.0);
        assert!(
            matches!(r[0], (0, Err(TransportError::PeerUnreachable { .. }))),
            "seed {seed}: {r:?}"
        );
        assert_eq!(r[1], (1, Ok(())), "seed {seed}");
        assert_eq!(imms(&poll_all(&mut b1)), vec![1], "seed {seed}");
        assert_eq!(dst.snapshot(), src.snapshot(), "seed {seed}");
        assert!(fabric.is_alive(hb, 1) && !fabric.is_alive(hb, 0));
        drop((a, b0, b1));
    });
}

#[test]
fn null_mode_still_rejects_bad_keys() {
    with_seed(0, || {
        let fabric = Fabric::new(FabricConfig::null());
        let (mut a, mut b) = pair(&fabric);
        let src = mem::filled(100, 1);
        let dst = mem::filled(100, 0);
        let ms = a.register(&src.region(), Access::LocalOnly).unwrap();
        let md = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(b.local_addr()).unwrap();
        let w = |off, rkey| WriteWr {
            wr: WrId(off),
            peer,
            src: ms.slice(0, 10).unwrap(),
            dst: RemoteSlice {
                rkey,
                ..remote(&md, off)
            },
            imm: Some(1),
        };
        a.post_writes(&[w(0, md.rkey), w(95, md.rkey), w(0, Rkey(3))])
            .unwrap();
        let r = write_results(&poll_all(&mut a));
        assert_eq!(r[0], (0, Ok(())));
        assert!(matches!(
            r[1].1,
            Err(TransportError::RemoteAccess {
                reason: RemoteAccessReason::OutOfBounds,
                ..
            })
        ));
        assert!(matches!(
            r[2].1,
            Err(TransportError::RemoteAccess {
                reason: RemoteAccessReason::UnknownKey,
                ..
            })
        ));
        assert_eq!(imms(&poll_all(&mut b)), vec![1]);
        // Rules still apply in null mode.
        fabric.add_rule(Rule::new(Action::Fail));
        a.post_write(&w(0, md.rkey)).unwrap();
        let r = write_results(&poll_all(&mut a));
        assert!(
            matches!(r[..], [(0, Err(TransportError::Failed { .. }))]),
            "{r:?}"
        );
        assert!(poll_all(&mut b).is_empty());
        assert!(dst.snapshot().iter().all(|&x| x == 0));
        drop((a, b));
    });
}
