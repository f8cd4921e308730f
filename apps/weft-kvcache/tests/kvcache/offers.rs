//! `Offers`: prompts served by key over the adversarial loopback fabric —
//! offer before or after the request, layer-wise readiness, keys never
//! offered, offers nobody asked for, one serve per offer.

use crate::common::*;
use std::sync::Arc;
use std::time::Duration;
use weft::loopback::{Fabric, FabricConfig};
use weft::TransferEngine;
use weft_kvcache::{
    request_meta, Completed, Decoder, KvError, KvLayout, Offers, PageLease, Prefiller, Route,
};
use weft_testkit::{seeds_or, SeedGuard};

const NICS: usize = 2;

fn lay() -> KvLayout {
    layout(4, 2, 1024, 700, 32)
}

struct Pair {
    _fabric: Fabric,
    pe: Arc<TransferEngine>,
    de: Arc<TransferEngine>,
    pcache: Cache,
    dcache: Cache,
    offers: Offers,
    dec: Decoder,
    route: Route,
}

fn pair(seed: u64, hold: Duration) -> Pair {
    let fabric = Fabric::new_realtime(FabricConfig {
        max_write_len: 1500,
        ..FabricConfig::adversarial(seed)
    });
    let (ph, dh) = (fabric.add_host(NICS), fabric.add_host(NICS));
    let (pe, de) = (engine(&fabric, ph, NICS), engine(&fabric, dh, NICS));
    let pcache = Cache::new(lay());
    let pre = Prefiller::new(pe.clone(), lay(), pcache.per_layer_regions(), kv_config()).unwrap();
    let offers = Offers::new(Arc::new(pre), hold).unwrap();
    let dcache = Cache::new(lay());
    let dec = Decoder::new(de.clone(), lay(), dcache.per_layer_regions(), kv_config()).unwrap();
    let route = Route::single(dec.add_prefiller(pe.main_address()), 2);
    Pair {
        _fabric: fabric,
        pe,
        de,
        pcache,
        dcache,
        offers,
        dec,
        route,
    }
}

impl Pair {
    /// Requests `lease` with `meta` and waits for the outcome.
    fn ask(&self, lease: &PageLease, meta: &[u8]) -> Result<Completed, KvError> {
        self.dec.request(&self.route, lease, meta).unwrap().wait()
    }

    /// Computes prompt `seed` into the prefill pages `src` (tail slot 0).
    fn compute(&self, src: &[u32], seed: u64) {
        for l in 0..lay().layers {
            compute_layer(&self.pcache, &[0, 1], src, seed, l);
        }
        compute_tail(&self.pcache, 0, seed);
    }

    fn done_keys(&self, want: usize) -> Vec<(Vec<u8>, Result<(), String>)> {
        let mut got = Vec::new();
        for _ in 0..500 {
            got.extend(
                self.offers
                    .take_done()
                    .into_iter()
                    .map(|d| (d.key, d.outcome.map_err(|e| e.kind().to_string()))),
            );
            if got.len() >= want {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        got
    }

    fn teardown(mut self) {
        self.offers.stop();
        self.dec.shutdown();
        self.offers.prefiller().shutdown(Duration::from_secs(2));
        self.de.shutdown();
        self.pe.shutdown();
    }
}

const ALL: u64 = 5; // 4 layers + the tail

#[test]
fn an_offer_made_before_or_after_its_request_is_served_byte_exact() {
    for seed in seeds_or([1, 2]) {
        let _g = SeedGuard::new(
            seed,
            "an_offer_made_before_or_after_its_request_is_served_byte_exact",
        );
        let p = pair(seed, Duration::from_secs(10));
        // offered first
        p.compute(&[3, 9, 4], seed);
        let key = seed.to_le_bytes().to_vec();
        p.offers
            .offer(key.clone(), vec![3, 9, 4], 0, ALL, Duration::from_secs(10))
            .unwrap();
        let lease = p.dec.alloc_pages(&[7, 1, 30]).unwrap();
        p.ask(&lease, &request_meta(&key, 0)).unwrap();
        check_request(&p.dcache, &[0, 1], &[7, 1, 30], lease.tail_slot(), seed).unwrap();
        p.dec.free(lease);
        // asked for first: the request waits for the offer
        let s2 = seed + 100;
        let key2 = s2.to_le_bytes().to_vec();
        let lease = p.dec.alloc(2).unwrap();
        let h = p
            .dec
            .request(&p.route, &lease, &request_meta(&key2, 0))
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(!h.is_done(), "seed {seed}: served before it was offered");
        p.compute(&[5, 6], s2);
        p.offers
            .offer(key2.clone(), vec![5, 6, 8], 0, ALL, Duration::from_secs(10))
            .unwrap();
        h.wait().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        check_request(&p.dcache, &[0, 1], lease.pages(), lease.tail_slot(), s2).unwrap();
        let done = p.done_keys(2);
        assert_eq!(done, vec![(key, Ok(())), (key2, Ok(()))], "seed {seed}");
        assert_eq!(p.offers.pending(), 0);
        p.teardown();
    }
}

#[test]
fn layers_reported_after_the_offer_are_posted_as_they_come() {
    let seed = seeds_or([3])[0];
    let _g = SeedGuard::new(
        seed,
        "layers_reported_after_the_offer_are_posted_as_they_come",
    );
    let p = pair(seed, Duration::from_secs(10));
    let key = b"prompt-layerwise".to_vec();
    p.offers
        .offer(key.clone(), vec![0, 1], 0, 0, Duration::from_secs(10))
        .unwrap();
    let lease = p.dec.alloc(2).unwrap();
    let h = p
        .dec
        .request(&p.route, &lease, &request_meta(&key, 0))
        .unwrap();
    for l in 0..lay().layers {
        compute_layer(&p.pcache, &[0, 1], &[0, 1], seed, l);
        p.offers.ready(&key, u64::from(l) + 1).unwrap();
        assert!(
            !h.is_done() || l == lay().layers,
            "seed {seed}: done before the tail"
        );
    }
    compute_tail(&p.pcache, 0, seed);
    p.offers.ready(&key, ALL).unwrap();
    h.wait().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    check_request(&p.dcache, &[0, 1], lease.pages(), lease.tail_slot(), seed).unwrap();
    p.teardown();
}

#[test]
fn keys_not_offered_are_refused_and_offers_not_asked_for_expire() {
    let seed = seeds_or([4])[0];
    let _g = SeedGuard::new(
        seed,
        "keys_not_offered_are_refused_and_offers_not_asked_for_expire",
    );
    let p = pair(seed, Duration::from_millis(200));
    let lease = p.dec.alloc(1).unwrap();
    let r = p.ask(&lease, &request_meta(b"never-offered", 0));
    assert!(
        matches!(r, Err(KvError::Refused { .. })),
        "seed {seed}: {r:?}"
    );
    p.dec.free(lease);
    p.offers
        .offer(
            b"lonely".to_vec(),
            vec![2],
            0,
            ALL,
            Duration::from_millis(100),
        )
        .unwrap();
    assert!(matches!(
        p.offers
            .offer(b"lonely".to_vec(), vec![3], 0, ALL, Duration::from_secs(1)),
        Err(KvError::InvalidRoute { .. })
    ));
    let done = p.done_keys(1);
    assert_eq!(done, vec![(b"lonely".to_vec(), Err("Expired".into()))]);
    // withdrawn offers are gone at once and never served
    p.offers
        .offer(b"gone".to_vec(), vec![2], 0, ALL, Duration::from_secs(10))
        .unwrap();
    assert!(p.offers.withdraw(b"gone"));
    let lease = p.dec.alloc(1).unwrap();
    let r = p.ask(&lease, &request_meta(b"gone", 0));
    assert!(
        matches!(r, Err(KvError::Refused { .. })),
        "seed {seed}: {r:?}"
    );
    p.teardown();
}

#[test]
fn an_offer_serves_one_request_and_only_as_many_pages_as_offered() {
    let seed = seeds_or([5])[0];
    let _g = SeedGuard::new(
        seed,
        "an_offer_serves_one_request_and_only_as_many_pages_as_offered",
    );
    let p = pair(seed, Duration::from_millis(300));
    p.compute(&[4, 5], seed);
    let key = b"once".to_vec();
    // too many pages asked for: refused, the offer stays
    p.offers
        .offer(key.clone(), vec![4, 5], 0, ALL, Duration::from_secs(10))
        .unwrap();
    let big = p.dec.alloc(3).unwrap();
    let r = p.ask(&big, &request_meta(&key, 0));
    assert!(
        matches!(r, Err(KvError::Refused { .. })),
        "seed {seed}: {r:?}"
    );
    let a = p.dec.alloc(2).unwrap();
    p.ask(&a, &request_meta(&key, 0)).unwrap();
    check_request(&p.dcache, &[0, 1], a.pages(), a.tail_slot(), seed).unwrap();
    // a second request for the same key (a replay) gets nothing
    let b = p.dec.alloc(2).unwrap();
    let r = p.ask(&b, &request_meta(&key, 0));
    assert!(
        matches!(r, Err(KvError::Refused { .. })),
        "seed {seed}: {r:?}"
    );
    p.teardown();
}

/// A decoder holding the prompt's first pages (its prefix cache) asks for
/// the rest: it gets the offered pages from `first` on, and nothing past
/// the offer; metadata that is not an offer request is refused.
#[test]
fn a_request_may_skip_the_prompt_pages_it_holds_but_not_run_past_the_offer() {
    let seed = seeds_or([6])[0];
    let _g = SeedGuard::new(
        seed,
        "a_request_may_skip_the_prompt_pages_it_holds_but_not_run_past_the_offer",
    );
    let p = pair(seed, Duration::from_millis(300));
    // the prompt's pages 0..4 live in prefill pages [10, 11, 12, 13]; the
    // decoder holds the first two and asks for pages 2..4 of the prompt
    for l in 0..lay().layers {
        compute_layer(&p.pcache, &[0, 1], &[10, 11, 12, 13], seed, l);
    }
    compute_tail(&p.pcache, 0, seed);
    p.offers
        .offer(
            b"prefix".to_vec(),
            vec![10, 11, 12, 13],
            0,
            ALL,
            Duration::from_secs(10),
        )
        .unwrap();
    let past = p.dec.alloc(3).unwrap();
    let r = p.ask(&past, &request_meta(b"prefix", 2));
    assert!(
        matches!(r, Err(KvError::Refused { .. })),
        "seed {seed}: {r:?}"
    );
    p.dec.free(past);
    let lease = p.dec.alloc_pages(&[20, 21]).unwrap();
    p.ask(&lease, &request_meta(b"prefix", 2))
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    // decoder page 20 holds prompt page 2, 21 prompt page 3
    let l = lay();
    for layer in 0..l.layers {
        for h in 0..2u32 {
            for (j, dp) in [(2u32, 20u32), (3, 21)] {
                let off = l.offset(layer, h, dp).unwrap() as usize;
                let got = p.dcache.kv.read(off, l.page_len as usize).unwrap();
                let want: Vec<u8> = (0..l.page_len)
                    .map(|i| kv_byte(seed, layer, h, j, i))
                    .collect();
                assert_eq!(
                    got, want,
                    "seed {seed}: layer {layer} head {h} prompt page {j}"
                );
            }
        }
    }
    let short = p.dec.alloc(1).unwrap();
    let r = p.ask(&short, b"abc");
    assert!(
        matches!(r, Err(KvError::Refused { .. })),
        "seed {seed}: {r:?}"
    );
    p.teardown();
}

/// A request cancelled while it waits for its offer takes the offer with
/// it when the offer comes: the offer ends at once (`Cancelled`), nothing
/// is written, and the decoder's pages keep what they held.
#[test]
fn an_offer_whose_request_was_cancelled_first_ends_without_a_write() {
    let seed = seeds_or([7])[0];
    let _g = SeedGuard::new(
        seed,
        "an_offer_whose_request_was_cancelled_first_ends_without_a_write",
    );
    let p = pair(seed, Duration::from_secs(10));
    let lease = p.dec.alloc_pages(&[3, 4]).unwrap();
    p.dcache.fill_pages(&[3, 4], 0xee);
    let h = p
        .dec
        .request(&p.route, &lease, &request_meta(b"late", 0))
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    p.dec.cancel(&h);
    let r = h.wait();
    assert!(
        matches!(r, Err(KvError::Cancelled { .. })),
        "seed {seed}: {r:?}"
    );
    p.compute(&[0, 1], seed);
    p.offers
        .offer(
            b"late".to_vec(),
            vec![0, 1],
            0,
            ALL,
            Duration::from_secs(10),
        )
        .unwrap();
    let done = p.done_keys(1);
    assert_eq!(
        done,
        vec![(b"late".to_vec(), Err("Cancelled".into()))],
        "seed {seed}"
    );
    std::thread::sleep(Duration::from_millis(100));
    p.dcache.check_filled(&[3, 4], 0xee).unwrap();
    p.teardown();
}

/// An offer for two requests (two decode ranks reading one prefill rank
/// under a TP mismatch) serves both and ends once both ended; a third is
/// refused.
#[test]
fn an_offer_for_several_requests_serves_each_and_ends_after_the_last() {
    let seed = seeds_or([8])[0];
    let _g = SeedGuard::new(
        seed,
        "an_offer_for_several_requests_serves_each_and_ends_after_the_last",
    );
    let p = pair(seed, Duration::from_millis(300));
    p.compute(&[6, 7], seed);
    p.offers
        .offer_to(
            b"shared".to_vec(),
            vec![6, 7],
            0,
            ALL,
            Duration::from_secs(10),
            2,
        )
        .unwrap();
    let a = p.dec.alloc(2).unwrap();
    p.ask(&a, &request_meta(b"shared", 0)).unwrap();
    assert_eq!(p.offers.pending(), 1, "seed {seed}: ended after one of two");
    assert!(p.offers.take_done().is_empty());
    let b = p.dec.alloc(2).unwrap();
    p.ask(&b, &request_meta(b"shared", 0)).unwrap();
    for l in [&a, &b] {
        check_request(&p.dcache, &[0, 1], l.pages(), l.tail_slot(), seed).unwrap();
    }
    assert_eq!(
        p.done_keys(1),
        vec![(b"shared".to_vec(), Ok(()))],
        "seed {seed}"
    );
    let c = p.dec.alloc(2).unwrap();
    let r = p.ask(&c, &request_meta(b"shared", 0));
    assert!(
        matches!(r, Err(KvError::Refused { .. })),
        "seed {seed}: {r:?}"
    );
    p.teardown();
}

/// A request whose frame cannot fit the receive buffers is refused at the
/// decoder, typed, and the prefiller stays alive for the next request
/// (a SEND that fails would count as the prefiller's death).
#[test]
fn a_request_too_long_for_the_receive_buffers_is_refused_locally() {
    let seed = seeds_or([9])[0];
    let _g = SeedGuard::new(
        seed,
        "a_request_too_long_for_the_receive_buffers_is_refused_locally",
    );
    let p = pair(seed, Duration::from_millis(300));
    let lease = p.dec.alloc(1).unwrap();
    let huge = request_meta(&vec![b'k'; 70_000], 0);
    let r = p.dec.request(&p.route, &lease, &huge);
    assert!(matches!(r, Err(KvError::InvalidRoute { .. })), "{r:?}");
    p.compute(&[1], seed);
    p.offers
        .offer(b"after".to_vec(), vec![1], 0, ALL, Duration::from_secs(10))
        .unwrap();
    p.ask(&lease, &request_meta(b"after", 0))
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    p.teardown();
}
