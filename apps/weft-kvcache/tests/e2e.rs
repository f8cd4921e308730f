//! End-to-end KvCache transfers over the adversarial loopback fabric
//! (realtime mode: real engine worker/callback/watcher threads).

use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_kvcache::{Decoder, KvConfig, KvError, KvLayout, LayerHook, Prefiller};
use weft_loopback::{Fabric, FabricConfig, HostId};
use weft_testkit::{seeds_or, SeedGuard};

const NICS: usize = 2;
const LAYOUT: KvLayout = KvLayout {
    layers: 6,
    heads: 2,
    page_len: 2048,
    tail_len: 3000,
};
const PAGES: u32 = 48;

fn engine(fabric: &Fabric, host: HostId) -> Arc<TransferEngine> {
    let p = Arc::new(fabric.provider(host));
    let cfg = EngineConfig {
        queue_capacity: 256,
        send_slots: 16,
        idle_sleep: Some(std::time::Duration::from_micros(300)),
        ..EngineConfig::default()
    };
    Arc::new(
        TransferEngine::builder()
            .group(DomainGroupSpec::new(p, (0..NICS).collect::<Vec<_>>()))
            .config(cfg)
            .build()
            .expect("engine builds"),
    )
}

struct Setup {
    fabric: Fabric,
    pre_host: HostId,
    pe: Arc<TransferEngine>,
    de: Arc<TransferEngine>,
    pre: Prefiller,
    dec: Decoder,
}

fn setup(seed: u64, hook: Option<LayerHook>) -> Setup {
    let fabric = Fabric::new_realtime(FabricConfig {
        max_write_len: 1500,
        ..FabricConfig::adversarial(seed)
    });
    let pre_host = fabric.add_host(NICS);
    let dec_host = fabric.add_host(NICS);
    let pe = engine(&fabric, pre_host);
    let de = engine(&fabric, dec_host);
    let pre = Prefiller::new(pe.clone(), LAYOUT, KvConfig::default(), hook).expect("prefiller");
    let dec = Decoder::new(
        de.clone(),
        LAYOUT,
        PAGES,
        pe.main_address(),
        KvConfig::default(),
    )
    .expect("decoder");
    Setup {
        fabric,
        pre_host,
        pe,
        de,
        pre,
        dec,
    }
}

impl Setup {
    fn teardown(self) {
        self.dec.shutdown();
        self.pre.shutdown();
        self.de.shutdown();
        self.pe.shutdown();
        drop(self.fabric);
    }
}

#[test]
fn concurrent_requests_verified() {
    for seed in seeds_or([1, 2, 3]) {
        let _g = SeedGuard::new(seed, "concurrent_requests_verified");
        let s = setup(seed, None);
        let sizes = [1u32, 5, 9, 3, 12, 7];
        let handles: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| s.dec.submit(n, seed * 100 + k as u64).expect("submit"))
            .collect();
        let mut total = 0;
        for (h, &n) in handles.iter().zip(&sizes) {
            let c = h
                .wait()
                .unwrap_or_else(|e| panic!("seed {seed}: request {}: {e}", h.id));
            assert_eq!(c.pages.len(), n as usize, "seed {seed}");
            assert_eq!(
                c.bytes,
                u64::from(LAYOUT.layers * LAYOUT.heads * n) * LAYOUT.page_len + LAYOUT.tail_len,
                "seed {seed}"
            );
            // more immediates than submits: writes were sharded
            assert!(c.imms > LAYOUT.layers + 1, "seed {seed}: {}", c.imms);
            total += n;
        }
        assert_eq!(total, 37);
        assert_eq!(s.dec.free_pages(), PAGES, "seed {seed}: pages not returned");
        // the prefiller learns of completion from its own write completions,
        // which may trail the decoder's immediates (hang detection only)
        while s.pre.stats().completed.load(Ordering::SeqCst) < 6 {
            std::thread::yield_now();
        }
        assert_eq!(
            s.pre.stats().completed.load(Ordering::SeqCst),
            6,
            "seed {seed}"
        );
        // pages are reused by later requests and still verify
        let again: Vec<_> = (0..3)
            .map(|k| s.dec.submit(16, seed + k).expect("submit"))
            .collect();
        for h in again {
            h.wait()
                .unwrap_or_else(|e| panic!("seed {seed}: reuse: {e}"));
        }
        s.teardown();
    }
}

/// A hook that blocks `id`'s compute at `layer` until released.
fn gate(id: u64, layer: u32) -> (LayerHook, Receiver<()>, Sender<()>) {
    let (reached_tx, reached_rx) = crossbeam_channel::unbounded();
    let (release_tx, release_rx) = crossbeam_channel::unbounded::<()>();
    let hook: LayerHook = Arc::new(move |rid, l| {
        if rid == id && l == layer {
            let _ = reached_tx.send(());
            let _ = release_rx.recv();
        }
    });
    (hook, reached_rx, release_tx)
}

#[test]
fn cancel_is_confirmed_before_pages_return() {
    for seed in seeds_or([11, 12]) {
        let _g = SeedGuard::new(seed, "cancel_is_confirmed_before_pages_return");
        let (hook, reached, release) = gate(1, 2);
        let s = setup(seed, Some(hook));
        let h = s.dec.submit(10, seed).expect("submit");
        assert_eq!(h.id, 1);
        reached.recv().expect("compute reached layer 2");
        s.dec.cancel(h.id).expect("cancel");
        // wait (hang detection only) until the prefiller saw the cancel
        while s.pre.stats().cancel_requests.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        // not confirmed yet (compute is held): the pages stay reserved
        assert_eq!(s.dec.free_pages(), PAGES - 10, "seed {seed}");
        release.send(()).expect("release");
        match h.wait() {
            Err(KvError::Cancelled(id)) => assert_eq!(id, 1),
            other => panic!("seed {seed}: expected Cancelled, got {other:?}"),
        }
        assert_eq!(s.dec.free_pages(), PAGES, "seed {seed}");
        assert_eq!(s.pre.stats().cancelled.load(Ordering::SeqCst), 1);
        // the pool still works afterwards
        let h2 = s.dec.submit(10, seed + 1).expect("submit");
        h2.wait()
            .unwrap_or_else(|e| panic!("seed {seed}: after cancel: {e}"));
        s.teardown();
    }
}

#[test]
fn dead_prefiller_fails_requests() {
    for seed in seeds_or([21, 22]) {
        let _g = SeedGuard::new(seed, "dead_prefiller_fails_requests");
        let (hook, reached, release) = gate(1, 3);
        let s = setup(seed, Some(hook));
        let h = s.dec.submit(8, seed).expect("submit");
        reached.recv().expect("compute reached layer 3");
        s.fabric.kill_host(s.pre_host);
        match h.wait() {
            Err(KvError::PeerDead { peer, .. }) => assert_eq!(peer, s.pe.main_address()),
            other => panic!("seed {seed}: expected PeerDead, got {other:?}"),
        }
        assert_eq!(s.dec.free_pages(), PAGES, "seed {seed}");
        match s.dec.submit(1, 0) {
            Err(KvError::PeerDead { .. }) => {}
            other => panic!("seed {seed}: expected PeerDead, got {other:?}"),
        }
        let _ = release.send(());
        s.teardown();
    }
}
