//! Two shm engines in one process: once one shuts down, writes from the
//! other to it fail as unreachable (the provider shares the owner's mapping
//! of its region inside a process; writing to it after the owner closed it
//! crashed the writer), and the writer keeps working with a third engine
//! and shuts down cleanly.

use std::time::Duration;
use weft_engine::{EngineConfig, OnDone, TransferEngine};
use weft_testkit::mem;

fn write(
    from: &TransferEngine,
    to: &weft_engine::Registration,
    src: &weft_engine::Registration,
) -> Result<(), weft_engine::EngineError> {
    let (on, flag) = OnDone::flag();
    from.submit_single_write(4096, None, (&src.handle(), 0), (to.desc(), 0), on)?;
    flag.wait_timeout(Duration::from_secs(60))
        .expect("write ends")
}

#[test]
fn writes_to_a_shut_down_engine_of_this_process_fail_cleanly() {
    let cfg = EngineConfig::default();
    let (Some(a), Some(b), Some(c)) = (
        crate::common::one_nic_engine("shm", cfg.clone()),
        crate::common::one_nic_engine("shm", cfg.clone()),
        crate::common::one_nic_engine("shm", cfg),
    ) else {
        eprintln!("SKIP: libfabric shm unavailable");
        return;
    };
    let src_buf = mem::patterned(9, 4096);
    let (b_buf, c_buf) = (mem::zeroed(4096), mem::zeroed(4096));
    let src = a.register(src_buf.region()).unwrap();
    let to_b = b.register(b_buf.region()).unwrap();
    let to_c = c.register(c_buf.region()).unwrap();
    write(&a, &to_b, &src).expect("write to b while it runs");
    b.shutdown();
    for k in 0..3 {
        let r = write(&a, &to_b, &src);
        assert!(r.is_err(), "write {k} to the shut-down engine: {r:?}");
    }
    write(&a, &to_c, &src).expect("write to c after b shut down");
    assert_eq!(c_buf.read(0, 4096), src_buf.read(0, 4096));
    drop((src, to_c));
    a.shutdown();
    c.shutdown();
}
