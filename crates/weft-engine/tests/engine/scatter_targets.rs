//! Scatters to prepared destinations (`TransferEngine::scatter_targets`,
//! `submit_scatter_to`) in manual mode over the adversarial loopback
//! fabric (step mode): they land the bytes, immediates and per-NIC spread
//! that `submit_scatter` gives the same slices, round after round with
//! other offsets and lengths on the same targets; descriptors that do not
//! match their members are resolved by address as `submit_scatter` does;
//! a removed member fails its scatter as it does there; every refusal is
//! typed and leaves nothing queued.

use crate::common::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weft_engine::{
    EngineError, GroupAddress, MrDesc, MrHandle, OnDone, PeerGroupHandle, ScatterDst, ScatterMode,
    ScatterSlice, ScatterTargets, TransferEngine,
};
use weft_loopback::{Fabric, FabricConfig};
use weft_transport::HostBuffer;

/// Bytes of each peer's destination region.
const REGION: usize = 16 << 10;
/// Bytes of the sender's source registration.
const SRC: usize = 64 << 10;

/// A sender and `n` peers with `nics` NICs each (manual mode). Each peer
/// registers two regions: `a` (written by prepared scatters) and `b`
/// (written by `submit_scatter` with the same slices).
struct Star {
    fabric: Fabric,
    sender: TransferEngine,
    peers: Vec<TransferEngine>,
    src: Arc<HostBuffer>,
    sh: MrHandle,
    a: Vec<Arc<HostBuffer>>,
    b: Vec<Arc<HostBuffer>>,
    adesc: Vec<MrDesc>,
    bdesc: Vec<MrDesc>,
    group: PeerGroupHandle,
}

impl Star {
    fn new(seed: u64, n: usize, nics: usize) -> Star {
        Star::on(FabricConfig::adversarial(seed), seed, n, nics)
    }

    /// [`Star::new`] on a fabric with `cfg`.
    fn on(cfg: FabricConfig, seed: u64, n: usize, nics: usize) -> Star {
        let fabric = Fabric::new(cfg);
        let hs = fabric.add_host(nics);
        let sender = engine(&fabric, hs, nics, test_config(), true);
        let peers: Vec<TransferEngine> = (0..n)
            .map(|_| {
                let h = fabric.add_host(nics);
                engine(&fabric, h, nics, test_config(), true)
            })
            .collect();
        let src = Arc::new(mem::patterned(seed, SRC));
        let (sh, _) = sender.reg_mr(src.region()).unwrap();
        let (mut a, mut b, mut adesc, mut bdesc) = (vec![], vec![], vec![], vec![]);
        for p in &peers {
            for (bufs, descs) in [(&mut a, &mut adesc), (&mut b, &mut bdesc)] {
                let buf = Arc::new(mem::zeroed(REGION));
                let (_, d) = p.reg_mr(buf.region()).unwrap();
                bufs.push(buf);
                descs.push(d);
            }
        }
        let addrs: Vec<GroupAddress> = peers.iter().map(|p| p.main_address()).collect();
        let group = sender.add_peer_group(&addrs).unwrap();
        Star {
            fabric,
            sender,
            peers,
            src,
            sh,
            a,
            b,
            adesc,
            bdesc,
            group,
        }
    }

    fn all(&self) -> Vec<TransferEngine> {
        let mut v = vec![self.sender.clone()];
        v.extend(self.peers.iter().cloned());
        v
    }

    /// Arms immediate `imm` on every peer for a scatter of `slices[j]` to
    /// peer `dest(j)`; returns the count of rounds that fired.
    fn arm(
        &self,
        imm: u32,
        slices: &[ScatterSlice],
        mode: ScatterMode,
        dest: impl Fn(usize) -> usize,
    ) -> Arc<AtomicU64> {
        let fired = Arc::new(AtomicU64::new(0));
        let mut want = vec![0u64; self.peers.len()];
        for (j, s) in slices.iter().enumerate() {
            let p = &self.peers[dest(j)];
            want[dest(j)] += p.imm_counts(0).unwrap().scatter_dst(s.len, mode);
        }
        for (p, n) in self.peers.iter().zip(want) {
            let f = fired.clone();
            p.expect_imm_count(imm, n, move |r| {
                assert!(r.is_ok(), "imm round failed: {r:?}");
                f.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        }
        fired
    }

    /// Submits with `submit`, arms `imm` first, drives until the scatter and
    /// every peer's round are done; returns the bytes posted per sender NIC.
    fn run(
        &self,
        imm: u32,
        slices: &[ScatterSlice],
        mode: ScatterMode,
        dest: impl Fn(usize) -> usize,
        submit: impl FnOnce(OnDone) -> Result<weft_engine::TransferId, EngineError>,
    ) -> Vec<u64> {
        let before = self.posted();
        let fired = self.arm(imm, slices, mode, dest);
        let (od, flag) = OnDone::flag();
        submit(od).unwrap();
        let n = self.peers.len() as u64;
        drive(&self.fabric, &self.all(), || {
            flag.is_done() && fired.load(Ordering::SeqCst) == n
        });
        assert_eq!(flag.result(), Some(Ok(())));
        self.sender.progress(); // publishes the stats
        self.posted()
            .iter()
            .zip(before)
            .map(|(a, b)| a - b)
            .collect()
    }

    fn posted(&self) -> Vec<u64> {
        self.sender.stats().groups[0]
            .nics
            .iter()
            .map(|n| n.bytes_posted)
            .collect()
    }

    fn shutdown(&self) {
        for e in self.all() {
            e.shutdown();
        }
    }
}

/// Round `r`'s slices, from the seed: lengths 0…2000 (one destination in
/// four gets 0 bytes in some round), source offsets anywhere, destination
/// offsets in round `r`'s quarter of the region.
fn slices(seed: u64, r: u64, n: usize) -> Vec<ScatterSlice> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (r + 1);
    let mut next = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let quarter = (REGION / 4) as u64;
    (0..n)
        .map(|j| {
            let len = if (j as u64 + r).is_multiple_of(4) && r > 0 {
                0
            } else {
                1 + next(2000)
            };
            ScatterSlice {
                src_offset: next(SRC as u64 - len),
                dst_offset: r * quarter + next(quarter - len),
                len,
            }
        })
        .collect()
}

/// What each destination buffer must hold after `rounds`: the source bytes
/// of every slice written to it, zero elsewhere.
fn expected(src: &HostBuffer, rounds: &[Vec<ScatterSlice>], dest_of: usize) -> Vec<u8> {
    let mut want = vec![0u8; REGION];
    for s in rounds.iter().filter_map(|r| r.get(dest_of)) {
        let (d, so, l) = (s.dst_offset as usize, s.src_offset as usize, s.len as usize);
        want[d..d + l].copy_from_slice(&src.bytes(so, l));
    }
    want
}

/// `submit_scatter`'s destinations for `slices`: slice `j` into `dst(j)`.
fn dsts_of<'a>(slices: &[ScatterSlice], dst: impl Fn(usize) -> &'a MrDesc) -> Vec<ScatterDst> {
    slices
        .iter()
        .enumerate()
        .map(|(j, s)| ScatterDst {
            len: s.len,
            src_offset: s.src_offset,
            dst: dst(j).clone(),
            dst_offset: s.dst_offset,
        })
        .collect()
}

/// `descs` with one rkey each (NIC 0's).
fn narrow(descs: &[MrDesc]) -> Vec<MrDesc> {
    descs
        .iter()
        .map(|d| {
            let mut d = d.clone();
            d.rkeys.truncate(1);
            d
        })
        .collect()
}

impl Star {
    /// What became of a submit: refused (its error), or how it resolved
    /// once driven.
    fn outcome(
        &self,
        r: Result<weft_engine::TransferId, EngineError>,
        flag: &weft_engine::DoneFlag,
    ) -> String {
        match r {
            Err(e) => format!("refused: {e:?}"),
            Ok(_) => {
                drive(&self.fabric, &self.all(), || flag.is_done());
                format!("resolved: {:?}", flag.result())
            }
        }
    }
}

/// Prepared targets give what `submit_scatter` gives for the same slices:
/// the bytes (checked against a model of every slice written), the
/// immediates, and the bytes posted per NIC; the targets are reused for
/// three rounds of other offsets and lengths; both modes, 1 and 2 NICs,
/// slices of one WRITE and of several.
#[test]
fn prepared_scatters_land_what_submit_scatter_lands() {
    for seed in seeds_or([31, 32, 33, 34]) {
        let _g = SeedGuard::new(seed, "prepared_scatters_land_what_submit_scatter_lands");
        let nics = 1 + (seed as usize % 2);
        let mode = if (seed / 2).is_multiple_of(2) {
            ScatterMode::ByPeer
        } else {
            ScatterMode::ByBytes
        };
        // Seeds 33 and 34: WRITEs of at most 700 bytes, so that longer
        // slices take several pieces (the general planning path).
        let cfg = FabricConfig {
            max_write_len: if seed >= 33 { 700 } else { 1 << 40 },
            ..FabricConfig::adversarial(seed)
        };
        let st = Star::on(cfg, seed, 12, nics);
        let targets = st.sender.scatter_targets(&st.group, &st.adesc).unwrap();
        assert!(targets.matched(), "seed {seed}");
        assert_eq!((targets.len(), targets.nics()), (12, nics));
        let mut rounds = Vec::new();
        for r in 0..3u64 {
            let sl = slices(seed, r, 12);
            let imm = 10 + 2 * r as u32;
            let prepared = st.run(
                imm,
                &sl,
                mode,
                |j| j,
                |od| {
                    st.sender
                        .submit_scatter_to_mode(&targets, od, Some(imm), &st.sh, &sl, mode)
                },
            );
            let dsts = dsts_of(&sl, |j| &st.bdesc[j]);
            let plain = st.run(
                imm + 1,
                &sl,
                mode,
                |j| j,
                |od| {
                    st.sender
                        .submit_scatter_mode(&st.group, od, Some(imm + 1), &st.sh, &dsts, mode)
                },
            );
            assert_eq!(
                prepared, plain,
                "seed {seed} round {r}: bytes posted per NIC"
            );
            let total: u64 = sl.iter().map(|s| s.len).sum();
            assert_eq!(prepared.iter().sum::<u64>(), total, "seed {seed} round {r}");
            rounds.push(sl);
        }
        for j in 0..12 {
            let want = expected(&st.src, &rounds, j);
            assert!(
                st.a[j].bytes(0, REGION) == want,
                "seed {seed}: peer {j}: prepared scatter bytes"
            );
            assert!(
                st.b[j].bytes(0, REGION) == want,
                "seed {seed}: peer {j}: submit_scatter bytes"
            );
        }
        for p in &st.peers {
            assert_eq!(p.stats().imm_excess, 0, "seed {seed}");
        }
        st.shutdown();
    }
}

/// Descriptors that are not their member's (each member handed the next
/// member's region) do not match: the targets keep them and every submit
/// resolves them by address, landing where `submit_scatter` lands them.
#[test]
fn unmatched_targets_resolve_by_address() {
    for seed in seeds_or([35, 36]) {
        let _g = SeedGuard::new(seed, "unmatched_targets_resolve_by_address");
        let nics = 1 + (seed as usize % 2);
        let st = Star::new(seed, 5, nics);
        let n = st.peers.len();
        let next = |j: usize| (j + 1) % n;
        let shifted: Vec<MrDesc> = (0..n).map(|j| st.adesc[next(j)].clone()).collect();
        let targets = st.sender.scatter_targets(&st.group, &shifted).unwrap();
        assert!(!targets.matched(), "seed {seed}");
        let mode = ScatterMode::ByPeer;
        let mut rounds = Vec::new();
        for r in 0..2u64 {
            let sl = slices(seed, r, n);
            let imm = 20 + 2 * r as u32;
            let prepared = st.run(imm, &sl, mode, next, |od| {
                st.sender
                    .submit_scatter_to_mode(&targets, od, Some(imm), &st.sh, &sl, mode)
            });
            let dsts = dsts_of(&sl, |j| &st.bdesc[next(j)]);
            let plain = st.run(imm + 1, &sl, mode, next, |od| {
                st.sender
                    .submit_scatter_mode(&st.group, od, Some(imm + 1), &st.sh, &dsts, mode)
            });
            assert_eq!(
                prepared, plain,
                "seed {seed} round {r}: bytes posted per NIC"
            );
            rounds.push(sl);
        }
        for j in 0..n {
            // Peer next(j) received slice j of each round, both ways.
            let want = expected(&st.src, &rounds, j);
            for (bufs, api) in [(&st.a, "prepared"), (&st.b, "submit_scatter")] {
                assert!(
                    bufs[next(j)].bytes(0, REGION) == want,
                    "seed {seed}: {api}: slice {j} at peer {}",
                    next(j)
                );
            }
        }
        st.shutdown();
    }
}

/// A member removed after the targets were made fails the next scatter
/// as it fails `submit_scatter`'s: refused at submit, or resolved with
/// `PeerRemoved` naming that member; nothing is written to either member.
#[test]
fn removed_member_fails_prepared_scatter_like_submit_scatter() {
    for seed in seeds_or([37, 38]) {
        let _g = SeedGuard::new(seed, "removed_member_fails_prepared_scatter");
        let st = Star::new(seed, 2, 1);
        let targets = st.sender.scatter_targets(&st.group, &st.adesc).unwrap();
        st.sender.remove_peer(&st.peers[1].main_address()).unwrap();
        let sl = slices(seed, 0, 2);
        let dsts = dsts_of(&sl, |j| &st.bdesc[j]);
        let (od, fa) = OnDone::flag();
        let a = st.outcome(
            st.sender.submit_scatter_to(&targets, od, None, &st.sh, &sl),
            &fa,
        );
        let (od, fb) = OnDone::flag();
        let b = st.outcome(
            st.sender.submit_scatter(&st.group, od, None, &st.sh, &dsts),
            &fb,
        );
        assert_eq!(a, b, "seed {seed}");
        // Refused at submit, or resolved with `PeerRemoved` naming member 1.
        assert!(
            a.starts_with("refused: PeerRemoved")
                || a.starts_with("resolved: Some(Err(PeerRemoved") && a.contains("member: 1,"),
            "seed {seed}: {a}"
        );
        for (j, buf) in st.a.iter().chain(&st.b).enumerate() {
            assert!(
                buf.bytes(0, REGION).iter().all(|&x| x == 0),
                "seed {seed}: region {j} written"
            );
        }
        st.shutdown();
    }
}

/// Every refusal of `scatter_targets` and `submit_scatter_to` is typed and
/// leaves nothing queued: the scatter submitted after them all completes,
/// and it is the only transfer the sender ran.
#[test]
fn prepared_scatter_refusals_are_typed_and_queue_nothing() {
    let seed = seeds_or([39])[0];
    let _g = SeedGuard::new(seed, "prepared_scatter_refusals");
    let st = Star::new(seed, 3, 2);
    let s = &st.sender;
    let bad_arg = |r: Result<ScatterTargets, EngineError>| {
        matches!(r, Err(EngineError::InvalidArgument { .. }))
    };
    // Too few descriptors for the group.
    assert!(bad_arg(s.scatter_targets(&st.group, &st.adesc[..2])));
    // A group resolved by another engine.
    let other = st.peers[0]
        .add_peer_group(&[
            st.sender.main_address(),
            st.peers[1].main_address(),
            st.peers[2].main_address(),
        ])
        .unwrap();
    assert!(bad_arg(s.scatter_targets(&other, &st.adesc)));
    // A descriptor without rkeys.
    let mut none = st.adesc.clone();
    none[1].rkeys.clear();
    assert!(bad_arg(s.scatter_targets(&st.group, &none)));
    // Descriptors with different rkey counts.
    let mut mixed = st.adesc.clone();
    mixed[2].rkeys.truncate(1);
    assert!(bad_arg(s.scatter_targets(&st.group, &mixed)));

    let targets = s.scatter_targets(&st.group, &st.adesc).unwrap();
    let ok = slices(seed, 0, 3);
    let submit =
        |sl: &[ScatterSlice]| s.submit_scatter_to(&targets, OnDone::Ignore, None, &st.sh, sl);
    // A slice count other than the targets'.
    assert!(matches!(
        submit(&ok[..2]),
        Err(EngineError::InvalidArgument { .. })
    ));
    // A destination range past its region, or overflowing.
    for (offset, len) in [(REGION as u64 - 10, 11), (u64::MAX, 2)] {
        let mut sl = ok.clone();
        sl[2].dst_offset = offset;
        sl[2].len = len;
        match submit(&sl) {
            Err(EngineError::OutOfBounds {
                what, region_len, ..
            }) => {
                assert_eq!(region_len, REGION as u64);
                assert!(what.contains("destination 2"), "{what}");
            }
            r => panic!("seed {seed}: destination ({offset}, {len}): {r:?}"),
        }
    }
    // A source range past the registration.
    let mut sl = ok.clone();
    sl[0].src_offset = SRC as u64;
    sl[0].len = 1;
    assert!(matches!(submit(&sl), Err(EngineError::OutOfBounds { .. })));
    // Targets with one rkey each, from a two-NIC group.
    let one = narrow(&st.adesc);
    let narrow = s.scatter_targets(&st.group, &one).unwrap();
    assert!(matches!(
        s.submit_scatter_to(&narrow, OnDone::Ignore, None, &st.sh, &ok),
        Err(EngineError::NicCountMismatch {
            local: 2,
            remote: 1,
            ..
        })
    ));
    // Targets of another engine.
    let foreign = st.peers[0].scatter_targets(&other, &st.adesc).unwrap();
    assert!(matches!(
        s.submit_scatter_to(&foreign, OnDone::Ignore, None, &st.sh, &ok),
        Err(EngineError::InvalidArgument { .. })
    ));

    s.progress();
    assert_eq!(s.stats().groups[0].pending_wrs, 0);
    let posted = st.run(
        30,
        &ok,
        ScatterMode::ByPeer,
        |j| j,
        |od| s.submit_scatter_to_mode(&targets, od, Some(30), &st.sh, &ok, ScatterMode::ByPeer),
    );
    assert_eq!(
        posted.iter().sum::<u64>(),
        ok.iter().map(|x| x.len).sum::<u64>(),
        "only the last scatter was posted"
    );
    for (j, buf) in st.a.iter().enumerate() {
        assert!(
            buf.bytes(0, REGION) == expected(&st.src, std::slice::from_ref(&ok), j),
            "peer {j}"
        );
    }
    st.shutdown();
}

/// Requests with several faults get the error `submit_scatter` gives them
/// (the same checks in the same order); an empty peer group scatters
/// (nothing) as it does there.
#[test]
fn prepared_scatter_errors_follow_submit_scatter_order() {
    let seed = seeds_or([40])[0];
    let _g = SeedGuard::new(seed, "prepared_scatter_errors_follow_submit_scatter_order");
    let st = Star::new(seed, 3, 2);
    let s = &st.sender;
    // One rkey per destination where the group has two NICs.
    let narrow = narrow(&st.adesc);
    let ok = slices(seed, 0, 3);
    let bad_src = |mut v: Vec<ScatterSlice>, j: usize| {
        v[j].src_offset = SRC as u64;
        v
    };
    let bad_dst = |mut v: Vec<ScatterSlice>, j: usize| {
        v[j].dst_offset = REGION as u64;
        v
    };
    let cases: Vec<(&str, &[MrDesc], Vec<ScatterSlice>)> = vec![
        (
            "source 2 and destination 0",
            &st.adesc,
            bad_dst(bad_src(ok.clone(), 2), 0),
        ),
        (
            "source 1 and destination 1",
            &st.adesc,
            bad_dst(bad_src(ok.clone(), 1), 1),
        ),
        (
            "NIC count and destination 2",
            &narrow,
            bad_dst(ok.clone(), 2),
        ),
        ("NIC count and source 0", &narrow, bad_src(ok.clone(), 0)),
        ("NIC count alone", &narrow, ok.clone()),
    ];
    for (what, descs, sl) in cases {
        let targets = s.scatter_targets(&st.group, descs).unwrap();
        let prepared = s
            .submit_scatter_to(&targets, OnDone::Ignore, None, &st.sh, &sl)
            .expect_err(what);
        let dsts = dsts_of(&sl, |j| &descs[j]);
        let plain = s
            .submit_scatter(&st.group, OnDone::Ignore, None, &st.sh, &dsts)
            .expect_err(what);
        assert_eq!(format!("{prepared:?}"), format!("{plain:?}"), "{what}");
    }
    // An empty group: both APIs give the same outcome.
    let empty = s.add_peer_group(&[]).unwrap();
    let targets = s.scatter_targets(&empty, &[]).unwrap();
    assert!(targets.is_empty() && targets.nics() == 0);
    let (od, fa) = OnDone::flag();
    let a = st.outcome(s.submit_scatter_to(&targets, od, None, &st.sh, &[]), &fa);
    let (od, fb) = OnDone::flag();
    let b = st.outcome(s.submit_scatter(&empty, od, None, &st.sh, &[]), &fb);
    assert_eq!(a, b);
    st.shutdown();
}
