//! The store suite on the in-process store (manual clock: deterministic).

use std::sync::Arc;
use std::time::Duration;

use weft_rendezvous::{MemStore, Store};

struct Mem(Arc<MemStore>);

impl crate::suite::Backend for Mem {
    fn start() -> Option<Self> {
        Some(Mem(Arc::new(MemStore::with_manual_clock())))
    }
    fn client(&self) -> Arc<dyn Store> {
        self.0.clone()
    }
    fn ttl(&self) -> Duration {
        Duration::from_millis(300)
    }
    fn pass(&self, d: Duration) {
        self.0.advance(d);
    }
    fn child_spec(&self) -> Option<String> {
        None
    }
}

store_suite!(Mem);

#[test]
fn manual_clock_expires_exactly_at_the_ttl() {
    let s = MemStore::with_manual_clock();
    let l = s.grant(Duration::from_secs(10)).unwrap();
    s.put("k", b"v", Some(l)).unwrap();
    s.advance(Duration::from_millis(9_999));
    assert!(s.get("k").unwrap().is_some());
    s.advance(Duration::from_millis(1));
    assert!(s.get("k").unwrap().is_none());
}

#[test]
fn real_clock_reaper_ends_leases_without_any_call() {
    let s = MemStore::new();
    let w = s.watch("").unwrap();
    let l = s.grant(Duration::from_millis(50)).unwrap();
    s.put("k", b"v", Some(l)).unwrap();
    assert!(matches!(
        w.recv_timeout(crate::suite::WAIT).unwrap(),
        Some(weft_rendezvous::Event::Join { .. })
    ));
    // No operation on the store: the reaper thread ends the lease.
    assert_eq!(
        w.recv_timeout(crate::suite::WAIT).unwrap(),
        Some(weft_rendezvous::Event::Leave { key: "k".into() })
    );
}
