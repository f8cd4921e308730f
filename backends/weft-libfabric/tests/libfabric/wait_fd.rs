//! The wait primitive of the transport contract (`Domain::wait_fd`,
//! `Domain::try_wait`) on libfabric's software-progress providers, and an
//! engine whose idle workers sleep in those fds (`idle_block_after`).
//!
//! Domain level: an idle domain lets its caller sleep (`try_wait`), and a
//! WRITE with an immediate from a connected peer makes its fd readable, so
//! a caller asleep in `poll(2)` wakes and finds the immediate. Engine level: with
//! `idle_block_after = 0` both engines' workers sleep in their fds between
//! steps (checked through `GroupStats::fd_sleeps`), and every way work
//! reaches a sleeping worker still gets through: a peer's WRITE into its
//! memory (which completes nothing there), a peer's immediate before and
//! after its round is armed, a message, and its own submits.

use crate::common::one_nic_provider as provider;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use weft_engine::{EngineConfig, Imm, MrDesc, MrHandle, OnDone, TransferEngine};
use weft_libfabric::LibfabricDomain;
use weft_testkit::mem::{self, HostBufferExt};
use weft_transport::{Access, Completion, Domain, RemoteSlice, WrId, WriteWr};

/// Bound on every wait (it only catches hangs).
const DEADLINE: Duration = Duration::from_secs(30);

/// Whether `fd` becomes readable within `timeout`.
fn readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd on the stack; poll writes only its revents.
    #[allow(unsafe_code)]
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0 && p.revents != 0
}

fn domain_wakes_its_sleeper(name: &str) {
    let Some(p) = provider(name) else { return };
    let src = mem::patterned(11, 8192);
    let dst = mem::zeroed(8192);
    let mut a: LibfabricDomain = p.open_domain(0).expect("open a");
    let mut b: LibfabricDomain = p.open_domain(0).expect("open b");
    let Some(fd) = b.wait_fd() else {
        // Not a failure of the contract: the engine then keeps polling.
        eprintln!("NOTE: libfabric {name} gives no CQ wait fd; nothing to check");
        return;
    };
    let smr = a.register(&src.region(), Access::LocalOnly).unwrap();
    let dmr = b.register(&dst.region(), Access::RemoteWrite).unwrap();
    let peer = a.add_peer(&b.local_addr().clone()).unwrap();
    let mut out = Vec::new();
    // First contact with both sides polling: tcp;ofi_rxm's connection
    // set-up at the target is not signalled through its CQ's fd (on 1.17
    // a first WRITE to a target asleep in its fd waits for the target's
    // next poll; the engine bounds that sleep, see `EngineConfig::
    // idle_block_after`).
    let write = |id: u64, len: u64, imm: Option<u32>| WriteWr {
        wr: WrId(id),
        peer,
        src: smr.slice(0, len).unwrap(),
        dst: RemoteSlice {
            base: dmr.addr,
            offset: 0,
            rkey: dmr.rkey,
        },
        imm,
    };
    a.post_write(&write(99, 64, None)).unwrap();
    let mut oa = Vec::new();
    weft_testkit::wait_until(&format!("{name}: first contact"), DEADLINE, || {
        a.poll(&mut oa).unwrap();
        b.poll(&mut out).unwrap();
        !oa.is_empty()
    });
    assert!(
        matches!(oa[..], [Completion::Write { result: Ok(()), .. }]),
        "{name}: first contact {oa:?}"
    );
    for round in 0..5u32 {
        // Idle: after polls, the domain lets its caller sleep.
        weft_testkit::wait_until(&format!("{name} #{round}: b idle"), DEADLINE, || {
            b.poll(&mut out).unwrap();
            b.try_wait()
        });
        assert!(out.is_empty(), "{name} #{round}: {out:?}");
        // Nothing pending: a sleeper would not be woken at once.
        assert!(
            !readable(fd, Duration::ZERO),
            "{name} #{round}: idle fd readable"
        );
        a.post_write(&write(u64::from(round), 8192, Some(100 + round)))
            .unwrap();
        // The initiator progresses on another thread while b sleeps in
        // its fd (on tcp nothing reaches b without a's progress).
        let t = Instant::now();
        let done = std::thread::scope(|s| {
            let h = s.spawn(|| {
                let mut oa = Vec::new();
                while oa.is_empty() && t.elapsed() < DEADLINE {
                    a.poll(&mut oa).unwrap();
                    std::thread::yield_now();
                }
                oa
            });
            let woke = readable(fd, DEADLINE);
            // Awake: b polls (on tcp a's WRITE completes only once b has
            // taken it in) until the immediate is there.
            weft_testkit::wait_until(&format!("{name} #{round}: imm"), DEADLINE, || {
                b.poll(&mut out).unwrap();
                !out.is_empty()
            });
            (woke, h.join().unwrap())
        });
        assert!(done.0, "{name} #{round}: b's fd never became readable");
        assert!(
            matches!(done.1[..], [Completion::Write { result: Ok(()), .. }]),
            "{name} #{round}: a got {:?}",
            done.1
        );
        assert!(
            matches!(out[..], [Completion::Imm { imm }] if imm == 100 + round),
            "{name} #{round}: {out:?}"
        );
        out.clear();
        assert_eq!(dst.bytes(0, 8192), src.bytes(0, 8192), "{name} #{round}");
    }
}

#[test]
fn tcp_domain_wakes_its_sleeper() {
    domain_wakes_its_sleeper("tcp");
}

#[test]
fn shm_domain_wakes_its_sleeper() {
    domain_wakes_its_sleeper("shm");
}

fn engine(name: &str) -> Option<TransferEngine> {
    let cfg = {
        let mut c = EngineConfig::default();
        c.idle_block_after = Some(Duration::ZERO);
        c
    };
    crate::common::one_nic_engine(name, cfg)
}

/// A single WRITE of `len` bytes from offset 0 to offset 0, waited for.
fn write_and_wait(
    from: &TransferEngine,
    len: u64,
    imm: Option<Imm>,
    src: &MrHandle,
    dst: &MrDesc,
    what: &str,
) {
    let (on, flag) = OnDone::flag();
    from.submit_single_write(len, imm, (src, 0), (dst, 0), on)
        .unwrap();
    flag.wait_timeout(DEADLINE).expect(what).unwrap();
}

fn fd_sleeps(e: &TransferEngine) -> u64 {
    e.stats().groups[0].fd_sleeps
}

/// Waits until `e`'s worker has gone to sleep in its fds again.
fn slept_again(name: &str, what: &str, e: &TransferEngine) {
    let n = fd_sleeps(e);
    weft_testkit::wait_until(&format!("{name}: {what} sleeps"), DEADLINE, || {
        fd_sleeps(e) >= n + 2
    });
}

fn sleeping_engines_get_all_work(name: &str) {
    let (Some(a), Some(b)) = (engine(name), engine(name)) else {
        return;
    };
    if !a_has_fds(name) {
        eprintln!("NOTE: libfabric {name} gives no CQ wait fd; workers poll");
        return;
    }
    let len = 64 << 10;
    let src = mem::patterned(5, len);
    let dst = mem::zeroed(len);
    let back = mem::zeroed(len);
    let (smr, _) = a.reg_mr(src.region()).unwrap();
    let (bsmr, ddesc) = b.reg_mr(dst.region()).unwrap();
    let (_back_mr, back_desc) = a.reg_mr(back.region()).unwrap();

    // 1. A WRITE without immediate into the sleeping b.
    slept_again(name, "b", &b);
    write_and_wait(
        &a,
        len as u64,
        None,
        &smr,
        &ddesc,
        "write into a sleeping engine completes",
    );
    assert_eq!(dst.bytes(0, len), src.bytes(0, len), "{name}: bytes");

    // 2. An immediate that reaches the sleeping b before its round is
    //    armed, then one after.
    let imm = b.alloc_imm().unwrap();
    slept_again(name, "b", &b);
    write_and_wait(&a, 1024, Some(imm), &smr, &ddesc, "early imm write");
    slept_again(name, "b", &b);
    let (on, r1) = OnDone::flag();
    b.expect_imm_count_with(imm, 1, on).unwrap();
    r1.wait_timeout(DEADLINE)
        .expect("round of an early imm")
        .unwrap();
    let (on, r2) = OnDone::flag();
    b.expect_imm_count_with(imm, 1, on).unwrap();
    slept_again(name, "a", &a);
    write_and_wait(&a, 1024, Some(imm), &smr, &ddesc, "armed imm write");
    r2.wait_timeout(DEADLINE).expect("armed round").unwrap();

    // 3. b's own submit wakes b (its eventfd), and its WRITE reaches the
    //    sleeping a.
    slept_again(name, "a", &a);
    slept_again(name, "b", &b);
    write_and_wait(
        &b,
        len as u64,
        None,
        &bsmr,
        &back_desc,
        "write from a sleeping engine",
    );
    assert_eq!(back.bytes(0, len), src.bytes(0, len), "{name}: bytes back");

    assert!(fd_sleeps(&a) > 0 && fd_sleeps(&b) > 0);
    a.shutdown();
    b.shutdown();
}

/// Whether the provider's domains offer a wait fd.
fn a_has_fds(name: &str) -> bool {
    provider(name)
        .and_then(|p| p.open_domain(0).ok())
        .is_some_and(|d: LibfabricDomain| d.wait_fd().is_some())
}

#[test]
fn tcp_sleeping_engines_get_all_work() {
    sleeping_engines_get_all_work("tcp");
}

#[test]
fn shm_sleeping_engines_get_all_work() {
    sleeping_engines_get_all_work("shm");
}
