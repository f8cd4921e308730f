//! Fuzzing what MoE ranks take from each other: the [`RankInfo`] exchanged
//! before `connect` (postcard) and the route rows peers write into a
//! rank's route buffer (E little-endian `u32` counts), from arbitrary bytes
//! and from mutated valid encodings. No panic; no allocation beyond what
//! the input can hold; a route row is accepted only if it has E counts
//! summing to at most T·R, and then exactly as written (a refused row
//! leaves the matrix unchanged).

use proptest::prelude::*;
use weft::{GroupAddress, Incarnation, MrDesc, NetAddr, Rkey};
use weft_moe::{Dims, MoeConfig, RankInfo, RouteMatrix};
use weft_testkit::fuzz::{self, mutated, peak_during};

/// The most a decode of `len` input bytes may allocate (see the engine's
/// `wire_fuzz`: at most 32 bytes of memory per input byte, doubled, plus
/// slack).
fn alloc_bound(len: usize) -> usize {
    64 * len + 4096
}

fn desc() -> impl Strategy<Value = MrDesc> {
    (
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec(
            (proptest::collection::vec(any::<u8>(), 0..16), any::<u64>()),
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

fn rank_info() -> impl Strategy<Value = RankInfo> {
    (
        any::<u32>(),
        proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..16), 0..4),
        any::<u64>(),
        desc(),
        desc(),
        any::<u64>(),
    )
        .prop_map(|(rank, nics, inc, route, recv, config_hash)| RankInfo {
            rank,
            addr: GroupAddress {
                nics: nics.into_iter().map(NetAddr).collect(),
                incarnation: Incarnation(inc),
            },
            route,
            recv,
            config_hash,
        })
}

/// Small valid shapes: N ranks, E = N·L experts, R, T.
fn dims() -> impl Strategy<Value = Dims> {
    (1u32..6, 1u32..5, 1u32..5, 1u32..40).prop_map(|(n, l, r, t)| {
        MoeConfig::new(n, n * l, r, t, 64, 32)
            .validate()
            .expect("a valid shape")
    })
}

/// What `set_row_le_bytes` must do with `bytes` for row `s`.
fn row_ok(d: &Dims, s: u32, bytes: &[u8]) -> Option<Vec<u32>> {
    if s >= d.ranks || bytes.len() as u64 != d.route_row_len() {
        return None;
    }
    let row: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let sum: u64 = row.iter().map(|&c| u64::from(c)).sum();
    (sum <= d.max_pairs()).then_some(row)
}

/// Sets row `s` from `bytes` on a matrix whose rows hold a marker, and
/// checks the outcome against [`row_ok`].
fn check_row(d: &Dims, s: u32, bytes: &[u8]) -> Result<(), TestCaseError> {
    let marker: Vec<Vec<u32>> = (0..d.ranks)
        .map(|r| {
            let mut row = vec![0u32; d.experts as usize];
            row[0] = r.min(u32::try_from(d.max_pairs()).unwrap_or(u32::MAX));
            row
        })
        .collect();
    let mut m = RouteMatrix::from_rows(d, &marker).expect("marker rows");
    let r = m.set_row_le_bytes(d, s, bytes);
    match row_ok(d, s, bytes) {
        Some(row) => {
            prop_assert!(r.is_ok(), "a valid row refused: {r:?}");
            prop_assert_eq!(m.row(s), &row[..]);
        }
        None => {
            prop_assert!(
                r.is_err(),
                "an invalid row of {} bytes accepted",
                bytes.len()
            );
            if s < d.ranks {
                prop_assert_eq!(
                    m.row(s),
                    &marker[s as usize][..],
                    "a refused row changed the matrix"
                );
            }
        }
    }
    for other in (0..d.ranks).filter(|&o| o != s) {
        prop_assert_eq!(m.row(other), &marker[other as usize][..]);
    }
    Ok(())
}

/// A valid row for `d`: counts summing to at most T·R.
fn valid_row(d: Dims) -> impl Strategy<Value = (Dims, Vec<u8>)> {
    let e = d.experts as usize;
    let cap = d.max_pairs();
    proptest::collection::vec(0u64..=cap, e).prop_map(move |v| {
        let mut left = cap;
        let mut out = Vec::with_capacity(e * 4);
        for c in v {
            let c = c.min(left);
            left -= c;
            out.extend_from_slice(&(c as u32).to_le_bytes());
        }
        (d.clone(), out)
    })
}

/// Cases per property (a few seconds each on 2 loaded cores).
const CASES: u32 = 200_000;

proptest! {
    #![proptest_config(fuzz::config(CASES))]

    /// Arbitrary bytes as a rank's info: no panic, bounded allocation.
    #[test]
    fn rank_info_from_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let (_, peak) = peak_during(|| RankInfo::from_bytes(&bytes));
        prop_assert!(peak <= alloc_bound(bytes.len()), "{peak} bytes for {}", bytes.len());
    }

    /// Valid rank infos, mutated: no panic, bounded allocation; whatever
    /// decodes round-trips; the unmutated encoding decodes to itself.
    #[test]
    fn rank_info_mutated((info, bytes) in rank_info().prop_flat_map(|i| {
        let b = i.to_bytes();
        (Just(i), mutated(b))
    })) {
        prop_assert_eq!(RankInfo::from_bytes(&info.to_bytes()).unwrap(), info);
        let (r, peak) = peak_during(|| RankInfo::from_bytes(&bytes));
        prop_assert!(peak <= alloc_bound(bytes.len()), "{peak} bytes for {}", bytes.len());
        if let Ok(i) = r {
            prop_assert_eq!(RankInfo::from_bytes(&i.to_bytes()).unwrap(), i);
        }
    }

    /// Arbitrary bytes as a route row, for any row index: accepted exactly
    /// when valid.
    #[test]
    fn route_rows_from_arbitrary_bytes(
        d in dims(),
        s in prop_oneof![0u32..6, any::<u32>()],
        bytes in proptest::collection::vec(any::<u8>(), 0..96),
    ) {
        check_row(&d, s, &bytes)?;
    }

    /// Valid route rows, mutated (counts inflated, cut, extended): accepted
    /// exactly when still valid.
    #[test]
    fn route_rows_mutated(
        (d, bytes) in dims().prop_flat_map(valid_row).prop_flat_map(|(d, b)| (Just(d), mutated(b))),
        s in 0u32..6,
    ) {
        check_row(&d, s, &bytes)?;
    }
}

/// Trailing bytes after a valid rank info, and length prefixes claiming
/// 2^60 elements: refused, and nothing near that size allocated.
#[test]
fn rank_info_refuses_trailing_bytes_and_huge_lengths() {
    assert!(
        fuzz::tracking(),
        "the test binary's allocator is TrackingAlloc"
    );
    let info = RankInfo {
        rank: 3,
        addr: GroupAddress {
            nics: vec![NetAddr(vec![1; 8])],
            incarnation: Incarnation(9),
        },
        route: MrDesc {
            addr: 1,
            len: 2,
            rkeys: vec![(NetAddr(vec![1; 8]), Rkey(3))],
            incarnation: Incarnation(9),
        },
        recv: MrDesc {
            addr: 4,
            len: 5,
            rkeys: vec![(NetAddr(vec![1; 8]), Rkey(6))],
            incarnation: Incarnation(9),
        },
        config_hash: 7,
    };
    let mut b = info.to_bytes();
    assert_eq!(RankInfo::from_bytes(&b).unwrap(), info);
    b.push(0);
    assert!(RankInfo::from_bytes(&b).is_err(), "trailing bytes");
    for claim in [1u64 << 60, u64::MAX, u64::from(u32::MAX)] {
        // The group address's NIC count, then a few bytes.
        let bytes = [&[3u8][..], &fuzz::varint(claim), &[1; 32]].concat();
        let (r, peak) = peak_during(|| RankInfo::from_bytes(&bytes));
        assert!(r.is_err());
        assert!(
            peak <= alloc_bound(bytes.len()),
            "claim {claim}: {peak} bytes"
        );
    }
}
