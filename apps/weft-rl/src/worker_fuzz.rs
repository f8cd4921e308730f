//! Fuzzing what a rank takes from its parent and its peers: the spec line
//! ([`Spec::decode`]), the hex descriptor words of `ep`/`dir` lines
//! ([`unhex`]) and the rank records in a rendezvous store
//! ([`RankRecord`]), from arbitrary input and from mutated valid
//! encodings. No panic; a garbled value is refused, never truncated into
//! another valid one; whatever is accepted round-trips. (The descriptor
//! decoder's allocation bound is checked with the engine's `wire_fuzz`.)

use crate::worker::{hex, unhex, RankRecord, Spec};
use proptest::prelude::*;
use std::sync::Arc;
use weft::rendezvous::{MemStore, Namespace, Records, Store};
use weft::{Incarnation, MrDesc, NetAddr, Rkey};
use weft_rl::models::{InferLayout, TrainLayout};
use weft_testkit::fuzz::{self, mutated};

/// Cases per property (a few seconds each on 2 loaded cores).
const CASES: u32 = 100_000;

fn word() -> impl Strategy<Value = String> {
    "[a-z0-9:/._-]{1,12}"
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        (word(), word()),
        (any::<u32>(), any::<u32>(), any::<u32>()),
        (any::<u32>(), any::<u32>(), any::<u32>()),
        (0usize..64, any::<u64>(), any::<u64>(), any::<u64>()),
        proptest::option::of((word(), word())),
    )
        .prop_map(
            |(
                (provider, model),
                (fsdp, pp, ep),
                (ranks, instance, attn_tp),
                (nics, unit_bytes, watermark, timeout_ms),
                rendezvous,
            )| Spec {
                provider,
                model,
                train: TrainLayout {
                    fsdp,
                    pp,
                    ep,
                    tp: 1,
                    replicas: 1,
                },
                infer: InferLayout {
                    ranks,
                    instance,
                    attn_tp,
                    pp: 1,
                },
                nics,
                unit_bytes,
                watermark,
                timeout_ms,
                rendezvous,
            },
        )
}

fn desc() -> impl Strategy<Value = MrDesc> {
    (
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec(
            (proptest::collection::vec(any::<u8>(), 0..12), any::<u64>()),
            0..4,
        ),
        any::<u64>(),
    )
        .prop_map(|(addr, len, keys, inc)| MrDesc {
            addr,
            len,
            rkeys: keys
                .into_iter()
                .map(|(a, k)| (NetAddr(a), Rkey(k)))
                .collect(),
            incarnation: Incarnation(inc),
        })
}

/// A string mutated byte-wise (kept only if still UTF-8).
fn mutated_str(s: String) -> impl Strategy<Value = String> {
    mutated(s.into_bytes()).prop_map(|b| String::from_utf8_lossy(&b).into_owned())
}

proptest! {
    #![proptest_config(fuzz::config(CASES))]

    /// Specs round-trip; mutated spec lines never panic, and what decodes
    /// re-encodes to a line that decodes to the same spec.
    #[test]
    fn spec_lines((s, line) in spec().prop_flat_map(|s| {
        let e = s.encode();
        (Just(s), mutated_str(e))
    })) {
        prop_assert_eq!(Spec::decode(&s.encode()).unwrap(), s);
        if let Ok(d) = Spec::decode(&line) {
            prop_assert_eq!(Spec::decode(&d.encode()).unwrap(), d);
        }
    }

    /// A number too large for its field is refused, never truncated.
    #[test]
    fn spec_numbers_out_of_range_are_refused(s in spec(), big in (1u64 << 32)..) {
        let line = s.encode();
        for key in ["fsdp", "pp", "ep", "inf", "instance", "tp", "nics"] {
            let mut parts: Vec<String> = line.split(';').map(str::to_string).collect();
            for p in &mut parts {
                if p.split_once('=').is_some_and(|(k, _)| k == key) {
                    *p = format!("{key}={big}");
                }
            }
            prop_assert!(Spec::decode(&parts.join(";")).is_err(), "{} accepted", key);
        }
    }

    /// Arbitrary text as a spec line or a hex word: no panic.
    #[test]
    fn arbitrary_text(s in ".{0,200}") {
        let _ = Spec::decode(&s);
        let _ = unhex(&s);
    }

    /// Hex words: descriptors round-trip; mutated words never panic, are
    /// accepted only as an even number of hex digits, and what they decode
    /// to round-trips.
    #[test]
    fn hex_words((d, w) in desc().prop_flat_map(|d| {
        let h = hex(&d);
        (Just(d), mutated_str(h))
    })) {
        prop_assert_eq!(unhex(&hex(&d)).unwrap(), Some(d));
        if let Ok(Some(back)) = unhex(&w) {
            prop_assert!(w.len().is_multiple_of(2) && w.bytes().all(|c| c.is_ascii_hexdigit()));
            prop_assert_eq!(unhex(&hex(&back)).unwrap(), Some(back));
        }
    }

    /// Rank records read from a store holding arbitrary or damaged bytes
    /// under some names: no panic; listing returns exactly the good
    /// records, and the rest are counted as skipped.
    #[test]
    fn rank_records_in_a_damaged_store(
        good in proptest::collection::vec((any::<u64>(), proptest::collection::vec(proptest::option::of(desc()), 0..3)), 1..4),
        bad in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..4),
    ) {
        let store: Arc<dyn Store> = Arc::new(MemStore::with_manual_clock());
        let ns = Namespace::new(store.clone(), "fuzz");
        let recs: Records<RankRecord> = Records::new(&ns, "rl-ranks");
        let mut want = Vec::new();
        for (i, (generation, descs)) in good.into_iter().enumerate() {
            let rec = RankRecord { generation, descs };
            let name = format!("trainer-{i}");
            let bytes = weft::encode(&(weft::rendezvous::FORMAT_VERSION, &rec)).unwrap();
            store.put(&format!("weft/fuzz/app/rl-ranks/{name}"), &bytes, None).unwrap();
            want.push((name, rec.generation));
        }
        let mut planted = 0;
        for (i, b) in bad.iter().enumerate() {
            let name = format!("zz-bad-{i}");
            store.put(&format!("weft/fuzz/app/rl-ranks/{name}"), b, None).unwrap();
            if recs.get(&name).is_ok() {
                // Random bytes that happen to be a record: a good one.
                want.push((name, recs.get(&format!("zz-bad-{i}")).unwrap().unwrap().generation));
            } else {
                planted += 1;
            }
        }
        let before = ns.skipped_records();
        let got: Vec<(String, u64)> = recs
            .list()
            .unwrap()
            .into_iter()
            .map(|(n, r)| (n, r.generation))
            .collect();
        prop_assert_eq!(got, want);
        prop_assert_eq!(ns.skipped_records() - before, planted);
    }
}
