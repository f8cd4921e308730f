//! A decoder pool that grows and shrinks under load, found through a
//! rendezvous store (the in-process `mem` store; every simulated process
//! reaches it through its own [`Link`], which a kill cuts). One prefiller
//! follows the decoders, every decoder follows the prefillers, and a client
//! routes requests over the decoders the store lists, round robin, while
//! decoders join, leave cleanly and are killed without leaving (their lease
//! runs out). Checks: every request ends exactly once — completed with
//! every byte right, or (only those routed to the killed decoder) with a
//! typed error; the joined decoder serves requests; the killed decoder's
//! work at the prefiller ends with `DecoderDead` because its record left
//! the store (heartbeats are set far too slow to notice), and nothing more
//! is written to it.

use crate::common::*;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use weft::loopback::{Fabric, FabricConfig};
use weft::rendezvous::{LeaseId, MemStore, Session, Store, StoreError, Watch};
use weft::TransferEngine;
use weft_kvcache::{
    Decoder, Follower, Heartbeat, KvConfig, KvError, KvLayout, KvRendezvous, PeerLoss, Prefiller,
    RequestHandle, Route, Serve,
};
use weft_testkit::{seeds_or, SeedGuard};

/// Hang detection only: nothing here is a timed assertion.
const HANG: Duration = Duration::from_secs(60);
/// Session lease TTL: long enough that a loaded machine keeps it alive.
const TTL: Duration = Duration::from_secs(3);
const NS: &str = "kvpool";
/// How long a follower waits for a record that left to come back.
const GRACE: Duration = Duration::from_millis(500);
/// Requests in flight per decoder.
const PER_DECODER: usize = 2;

fn lay() -> KvLayout {
    layout(4, 2, 1024, 512, 64)
}

/// Heartbeats far slower than the lease: only the store can tell the
/// prefiller that a decoder is gone.
fn cfg() -> KvConfig {
    KvConfig {
        heartbeat: Heartbeat {
            interval: Duration::from_secs(60),
            timeout: Duration::from_secs(600),
        },
        ..KvConfig::default()
    }
}

/// One process's connection to the shared store; [`Link::cut`] is the
/// process dying: nothing of it reaches the store any more (its lease is
/// neither kept alive nor revoked).
struct Link {
    inner: Arc<dyn Store>,
    cut: AtomicBool,
}

impl Link {
    fn new(inner: Arc<dyn Store>) -> Arc<Link> {
        Arc::new(Link {
            inner,
            cut: AtomicBool::new(false),
        })
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    fn up(&self, op: &str) -> Result<(), StoreError> {
        if self.cut.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable {
                endpoint: "mem".into(),
                op: op.into(),
                reason: "process killed".into(),
            });
        }
        Ok(())
    }
}

impl Store for Link {
    fn endpoint(&self) -> &str {
        self.inner.endpoint()
    }
    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), StoreError> {
        self.up("put")?;
        self.inner.put(key, value, lease)
    }
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.up("get")?;
        self.inner.get(key)
    }
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        self.up("list")?;
        self.inner.list(prefix)
    }
    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.up("delete")?;
        self.inner.delete(key)
    }
    fn grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        self.up("grant")?;
        self.inner.grant(ttl)
    }
    fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.up("keep_alive")?;
        self.inner.keep_alive(lease)
    }
    fn revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.up("revoke")?;
        self.inner.revoke(lease)
    }
    fn watch(&self, prefix: &str) -> Result<Watch, StoreError> {
        self.up("watch")?;
        self.inner.watch(prefix)
    }
}

/// A decode "process": its engine, decoder, cache, store link and session.
struct DecProc {
    name: String,
    engine: Arc<TransferEngine>,
    dec: Arc<Decoder>,
    cache: Cache,
    link: Arc<Link>,
    rdv: KvRendezvous,
    session: Mutex<Option<Session>>,
    follower: Mutex<Option<Follower>>,
}

impl DecProc {
    fn start(fabric: &Fabric, store: &Arc<dyn Store>, name: &str) -> Arc<DecProc> {
        let host = fabric.add_host(1);
        let engine = crate::common::engine(fabric, host, 1);
        let cache = Cache::new(lay());
        let dec = Arc::new(Decoder::new(engine.clone(), lay(), cache.regions(), cfg()).unwrap());
        let link = Link::new(store.clone());
        let link_store: Arc<dyn Store> = link.clone();
        let rdv = KvRendezvous::new(link_store.clone(), NS).with_grace(GRACE);
        let follower = rdv.follow_prefillers(&dec).expect("follow prefillers");
        assert!(
            follower.wait_until(HANG, |m| m.iter().any(|p| p.prefiller.is_some())),
            "{name} found no prefiller"
        );
        let session = Session::new(link_store, TTL).expect("session");
        rdv.announce_decoder(&session, name, &dec, 1)
            .expect("announce");
        Arc::new(DecProc {
            name: name.into(),
            engine,
            dec,
            cache,
            link,
            rdv,
            session: Mutex::new(Some(session)),
            follower: Mutex::new(Some(follower)),
        })
    }

    /// The route to the first prefiller this decoder knows.
    fn route(&self) -> Option<Route> {
        let f = self.follower.lock();
        let p = f
            .as_ref()?
            .members()
            .into_iter()
            .find_map(|m| m.prefiller)?;
        Some(Route::single(p, lay().kv_heads))
    }

    /// The process dies: no clean leave, its engine goes away.
    fn kill(&self) {
        self.link.cut();
        drop(self.follower.lock().take());
        drop(self.session.lock().take()); // its revoke cannot reach the store
        self.dec.shutdown();
        self.engine.shutdown();
    }
}

/// One request's record in the client's ledger.
#[derive(Debug)]
struct Entry {
    decoder: String,
    result: Option<Result<(), String>>,
}

/// The client: routes requests round robin over the decoders the store
/// lists, at most [`PER_DECODER`] in flight each, checks every completed
/// request's bytes and records every outcome exactly once.
struct Client {
    stop: Arc<AtomicBool>,
    pause: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    ledger: Arc<Mutex<BTreeMap<u64, Entry>>>,
    done_by: Arc<Mutex<BTreeMap<String, u64>>>,
    issued: Arc<AtomicU64>,
    /// Turns of the client's loop (each reads `pause` once).
    laps: Arc<AtomicU64>,
}

struct InFlight {
    seq: u64,
    proc_: Arc<DecProc>,
    lease: weft_kvcache::PageLease,
    handle: RequestHandle,
    seed: u64,
}

impl Client {
    fn start(
        seed: u64,
        router: Arc<Follower>,
        procs: Arc<Mutex<BTreeMap<String, Arc<DecProc>>>>,
    ) -> Client {
        let stop = Arc::new(AtomicBool::new(false));
        let pause = Arc::new(AtomicBool::new(false));
        let p2 = pause.clone();
        let ledger: Arc<Mutex<BTreeMap<u64, Entry>>> = Arc::default();
        let done_by: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
        let issued = Arc::new(AtomicU64::new(0));
        let laps = Arc::new(AtomicU64::new(0));
        let (s2, l2, d2, i2, laps2) = (
            stop.clone(),
            ledger.clone(),
            done_by.clone(),
            issued.clone(),
            laps.clone(),
        );
        let thread = std::thread::spawn(move || {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut flying: Vec<InFlight> = Vec::new();
            let mut next = 0usize;
            let finish = |f: InFlight, r: Result<(), String>| {
                if r.is_ok() {
                    *d2.lock().entry(f.proc_.name.clone()).or_default() += 1;
                }
                let mut l = l2.lock();
                let e = l.get_mut(&f.seq).expect("ledger entry");
                assert!(e.result.is_none(), "request {} ended twice", f.seq);
                e.result = Some(r);
                drop(l);
                f.proc_.dec.free(f.lease);
            };
            loop {
                laps2.fetch_add(1, Ordering::SeqCst);
                // Collect what ended.
                let mut k = 0;
                while k < flying.len() {
                    let Some(out) = flying[k].handle.result() else {
                        k += 1;
                        continue;
                    };
                    let f = flying.swap_remove(k);
                    let r = match out {
                        Ok(_) => check_request(
                            &f.proc_.cache,
                            &[0, 1],
                            f.lease.pages(),
                            f.lease.tail_slot(),
                            f.seed,
                        )
                        .map_err(|e| format!("BYTES: {e}")),
                        Err(e) => Err(typed(&e)),
                    };
                    finish(f, r);
                }
                if s2.load(Ordering::SeqCst) && flying.is_empty() {
                    return;
                }
                // Issue to the next decoder the store lists that has room.
                let members = router.members();
                let mut issued_one = false;
                if !s2.load(Ordering::SeqCst) && !p2.load(Ordering::SeqCst) && !members.is_empty() {
                    for _ in 0..members.len() {
                        let m = &members[next % members.len()];
                        next = next.wrapping_add(1);
                        let busy = flying.iter().filter(|f| f.proc_.name == m.name).count();
                        if busy >= PER_DECODER {
                            continue;
                        }
                        let Some(p) = procs.lock().get(&m.name).cloned() else {
                            continue;
                        };
                        let seq = i2.fetch_add(1, Ordering::SeqCst);
                        let pages = rng.gen_range(1..=6u32);
                        let rseed = seed * 1_000_000 + seq;
                        l2.lock().insert(
                            seq,
                            Entry {
                                decoder: m.name.clone(),
                                result: None,
                            },
                        );
                        let start = p.route().ok_or(KvError::ShutDown).and_then(|route| {
                            let lease = p.dec.alloc(pages)?;
                            match p.dec.request(&route, &lease, &rseed.to_le_bytes()) {
                                Ok(h) => Ok((lease, h)),
                                Err(e) => {
                                    p.dec.free(lease);
                                    Err(e)
                                }
                            }
                        });
                        match start {
                            Ok((lease, handle)) => flying.push(InFlight {
                                seq,
                                proc_: p,
                                lease,
                                handle,
                                seed: rseed,
                            }),
                            Err(e) => {
                                let mut l = l2.lock();
                                l.get_mut(&seq).expect("entry").result = Some(Err(typed(&e)));
                            }
                        }
                        issued_one = true;
                        break;
                    }
                }
                // Leave the (two, shared) cores to the engines and the
                // store's keep-alives.
                std::thread::sleep(Duration::from_micros(if issued_one { 200 } else { 1000 }));
            }
        });
        Client {
            stop,
            pause,
            thread: Some(thread),
            ledger,
            done_by,
            issued,
            laps,
        }
    }

    /// Stops issuing and waits until every request issued before has
    /// ended, except those of `except` (a decoder that may never answer).
    fn pause_and_drain(&self, except: &str) {
        self.pause.store(true, Ordering::SeqCst);
        // A lap that read `pause` before the store ends before lap + 2
        // starts: what it issued is in the ledger by then.
        let lap = self.laps.load(Ordering::SeqCst);
        wait_for("two turns of the client", || {
            self.laps.load(Ordering::SeqCst) >= lap + 2
        });
        wait_for("the requests issued before the pause", || {
            self.ledger
                .lock()
                .values()
                .all(|e| e.result.is_some() || e.decoder == except)
        });
    }

    fn done_by(&self, name: &str) -> u64 {
        self.done_by.lock().get(name).copied().unwrap_or(0)
    }

    /// Waits until `name` completed `n` more requests than `from`.
    fn wait_done_by(&self, name: &str, n: u64) {
        let from = self.done_by(name);
        let deadline = std::time::Instant::now() + HANG;
        while self.done_by(name) < from + n {
            assert!(
                std::time::Instant::now() < deadline,
                "{name} completed no {n} requests; ledger {:?}",
                self.ledger.lock().len()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("client thread");
        }
    }
}

/// An error's kind with its text: every failure must be a typed error.
fn typed(e: &KvError) -> String {
    format!("{}: {e}", e.kind())
}

/// The prefill process's application: accepts every request, "computes"
/// its layers and reports them; requests of a decoder in `hold` are
/// accepted, get layer 0 and are parked in `held`.
struct PrefillLoop {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PrefillLoop {
    fn start(
        pre: Arc<Prefiller>,
        cache: Arc<Cache>,
        hold: Arc<Mutex<BTreeSet<weft::GroupAddress>>>,
        held: Arc<Mutex<Vec<Serve>>>,
    ) -> PrefillLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let thread = std::thread::spawn(move || {
            let free = Arc::new(Mutex::new(
                (0..cache.layout.num_pages).collect::<BTreeSet<u32>>(),
            ));
            let slots = Arc::new(Mutex::new(
                (0..cache.layout.tail_slots).collect::<BTreeSet<u32>>(),
            ));
            while !s2.load(Ordering::SeqCst) {
                let Some(inc) = pre.next_request_timeout(Duration::from_millis(10)) else {
                    continue;
                };
                let seed = seed_of(&inc);
                let src: Vec<u32> = {
                    let mut f = free.lock();
                    (0..inc.pages).filter_map(|_| f.pop_first()).collect()
                };
                let slot = slots.lock().pop_first();
                let (Some(slot), true) = (slot, src.len() == inc.pages as usize) else {
                    free.lock().extend(src);
                    slots.lock().extend(slot);
                    pre.reject(&inc, "no source pages");
                    continue;
                };
                let serve = match pre.accept(&inc, &src, slot) {
                    Ok(s) => s,
                    Err(_) => {
                        free.lock().extend(src);
                        slots.lock().insert(slot);
                        continue;
                    }
                };
                {
                    let (f, sl, src) = (free.clone(), slots.clone(), src.clone());
                    serve.on_complete(move |_| {
                        f.lock().extend(src);
                        sl.lock().insert(slot);
                    });
                }
                compute_layer(&cache, &[0, 1], &src, seed, 0);
                let _ = serve.layer_ready(0);
                if hold.lock().contains(&inc.key.decoder) {
                    held.lock().push(serve);
                    continue;
                }
                for layer in 1..cache.layout.layers {
                    compute_layer(&cache, &[0, 1], &src, seed, layer);
                    let _ = serve.layer_ready(layer);
                }
                compute_tail(&cache, slot, seed);
                let _ = serve.tail_ready();
            }
        });
        PrefillLoop {
            stop,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("prefill thread");
        }
    }
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + HANG;
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn names(f: &Follower) -> Vec<String> {
    f.members().into_iter().map(|m| m.name).collect()
}

#[test]
fn decoder_pool_grows_and_shrinks_under_load() {
    for seed in seeds_or([1, 2]) {
        let _g = SeedGuard::new(seed, "decoder_pool_grows_and_shrinks_under_load");
        pool_run(seed);
    }
}

fn pool_run(seed: u64) {
    let fabric = Fabric::new_realtime(FabricConfig {
        max_write_len: 1500,
        ..FabricConfig::adversarial(seed)
    });
    let mem: Arc<dyn Store> = Arc::new(MemStore::new());

    // The prefill process: announces itself, follows the decoders.
    let pe = crate::common::engine(&fabric, fabric.add_host(1), 1);
    let pcache = Arc::new(Cache::new(lay()));
    let pre = Arc::new(Prefiller::new(pe.clone(), lay(), pcache.regions(), cfg()).unwrap());
    let plink: Arc<dyn Store> = Link::new(mem.clone());
    let prdv = KvRendezvous::new(plink.clone(), NS).with_grace(GRACE);
    let psession = Session::new(plink, TTL).unwrap();
    prdv.announce_prefiller(&psession, "prefill-0", &pre, 1)
        .unwrap();
    let pfollow = prdv.follow_decoders(&pre).unwrap();
    let hold: Arc<Mutex<BTreeSet<weft::GroupAddress>>> = Arc::default();
    let held: Arc<Mutex<Vec<Serve>>> = Arc::default();
    let mut ploop = PrefillLoop::start(pre.clone(), pcache.clone(), hold.clone(), held.clone());

    // Two decoders, and a client routing over what the store lists.
    let procs: Arc<Mutex<BTreeMap<String, Arc<DecProc>>>> = Arc::default();
    for n in ["decode-0", "decode-1"] {
        procs
            .lock()
            .insert(n.into(), DecProc::start(&fabric, &mem, n));
    }
    let router = Arc::new(
        KvRendezvous::new(mem.clone(), NS)
            .with_grace(GRACE)
            .watch_decoders()
            .unwrap(),
    );
    assert!(router.wait_until(HANG, |m| m.len() == 2));
    let mut client = Client::start(seed, router.clone(), procs.clone());
    client.wait_done_by("decode-0", 4);
    client.wait_done_by("decode-1", 4);

    // decode-2 joins under load: the client starts using it.
    procs
        .lock()
        .insert("decode-2".into(), DecProc::start(&fabric, &mem, "decode-2"));
    client.wait_done_by("decode-2", 4);
    assert_eq!(names(&pfollow), ["decode-0", "decode-1", "decode-2"]);

    println!(
        "seed {seed}: router joins/leaves before the first leave: {:?}",
        router.counts()
    );
    // decode-0 leaves cleanly: withdraws, drains what it has in flight,
    // closes its session.
    {
        let d0 = procs.lock().get("decode-0").cloned().unwrap();
        let s = d0.session.lock().take().unwrap();
        assert!(d0.rdv.withdraw_decoder(&s, "decode-0").unwrap());
        assert!(router.wait_until(HANG, |m| m.iter().all(|x| x.name != "decode-0")));
        let deadline = std::time::Instant::now() + HANG;
        while d0.dec.pending() > 0 {
            if std::time::Instant::now() > deadline {
                let open: Vec<_> = client
                    .ledger
                    .lock()
                    .iter()
                    .filter(|(_, e)| e.result.is_none())
                    .map(|(k, e)| (*k, e.decoder.clone()))
                    .collect();
                let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
                for e in client.ledger.lock().values() {
                    if let Some(Err(m)) = &e.result {
                        *kinds.entry(m.chars().take(90).collect()).or_default() += 1;
                    }
                }
                panic!(
                    "errors {kinds:?}; decode-0 never drained: {} pending, {} free pages; open requests {open:?}; prefiller pending {}",
                    d0.dec.pending(),
                    d0.dec.free_pages(),
                    pre.pending()
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        s.close().unwrap();
        assert!(pfollow.wait_until(HANG, |m| m.iter().all(|x| x.name != "decode-0")));
        procs.lock().remove("decode-0");
        d0.dec.shutdown();
        d0.engine.shutdown();
    }
    let after_leave = client.done_by("decode-0");
    client.wait_done_by("decode-1", 4);
    client.wait_done_by("decode-2", 4);
    assert_eq!(
        client.done_by("decode-0"),
        after_leave,
        "routed to a decoder that left"
    );

    // decode-1 is killed with requests parked at the prefiller.
    let d1 = procs.lock().get("decode-1").cloned().unwrap();
    hold.lock().insert(d1.dec.address());
    wait_for("a parked request of decode-1", || !held.lock().is_empty());
    d1.kill();
    // Its record stays until the lease runs out; then the prefiller drops
    // its work and the client stops routing to it.
    assert!(pfollow.wait_until(HANG, |m| m.iter().all(|x| x.name != "decode-1")));
    assert!(router.wait_until(HANG, |m| m.iter().all(|x| x.name != "decode-1")));
    // The prefiller learns of the death from whichever comes first: the
    // record leaving the store, a heartbeat SEND to the dead decoder
    // failing, or its silence.
    let parked: Vec<Serve> = held.lock().clone();
    for s in &parked {
        match s.wait_timeout(HANG).expect("parked serve ends") {
            Err(KvError::DecoderDead {
                loss:
                    PeerLoss::Left { .. }
                    | PeerLoss::SendFailed { .. }
                    | PeerLoss::HeartbeatTimeout { .. },
                ..
            }) => {}
            other => panic!("parked serve of the killed decoder: {other:?}"),
        }
    }
    // Reporting more of them writes nothing to the departed decoder (the
    // client pauses and its requests end, so that nothing else is written
    // meanwhile).
    client.pause_and_drain("decode-1");
    wait_for("the prefiller idle", || pre.pending() == 0);
    let steps_before = pre.stats().steps.load(Ordering::SeqCst);
    for s in &parked {
        let _ = s.tail_ready();
    }
    assert_eq!(pre.stats().steps.load(Ordering::SeqCst), steps_before);
    client.pause.store(false, Ordering::SeqCst);
    procs.lock().remove("decode-1");
    client.wait_done_by("decode-2", 8);

    client.stop();
    ploop.stop();

    // The ledger: every request ended exactly once; failures only where
    // the killed decoder was involved, each a typed error; bytes checked.
    let ledger = client.ledger.lock();
    assert_eq!(ledger.len() as u64, client.issued.load(Ordering::SeqCst));
    let mut failed = 0;
    for (seq, e) in ledger.iter() {
        match &e.result {
            Some(Ok(())) => {}
            Some(Err(msg)) => {
                assert_eq!(e.decoder, "decode-1", "request {seq} failed: {msg}");
                assert!(!msg.starts_with("BYTES"), "request {seq}: {msg}");
                failed += 1;
            }
            None => panic!("request {seq} to {} never ended", e.decoder),
        }
    }
    assert!(
        failed >= parked.len(),
        "{failed} failed, {} parked",
        parked.len()
    );
    println!(
        "seed {seed}: {} requests, {failed} failed (killed decoder), completed per decoder {:?}",
        ledger.len(),
        client.done_by.lock()
    );
    drop(ledger);

    drop(pfollow);
    for p in procs.lock().values() {
        p.dec.shutdown();
        p.engine.shutdown();
    }
    pre.shutdown(Duration::from_secs(2));
    psession.close().unwrap();
    pe.shutdown();
}
