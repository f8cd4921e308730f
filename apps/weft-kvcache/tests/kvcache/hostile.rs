//! Hostile and unlucky orders, fed straight to the cores: delivery is
//! reliable but unordered, and any process may send anything. The first
//! five tests reproduce review findings (each failed before its fix); the
//! rest pin down the rules that fixed them, and the last ones feed garbage
//! to the wire decoder.

use crate::sans_io::*;
use proptest::prelude::*;
use std::time::Instant;
use weft::{GroupAddress, MrDesc};
use weft_kvcache::wire::{self, Failure};
use weft_kvcache::{
    Auth, DecoderCore, HeadMap, KvError, KvLayout, KvRequest, Msg, PreAction, PrefillerCore,
    PrefillerId, Refusal, Route,
};

/// A decoder at `addr(100)` and a prefiller at `addr(1)` that believe each
/// other.
fn connected(t0: Instant) -> (DecoderCore, PrefillerCore, PrefillerId) {
    let mut dec = DecoderCore::new(addr(100), LAYOUT, vec![desc()], Some(desc()), HB).unwrap();
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let (p, hello) = dec.add_prefiller(addr(1), t0);
    assert!(pump(&mut dec, &mut pre, &addr(1), hello, t0).is_empty());
    (dec, pre, p)
}

/// Finding 1: a Cancel that overtakes its Request is confirmed at once;
/// the Request, arriving later, must be answered as cancelled and never
/// served (its pages may already belong to another request).
#[test]
fn a_cancel_that_overtakes_its_request_is_never_served() {
    let t0 = Instant::now();
    let (mut dec, mut pre, p) = connected(t0);
    let lease = dec.alloc(2).unwrap();
    let st = dec
        .begin(&Route::single(p, 2), &lease, 5, &counts(), b"", t0)
        .unwrap();
    let (_, auth, request) = frames(&st.actions).remove(0);
    let (_, _, cancel) = frames(&dec.cancel(st.id, t0)).remove(0);
    // The cancel arrives first and is confirmed: the decoder's request ends
    // and its pages go back.
    let ack = pre_frames(&pre.on_msg(&addr(100), auth, cancel, t0));
    assert_eq!(ack[0].2, Msg::CancelAck { id: st.id });
    let f = finishes(&dec.on_msg(&addr(1), ack[0].1, ack[0].2.clone(), t0));
    assert!(matches!(f[..], [(_, Err(KvError::Cancelled { .. }))]));
    dec.free(lease, t0);
    let reused = dec.alloc(2).unwrap();
    assert_eq!(reused.pages(), &[0, 1], "the next lease reuses the pages");
    // Now the request arrives: it must not reach the application.
    let a = pre.on_msg(&addr(100), auth, request, t0);
    assert!(
        !a.iter().any(|x| matches!(x, PreAction::Incoming(_))),
        "a request whose cancel was confirmed is handed out for serving \
         (its writes would land in pages {:?}, now another lease's): {a:?}",
        reused.pages()
    );
    assert_eq!(pre.pending(), 0);
    assert_eq!(
        pre_sends(&a),
        vec![(addr(100), Msg::CancelAck { id: st.id })],
        "answered as cancelled"
    );
}

/// Finding 2: a lease of another decoder (same id, since both pools count
/// from 1) is refused, and freeing it does not release this decoder's own
/// lease of that id.
#[test]
fn a_lease_of_another_decoder_is_refused() {
    let t0 = Instant::now();
    let mut a = DecoderCore::new(addr(100), LAYOUT, vec![desc()], Some(desc()), HB).unwrap();
    let mut b = DecoderCore::new(addr(101), LAYOUT, vec![desc()], Some(desc()), HB).unwrap();
    let (p, _) = b.add_prefiller(addr(1), t0);
    let own = b.alloc(1).unwrap(); // b's lease 1: page 0
    let _other = b.alloc(2).unwrap(); // b's lease 2: pages 1, 2
    let foreign = a.alloc(3).unwrap(); // a's lease 1: pages 0, 1, 2
    assert_eq!(own.id(), foreign.id(), "both pools number leases alike");
    let r = b.begin(&Route::single(p, 2), &foreign, 5, &counts(), b"", t0);
    assert!(
        matches!(r, Err(KvError::UnknownLease { .. })),
        "another decoder's lease is taken: it would write pages {:?} that b \
         holds for other leases: {r:?}",
        foreign.pages()
    );
    // Freeing the foreign lease leaves b's own lease of that id alone, and
    // gives it back for its own decoder.
    let back = b.try_free(foreign, t0).unwrap_err().0;
    assert!(!b.pool().is_free(0), "b's own lease 1 was released");
    assert_eq!(b.pool().free_pages(), 13);
    assert!(a.try_free(back, t0).unwrap().is_empty());
    assert_eq!(a.pool().free_pages(), 16);
}

/// Finding 3a: a Hello naming the decoder's NICs with a newer incarnation,
/// sent by a third engine, must not make the prefiller talk to that
/// incarnation: the engine replaces (drops) the older incarnation at an
/// address as soon as a send names a newer one there.
#[test]
fn a_forged_newer_incarnation_does_not_replace_the_decoder() {
    let t0 = Instant::now();
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let real = join(&mut pre, &addr(100), t0);
    let mut forged = addr(100);
    forged.incarnation = weft::Incarnation(1);
    let claim = Auth {
        proof: 0,
        grant: 77,
    };
    let mut out = pre.on_msg(&forged, claim, Msg::Hello, t0);
    let mut t = t0;
    for _ in 0..5 {
        t += HB.interval;
        // the real decoder keeps talking; the stranger keeps claiming
        out.extend(pre.on_msg(&addr(100), real, Msg::Heartbeat, t));
        out.extend(pre.on_msg(&forged, claim, Msg::Hello, t));
        out.extend(pre.tick(t));
    }
    let to_forged: Vec<_> = out
        .iter()
        .filter(|a| matches!(a, PreAction::Send { to, .. } | PreAction::Forget { peer: to } if to.incarnation != addr(100).incarnation))
        .collect();
    assert!(
        to_forged.is_empty(),
        "the prefiller talks to the claimed newer incarnation (the engine would \
         drop the real decoder for it): {to_forged:?}"
    );
    assert_eq!(pre.decoders(), 1, "the claim made a second decoder");
    // Once the real decoder is dead (silent past the timeout), a real
    // restart at the same NICs is answered.
    let t = t + HB.timeout * 2;
    assert!(pre
        .tick(t)
        .iter()
        .any(|a| matches!(a, PreAction::Forget { peer } if *peer == addr(100))));
    let a = pre_sends(&pre.on_msg(&forged, claim, Msg::Hello, t));
    assert_eq!(a, vec![(forged.clone(), Msg::Hello)]);
}

/// Finding 3b: a request whose pages cannot be mapped (a decoder layout
/// whose page indices overflow) is refused with a typed answer, not
/// accepted and left unanswered.
#[test]
fn a_request_whose_pages_cannot_be_mapped_is_refused() {
    let t0 = Instant::now();
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let auth = join(&mut pre, &addr(100), t0);
    // Decoder head 2 of 3, 2^31 pages per head: head 2's page indices
    // (2 * 2^31 + p) do not fit in u32.
    let dec_layout = KvLayout {
        kv_heads: 3,
        num_pages: 1 << 31,
        ..LAYOUT
    };
    let req = KvRequest {
        id: 9,
        layout: dec_layout,
        kv: vec![desc()],
        tail: Some(desc()),
        heads: vec![HeadMap { src: 0, dst: 2 }],
        pages: vec![0],
        tail_slot: None,
        imm: 3,
        meta: Vec::new(),
    };
    let mut out = pre.on_msg(&addr(100), auth, Msg::Request(req), t0);
    if let Some(PreAction::Incoming(inc)) = out.first().cloned() {
        pre.accept(&inc.key, &[0], 0).unwrap();
        out.extend(pre.ready(&inc.key, 4).unwrap());
    }
    let failed = pre_sends(&out);
    assert!(
        matches!(
            &failed[..],
            [(
                _,
                Msg::Failed {
                    id: 9,
                    failure: Failure::Refused(Refusal::BadPages { .. })
                }
            )]
        ),
        "no typed refusal: {out:?}"
    );
    assert_eq!(pre.pending(), 0, "the request is held, never to end");
}

/// Finding 3c: only a prefiller the request was sent to may fail it.
#[test]
fn a_failed_from_a_prefiller_without_the_request_is_ignored() {
    let t0 = Instant::now();
    let mut dec = DecoderCore::new(addr(100), LAYOUT, vec![desc()], Some(desc()), HB).unwrap();
    let (p1, h1) = dec.add_prefiller(addr(1), t0);
    let (_p2, h2) = dec.add_prefiller(addr(2), t0);
    fake_prefiller(&mut dec, &h1, &addr(1), t0);
    let auth2 = fake_prefiller(&mut dec, &h2, &addr(2), t0);
    let lease = dec.alloc(1).unwrap();
    let st = dec
        .begin(&Route::single(p1, 2), &lease, 5, &counts(), b"", t0)
        .unwrap();
    let a = dec.on_msg(
        &addr(2),
        auth2,
        Msg::Failed {
            id: st.id,
            failure: Failure::Refused(Refusal::Busy { max: 1 }),
        },
        t0,
    );
    assert!(
        a.is_empty(),
        "a prefiller that never got the request stopped it: {a:?}"
    );
    // The request still completes when its data lands.
    let f = finishes(&dec.on_imms(st.id, Ok(())));
    assert!(matches!(f[..], [(_, Ok(()))]), "{f:?}");
}

/// Frames whose proof is not the receiver's grant (a stranger naming a
/// peer's address) are dropped on both sides: no cancel, no request, no
/// failure, no confirmation counts.
#[test]
fn frames_of_strangers_are_dropped() {
    let t0 = Instant::now();
    let (mut dec, mut pre, p) = connected(t0);
    let lease = dec.alloc(2).unwrap();
    let st = dec
        .begin(&Route::single(p, 2), &lease, 5, &counts(), b"", t0)
        .unwrap();
    let (_, auth, request) = frames(&st.actions).remove(0);
    let before = pre.dropped();
    for proof in [0, 1, auth.proof ^ 1] {
        let forged = Auth {
            proof,
            grant: auth.grant,
        };
        assert!(pre
            .on_msg(&addr(100), forged, request.clone(), t0)
            .is_empty());
        assert!(pre
            .on_msg(&addr(100), forged, Msg::Cancel { id: st.id }, t0)
            .is_empty());
        for m in [
            Msg::CancelAck { id: st.id },
            Msg::Failed {
                id: st.id,
                failure: Failure::Refused(Refusal::ShuttingDown),
            },
        ] {
            assert!(dec.on_msg(&addr(1), forged, m, t0).is_empty());
        }
    }
    assert_eq!(pre.dropped() - before, 6);
    assert_eq!(pre.pending(), 0);
    // The real request is still served, and completes.
    let a = pre.on_msg(&addr(100), auth, request, t0);
    assert!(matches!(&a[..], [PreAction::Incoming(_)]), "{a:?}");
    assert!(matches!(
        finishes(&dec.on_imms(st.id, Ok(())))[..],
        [(_, Ok(()))]
    ));
}

/// A duplicate of a request being served is dropped unanswered (a `Failed`
/// would end it at the decoder while its writes go on), and a replay of a
/// finished one is never served again.
#[test]
fn duplicates_and_replays_of_a_request_are_harmless() {
    let t0 = Instant::now();
    let (mut dec, mut pre, p) = connected(t0);
    let lease = dec.alloc(1).unwrap();
    let st = dec
        .begin(&Route::single(p, 2), &lease, 5, &counts(), b"", t0)
        .unwrap();
    let (_, auth, request) = frames(&st.actions).remove(0);
    let key = match &pre.on_msg(&addr(100), auth, request.clone(), t0)[..] {
        [PreAction::Incoming(i)] => i.key.clone(),
        other => panic!("{other:?}"),
    };
    assert!(pre.on_msg(&addr(100), auth, request.clone(), t0).is_empty());
    pre.accept(&key, &[0], 0).unwrap();
    let p = posts(&pre.ready(&key, 5).unwrap());
    let mut last = Vec::new();
    for (k, step, _) in &p {
        last = pre.on_posted(k, *step, Ok(()), t0);
    }
    assert!(matches!(pre_finish(&last), Some(Ok(()))));
    assert!(finishes(&dec.on_imms(st.id, Ok(()))).len() == 1);
    // The replay, after the request ended: never served; its id is at the
    // floor now, so it is answered stale, which the decoder, done with it,
    // drops.
    let a = pre.on_msg(&addr(100), auth, request, t0);
    assert!(
        !a.iter().any(|x| matches!(x, PreAction::Incoming(_))),
        "{a:?}"
    );
    assert_eq!(pre.pending(), 0);
    for (_, auth, m) in pre_frames(&a) {
        assert!(matches!(
            m,
            Msg::Failed {
                failure: Failure::Refused(Refusal::Stale { .. }),
                ..
            }
        ));
        assert!(dec.on_msg(&addr(1), auth, m, t0).is_empty());
    }
}

/// Cancels before their requests are remembered per decoder in a bounded
/// window: past it, the oldest are forgotten and their requests, if they
/// still come, are refused `Stale`, never served.
#[test]
fn early_cancels_are_bounded_and_never_served() {
    let t0 = Instant::now();
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let auth = join(&mut pre, &addr(100), t0);
    let n = weft_kvcache::ID_WINDOW as u64 + 10;
    // ids 2..n+2 cancelled before any request (id 1 has not come: no
    // contiguous run folds into the floor)
    for id in 2..n + 2 {
        let a = pre.on_msg(&addr(100), auth, Msg::Cancel { id }, t0);
        assert_eq!(pre_sends(&a), vec![(addr(100), Msg::CancelAck { id })]);
    }
    let req = |id| {
        Msg::Request(KvRequest {
            id,
            layout: LAYOUT,
            kv: vec![desc()],
            tail: Some(desc()),
            heads: vec![HeadMap { src: 0, dst: 0 }],
            pages: vec![0],
            tail_slot: None,
            imm: 1,
            meta: Vec::new(),
        })
    };
    // an old one: forgotten, refused stale
    let a = pre_sends(&pre.on_msg(&addr(100), auth, req(3), t0));
    assert!(
        matches!(
            &a[..],
            [(
                _,
                Msg::Failed {
                    id: 3,
                    failure: Failure::Refused(Refusal::Stale { .. })
                }
            )]
        ),
        "{a:?}"
    );
    // a recent one: remembered, answered as cancelled
    let a = pre_sends(&pre.on_msg(&addr(100), auth, req(n + 1), t0));
    assert_eq!(a, vec![(addr(100), Msg::CancelAck { id: n + 1 })]);
    // id 1, never cancelled, comes late: the floor passed it, so it is
    // refused too (a request is never served unless its id is known new)
    let a = pre_sends(&pre.on_msg(&addr(100), auth, req(1), t0));
    assert!(
        matches!(
            &a[..],
            [(
                _,
                Msg::Failed {
                    id: 1,
                    failure: Failure::Refused(Refusal::Stale { .. })
                }
            )]
        ),
        "{a:?}"
    );
    // a new id: served
    let a = pre.on_msg(&addr(100), auth, req(n + 2), t0);
    assert!(matches!(&a[..], [PreAction::Incoming(_)]), "{a:?}");
    assert_eq!(pre.pending(), 1);
}

/// A request cancelled before the decoder heard from its prefiller is
/// never sent, and ends at once.
#[test]
fn a_request_cancelled_before_the_handshake_is_never_sent() {
    let t0 = Instant::now();
    let mut dec = DecoderCore::new(addr(100), LAYOUT, vec![desc()], Some(desc()), HB).unwrap();
    let (p, hello) = dec.add_prefiller(addr(1), t0);
    let lease = dec.alloc(1).unwrap();
    let st = dec
        .begin(&Route::single(p, 2), &lease, 5, &counts(), b"", t0)
        .unwrap();
    assert!(sends(&st.actions).is_empty(), "waits for the handshake");
    let a = dec.cancel(st.id, t0);
    assert!(sends(&a).is_empty());
    assert!(matches!(
        finishes(&a)[..],
        [(_, Err(KvError::Cancelled { .. }))]
    ));
    // the handshake then sends nothing of it
    fake_prefiller(&mut dec, &hello, &addr(1), t0);
    assert_eq!(dec.pending(), 0);
    // and the tick greets an unproven prefiller again, not a heartbeat
    let mut d2 = DecoderCore::new(addr(100), LAYOUT, vec![desc()], Some(desc()), HB).unwrap();
    d2.add_prefiller(addr(1), t0);
    let a = sends(&d2.tick(t0 + HB.interval));
    assert_eq!(a, vec![(addr(1), Msg::Hello)]);
}

// ---- the wire decoder on garbage ----

mod alloc_meter {
    //! Counts the bytes this thread allocates while metering.
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static ON: Cell<bool> = const { Cell::new(false) };
        static NOW: Cell<usize> = const { Cell::new(0) };
        static PEAK: Cell<usize> = const { Cell::new(0) };
    }

    pub struct Meter;

    // SAFETY: every call forwards to the system allocator unchanged; the
    // bookkeeping touches only const-initialised thread-locals (no
    // allocation, no destructor).
    unsafe impl GlobalAlloc for Meter {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            note(l.size() as isize);
            // SAFETY: the caller's contract is GlobalAlloc::alloc's.
            unsafe { System.alloc(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            note(-(l.size() as isize));
            // SAFETY: the caller's contract is GlobalAlloc::dealloc's.
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            note(new as isize - l.size() as isize);
            // SAFETY: the caller's contract is GlobalAlloc::realloc's.
            unsafe { System.realloc(p, l, new) }
        }
    }

    fn note(d: isize) {
        let _ = ON.try_with(|on| {
            if on.get() {
                NOW.with(|n| {
                    let v = n.get().saturating_add_signed(d);
                    n.set(v);
                    PEAK.with(|p| p.set(p.get().max(v)));
                });
            }
        });
    }

    /// Runs `f` and returns the most bytes it held allocated at once.
    pub fn peak<T>(f: impl FnOnce() -> T) -> (T, usize) {
        NOW.with(|n| n.set(0));
        PEAK.with(|p| p.set(0));
        ON.with(|on| on.set(true));
        let r = f();
        ON.with(|on| on.set(false));
        (r, PEAK.with(|p| p.get()))
    }
}

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

/// Decoding `bytes` never panics and never holds more than a bounded
/// multiple of the frame's length (plus a constant) allocated.
fn decode_is_bounded(bytes: &[u8]) {
    let (r, peak) = alloc_meter::peak(|| std::panic::catch_unwind(|| wire::decode(bytes)));
    assert!(r.is_ok(), "decode panicked on {bytes:02x?}");
    let bound = 64 * bytes.len() + 4096;
    assert!(
        peak <= bound,
        "decoding {} bytes held {peak} bytes (bound {bound})",
        bytes.len()
    );
}

/// Valid frames of every message kind, to mutate.
fn valid_frames() -> Vec<Vec<u8>> {
    let from = GroupAddress {
        nics: vec![weft::NetAddr(vec![1, 2, 3]), weft::NetAddr(vec![4])],
        incarnation: weft::Incarnation(9),
    };
    let req = KvRequest {
        id: 7,
        layout: LAYOUT,
        kv: vec![desc()],
        tail: Some(desc()),
        heads: vec![HeadMap { src: 0, dst: 1 }, HeadMap { src: 1, dst: 0 }],
        pages: vec![3, 1, 4, 1, 5],
        tail_slot: Some(2),
        imm: 11,
        meta: b"prompt".to_vec(),
    };
    let auth = Auth {
        proof: 0x1234_5678,
        grant: u64::MAX,
    };
    [
        Msg::Hello,
        Msg::Heartbeat,
        Msg::Request(req),
        Msg::Cancel { id: 1 << 40 },
        Msg::CancelAck { id: 3 },
        Msg::Failed {
            id: 4,
            failure: Failure::Write {
                step: "layer 1".into(),
                error: "x".into(),
            },
        },
        Msg::Failed {
            id: 5,
            failure: Failure::Refused(Refusal::Stale { id: 5, floor: 9 }),
        },
    ]
    .iter()
    .map(|m| wire::encode(&from, auth, m).unwrap())
    .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// Arbitrary bytes: an error or a frame, never a panic, bounded memory.
    #[test]
    fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_is_bounded(&bytes);
    }

    /// Valid frames with bytes flipped, cut, or stretched with garbage
    /// (length prefixes claiming huge lists among them).
    #[test]
    fn decoding_mutated_frames_never_panics(
        which in 0usize..7,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
        cut in any::<usize>(),
        tail in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut f = valid_frames()[which].clone();
        for (at, x) in flips {
            let i = at % f.len();
            f[i] ^= x;
        }
        f.truncate(cut % (f.len() + 1));
        f.extend(tail);
        decode_is_bounded(&f);
    }
}

/// A length prefix claiming a list of 2^32 entries in a short frame is an
/// error, not an allocation.
#[test]
fn a_huge_length_prefix_is_an_error() {
    let mut f = valid_frames()[2].clone();
    // the frame's end: meta's length prefix and bytes; claim 2^32-1 bytes
    f.truncate(f.len() - 7);
    f.extend([0xff, 0xff, 0xff, 0xff, 0x0f]);
    decode_is_bounded(&f);
    assert!(wire::decode(&f).is_err());
}

/// A request whose decoder regions do not fit its layout — a KV region
/// count that is neither one nor the layer count, a tail slot without a
/// tail region — is refused with a typed answer before anything is taken.
#[test]
fn a_request_whose_regions_do_not_fit_its_layout_is_refused() {
    let t0 = Instant::now();
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let auth = join(&mut pre, &addr(100), t0);
    let base = KvRequest {
        id: 11,
        layout: LAYOUT,
        kv: vec![desc()],
        tail: Some(desc()),
        heads: vec![HeadMap { src: 0, dst: 0 }],
        pages: vec![0],
        tail_slot: Some(0),
        imm: 3,
        meta: Vec::new(),
    };
    let too_many = KvRequest {
        kv: vec![desc(); LAYOUT.layers as usize + 1],
        ..base.clone()
    };
    let no_tail = KvRequest {
        id: 12,
        tail: None,
        ..base
    };
    for (req, want_layout) in [(too_many, true), (no_tail, false)] {
        let id = req.id;
        let out = pre.on_msg(&addr(100), auth, Msg::Request(req), t0);
        let sent = pre_sends(&out);
        let ok = match &sent[..] {
            [(_, Msg::Failed { id: got, failure })] if *got == id => match failure {
                Failure::Refused(Refusal::LayoutMismatch { .. }) => want_layout,
                Failure::Refused(Refusal::BadPages { .. }) => !want_layout,
                _ => false,
            },
            _ => false,
        };
        assert!(ok, "request {id}: {out:?}");
    }
    assert_eq!(pre.pending(), 0);
}

/// A decoder that hands over another engine's region (a descriptor of
/// another incarnation) is refused: the prefiller never writes a prompt
/// into a third party's memory on a decoder's word.
#[test]
fn a_request_naming_another_engines_region_is_refused() {
    let t0 = Instant::now();
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let auth = join(&mut pre, &addr(100), t0);
    let foreign = MrDesc {
        incarnation: weft::Incarnation(77),
        ..desc()
    };
    let req = KvRequest {
        id: 13,
        layout: LAYOUT,
        kv: vec![desc(), foreign],
        tail: Some(desc()),
        heads: vec![HeadMap { src: 0, dst: 0 }],
        pages: vec![0],
        tail_slot: None,
        imm: 3,
        meta: Vec::new(),
    };
    let out = pre.on_msg(&addr(100), auth, Msg::Request(req), t0);
    let sent = pre_sends(&out);
    assert!(
        matches!(
            &sent[..],
            [(
                _,
                Msg::Failed {
                    id: 13,
                    failure: Failure::Refused(Refusal::BadPages { .. })
                }
            )]
        ),
        "{out:?}"
    );
    assert_eq!(pre.pending(), 0);
}
