//! Hostile peers and out-of-band bytes (manual mode, step-mode loopback):
//! a forged or garbled descriptor naming a live peer's addresses must not
//! retire that peer (it is refused for itself, with
//! `EngineError::IncarnationUnproven`).

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
