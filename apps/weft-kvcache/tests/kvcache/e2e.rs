//! End-to-end transfers over the adversarial loopback fabric (realtime:
//! real engine worker, callback and watcher threads): byte-exact data,
//! cancellation, dead peers, and no write into pages handed back.

use crate::common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::loopback::{Fabric, FabricConfig, HostId, NicModel};
use weft::TransferEngine;
use weft_kvcache::{Decoder, KvError, KvLayout, Prefiller, Route};
use weft_testkit::{seeds_or, SeedGuard};

const NICS: usize = 2;

fn lay() -> KvLayout {
    layout(6, 2, 2048, 3000, 48)
}

struct Setup {
    fabric: Fabric,
    pre_host: HostId,
    dec_host: HostId,
    pe: Arc<TransferEngine>,
    de: Arc<TransferEngine>,
    app: PrefillApp,
    dec: Decoder,
    dcache: Cache,
    route: Route,
}

fn setup(seed: u64, signal: Signal, hook: Option<Hook>) -> Setup {
    setup_with(seed, signal, hook, None)
}

/// `slow`: the prefiller's NICs' link (Gbit/s), so its writes are still in
/// flight when a cancel arrives.
fn setup_with(seed: u64, signal: Signal, hook: Option<Hook>, slow: Option<f64>) -> Setup {
    let fabric = Fabric::new_realtime(FabricConfig {
        max_write_len: 1500,
        ..FabricConfig::adversarial(seed)
    });
    let pre_host = match slow {
        Some(gbps) => fabric.add_host_with(
            NICS,
            NicModel {
                latency: Duration::from_micros(2),
                link_gbps: gbps,
            },
        ),
        None => fabric.add_host(NICS),
    };
    let dec_host = fabric.add_host(NICS);
    let pe = engine(&fabric, pre_host, NICS);
    let de = engine(&fabric, dec_host, NICS);
    let pcache = Arc::new(Cache::new(lay()));
    let pre = Arc::new(Prefiller::new(pe.clone(), lay(), pcache.regions(), kv_config()).unwrap());
    let app = PrefillApp::start(pre, pcache, vec![0, 1], signal, hook);
    let dcache = Cache::new(lay());
    let dec = Decoder::new(de.clone(), lay(), dcache.regions(), kv_config()).unwrap();
    let p = dec.add_prefiller(pe.main_address());
    Setup {
        fabric,
        pre_host,
        dec_host,
        pe,
        de,
        app,
        dec,
        dcache,
        route: Route::single(p, 2),
    }
}

impl Setup {
    fn teardown(mut self) {
        self.app.stop();
        self.dec.shutdown();
        self.app.pre.shutdown(Duration::from_secs(2));
        self.de.shutdown();
        self.pe.shutdown();
    }
}

fn meta(seed: u64) -> Vec<u8> {
    seed.to_le_bytes().to_vec()
}

#[test]
fn concurrent_requests_arrive_byte_exact() {
    for seed in seeds_or([1, 2, 3]) {
        let _g = SeedGuard::new(seed, "concurrent_requests_arrive_byte_exact");
        let s = setup(seed, Signal::Mixed, None);
        let sizes = [1u32, 5, 9, 3, 12, 7];
        let mut reqs = Vec::new();
        for (k, &n) in sizes.iter().enumerate() {
            let lease = s.dec.alloc(n).unwrap();
            let ps = seed * 100 + k as u64;
            let h = s.dec.request(&s.route, &lease, &meta(ps)).unwrap();
            reqs.push((lease, h, ps));
        }
        // one handle through the callback, one through the future
        let (tx, rx) = crossbeam_channel::bounded(1);
        reqs[0].1.on_complete(move |r| {
            let _ = tx.send(r.is_ok());
        });
        assert!(block_on(reqs[1].1.future()).is_ok(), "seed {seed}");
        for (lease, h, ps) in &reqs {
            let c = h.wait().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            assert!(h.is_done());
            assert_eq!(c.id, h.id());
            // more immediates than writes: the pages were split
            assert!(c.imms > u64::from(lay().layers) + 1);
            check_request(&s.dcache, &[0, 1], lease.pages(), lease.tail_slot(), *ps)
                .unwrap_or_else(|e| panic!("seed {seed}: request {}: {e}", h.id()));
        }
        assert!(rx.recv().unwrap());
        for (lease, _, _) in reqs {
            s.dec.free(lease);
        }
        assert_eq!(s.dec.free_pages(), 48);
        // pages are reused by later requests and arrive again
        for k in 0..3 {
            let lease = s.dec.alloc(16).unwrap();
            let h = s
                .dec
                .request(&s.route, &lease, &meta(seed + 1000 + k))
                .unwrap();
            h.wait()
                .unwrap_or_else(|e| panic!("seed {seed}: reuse: {e}"));
            check_request(
                &s.dcache,
                &[0, 1],
                lease.pages(),
                lease.tail_slot(),
                seed + 1000 + k,
            )
            .unwrap_or_else(|e| panic!("seed {seed}: reuse: {e}"));
            s.dec.free(lease);
        }
        s.teardown();
    }
}

/// Cancel right after layer `at` was reported (its writes in flight over a
/// slow link); once the cancel is confirmed the handed-back pages get a
/// sentinel, the prefiller goes on "computing" and reporting layers, and
/// after more traffic the sentinel must be intact: nothing landed in them
/// after the confirmation.
#[test]
fn cancelled_pages_are_never_written_after_the_confirmation() {
    for seed in seeds_or(0..12) {
        let _g = SeedGuard::new(
            seed,
            "cancelled_pages_are_never_written_after_the_confirmation",
        );
        let at = 1 + (seed % 5) as u32;
        let (hook, reached, release) = gate(1, at);
        let signal = if seed % 2 == 0 {
            Signal::Call
        } else {
            Signal::Watcher
        };
        let s = setup_with(seed, signal, Some(hook), Some(0.2));
        let lease = s.dec.alloc(10).unwrap();
        let h = s.dec.request(&s.route, &lease, &meta(seed)).unwrap();
        assert_eq!(h.id(), 1);
        reached.recv().expect("compute reached the layer");
        s.dec.cancel(&h);
        // not confirmed while the compute is held with writes maybe in flight:
        // the request is pending and its pages stay out of the pool
        let r = h.wait_timeout(Duration::from_millis(1));
        if r.is_none() {
            assert_eq!(s.dec.free_pages(), 38);
        }
        match h.wait() {
            Err(KvError::Cancelled { request: 1 }) => {}
            other => panic!("seed {seed}: expected Cancelled, got {other:?}"),
        }
        s.dcache.fill_pages(lease.pages(), 0xEE);
        release.send(()).unwrap();
        // the prefill side ends the request too, and drops nothing late
        let serve = loop {
            if let Some(sv) = s.app.serves.lock().first().cloned() {
                break sv;
            }
            std::thread::yield_now();
        };
        match serve.wait() {
            Err(KvError::Cancelled { .. }) => {}
            other => panic!("seed {seed}: the prefill side: expected Cancelled, got {other:?}"),
        }
        // more traffic on other pages, then the sentinel must be intact
        let l2 = s.dec.alloc(8).unwrap();
        let h2 = s.dec.request(&s.route, &l2, &meta(seed + 7)).unwrap();
        h2.wait()
            .unwrap_or_else(|e| panic!("seed {seed}: after cancel: {e}"));
        check_request(&s.dcache, &[0, 1], l2.pages(), l2.tail_slot(), seed + 7).unwrap();
        s.dcache
            .check_filled(lease.pages(), 0xEE)
            .unwrap_or_else(|e| panic!("seed {seed}: written after the cancel ack: {e}"));
        s.dec.free(lease);
        s.dec.free(l2);
        assert_eq!(s.dec.free_pages(), 48);
        s.teardown();
    }
}

#[test]
fn a_dead_prefiller_fails_pending_requests() {
    for seed in seeds_or([21, 22]) {
        let _g = SeedGuard::new(seed, "a_dead_prefiller_fails_pending_requests");
        let (hook, reached, release) = gate(1, 3);
        let s = setup(seed, Signal::Call, Some(hook));
        let lease = s.dec.alloc(8).unwrap();
        let h = s.dec.request(&s.route, &lease, &meta(seed)).unwrap();
        reached.recv().unwrap();
        s.fabric.kill_host(s.pre_host);
        match h.wait() {
            Err(KvError::PrefillerDead { peer, request, .. }) => {
                assert_eq!(peer, s.pe.main_address());
                assert_eq!(request, 1);
            }
            other => panic!("seed {seed}: expected PrefillerDead, got {other:?}"),
        }
        s.dec.free(lease);
        assert_eq!(s.dec.free_pages(), 48);
        let l2 = s.dec.alloc(1).unwrap();
        match s.dec.request(&s.route, &l2, &meta(0)) {
            Err(KvError::PeerDead { .. }) => {}
            other => panic!("seed {seed}: expected PeerDead, got {other:?}"),
        }
        let _ = release.send(());
        s.teardown();
    }
}

#[test]
fn a_dead_decoder_makes_the_prefiller_drop_its_work() {
    for seed in seeds_or([31, 32]) {
        let _g = SeedGuard::new(seed, "a_dead_decoder_makes_the_prefiller_drop_its_work");
        let (hook, reached, release) = gate(1, 2);
        let s = setup(seed, Signal::Call, Some(hook));
        let lease = s.dec.alloc(6).unwrap();
        let _h = s.dec.request(&s.route, &lease, &meta(seed)).unwrap();
        reached.recv().unwrap();
        s.fabric.kill_host(s.dec_host);
        let serve = s.app.serves.lock().first().cloned().expect("accepted");
        // the compute is still held: only the heartbeat (or a failed write
        // in flight) can end it
        match serve.wait() {
            Err(KvError::DecoderDead { request: 1, .. })
            | Err(KvError::TransferFailed { request: 1, .. }) => {}
            other => panic!("seed {seed}: expected DecoderDead, got {other:?}"),
        }
        assert_eq!(s.app.pre.pending(), 0);
        let _ = release.send(());
        s.teardown();
    }
}

#[test]
fn freeing_a_lease_in_flight_returns_its_pages_after_the_confirmation() {
    let seed = 41;
    let _g = SeedGuard::new(seed, "freeing_a_lease_in_flight");
    let (hook, reached, release) = gate(1, 1);
    let s = setup(seed, Signal::Call, Some(hook));
    let lease = s.dec.alloc(20).unwrap();
    let pages = lease.pages().to_vec();
    let h = s.dec.request(&s.route, &lease, &meta(seed)).unwrap();
    reached.recv().unwrap();
    s.dec.free(lease);
    assert!(matches!(h.wait(), Err(KvError::Cancelled { .. })));
    assert!(pages.iter().all(|&p| s.dec.is_page_free(p)));
    release.send(()).unwrap();
    s.teardown();
}

#[test]
fn an_external_watcher_word_reused_across_requests_drives_the_posts() {
    let seed = 51;
    let _g = SeedGuard::new(seed, "external_watcher_word");
    let s = setup(seed, Signal::External, None);
    for k in 0..4u64 {
        let lease = s.dec.alloc(3 + k as u32).unwrap();
        let h = s.dec.request(&s.route, &lease, &meta(seed + k)).unwrap();
        h.wait().unwrap_or_else(|e| panic!("request {k}: {e}"));
        check_request(
            &s.dcache,
            &[0, 1],
            lease.pages(),
            lease.tail_slot(),
            seed + k,
        )
        .unwrap();
        s.dec.free(lease);
    }
    let st = s.app.pre.stats();
    assert!(st.steps.load(std::sync::atomic::Ordering::Relaxed) >= 4 * 7);
    s.teardown();
}

/// The decoder's and the prefiller's counters count every request once,
/// by outcome, and land on one Prometheus page with their engines'.
#[test]
fn metrics_count_requests_by_outcome() {
    let s = setup(5, Signal::Mixed, None);
    for k in 0..3u64 {
        let lease = s.dec.alloc(4).unwrap();
        let h = s.dec.request(&s.route, &lease, &meta(500 + k)).unwrap();
        h.wait().unwrap();
        s.dec.free(lease);
    }
    let d = s.dec.outcomes();
    assert_eq!((d.taken(), d.completed()), (3, 3));
    assert!(d.failed().is_empty());
    let p = s.app.pre.outcomes();
    // The prefiller's side ends once its last write completed: it may
    // trail the decoder's count by a moment.
    let t0 = Instant::now();
    while p.completed() < 3 && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!((p.taken(), p.completed()), (3, 3));
    let mut m = weft::metrics::Metrics::new();
    s.dec.write_metrics(&mut m, &[("role", "decode")]).unwrap();
    s.app
        .pre
        .write_metrics(&mut m, &[("role", "prefill")])
        .unwrap();
    m.add_engine(&s.de, &[("role", "decode")]).unwrap();
    m.add_engine(&s.pe, &[("role", "prefill")]).unwrap();
    let page = m.render();
    for line in [
        "weft_kvcache_decoder_requests_total{role=\"decode\"} 3\n",
        "weft_kvcache_decoder_completed_total{role=\"decode\"} 3\n",
        "weft_kvcache_prefiller_completed_total{role=\"prefill\"} 3\n",
        "weft_kvcache_decoder_free_pages{role=\"decode\"} 48\n",
        "# TYPE weft_kvcache_decoder_failed_total counter\n",
    ] {
        assert!(page.contains(line), "{line:?} missing from\n{page}");
    }
    assert!(page.contains("weft_kvcache_prefiller_steps_total{role=\"prefill\"} "));
    assert_eq!(
        page.matches("# TYPE weft_transfers_ok_total counter")
            .count(),
        1
    );
    s.teardown();
}

/// One region per layer on either side, or on both (the layout of
/// vLLM-style per-layer tensors), mixed with whole-cache regions: every
/// byte arrives where the layout says, the tail too.
#[test]
fn per_layer_regions_on_either_side_arrive_byte_exact() {
    for seed in seeds_or([4, 5]) {
        let _g = SeedGuard::new(seed, "per_layer_regions_on_either_side_arrive_byte_exact");
        for (pre_layered, dec_layered) in [(false, true), (true, false), (true, true)] {
            let fabric = Fabric::new_realtime(FabricConfig {
                max_write_len: 1500,
                ..FabricConfig::adversarial(seed)
            });
            let (ph, dh) = (fabric.add_host(NICS), fabric.add_host(NICS));
            let (pe, de) = (engine(&fabric, ph, NICS), engine(&fabric, dh, NICS));
            let regions = |c: &Cache, layered: bool| {
                if layered {
                    c.per_layer_regions()
                } else {
                    c.regions()
                }
            };
            let pcache = Arc::new(Cache::new(lay()));
            let preg = regions(&pcache, pre_layered);
            let pre = Arc::new(Prefiller::new(pe.clone(), lay(), preg, kv_config()).unwrap());
            let mut app = PrefillApp::start(pre, pcache, vec![0, 1], Signal::Mixed, None);
            let dcache = Cache::new(lay());
            let dreg = regions(&dcache, dec_layered);
            let dec = Decoder::new(de.clone(), lay(), dreg, kv_config()).unwrap();
            let route = Route::single(dec.add_prefiller(pe.main_address()), 2);
            for (k, n) in [3u32, 11, 1].into_iter().enumerate() {
                let lease = dec.alloc(n).unwrap();
                let ps = seed * 100 + k as u64;
                dec.request(&route, &lease, &meta(ps))
                    .unwrap()
                    .wait()
                    .unwrap_or_else(|e| panic!("seed {seed} {pre_layered}/{dec_layered}: {e}"));
                check_request(&dcache, &[0, 1], lease.pages(), lease.tail_slot(), ps)
                    .unwrap_or_else(|e| panic!("seed {seed} {pre_layered}/{dec_layered}: {e}"));
                dec.free(lease);
            }
            app.stop();
            dec.shutdown();
            app.pre.shutdown(Duration::from_secs(2));
            de.shutdown();
            pe.shutdown();
        }
    }
}

/// Regions that do not fit the layout are refused before anything is
/// registered: a count that is neither one nor the layer count, a
/// per-layer region shorter than a layer, a missing tail region.
#[test]
fn cache_regions_that_do_not_fit_the_layout_are_refused() {
    let c = Cache::new(lay());
    let mut r = c.per_layer_regions();
    r.kv.pop();
    assert!(
        matches!(r.check(&lay()), Err(KvError::Layout { .. })),
        "{r:?}"
    );
    let mut r = c.per_layer_regions();
    let lb = lay().layer_bytes().unwrap() as usize;
    r.kv[2] = c.kv.sub_region(0..lb - 1).unwrap();
    assert!(matches!(r.check(&lay()), Err(KvError::Layout { .. })));
    let mut r = c.per_layer_regions();
    r.tail = None;
    assert!(matches!(r.check(&lay()), Err(KvError::Layout { .. })));
    assert!(c.per_layer_regions().check(&lay()).is_ok());
    assert!(c.regions().check(&lay()).is_ok());
}
