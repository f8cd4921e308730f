//! Regression tests for faults and refusals: a NIC that dies on post, a
//! receive callback that panics and a backend that panics in the worker
//! (threaded and manual) still resolve every transfer and buffer; a stale
//! MR handle and a destination with another NIC count are refused at
//! submit. Manual-mode (and one threaded) engines over the loopback fabric
//! in step mode.

use crate::common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use weft_engine::{EngineError, OnDone};
use weft_loopback::{Fabric, FabricConfig};

/// A NIC that dies on `post_writes` (before `poll` notices) still resolves
/// the pieces already posted on it.
#[test]
fn nic_down_on_post_resolves_posted_pieces() {
    for seed in seeds_or([21, 22]) {
        let _g = SeedGuard::new(seed, "nic_down_on_post_resolves_posted_pieces");
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let ea = engine(&fabric, a, 1, test_config(), true);
        let eb = engine(&fabric, b, 1, test_config(), true);
        let src = Arc::new(mem::patterned(seed, 8192));
        let dst = Arc::new(mem::zeroed(8192));
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, dd) = eb.reg_mr(dst.region()).unwrap();
        // T1 is posted (the fabric is never stepped, so it cannot complete).
        let (od1, f1) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 0), (&dd, 0), od1)
            .unwrap();
        ea.progress();
        assert!(!f1.is_done(), "seed {seed}: T1 completed too early");
        fabric.kill_nic(a, 0);
        // T2's post hits the dead NIC first.
        let (od2, f2) = OnDone::flag();
        ea.submit_single_write(4096, None, (&sh, 4096), (&dd, 4096), od2)
            .unwrap();
        for _ in 0..4 {
            ea.progress();
        }
        assert!(
            matches!(f2.result(), Some(Err(_))),
            "seed {seed}: T2 {:?}",
            f2.result()
        );
        assert!(
            matches!(f1.result(), Some(Err(_))),
            "seed {seed}: posted T1 never resolved: {:?}",
            f1.result()
        );
        ea.shutdown();
        eb.shutdown();
    }
}

/// A receive callback that panics still gets its buffer re-posted: with a
/// pool of one buffer, the second message is received too.
#[test]
fn panicking_recv_callback_reposts_buffer() {
    for seed in seeds_or([31]) {
        let _g = SeedGuard::new(seed, "panicking_recv_callback_reposts_buffer");
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let ea = engine(&fabric, a, 1, test_config(), true);
        let eb = engine(&fabric, b, 1, test_config(), true);
        let got = Arc::new(AtomicUsize::new(0));
        {
            let got = got.clone();
            eb.submit_recvs(64, 1, move |r| {
                assert!(r.is_ok());
                let n = got.fetch_add(1, Ordering::SeqCst);
                if n == 0 {
                    panic!("deliberate panic in a receive callback");
                }
            })
            .unwrap();
        }
        let engines = [ea.clone(), eb.clone()];
        let to = eb.main_address();
        for i in 0..2 {
            let (od, f) = OnDone::flag();
            ea.submit_send(&to, &[i as u8; 8], od).unwrap();
            drive(&fabric, &engines, || {
                f.is_done() && got.load(Ordering::SeqCst) > i
            });
            assert_eq!(f.result(), Some(Ok(())), "seed {seed}: send {i}");
        }
        ea.shutdown();
        eb.shutdown();
    }
}

/// A handle kept past `unreg_mr` does not reach the registration that
/// reuses its slot.
#[test]
fn stale_mr_handle_is_rejected() {
    let fabric = Fabric::new(FabricConfig::adversarial(41));
    let (a, b) = (fabric.add_host(1), fabric.add_host(1));
    let ea = engine(&fabric, a, 1, test_config(), true);
    let eb = engine(&fabric, b, 1, test_config(), true);
    let s1 = mem::zeroed(4096);
    let s2 = mem::zeroed(4096);
    let dst = mem::zeroed(4096);
    let (_, dd) = eb.reg_mr(dst.region()).unwrap();
    let (h1, _) = ea.reg_mr(s1.region()).unwrap();
    ea.unreg_mr(h1).unwrap();
    let (h2, _) = ea.reg_mr(s2.region()).unwrap();
    let engines = [ea.clone(), eb.clone()];
    let (od, f) = OnDone::flag();
    // Submits check only the handle's own bounds; the worker checks the
    // generation.
    match ea.submit_single_write(16, None, (&h1, 0), (&dd, 0), od) {
        Ok(_) => {
            drive(&fabric, &engines, || f.is_done());
            assert!(
                matches!(f.result(), Some(Err(EngineError::StaleMr { .. }))),
                "{:?}",
                f.result()
            );
        }
        Err(e) => assert!(matches!(e, EngineError::StaleMr { .. }), "{e}"),
    }
    assert!(matches!(ea.unreg_mr(h1), Err(EngineError::StaleMr { .. })));
    // The live handle still works.
    let (od, f) = OnDone::flag();
    ea.submit_single_write(16, None, (&h2, 0), (&dd, 0), od)
        .unwrap();
    drive(&fabric, &engines, || f.is_done());
    assert_eq!(f.result(), Some(Ok(())));
    ea.unreg_mr(h2).unwrap();
    ea.shutdown();
    eb.shutdown();
}

/// A destination with another NIC count than the sending group is refused.
#[test]
fn nic_count_mismatch_is_refused() {
    let fabric = Fabric::new(FabricConfig::adversarial(51));
    let (a, b) = (fabric.add_host(1), fabric.add_host(2));
    let ea = engine(&fabric, a, 1, test_config(), true);
    let eb = engine(&fabric, b, 2, test_config(), true);
    let src = mem::zeroed(4096);
    let dst = mem::zeroed(4096);
    let (sh, _) = ea.reg_mr(src.region()).unwrap();
    let (_, dd) = eb.reg_mr(dst.region()).unwrap();
    let (od, _f) = OnDone::flag();
    let r = ea.submit_single_write(16, None, (&sh, 0), (&dd, 0), od);
    assert!(
        matches!(
            r,
            Err(EngineError::NicCountMismatch {
                local: 1,
                remote: 2,
                ..
            })
        ),
        "{r:?}"
    );
    ea.shutdown();
    eb.shutdown();
}

/// Wraps a provider so its domains panic in `poll` once `boom` is set.
struct PanicProvider {
    inner: weft_loopback::LoopbackProvider,
    boom: Arc<std::sync::atomic::AtomicBool>,
}

struct PanicDomain {
    inner: Box<dyn weft_transport::Domain>,
    boom: Arc<std::sync::atomic::AtomicBool>,
}

impl weft_transport::Provider for PanicProvider {
    fn name(&self) -> &str {
        "panic"
    }
    fn nics(&self) -> Result<Vec<weft_transport::NicInfo>, weft_transport::TransportError> {
        self.inner.nics()
    }
    fn open(
        &self,
        nic: usize,
    ) -> Result<Box<dyn weft_transport::Domain>, weft_transport::TransportError> {
        Ok(Box::new(PanicDomain {
            inner: self.inner.open(nic)?,
            boom: self.boom.clone(),
        }))
    }
}

impl weft_transport::Domain for PanicDomain {
    fn info(&self) -> &weft_transport::NicInfo {
        self.inner.info()
    }
    fn local_addr(&self) -> &weft_transport::NetAddr {
        self.inner.local_addr()
    }
    fn capabilities(&self) -> &weft_transport::Capabilities {
        self.inner.capabilities()
    }
    fn register(
        &mut self,
        region: &weft_transport::MemRegion,
        access: weft_transport::Access,
    ) -> Result<weft_transport::LocalMr, weft_transport::TransportError> {
        if self.boom.load(Ordering::SeqCst) {
            panic!("deliberate backend panic in register");
        }
        self.inner.register(region, access)
    }
    fn deregister(
        &mut self,
        mr: weft_transport::MrKey,
    ) -> Result<(), weft_transport::TransportError> {
        self.inner.deregister(mr)
    }
    fn add_peer(
        &mut self,
        addr: &weft_transport::NetAddr,
    ) -> Result<weft_transport::PeerId, weft_transport::TransportError> {
        self.inner.add_peer(addr)
    }
    fn post_send(
        &mut self,
        wr: weft_transport::WrId,
        peer: weft_transport::PeerId,
        src: weft_transport::LocalSlice,
    ) -> Result<(), weft_transport::TransportError> {
        self.inner.post_send(wr, peer, src)
    }
    fn post_recv(
        &mut self,
        wr: weft_transport::WrId,
        buf: weft_transport::LocalSlice,
    ) -> Result<(), weft_transport::TransportError> {
        self.inner.post_recv(wr, buf)
    }
    fn post_writes(
        &mut self,
        wrs: &[weft_transport::WriteWr],
    ) -> Result<usize, weft_transport::PostError> {
        self.inner.post_writes(wrs)
    }
    fn poll(
        &mut self,
        out: &mut Vec<weft_transport::Completion>,
    ) -> Result<usize, weft_transport::TransportError> {
        if self.boom.load(Ordering::SeqCst) {
            panic!("deliberate backend panic");
        }
        self.inner.poll(out)
    }
}

/// Engine A over a [`PanicProvider`] (threaded or manual) and a manual
/// engine B on a step-mode fabric that is never stepped, with a source on
/// A and a destination on B registered: writes from A never complete.
struct PanicPair {
    ea: weft_engine::TransferEngine,
    eb: weft_engine::TransferEngine,
    boom: Arc<std::sync::atomic::AtomicBool>,
    sh: weft_engine::MrHandle,
    dd: weft_transport::MrDesc,
    _mem: (weft_transport::HostBuffer, weft_transport::HostBuffer),
}

impl PanicPair {
    fn new(seed: u64, manual: bool) -> Self {
        let fabric = Fabric::new(FabricConfig::adversarial(seed));
        let (a, b) = (fabric.add_host(1), fabric.add_host(1));
        let boom = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let p = Arc::new(PanicProvider {
            inner: fabric.provider(a),
            boom: boom.clone(),
        });
        let mut builder = weft_engine::TransferEngine::builder()
            .group(weft_engine::DomainGroupSpec::new(p, vec![0]))
            .config(test_config());
        if manual {
            builder = builder.manual();
        }
        let ea = builder.build().unwrap();
        let eb = engine(&fabric, b, 1, test_config(), true);
        let (src, dst) = (mem::zeroed(4096), mem::zeroed(4096));
        let (sh, _) = ea.reg_mr(src.region()).unwrap();
        let (_, dd) = eb.reg_mr(dst.region()).unwrap();
        Self {
            ea,
            eb,
            boom,
            sh,
            dd,
            _mem: (src, dst),
        }
    }

    /// A 16-byte write from A at offset `off` of both buffers.
    fn write(&self, off: u64) -> Result<Arc<weft_engine::DoneFlag>, EngineError> {
        let (od, f) = OnDone::flag();
        self.ea
            .submit_single_write(16, None, (&self.sh, off), (&self.dd, off), od)
            .map(|_| f)
    }

    fn shutdown(&self) {
        self.ea.shutdown();
        self.eb.shutdown();
    }
}

/// A backend panic in the worker fails the in-flight transfer with
/// `WorkerFailed` and later submits fail too (threaded engine; the fabric
/// is in step mode and never stepped, so the transfer cannot complete).
#[test]
fn worker_panic_fails_inflight_and_later_submits() {
    let t = PanicPair::new(61, false);
    let f = t.write(0).unwrap();
    t.boom.store(true, Ordering::SeqCst);
    wait_until("in-flight transfer resolved", HANG, || f.is_done());
    assert_worker_failed("in flight", &f);
    let r = t.write(0);
    assert!(matches!(r, Err(EngineError::WorkerFailed { .. })), "{r:?}");
    t.shutdown();
}

fn assert_worker_failed(what: &str, f: &weft_engine::DoneFlag) {
    assert!(
        matches!(f.result(), Some(Err(EngineError::WorkerFailed { .. }))),
        "{what}: {:?}",
        f.result()
    );
}

/// The manual-mode twin of `worker_panic_fails_inflight_and_later_submits`:
/// a backend panic inside `progress` does not unwind into the caller; the
/// in-flight transfer and one queued behind it fail with `WorkerFailed`,
/// later submits fail too, and shutdown finishes.
#[test]
fn manual_worker_panic_fails_inflight_and_queued() {
    let t = PanicPair::new(62, true);
    let f = t.write(0).unwrap();
    t.ea.progress();
    assert!(
        !f.is_done(),
        "the fabric is never stepped: {:?}",
        f.result()
    );
    t.boom.store(true, Ordering::SeqCst);
    // Queued (not yet taken) when the worker panics on this lap's poll.
    let queued = t.write(16).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for _ in 0..4 {
            t.ea.progress();
        }
    }));
    assert!(panicked.is_ok(), "a backend panic unwound out of progress");
    assert_worker_failed("in flight", &f);
    assert_worker_failed("queued", &queued);
    let r = t.write(0);
    assert!(matches!(r, Err(EngineError::WorkerFailed { .. })), "{r:?}");
    t.shutdown();
}

/// A backend panic while the worker answers a control request (here a
/// registration) fails the request and the group with `WorkerFailed`, in
/// both modes: in manual mode the control queue runs on the caller's
/// thread, and the panic must not unwind into `reg_mr`.
#[test]
fn control_panic_fails_the_request_and_the_group() {
    for manual in [false, true] {
        let t = PanicPair::new(63, manual);
        t.boom.store(true, Ordering::SeqCst);
        let late = mem::zeroed(4096);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.ea.reg_mr(late.region()).map(|_| ())
        }));
        let r = r.unwrap_or_else(|_| panic!("manual {manual}: the panic reached reg_mr's caller"));
        assert!(
            matches!(r, Err(EngineError::WorkerFailed { .. })),
            "manual {manual}: {r:?}"
        );
        t.ea.progress();
        let r = t.write(0);
        assert!(
            matches!(r, Err(EngineError::WorkerFailed { .. })),
            "manual {manual}: {r:?}"
        );
        t.shutdown();
    }
}

/// A backend panic on a manual engine's shutdown lap (nothing called
/// `progress` since the submit): shutdown still finishes, without touching
/// the failed core again, and the transfer resolves with `WorkerFailed`.
#[test]
fn manual_worker_panic_during_shutdown_finishes() {
    let t = PanicPair::new(64, true);
    let f = t.write(0).unwrap();
    t.boom.store(true, Ordering::SeqCst);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.ea.shutdown()));
    assert!(r.is_ok(), "the backend panic unwound out of shutdown");
    assert_worker_failed("in flight", &f);
    t.eb.shutdown();
}
