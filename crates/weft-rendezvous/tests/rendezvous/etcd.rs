//! The store suite on etcd (a private server per test, started by
//! weft-testkit; skipped without the binary unless WEFT_REQUIRE_ETCD=1).

use std::sync::Arc;
use std::time::Duration;

use weft_rendezvous::{EtcdOptions, EtcdStore, Store};
use weft_testkit::etcd::Etcd;

struct E(Etcd);

impl crate::suite::Backend for E {
    fn start() -> Option<Self> {
        Etcd::start().map(E)
    }
    fn client(&self) -> Arc<dyn Store> {
        Arc::new(EtcdStore::new(&self.0.url(), EtcdOptions::default()).unwrap())
    }
    fn ttl(&self) -> Duration {
        // etcd's shortest lease with its default election timeout.
        Duration::from_secs(2)
    }
    fn pass(&self, d: Duration) {
        std::thread::sleep(d);
    }
    fn child_spec(&self) -> Option<String> {
        Some(format!("etcd:{}", self.0.url()))
    }
}

store_suite!(E);
