//! Timing-only mode: virtual registrations, the NIC model's times without
//! payload, `next_event_at` and `take_ready`.

use weft_loopback::{Fabric, FabricConfig, HostId, NicModel, SimTime};
use weft_transport::{Access, Completion, Domain, RemoteSlice, TransportError, WrId, WriteWr};

#[test]
fn virtual_registrations_need_timing_mode() {
    let f = Fabric::new(FabricConfig::ideal(1));
    let h = f.add_host(1);
    let mut d = f.open(h, 0).unwrap();
    let e = d
        .register_virtual(1 << 40, Access::RemoteWrite)
        .unwrap_err();
    assert!(matches!(e, TransportError::Unsupported { .. }), "{e:?}");
}

#[test]
fn timing_mode_charges_the_nic_model_without_memory() {
    let seed = 7;
    let f = Fabric::new(FabricConfig {
        nic: NicModel {
            latency: std::time::Duration::from_micros(2),
            link_gbps: 400.0,
        },
        ..FabricConfig::timing(seed)
    });
    let (a, b) = (f.add_host(1), f.add_host(1));
    let mut da = f.open(a, 0).unwrap();
    let mut db = f.open(b, 0).unwrap();
    // 1 TB on each side: nothing backs it.
    let src = da.register_virtual(1 << 40, Access::LocalOnly).unwrap();
    let dst = db.register_virtual(1 << 40, Access::RemoteWrite).unwrap();
    let peer = da.add_peer(db.local_addr()).unwrap();
    let len = 1u64 << 30;
    let wr = |i: u64, off: u64, len: u64| WriteWr {
        wr: WrId(i),
        peer,
        src: src.slice(0, len).unwrap(),
        dst: RemoteSlice {
            base: dst.addr,
            offset: off,
            rkey: dst.rkey,
        },
        imm: Some(9),
    };
    assert_eq!(
        da.post_writes(&[wr(1, 0, len), wr(2, len, len)]).unwrap(),
        2
    );
    // Out of bounds is still checked at the target.
    assert_eq!(da.post_writes(&[wr(3, (1 << 40) - 1, 2)]).unwrap(), 1);
    let ser = len * 8 / 400; // ns at 400 Gbit/s
    let lat = 2_000;
    // Store and forward per WRITE: transmit, one latency, receive; the
    // second WRITE's transmission overlaps the first's reception.
    assert_eq!(
        f.next_event_at(),
        Some(SimTime(2 * ser + lat)),
        "seed {seed}"
    );
    let mut ready = Vec::new();
    let mut seen = Vec::new();
    while let Some(t) = f.next_event_at() {
        f.advance(std::time::Duration::from_nanos(
            t.as_nanos() - f.now().as_nanos(),
        ));
        f.take_ready(&mut ready);
        for (h, nic) in ready.drain(..) {
            assert_eq!(nic, 0);
            let mut out = Vec::new();
            if h == HostId(a.0) {
                da.poll(&mut out).unwrap();
            } else {
                db.poll(&mut out).unwrap();
            }
            seen.extend(out.into_iter().map(|c| (f.now().as_nanos(), h, c)));
        }
    }
    let imms: Vec<u64> = seen
        .iter()
        .filter(|(_, _, c)| matches!(c, Completion::Imm { imm: 9 }))
        .map(|(t, _, _)| *t)
        .collect();
    assert_eq!(imms, vec![2 * ser + lat, 3 * ser + lat], "seed {seed}");
    let done: Vec<(u64, bool)> = seen
        .iter()
        .filter_map(|(t, _, c)| match c {
            Completion::Write { wr, result } if wr.0 < 3 => Some((*t, result.is_ok())),
            _ => None,
        })
        .collect();
    assert_eq!(
        done,
        vec![(2 * ser + 2 * lat, true), (3 * ser + 2 * lat, true)],
        "seed {seed}"
    );
    let oob = seen
        .iter()
        .find(|(_, _, c)| matches!(c, Completion::Write { wr: WrId(3), .. }))
        .unwrap();
    assert!(
        matches!(
            oob.2,
            Completion::Write {
                result: Err(TransportError::RemoteAccess { .. }),
                ..
            }
        ),
        "{oob:?}"
    );
    assert_eq!(f.stats().bytes_delivered, 2 * len);
}
