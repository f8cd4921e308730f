//! Hostile peers and out-of-band bytes (manual mode, step-mode loopback):
//! a forged or garbled descriptor naming a live peer's addresses must not
//! retire that peer (it is refused for itself, with
//! `EngineError::IncarnationUnproven`), and SENDs aimed at a dead
//! incarnation never reach the process restarted at its addresses (the
//! receiver drops them and counts them in `GroupStats::recv_stale`).

use crate::common::*;
use std::sync::{Arc, Mutex};
use weft_engine::{EngineError, GroupAddress, MrDesc, MrHandle, OnDone, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};
use weft_transport::{Incarnation, Rkey};

/// Whether `r` is the refusal of an unproven incarnation `named` at B's
/// address, with `live` the live one.
fn unproven(
    r: &Result<(), EngineError>,
    peer: &GroupAddress,
    named: Incarnation,
    live: Incarnation,
) -> bool {
    matches!(r, Err(EngineError::IncarnationUnproven { peer: p, named: n, live: l, .. })
        if *p == peer.nics[0] && *n == named && *l == live)
}

/// Submits one write of `len` bytes and drives it to its result.
fn write(
    fabric: &Fabric,
    engines: &[TransferEngine],
    sh: &MrHandle,
    dst: &MrDesc,
    off: u64,
    len: u64,
) -> Result<(), EngineError> {
    let (od, f) = OnDone::flag();
    engines[0].submit_single_write(len, None, (sh, off), (dst, off), od)?;
    drive(fabric, engines, || f.is_done());
    f.result().expect("resolved")
}

/// Submits one SEND and drives it to its result.
fn send(
    fabric: &Fabric,
    engines: &[TransferEngine],
    to: &GroupAddress,
    msg: &[u8],
) -> Result<(), EngineError> {
    let (od, f) = OnDone::flag();
    engines[0].submit_send(to, msg, od)?;
    drive(fabric, engines, || f.is_done());
    f.result().expect("resolved")
}

/// Progresses every engine and steps the fabric until nothing moves.
fn settle(fabric: &Fabric, engines: &[TransferEngine]) {
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

/// A receive pool whose messages are collected into the returned list.
fn collect_recvs(e: &TransferEngine) -> Arc<Mutex<Vec<Vec<u8>>>> {
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = Arc::clone(&got);
    e.submit_recvs(256, 8, move |r| {
        if let Ok(m) = r {
            g.lock().unwrap().push(m.to_vec());
        }
    })
    .expect("receive pool");
    got
}

/// Descriptors naming a live peer's NIC addresses with another, larger
/// incarnation — forged, garbled in a store, or decoded from damaged
/// bytes — are refused for themselves only: the peer keeps working through
/// its real descriptor, its group address and SENDs.
#[test]
fn a_forged_descriptor_does_not_retire_a_live_peer() {
    for seed in seeds_or([61, 62, 63]) {
        let _g = SeedGuard::new(seed, "a_forged_descriptor_does_not_retire_a_live_peer");
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let ea = engine(&fabric, a, 1, test_config(), true);
        let eb = engine(&fabric, b, 1, test_config(), true);
        let src = mem::patterned(seed, 1 << 16);
        let dst = mem::zeroed(1 << 16);
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, bdesc) = eb.reg_mr(dst.region()).unwrap();
        let got = collect_recvs(&eb);
        let engines = [ea.clone(), eb.clone()];
        let live = eb.incarnation();
        write(&fabric, &engines, &sh, &bdesc, 0, 4096).expect("a write to the live peer");

        // Forgeries: a newer incarnation with a garbled rkey (its write
        // would fail at the target), one with the real keys, the largest
        // incarnation there is, and descriptors decoded from damaged
        // encodings of the real one that still name B's address.
        let mut forged = Vec::new();
        let mut f = bdesc.clone();
        f.incarnation = Incarnation(live.0 + 1);
        f.rkeys[0].1 = Rkey(f.rkeys[0].1 .0 ^ 0xdead_beef);
        forged.push(f);
        let mut f = bdesc.clone();
        f.incarnation = Incarnation(live.0 + 7);
        forged.push(f);
        let mut f = bdesc.clone();
        f.incarnation = Incarnation(u64::MAX);
        forged.push(f);
        let bytes = weft_transport::encode(&bdesc).unwrap();
        let mut rng = seed;
        while forged.len() < 12 {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut b = bytes.clone();
            // The incarnation is the last field (a varint): damage its bytes.
            let i = b.len() - 1 - (rng >> 33) as usize % 4;
            b[i] ^= (rng >> 8) as u8 | 1;
            if let Ok(d) = weft_transport::decode::<MrDesc>(&b) {
                if d.rkeys == bdesc.rkeys && d.incarnation > live {
                    forged.push(d);
                }
            }
        }
        for (k, f) in forged.iter().enumerate() {
            let r = write(&fabric, &engines, &sh, f, 4096, 64);
            write(&fabric, &engines, &sh, &bdesc, 8192, 4096).unwrap_or_else(|e| {
                panic!(
                    "seed {seed}: forgery {k} ({:?}) retired the live peer: {e}",
                    f.incarnation
                )
            });
            assert!(
                unproven(&r, &eb.main_address(), f.incarnation, live),
                "seed {seed}: forgery {k}: {r:?}"
            );
            assert!(
                r.as_ref().unwrap_err().is_unproven_incarnation()
                    && !r.unwrap_err().is_peer_removed()
            );
        }

        // A forged group address is refused too; the real one still works.
        let mut fa = eb.main_address();
        fa.incarnation = Incarnation(live.0 + 3);
        match ea.add_peer_group(std::slice::from_ref(&fa)) {
            Err(EngineError::IncarnationUnproven {
                transfer: None,
                named,
                live: l,
                ..
            }) => assert_eq!((named, l), (fa.incarnation, live), "seed {seed}"),
            r => panic!("seed {seed}: a group with a forged address: {r:?}"),
        }
        let r = send(&fabric, &engines, &fa, b"forged");
        assert!(
            unproven(&r, &fa, fa.incarnation, live),
            "seed {seed}: {r:?}"
        );
        write(&fabric, &engines, &sh, &bdesc, 0, 4096)
            .expect("a write to the live peer after a forged group address");
        let group = ea
            .add_peer_group(&[eb.main_address()])
            .expect("a peer group with the live peer");
        let (od, f) = OnDone::flag();
        ea.submit_barrier(&group, od, 5, std::slice::from_ref(&bdesc))
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(matches!(f.result(), Some(Ok(()))), "seed {seed}: barrier");
        send(&fabric, &engines, &eb.main_address(), b"real").expect("a SEND to the live peer");
        settle(&fabric, &engines);
        assert_eq!(*got.lock().unwrap(), vec![b"real".to_vec()], "seed {seed}");
        assert_eq!(
            dst.read(0, 4096).unwrap(),
            src.read(0, 4096).unwrap(),
            "seed {seed}"
        );
        for e in &engines {
            e.shutdown();
        }
    }
}

/// A peer dies and is restarted at the same NIC addresses (a new
/// incarnation) without `remove_peer`: SENDs its old incarnation's address
/// still names are never delivered to the new process.
#[test]
fn sends_to_a_dead_incarnation_never_reach_its_successor() {
    for seed in seeds_or([71, 72, 73]) {
        let _g = SeedGuard::new(
            seed,
            "sends_to_a_dead_incarnation_never_reach_its_successor",
        );
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let ea = engine(&fabric, a, 1, test_config(), true);
        let eb = engine(&fabric, b, 1, test_config(), true);
        let got_old = collect_recvs(&eb);
        let old = eb.main_address();
        send(&fabric, &[ea.clone(), eb.clone()], &old, b"to-b").expect("a SEND to B");
        settle(&fabric, &[ea.clone(), eb.clone()]);
        assert_eq!(*got_old.lock().unwrap(), vec![b"to-b".to_vec()]);

        // B dies; A's SEND in the meantime fails (the transport's word).
        fabric.kill_host(b);
        eb.shutdown();
        let r = send(&fabric, std::slice::from_ref(&ea), &old, b"to-dead-b");
        assert!(r.is_err(), "seed {seed}: a SEND to a dead peer: {r:?}");

        // B restarts at the same addresses.
        fabric.revive_host(b).unwrap();
        let eb2 = engine(&fabric, b, 1, test_config(), true);
        let got = collect_recvs(&eb2);
        let new = eb2.main_address();
        assert_eq!(new.nics, old.nics, "seed {seed}: restarted in place");
        assert!(new.incarnation > old.incarnation, "seed {seed}");
        let engines = [ea.clone(), eb2.clone()];

        // A, not told yet, sends to the old incarnation: the SENDs reach
        // the address (the transport reports them done), and the new
        // process drops every one of them.
        for i in 0..4 {
            send(&fabric, &engines, &old, format!("to-old-b-{i}").as_bytes())
                .expect("a SEND the transport delivered");
        }
        settle(&fabric, &engines);
        assert_eq!(eb2.stats().groups[0].recv_stale, 4, "seed {seed}");
        assert_eq!(eb2.stats().groups[0].recv_malformed, 0, "seed {seed}");
        let leaked: Vec<String> = got
            .lock()
            .unwrap()
            .iter()
            .map(|m| String::from_utf8_lossy(m).into_owned())
            .collect();
        assert!(
            leaked.is_empty(),
            "seed {seed}: SENDs aimed at the dead incarnation reached its successor: {leaked:?}"
        );

        // A learns the new address: it works, and the old one is refused.
        send(&fabric, &engines, &new, b"to-new-b").expect("a SEND to the new incarnation");
        settle(&fabric, &engines);
        assert_eq!(
            *got.lock().unwrap(),
            vec![b"to-new-b".to_vec()],
            "seed {seed}"
        );
        let r = send(&fabric, &engines, &old, b"to-old-b-late");
        assert!(
            matches!(&r, Err(e) if e.is_peer_removed()),
            "seed {seed}: a SEND to the replaced incarnation: {r:?}"
        );
        settle(&fabric, &engines);
        assert_eq!(got.lock().unwrap().len(), 1, "seed {seed}");
        assert_eq!(eb2.stats().groups[0].recv_stale, 4, "seed {seed}");
        for e in &engines {
            e.shutdown();
        }
    }
}

/// A group address naming a live peer's NIC addresses with a newer
/// incarnation (`add_peer_group`, or a SEND to it) leaves the peer alone.
#[test]
fn a_forged_group_address_does_not_retire_a_live_peer() {
    for seed in seeds_or([81, 82]) {
        let _g = SeedGuard::new(seed, "a_forged_group_address_does_not_retire_a_live_peer");
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let ea = engine(&fabric, a, 1, test_config(), true);
        let eb = engine(&fabric, b, 1, test_config(), true);
        let src = mem::patterned(seed, 1 << 16);
        let dst = mem::zeroed(1 << 16);
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, bdesc) = eb.reg_mr(dst.region()).unwrap();
        let engines = [ea.clone(), eb.clone()];
        write(&fabric, &engines, &sh, &bdesc, 0, 4096).expect("a write to the live peer");
        let group = ea.add_peer_group(&[eb.main_address()]).unwrap();
        let mut fa = eb.main_address();
        fa.incarnation = Incarnation(eb.incarnation().0 + 1);
        let r = ea.add_peer_group(std::slice::from_ref(&fa));
        write(&fabric, &engines, &sh, &bdesc, 0, 4096).unwrap_or_else(|e| {
            panic!("seed {seed}: a forged group address retired the live peer: {e}")
        });
        assert!(
            matches!(r, Err(ref e) if e.is_unproven_incarnation()),
            "seed {seed}: a group with the forged address: {r:?}"
        );
        let r = send(&fabric, &engines, &fa, b"forged");
        assert!(
            unproven(&r, &fa, fa.incarnation, eb.incarnation()),
            "seed {seed}: a SEND to the forged address: {r:?}"
        );
        let (od, f) = OnDone::flag();
        ea.submit_barrier(&group, od, 5, std::slice::from_ref(&bdesc))
            .unwrap();
        drive(&fabric, &engines, || f.is_done());
        assert!(
            matches!(f.result(), Some(Ok(()))),
            "seed {seed}: the live peer's group: {:?}",
            f.result()
        );
        for e in &engines {
            e.shutdown();
        }
    }
}

/// SENDs queued at A for B when B dies and restarts at the same addresses:
/// those A posts after the restart, before it knows, are dropped by the
/// new process (counted in its `recv_stale`); once A meets the new
/// incarnation (the old one was reported unreachable), the ones still
/// queued fail at A with `PeerRemoved` and are never posted. None reaches
/// the new process's receive callback.
#[test]
fn queued_sends_to_a_dead_incarnation_fail_or_are_dropped() {
    for seed in seeds_or([91, 92, 93]) {
        let _g = SeedGuard::new(seed, "queued_sends_to_a_dead_incarnation");
        let fabric = Fabric::new(FabricConfig {
            max_inflight: 1,
            ..FabricConfig::adversarial(seed)
        });
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let ea = engine(&fabric, a, 1, test_config(), true);
        let eb = engine(&fabric, b, 1, test_config(), true);
        let _got_old = collect_recvs(&eb);
        let old = eb.main_address();
        // One SEND posted, the rest queued; B dies, A sees the posted one
        // fail.
        let mut flags = Vec::new();
        for i in 0..10 {
            let (od, f) = OnDone::flag();
            ea.submit_send(&old, format!("queued-{i}").as_bytes(), od)
                .unwrap();
            flags.push(f);
        }
        ea.progress();
        fabric.kill_host(b);
        eb.shutdown();
        drive(&fabric, std::slice::from_ref(&ea), || {
            flags.iter().any(|f| f.is_done())
        });
        fabric.revive_host(b).unwrap();
        let eb2 = engine(&fabric, b, 1, test_config(), true);
        let got = collect_recvs(&eb2);
        let engines = [ea.clone(), eb2.clone()];
        // A posts a few more of the queued SENDs before it learns.
        for _ in 0..3 {
            ea.progress();
            fabric.step();
        }
        // A meets the new incarnation: the rest fail at once.
        let (od, fnew) = OnDone::flag();
        ea.submit_send(&eb2.main_address(), b"to-new-b", od)
            .unwrap();
        ea.progress();
        drive(&fabric, &engines, || {
            fnew.is_done() && flags.iter().all(|f| f.is_done())
        });
        assert!(matches!(fnew.result(), Some(Ok(()))), "seed {seed}");
        settle(&fabric, &engines);
        let ok = flags
            .iter()
            .filter(|f| matches!(f.result(), Some(Ok(()))))
            .count();
        let removed = flags
            .iter()
            .filter(|f| matches!(f.result(), Some(Err(ref e)) if e.is_peer_removed()))
            .count();
        assert!(
            removed >= 1,
            "seed {seed}: no queued SEND failed at the replacement"
        );
        assert_eq!(
            eb2.stats().groups[0].recv_stale,
            ok as u64,
            "seed {seed}: each SEND the transport delivered was dropped"
        );
        assert_eq!(
            *got.lock().unwrap(),
            vec![b"to-new-b".to_vec()],
            "seed {seed}: only the new incarnation's message is delivered"
        );
        for e in &engines {
            e.shutdown();
        }
    }
}

/// Bytes that are not a weft SEND frame (a raw SEND from another program,
/// a damaged frame) are dropped and counted in `recv_malformed`; the
/// receive pool keeps serving frames.
#[test]
fn raw_sends_without_a_frame_are_dropped() {
    use weft_transport::{Access, Provider};
    for seed in seeds_or([95, 96]) {
        let _g = SeedGuard::new(seed, "raw_sends_without_a_frame_are_dropped");
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let eb = engine(&fabric, b, 1, test_config(), true);
        let got = collect_recvs(&eb);
        let mut raw = fabric.provider(a).open(0).unwrap();
        let peer = raw.add_peer(&eb.main_address().nics[0]).unwrap();
        let msgs: [&[u8]; 4] = [b"", b"short", &[0xab; 40], b"wS\x01\x00 but then"];
        let bufs: Vec<HostBuffer> = msgs
            .iter()
            .map(|m| mem::from_bytes(&[m, &[0u8][..]].concat()))
            .collect();
        for (i, b) in bufs.iter().enumerate() {
            let mr = raw.register(&b.region(), Access::LocalOnly).unwrap();
            let src = mr.slice(0, msgs[i].len() as u64).unwrap();
            raw.post_send(weft_transport::WrId(i as u64), peer, src)
                .unwrap();
        }
        let comps = std::cell::RefCell::new(Vec::new());
        weft_testkit::drive_until(
            "raw sends",
            3,
            || {
                let moved = eb.progress();
                let mut c = comps.borrow_mut();
                let n = c.len();
                raw.poll(&mut c).unwrap();
                moved || c.len() > n || fabric.step()
            },
            || comps.borrow().len() == msgs.len(),
        );
        settle(&fabric, std::slice::from_ref(&eb));
        assert_eq!(eb.stats().groups[0].recv_malformed, 4, "seed {seed}");
        assert!(got.lock().unwrap().is_empty(), "seed {seed}");
        drop(raw);
        eb.shutdown();
    }
}
