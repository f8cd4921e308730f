//! The decoder and prefiller state machines stepped by hand, clock passed
//! in: messages go from one core to the other, posts complete when the test
//! says so.

use crate::sans_io::*;
use std::time::{Duration, Instant};
use weft_kvcache::{
    Auth, DecAction, DecoderCore, HeadMap, KvError, KvLayout, Msg, PreAction, PrefillerCore, Route,
    Source, TaskKey, Write,
};

fn decoder(_t0: Instant) -> DecoderCore {
    DecoderCore::new(addr(100), LAYOUT, vec![desc()], Some(desc()), HB).unwrap()
}

/// Decoder with one prefiller, a request of `n` pages started and delivered
/// to the prefiller, which accepted it.
struct Pair {
    t0: Instant,
    dec: DecoderCore,
    pre: PrefillerCore,
    key: TaskKey,
    id: u64,
    lease: weft_kvcache::PageLease,
    /// What the decoder's frames to the prefiller carry.
    auth: Auth,
}

fn pair(n: u32) -> Pair {
    let t0 = Instant::now();
    let mut dec = decoder(t0);
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let (p, hello) = dec.add_prefiller(addr(1), t0);
    assert!(pump(&mut dec, &mut pre, &addr(1), hello, t0).is_empty());
    assert!(dec.prefiller_ready(p));
    let lease = dec.alloc(n).unwrap();
    let st = dec
        .begin(&Route::single(p, 2), &lease, 5, &counts(), b"prompt", t0)
        .unwrap();
    // one paged write per layer (2 heads x n pages, 1 piece each) + tail
    assert_eq!(st.imm_count, u64::from(LAYOUT.layers * 2 * n) + 1);
    let msgs = frames(&st.actions);
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0].0, addr(1));
    let auth = msgs[0].1;
    let acts = pre.on_msg(&addr(100), auth, msgs[0].2.clone(), t0);
    let inc = match &acts[..] {
        [PreAction::Incoming(i)] => i.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(inc.meta, b"prompt");
    assert!(inc.tail);
    let src: Vec<u32> = (0..n).map(|j| 15 - j).collect();
    pre.accept(&inc.key, &src, 3).unwrap();
    Pair {
        t0,
        dec,
        pre,
        key: inc.key,
        id: st.id,
        lease,
        auth,
    }
}

#[test]
fn layers_post_in_order_then_the_tail_and_the_count_completes() {
    let mut s = pair(3);
    let a = s.pre.ready(&s.key, 2).unwrap();
    let p = posts(&a);
    assert_eq!(p.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 1]);
    match &p[1].2 {
        Write::Layer {
            layer,
            src,
            dst_pages,
            imm,
            ..
        } => {
            assert_eq!(*layer, 1);
            assert_eq!(*imm, 5);
            // heads before pages: head h page p at h*16+p
            assert_eq!(src.indices, vec![15, 14, 13, 31, 30, 29]);
            assert_eq!(dst_pages.indices, vec![0, 1, 2, 16, 17, 18]);
            assert_eq!(src.offset, 2 * 16 * 4096);
        }
        w => panic!("{w:?}"),
    }
    // the same value again posts nothing; going back is ignored
    assert!(s.pre.ready(&s.key, 2).unwrap().is_empty());
    assert!(s.pre.ready(&s.key, 1).unwrap().is_empty());
    assert!(matches!(
        s.pre.ready(&s.key, 6),
        Err(KvError::StepOutOfRange {
            step: 6,
            steps: 5,
            ..
        })
    ));
    let a = s.pre.ready(&s.key, 5).unwrap();
    let p2 = posts(&a);
    assert_eq!(p2.iter().map(|x| x.1).collect::<Vec<_>>(), vec![2, 3, 4]);
    assert!(matches!(
        p2[2].2,
        Write::Tail {
            len: 1000,
            src_off: 3000,
            dst_off: 0,
            ..
        }
    ));
    for (k, step, _) in p.iter().chain(&p2) {
        let a = s.pre.on_posted(k, *step, Ok(()), s.t0);
        if *step == 4 {
            assert!(matches!(pre_finish(&a), Some(Ok(()))));
        } else {
            assert!(a.is_empty());
        }
    }
    assert_eq!(s.pre.pending(), 0);
    let f = finishes(&s.dec.on_imms(s.id, Ok(())));
    assert_eq!(f.len(), 1);
    assert!(f[0].1.is_ok());
    // the pages stay the application's until it frees them
    assert_eq!(s.dec.pool().free_pages(), 13);
    assert!(s.dec.free(s.lease, s.t0).is_empty());
    assert_eq!(s.dec.pool().free_pages(), 16);
}

#[test]
fn cancel_is_confirmed_only_after_posted_writes_complete() {
    let mut s = pair(2);
    let p = posts(&s.pre.ready(&s.key, 2).unwrap());
    let a = s.dec.cancel(s.id, s.t0);
    let m = sends(&a);
    assert_eq!(m, vec![(addr(1), Msg::Cancel { id: s.id })]);
    assert!(finishes(&a).is_empty());
    // the lease is still busy: no second request, no page reuse
    let r = s.dec.begin(
        &Route::single(weft_kvcache::PrefillerId(0), 2),
        &s.lease,
        6,
        &counts(),
        b"",
        s.t0,
    );
    assert!(matches!(r, Err(KvError::LeaseBusy { .. })));
    let a = s.pre.on_msg(&addr(100), s.auth, m[0].1.clone(), s.t0);
    assert!(a.is_empty(), "writes in flight: no ack yet");
    // no more posts once cancelled
    assert!(s.pre.ready(&s.key, 5).unwrap().is_empty());
    assert!(s.pre.on_posted(&s.key, 0, Ok(()), s.t0).is_empty());
    let a = s.pre.on_posted(&s.key, 1, Ok(()), s.t0);
    assert!(matches!(
        pre_finish(&a),
        Some(Err(KvError::Cancelled { .. }))
    ));
    let ack = pre_frames(&a);
    assert_eq!(
        pre_sends(&a),
        vec![(addr(100), Msg::CancelAck { id: s.id })]
    );
    let _ = p;
    let f = finishes(&s.dec.on_msg(&addr(1), ack[0].1, ack[0].2.clone(), s.t0));
    assert!(matches!(f[..], [(_, Err(KvError::Cancelled { .. }))]));
    // a late imm callback (the freed round) is ignored
    assert!(s.dec.on_imms(s.id, Ok(())).is_empty());
    assert!(s.dec.free(s.lease, s.t0).is_empty());
    assert_eq!(s.dec.pool().free_pages(), 16);
    // a cancel of an unknown request is acknowledged at once
    let a = s
        .pre
        .on_msg(&addr(100), s.auth, Msg::Cancel { id: 99 }, s.t0);
    assert_eq!(pre_sends(&a), vec![(addr(100), Msg::CancelAck { id: 99 })]);
}

#[test]
fn freeing_a_lease_in_flight_cancels_and_defers_the_pages() {
    let mut s = pair(4);
    let a = s.dec.free(s.lease, s.t0);
    assert_eq!(sends(&a), vec![(addr(1), Msg::Cancel { id: s.id })]);
    assert_eq!(s.dec.pool().free_pages(), 12);
    let a = s
        .pre
        .on_msg(&addr(100), s.auth, Msg::Cancel { id: s.id }, s.t0);
    let ack = pre_frames(&a);
    s.dec.on_msg(&addr(1), ack[0].1, ack[0].2.clone(), s.t0);
    assert_eq!(s.dec.pool().free_pages(), 16);
}

#[test]
fn heartbeats_and_silence() {
    let mut s = pair(1);
    let t = s.t0 + Duration::from_millis(10);
    assert_eq!(sends(&s.dec.tick(t)), vec![(addr(1), Msg::Heartbeat)]);
    assert!(s.dec.tick(t + Duration::from_millis(1)).is_empty());
    let beat = pre_frames(&s.pre.tick(t));
    assert_eq!(
        beat.iter()
            .map(|f| (f.0.clone(), f.2.clone()))
            .collect::<Vec<_>>(),
        vec![(addr(100), Msg::Heartbeat)]
    );
    // the prefiller keeps talking: the decoder keeps the request
    let t2 = s.t0 + Duration::from_millis(90);
    s.dec.on_msg(&addr(1), beat[0].1, Msg::Heartbeat, t2);
    assert!(finishes(&s.dec.tick(s.t0 + Duration::from_millis(150))).is_empty());
    // silence past the timeout: the request fails, typed, and the dead
    // prefiller is removed from the engine
    let a = s.dec.tick(s.t0 + Duration::from_millis(191));
    let forgot: Vec<_> = a
        .iter()
        .filter_map(|x| match x {
            DecAction::Forget { peer } => Some(peer.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(forgot, vec![addr(1)]);
    let f = finishes(&a);
    match &f[..] {
        [(id, Err(KvError::PrefillerDead { peer, .. }))] => {
            assert_eq!(*id, s.id);
            assert_eq!(*peer, addr(1));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.dec.begin(
            &Route::single(weft_kvcache::PrefillerId(0), 2),
            &s.lease,
            7,
            &counts(),
            b"",
            s.t0
        ),
        Err(KvError::PeerDead { .. })
    ));
    // the prefiller, hearing nothing from the decoder, drops the request
    // once its write in flight completed
    let p = posts(&s.pre.ready(&s.key, 1).unwrap());
    let a = s.pre.tick(s.t0 + Duration::from_millis(200));
    assert!(pre_finish(&a).is_none(), "a write is in flight");
    assert!(
        matches!(&a[..], [PreAction::Forget { peer }] if *peer == addr(100)),
        "the dead decoder is removed from the engine: {a:?}"
    );
    assert!(s.pre.ready(&s.key, 3).unwrap().is_empty(), "no new posts");
    let a = s
        .pre
        .on_posted(&p[0].0, 0, Err("peer unreachable".into()), s.t0);
    assert!(matches!(
        pre_finish(&a),
        Some(Err(KvError::DecoderDead { .. }))
    ));
    assert!(pre_sends(&a).is_empty());
}

#[test]
fn a_failed_write_fails_the_request_at_the_decoder() {
    let mut s = pair(1);
    let p = posts(&s.pre.ready(&s.key, 1).unwrap());
    let a = s.pre.on_posted(&p[0].0, 0, Err("nic down".into()), s.t0);
    assert!(matches!(
        pre_finish(&a),
        Some(Err(KvError::TransferFailed { .. }))
    ));
    let m = pre_frames(&a);
    let f = finishes(&s.dec.on_msg(&addr(1), m[0].1, m[0].2.clone(), s.t0));
    match &f[..] {
        [(_, Err(KvError::TransferFailed { step, error, .. }))] => {
            assert_eq!(step, "layer 0");
            assert_eq!(error, "nic down");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn refusals_are_typed() {
    let t0 = Instant::now();
    let mut dec = decoder(t0);
    let mut pre = PrefillerCore::new(
        KvLayout {
            layers: 5,
            ..LAYOUT
        },
        HB,
    )
    .unwrap();
    let (p, hello) = dec.add_prefiller(addr(1), t0);
    pump(&mut dec, &mut pre, &addr(1), hello, t0);
    let lease = dec.alloc(1).unwrap();
    let st = dec
        .begin(&Route::single(p, 2), &lease, 1, &counts(), b"", t0)
        .unwrap();
    let m = frames(&st.actions);
    let auth = m[0].1;
    let a = pre.on_msg(&addr(100), auth, m[0].2.clone(), t0);
    let r = pre_frames(&a);
    let f = finishes(&dec.on_msg(&addr(1), r[0].1, r[0].2.clone(), t0));
    assert!(matches!(
        f[..],
        [(
            _,
            Err(KvError::Refused {
                refusal: weft_kvcache::Refusal::LayoutMismatch { .. },
                ..
            })
        )]
    ));
    // A request naming one decoder head twice (the decoder never sends
    // one; a foreign peer may) is refused as such, not served.
    let mut dup_pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let dup_auth = join(&mut dup_pre, &addr(100), t0);
    let st2 = dec
        .begin(&Route::single(p, 2), &lease, 2, &counts(), b"", t0)
        .unwrap();
    let Msg::Request(mut req) = sends(&st2.actions)[0].1.clone() else {
        panic!("the decoder's first send is not its request");
    };
    req.heads = vec![HeadMap { src: 0, dst: 1 }; 5000];
    let id = req.id;
    let a = dup_pre.on_msg(&addr(100), dup_auth, Msg::Request(req), t0);
    let r = pre_sends(&a);
    assert!(
        matches!(
            &r[..],
            [(_, Msg::Failed { id: i, failure: weft_kvcache::wire::Failure::Refused(weft_kvcache::Refusal::DuplicateHead { head: 1 }) })] if *i == id
        ),
        "{r:?}"
    );
    assert_eq!(dup_pre.pending(), 0);
    // malformed routes are refused before anything is sent
    let bad = Route {
        sources: vec![Source {
            prefiller: p,
            heads: vec![HeadMap { src: 0, dst: 0 }],
            tail: true,
        }],
    };
    assert!(matches!(
        dec.begin(&bad, &lease, 1, &counts(), b"", t0),
        Err(KvError::InvalidRoute { .. })
    ));
}

/// A prefiller holds at most `max_pending` requests: one more is refused
/// as `Busy` (the decoder's request fails with that refusal), and once one
/// of those held ends, a new one is taken again.
#[test]
fn a_prefiller_at_its_request_bound_refuses_busy() {
    let t0 = Instant::now();
    let mut dec = decoder(t0);
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap().with_max_pending(2);
    let (p, hello) = dec.add_prefiller(addr(1), t0);
    pump(&mut dec, &mut pre, &addr(1), hello, t0);
    let mut keys = Vec::new();
    let mut leases = Vec::new();
    for k in 0..3u32 {
        leases.push(dec.alloc(1).unwrap());
        let st = dec
            .begin(
                &Route::single(p, 2),
                &leases[k as usize],
                k + 1,
                &counts(),
                b"",
                t0,
            )
            .unwrap();
        let m = frames(&st.actions);
        let a = pre.on_msg(&addr(100), m[0].1, m[0].2.clone(), t0);
        if k < 2 {
            match &a[..] {
                [PreAction::Incoming(i)] => keys.push(i.key.clone()),
                other => panic!("request {k}: {other:?}"),
            }
            continue;
        }
        let r = pre_sends(&a);
        assert!(
            matches!(
                &r[..],
                [(_, Msg::Failed { id, failure: weft_kvcache::wire::Failure::Refused(weft_kvcache::Refusal::Busy { max: 2 }) })] if *id == st.id
            ),
            "{r:?}"
        );
        assert_eq!(pre.pending(), 2);
        // The decoder's request ends with that refusal.
        let r = pre_frames(&a);
        let f = finishes(&dec.on_msg(&addr(1), r[0].1, r[0].2.clone(), t0));
        assert!(
            matches!(
                &f[..],
                [(id, Err(KvError::Refused { refusal: weft_kvcache::Refusal::Busy { max: 2 }, .. }))] if *id == st.id
            ),
            "{f:?}"
        );
    }
    // One held request ends (the application rejects it): room again.
    let a = pre.reject(&keys[0], "no room".into(), t0);
    assert_eq!(pre_sends(&a).len(), 1);
    assert_eq!(pre.pending(), 1);
    let lease = dec.alloc(1).unwrap();
    let st = dec
        .begin(&Route::single(p, 2), &lease, 9, &counts(), b"", t0)
        .unwrap();
    let m = frames(&st.actions);
    let a = pre.on_msg(&addr(100), m[0].1, m[0].2.clone(), t0);
    assert!(matches!(&a[..], [PreAction::Incoming(_)]), "{a:?}");
    assert_eq!(pre.pending(), 2);
}

/// A prefiller knows a bounded number of decoders: a message from one more
/// is dropped unless a dead one with nothing left can be forgotten for it;
/// and a dead decoder's entry (which makes its late messages ignored) goes
/// ten heartbeat timeouts after its death.
#[test]
fn a_prefiller_knows_a_bounded_number_of_decoders() {
    let t0 = Instant::now();
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap().with_max_decoders(2);
    let a1 = join(&mut pre, &addr(1), t0);
    let _a2 = join(&mut pre, &addr(2), t0);
    assert_eq!(pre.decoders(), 2);
    // A third, while both are alive: dropped, and nothing is sent to it
    // (but the answer to its first, unproven, hello).
    let t1 = t0 + Duration::from_millis(1);
    let a3 = join(&mut pre, &addr(3), t1);
    assert!(pre.on_msg(&addr(3), a3, Msg::Hello, t1).is_empty());
    assert_eq!(pre.decoders(), 2);
    let beats = pre.tick(t1 + HB.interval);
    assert!(
        pre_sends(&beats).iter().all(|(to, _)| *to != addr(3)),
        "{beats:?}"
    );
    // A decoder never heard from leaves the rendezvous store: with no room
    // and no dead one to forget, nothing is kept of it.
    let left = weft_kvcache::PeerLoss::Left {
        store: "test".into(),
    };
    assert!(pre.decoder_gone(&addr(4), left, t1).is_empty());
    assert_eq!(pre.decoders(), 2);
    // Decoder 1 is gone: kept, its messages ignored ...
    let a = pre.decoder_gone(
        &addr(1),
        weft_kvcache::PeerLoss::Left {
            store: "test".into(),
        },
        t1,
    );
    assert!(
        a.iter()
            .any(|x| matches!(x, PreAction::Forget { peer } if *peer == addr(1))),
        "{a:?}"
    );
    assert!(pre.on_msg(&addr(1), a1, Msg::Hello, t1).is_empty());
    assert_eq!(pre.decoders(), 2);
    // ... until a new decoder needs its place.
    assert!(pre.on_msg(&addr(3), a3, Msg::Hello, t1).is_empty());
    assert_eq!(pre.decoders(), 2);
    // Decoder 2 goes silent and is found dead; its entry stays for ten
    // heartbeat timeouts, then goes (decoder 3 keeps talking).
    let mut t = t1;
    let mut found_dead = None;
    while t < t1 + HB.timeout * 12 {
        t += HB.interval;
        assert!(pre.on_msg(&addr(3), a3, Msg::Heartbeat, t).is_empty());
        let a = pre.tick(t);
        if a.iter()
            .any(|x| matches!(x, PreAction::Forget { peer } if *peer == addr(2)))
        {
            found_dead = Some(t);
        }
        match found_dead {
            Some(d) if t >= d + HB.timeout * 10 => break,
            _ => assert_eq!(pre.decoders(), 2, "at {:?}", t - t1),
        }
    }
    assert!(found_dead.is_some(), "decoder 2 never found dead");
    assert_eq!(pre.decoders(), 1);
}

#[test]
fn a_dead_source_waits_for_the_other_sources_confirmation() {
    let t0 = Instant::now();
    let mut dec = decoder(t0);
    let (a, hello_a) = dec.add_prefiller(addr(1), t0);
    let (b, hello_b) = dec.add_prefiller(addr(2), t0);
    fake_prefiller(&mut dec, &hello_a, &addr(1), t0);
    let auth_b = fake_prefiller(&mut dec, &hello_b, &addr(2), t0);
    let route = Route {
        sources: vec![
            Source {
                prefiller: a,
                heads: vec![HeadMap { src: 0, dst: 0 }],
                tail: true,
            },
            Source {
                prefiller: b,
                heads: vec![HeadMap { src: 0, dst: 1 }],
                tail: false,
            },
        ],
    };
    let lease = dec.alloc(2).unwrap();
    let st = dec.begin(&route, &lease, 1, &counts(), b"", t0).unwrap();
    assert_eq!(st.imm_count, 4 * 2 + 1 + 4 * 2);
    let m = sends(&st.actions);
    assert_eq!(m.len(), 2);
    match (&m[0].1, &m[1].1) {
        (Msg::Request(r0), Msg::Request(r1)) => {
            assert_eq!(r0.tail_slot, Some(lease.tail_slot()));
            assert_eq!(r1.tail_slot, None);
        }
        other => panic!("{other:?}"),
    }
    let acts = dec.on_send_failed(&addr(1), "unreachable".into(), t0);
    assert_eq!(sends(&acts), vec![(addr(2), Msg::Cancel { id: st.id })]);
    assert!(finishes(&acts).is_empty(), "b may still write");
    let f = finishes(&dec.on_msg(&addr(2), auth_b, Msg::CancelAck { id: st.id }, t0));
    assert!(matches!(f[..], [(_, Err(KvError::PrefillerDead { .. }))]));
    dec.free(lease, t0);
    assert_eq!(dec.pool().free_pages(), 16);
}

#[test]
fn accept_checks_the_source_pages_and_reports_need_acceptance() {
    let t0 = Instant::now();
    let mut dec = decoder(t0);
    let mut pre = PrefillerCore::new(LAYOUT, HB).unwrap();
    let (p, hello) = dec.add_prefiller(addr(1), t0);
    pump(&mut dec, &mut pre, &addr(1), hello, t0);
    let lease = dec.alloc(2).unwrap();
    let st = dec
        .begin(&Route::single(p, 2), &lease, 1, &counts(), b"", t0)
        .unwrap();
    let m = frames(&st.actions);
    let key = match &pre.on_msg(&addr(100), m[0].1, m[0].2.clone(), t0)[..] {
        [PreAction::Incoming(i)] => i.key.clone(),
        other => panic!("{other:?}"),
    };
    // a report before acceptance is a misuse, not a post
    assert!(matches!(
        pre.ready(&key, 1),
        Err(KvError::NotIncoming { .. })
    ));
    assert!(matches!(
        pre.accept(&key, &[0], 0),
        Err(KvError::InvalidSourcePages { .. })
    ));
    assert!(matches!(
        pre.accept(&key, &[0, 16], 0),
        Err(KvError::InvalidSourcePages { .. })
    ));
    assert!(matches!(
        pre.accept(&key, &[0, 1], 4),
        Err(KvError::InvalidSourcePages { .. })
    ));
    pre.accept(&key, &[0, 1], 3).unwrap();
    assert!(matches!(
        pre.accept(&key, &[0, 1], 3),
        Err(KvError::NotIncoming { .. })
    ));
    assert_eq!(posts(&pre.ready(&key, 5).unwrap()).len(), 5);
}
