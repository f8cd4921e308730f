//! A region left in `/dev/shm` by a killed process whose pid this process
//! now has must not keep this process from opening shm endpoints (shm 1.17
//! fails `fi_enable` with EBUSY on the name clash). Its own test binary:
//! the clean-up runs once per process, before its first shm endpoint.

use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::Provider;

#[test]
fn stale_region_with_our_pid_is_removed() {
    let provider = match LibfabricProvider::with_config(LibfabricConfig::new("shm")) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIP: libfabric shm unavailable: {e}");
            return;
        }
    };
    let pid = std::process::id();
    // The names shm 1.17 gives this process's first endpoints, as a dead
    // process with this pid would have left them; plus a file of another
    // shape, which must stay.
    let stale: Vec<_> = (0..2)
        .map(|i| std::path::PathBuf::from(format!("/dev/shm/{pid}:0:{i}")))
        .collect();
    for p in &stale {
        std::fs::write(p, vec![0u8; 4096]).expect("write a fake stale region");
    }
    let other = std::path::PathBuf::from(format!("/dev/shm/{pid}:weft-test-keep"));
    std::fs::write(&other, b"x").expect("write an unrelated file");

    let d0 = provider.open(0);
    let d1 = provider.open(0);
    let kept = other.exists();
    let _ = std::fs::remove_file(&other);
    let d0 = d0.unwrap_or_else(|e| panic!("first shm endpoint despite a stale region: {e}"));
    let d1 = d1.unwrap_or_else(|e| panic!("second shm endpoint: {e}"));
    assert!(kept, "a file not named like a shm region was removed");
    assert_ne!(d0.local_addr(), d1.local_addr());
    drop((d0, d1));
}
