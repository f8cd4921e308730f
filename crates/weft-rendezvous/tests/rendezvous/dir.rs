//! The store suite on the directory store (several processes, one host).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use weft_rendezvous::{DirOptions, DirStore, Store};

static NEXT: AtomicU32 = AtomicU32::new(0);

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl crate::suite::Backend for Dir {
    fn start() -> Option<Self> {
        let p = std::env::temp_dir().join(format!(
            "weft-rdv-dir-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        Some(Dir(p))
    }
    fn client(&self) -> Arc<dyn Store> {
        let opts = DirOptions::default().with_poll_interval(Duration::from_millis(10));
        Arc::new(DirStore::open(&self.0, opts).unwrap())
    }
    fn ttl(&self) -> Duration {
        Duration::from_millis(300)
    }
    fn pass(&self, d: Duration) {
        std::thread::sleep(d);
    }
    fn child_spec(&self) -> Option<String> {
        Some(format!("dir:{}", self.0.display()))
    }
}

store_suite!(Dir);

#[test]
fn writes_leave_no_temporary_files() {
    let Some(b) = <Dir as crate::suite::Backend>::start() else {
        return;
    };
    let s = crate::suite::Backend::client(&b);
    for i in 0..20 {
        s.put(&format!("k{i}"), &[i as u8; 100], None).unwrap();
    }
    let l = s.grant(Duration::from_secs(5)).unwrap();
    s.keep_alive(l).unwrap();
    assert_eq!(std::fs::read_dir(b.0.join("tmp")).unwrap().count(), 0);
    assert_eq!(s.list("k").unwrap().len(), 20);
}
