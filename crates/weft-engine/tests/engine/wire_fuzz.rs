//! Fuzzing the descriptors peers hand each other out of band: `MrDesc` and
//! `GroupAddress` decoded from arbitrary bytes and from mutated valid
//! encodings (`weft_transport::decode`, postcard). No panic; no allocation
//! beyond what the input can hold (a length prefix claiming 2^60 elements
//! is refused before anything that size is allocated: postcard gives serde
//! no size hint larger than the bytes left); and, end to end, no decoded
//! descriptor — however damaged — retires the live peer it names.
//! (The SEND frame's fuzz properties are the engine's unit tests,
//! `frame::tests`.)

use crate::common::*;
use proptest::prelude::*;
use weft_engine::{GroupAddress, MrDesc, OnDone};
use weft_loopback::{Fabric, FabricConfig};
use weft_testkit::fuzz::{self, mutated, peak_during};
use weft_transport::{decode, encode, Incarnation, NetAddr, Rkey};

/// The most a decode of `len` input bytes may allocate: every element of
/// a sequence costs at least one input byte and at most 32 bytes of
/// memory (`(NetAddr, Rkey)`), doubled for a growing vector, plus slack.
fn alloc_bound(len: usize) -> usize {
    64 * len + 4096
}

fn netaddr() -> impl Strategy<Value = NetAddr> {
    proptest::collection::vec(any::<u8>(), 0..24).prop_map(NetAddr)
}

fn mrdesc() -> impl Strategy<Value = MrDesc> {
    (
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec((netaddr(), any::<u64>()), 0..5),
        any::<u64>(),
    )
        .prop_map(|(addr, len, keys, inc)| MrDesc {
            addr,
            len,
            rkeys: keys.into_iter().map(|(a, k)| (a, Rkey(k))).collect(),
            incarnation: Incarnation(inc),
        })
}

fn group_address() -> impl Strategy<Value = GroupAddress> {
    (proptest::collection::vec(netaddr(), 0..5), any::<u64>()).prop_map(|(nics, inc)| {
        GroupAddress {
            nics,
            incarnation: Incarnation(inc),
        }
    })
}

/// Decodes `bytes` as both descriptor types; checks the allocation bound.
fn decode_both(bytes: &[u8]) -> Result<(), TestCaseError> {
    let (_, peak) = peak_during(|| decode::<MrDesc>(bytes));
    prop_assert!(
        peak <= alloc_bound(bytes.len()),
        "MrDesc decode of {} bytes allocated {peak}",
        bytes.len()
    );
    let (_, peak) = peak_during(|| decode::<GroupAddress>(bytes));
    prop_assert!(
        peak <= alloc_bound(bytes.len()),
        "GroupAddress decode of {} bytes allocated {peak}",
        bytes.len()
    );
    Ok(())
}

/// Cases per decoding property (a few seconds each on 2 loaded cores).
const CASES: u32 = 500_000;
/// Cases of the end-to-end property (each drives two engines).
const E2E_CASES: u32 = 200_000;

proptest! {
    #![proptest_config(fuzz::config(CASES))]

    /// Arbitrary bytes never panic either decoder or allocate beyond the
    /// bound.
    #[test]
    fn descriptors_from_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_both(&bytes)?;
    }

    /// Valid `MrDesc` encodings, mutated (flips, cuts, splices, inflated
    /// length prefixes): no panic, bounded allocation; whatever decodes
    /// re-encodes to a value that decodes to itself.
    #[test]
    fn mrdesc_mutated(bytes in mrdesc().prop_flat_map(|d| mutated(encode(&d).unwrap()))) {
        decode_both(&bytes)?;
        if let Ok(d) = decode::<MrDesc>(&bytes) {
            let again = encode(&d).unwrap();
            prop_assert_eq!(decode::<MrDesc>(&again).unwrap(), d);
        }
    }

    /// Valid `GroupAddress` encodings, mutated: as for `MrDesc`.
    #[test]
    fn group_address_mutated(bytes in group_address().prop_flat_map(|g| mutated(encode(&g).unwrap()))) {
        decode_both(&bytes)?;
        if let Ok(g) = decode::<GroupAddress>(&bytes) {
            let again = encode(&g).unwrap();
            prop_assert_eq!(decode::<GroupAddress>(&again).unwrap(), g);
        }
    }
}

/// A length prefix claiming 2^60 (or 2^64 - 1) elements, in front of a
/// few bytes, at every sequence of both descriptors: refused, and nothing
/// near that size allocated.
#[test]
fn huge_length_prefixes_are_refused_before_allocating() {
    assert!(
        fuzz::tracking(),
        "the test binary's allocator is TrackingAlloc"
    );
    for claim in [1u64 << 60, u64::MAX, 1 << 40, u64::from(u32::MAX)] {
        let v = fuzz::varint(claim);
        let desc_rkeys = [&[1u8, 2][..], &v, &[0; 16]].concat();
        let addr_nics = [&v[..], &[3u8; 16]].concat();
        let netaddr_len = [&[1u8, 2, 1][..], &v, &[9; 8]].concat();
        for bytes in [&desc_rkeys, &addr_nics, &netaddr_len] {
            let (r, peak) = peak_during(|| decode::<MrDesc>(bytes));
            assert!(r.is_err(), "claim {claim}: {r:?}");
            assert!(
                peak <= alloc_bound(bytes.len()),
                "claim {claim}: {peak} bytes"
            );
            let (r, peak) = peak_during(|| decode::<GroupAddress>(bytes));
            assert!(r.is_err(), "claim {claim}: {r:?}");
            assert!(
                peak <= alloc_bound(bytes.len()),
                "claim {claim}: {peak} bytes"
            );
        }
    }
}

proptest! {
    #![proptest_config(fuzz::config(E2E_CASES))]

    /// End to end: B's real descriptor, encoded, mutated and decoded, is
    /// used for a write from A (when it decodes); whatever happens to that
    /// write, a write with B's real descriptor succeeds right after. No
    /// damaged descriptor retires the live peer.
    #[test]
    fn no_damaged_descriptor_retires_the_live_peer(
        seed in 0u64..4,
        muts in proptest::collection::vec(fuzz::mutation(), 1..3),
    ) {
        E2E.with(|e| {
            let mut slot = e.borrow_mut();
            let env = slot.get_or_insert_with(|| E2e::new(seed));
            let mut bytes = encode(&env.bdesc).unwrap();
            for m in &muts {
                fuzz::apply(&mut bytes, m);
            }
            if let Ok(d) = decode::<MrDesc>(&bytes) {
                let len = d.len.min(64);
                let (od, f) = OnDone::flag();
                if env.ea.submit_single_write(len, None, (&env.sh, 0), (&d, 0), od).is_ok() {
                    drive(&env.fabric, &env.engines(), || f.is_done());
                }
            }
            let (od, f) = OnDone::flag();
            env.ea
                .submit_single_write(64, None, (&env.sh, 0), (&env.bdesc, 128), od)
                .unwrap();
            drive(&env.fabric, &env.engines(), || f.is_done());
            prop_assert!(
                matches!(f.result(), Some(Ok(()))),
                "after {:?}: {:?}",
                decode::<MrDesc>(&bytes),
                f.result()
            );
            Ok(())
        })?;
    }
}

/// Two manual engines A and B, B live at A, and B's descriptor, kept
/// across the cases of the end-to-end property (one set per test thread).
struct E2e {
    fabric: Fabric,
    ea: weft_engine::TransferEngine,
    eb: weft_engine::TransferEngine,
    sh: weft_engine::MrHandle,
    bdesc: MrDesc,
    _bufs: (HostBuffer, HostBuffer),
}

impl E2e {
    fn new(seed: u64) -> Self {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let ea = engine(&fabric, a, 1, test_config(), true);
        let eb = engine(&fabric, b, 1, test_config(), true);
        let src = mem::patterned(seed, 4096);
        let dst = mem::zeroed(4096);
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, bdesc) = eb.reg_mr(dst.region()).unwrap();
        // B is live at A before any damaged descriptor: one write with the
        // real one first. (Without it, a damaged descriptor that names B's
        // NIC with another incarnation could be A's first contact with that
        // address and be bound there; docs/engine.md, "Known limits".)
        let (od, f) = OnDone::flag();
        ea.submit_single_write(64, None, (&sh, 0), (&bdesc, 0), od)
            .unwrap();
        drive(&fabric, &[ea.clone(), eb.clone()], || f.is_done());
        assert_eq!(
            f.result(),
            Some(Ok(())),
            "seed {seed}: the first real write"
        );
        E2e {
            fabric,
            ea,
            eb,
            sh,
            bdesc,
            _bufs: (src, dst),
        }
    }

    fn engines(&self) -> [weft_engine::TransferEngine; 2] {
        [self.ea.clone(), self.eb.clone()]
    }
}

impl Drop for E2e {
    fn drop(&mut self) {
        self.ea.shutdown();
        self.eb.shutdown();
    }
}

thread_local! {
    static E2E: std::cell::RefCell<Option<E2e>> = const { std::cell::RefCell::new(None) };
}
