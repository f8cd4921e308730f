//! Fuzzing the records a store hands back: weft's peer and memory records
//! and an application's records, from arbitrary bytes and from mutated
//! valid encodings, read through the public API (look-ups, listings).
//! No panic; no allocation beyond what the bytes can hold (a length prefix
//! claiming 2^60 elements is refused before anything that size is
//! allocated); a peer record is only ever returned under the name its key
//! gives it; bad records are skipped and counted, never fatal to a
//! listing.

use std::sync::Arc;

use proptest::prelude::*;
use weft_rendezvous::{MemStore, MrRecord, Namespace, PeerRecord, Records, Store, FORMAT_VERSION};
use weft_testkit::fuzz::{self, mutated, peak_during};
use weft_transport::{Incarnation, MrDesc, NetAddr, Rkey};

/// The most a decode of `len` bytes may allocate (at most 32 bytes of
/// memory per input byte, doubled for a growing vector, plus slack for
/// the key strings and the error message).
fn alloc_bound(len: usize) -> usize {
    64 * len + 8192
}

/// Cases per property (a few seconds each on 2 loaded cores).
const CASES: u32 = 500_000;

fn name() -> impl Strategy<Value = String> {
    prop_oneof![Just("a".to_string()), Just("b".to_string()), "[a-z]{1,6}"]
}

fn peer_record() -> impl Strategy<Value = PeerRecord> {
    (
        name(),
        any::<u64>(),
        proptest::collection::vec(
            proptest::collection::vec(
                proptest::collection::vec(any::<u8>(), 0..12).prop_map(NetAddr),
                0..3,
            ),
            0..3,
        ),
    )
        .prop_map(|(name, generation, groups)| PeerRecord {
            name,
            generation,
            groups,
        })
}

fn mr_record() -> impl Strategy<Value = MrRecord> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec(
            (proptest::collection::vec(any::<u8>(), 0..12), any::<u64>()),
            0..3,
        ),
        any::<u64>(),
    )
        .prop_map(|(generation, addr, len, keys, inc)| MrRecord {
            generation,
            desc: MrDesc {
                addr,
                len,
                rkeys: keys
                    .into_iter()
                    .map(|(a, k)| (NetAddr(a), Rkey(k)))
                    .collect(),
                incarnation: Incarnation(inc),
            },
        })
}

fn record<T: serde::Serialize>(rec: &T) -> Vec<u8> {
    postcard::to_stdvec(&(FORMAT_VERSION, rec)).unwrap()
}

/// One in-memory store and namespace per test thread (no reaper thread).
fn ns() -> (Arc<dyn Store>, Namespace) {
    let store: Arc<dyn Store> = Arc::new(MemStore::with_manual_clock());
    let ns = Namespace::new(store.clone(), "f");
    (store, ns)
}

/// Stores `bytes` as peer `key` and as memory region `key/m`, looks both
/// up and lists: no panic, bounded allocation, and a peer record comes
/// back only under its own name.
fn check(key: &str, bytes: &[u8]) -> Result<(), TestCaseError> {
    let (store, ns) = ns();
    store
        .put(&format!("weft/f/peers/{key}"), bytes, None)
        .unwrap();
    store
        .put(&format!("weft/f/mrs/{key}/m"), bytes, None)
        .unwrap();
    let (r, peak) = peak_during(|| ns.peer(key));
    prop_assert!(
        peak <= alloc_bound(bytes.len()),
        "peer: {peak} bytes for {}",
        bytes.len()
    );
    let ok = match r {
        Ok(Some(p)) => {
            prop_assert_eq!(&p.name, key, "a record returned under another name");
            true
        }
        Ok(None) => unreachable!("the key is there"),
        Err(_) => false,
    };
    let (list, peak) = peak_during(|| ns.peers());
    prop_assert!(peak <= alloc_bound(bytes.len()), "peers: {peak} bytes");
    let list = list.expect("a listing never fails on a bad record");
    prop_assert_eq!(list.len(), usize::from(ok));
    prop_assert!(list.iter().all(|p| p.name == key));
    let (_, peak) = peak_during(|| ns.mr(key, "m"));
    prop_assert!(peak <= alloc_bound(bytes.len()), "mr: {peak} bytes");
    let apps: Records<Vec<(u64, String)>> = Records::new(&ns, "k");
    store
        .put(&format!("weft/f/app/k/{key}"), bytes, None)
        .unwrap();
    let (l, peak) = peak_during(|| apps.list());
    prop_assert!(peak <= alloc_bound(bytes.len()), "app list: {peak} bytes");
    prop_assert!(l.is_ok());
    Ok(())
}

proptest! {
    #![proptest_config(fuzz::config(CASES))]

    /// Arbitrary bytes as records.
    #[test]
    fn records_from_arbitrary_bytes(key in name(), bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        check(&key, &bytes)?;
    }

    /// Valid peer records (under their own key or another one), mutated:
    /// the unmutated one is returned exactly when its name is its key's.
    #[test]
    fn peer_records_mutated(
        key in name(),
        (rec, bytes) in peer_record().prop_flat_map(|r| {
            let b = record(&r);
            (Just(r), mutated(b))
        }),
    ) {
        let (store, ns) = ns();
        store.put(&format!("weft/f/peers/{key}"), &record(&rec), None).unwrap();
        let got = ns.peers().unwrap();
        if rec.name == key {
            prop_assert_eq!(got, vec![rec]);
            prop_assert_eq!(ns.skipped_records(), 0);
        } else {
            prop_assert!(got.is_empty(), "an impostor was listed");
            prop_assert_eq!(ns.skipped_records(), 1);
        }
        check(&key, &bytes)?;
    }

    /// Valid memory records, mutated: whatever decodes round-trips.
    #[test]
    fn mr_records_mutated(bytes in mr_record().prop_flat_map(|r| mutated(record(&r)))) {
        let (store, ns) = ns();
        store.put("weft/f/mrs/p/m", &bytes, None).unwrap();
        let (r, peak) = peak_during(|| ns.mr("p", "m"));
        prop_assert!(peak <= alloc_bound(bytes.len()), "{peak} bytes");
        if let Ok(Some(rec)) = r {
            store.put("weft/f/mrs/p/n", &record(&rec), None).unwrap();
            prop_assert_eq!(ns.mr("p", "n").unwrap(), Some(rec));
        }
    }
}

/// Length prefixes claiming 2^60 (or 2^64 - 1) elements or bytes, for the
/// name, the groups and the addresses of a peer record: refused, counted,
/// and nothing near that size allocated.
#[test]
fn huge_length_prefixes_are_refused_before_allocating() {
    assert!(
        fuzz::tracking(),
        "the test binary's allocator is TrackingAlloc"
    );
    let version = fuzz::varint(u64::from(FORMAT_VERSION));
    for claim in [1u64 << 60, u64::MAX, u64::from(u32::MAX)] {
        let v = fuzz::varint(claim);
        let name_len = [&version[..], &v, b"abc"].concat();
        let groups = [&version[..], &[1, b'a', 7][..], &v, &[0; 8]].concat();
        let addrs = [&version[..], &[1, b'a', 7, 1][..], &v, &[0; 8]].concat();
        for bytes in [name_len, groups, addrs] {
            let (store, ns) = ns();
            store.put("weft/f/peers/a", &bytes, None).unwrap();
            let (r, peak) = peak_during(|| ns.peer("a"));
            assert!(r.is_err(), "claim {claim}: {r:?}");
            assert!(
                peak <= alloc_bound(bytes.len()),
                "claim {claim}: {peak} bytes"
            );
            assert_eq!(ns.peers().unwrap(), vec![]);
            assert_eq!(ns.skipped_records(), 2);
        }
    }
}
