//! What a user can observe and bound: waits with a timeout, a group's
//! queue depth and work in flight, which NIC carried how much of a sharded
//! write, immediate counts in the `u64` that `ImmCounts` computes, and
//! immediate values reserved on every member of a peer group.

use crate::common::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use weft_engine::{DoneCounter, EngineError, MrDesc, OnDone, ScatterDst};
use weft_loopback::{Fabric, FabricConfig};

/// `DoneFlag::wait_timeout` and `DoneCounter::wait_for_timeout` give up
/// on a transfer that has not finished and report one that has.
#[test]
fn waits_with_a_timeout() {
    let fabric = Fabric::new(FabricConfig::ideal(3));
    let ea = engine(&fabric, fabric.add_host(1), 1, test_config(), true);
    let eb = engine(&fabric, fabric.add_host(1), 1, test_config(), true);
    let src = mem::patterned(5, 4096);
    let dst = mem::zeroed(4096);
    let (sh, _) = ea.reg_mr(src.region()).unwrap();
    let (_, dd) = eb.reg_mr(dst.region()).unwrap();
    let (od, flag) = OnDone::flag();
    let counter = Arc::new(DoneCounter::new());
    ea.submit_single_write(4096, None, (&sh, 0), (&dd, 0), od)
        .unwrap();
    ea.submit_single_write(64, None, (&sh, 0), (&dd, 0), OnDone::counter(&counter))
        .unwrap();
    // Manual mode: nothing moves until the test drives the engines.
    assert_eq!(flag.wait_timeout(Duration::from_millis(20)), None);
    assert!(!counter.wait_for_timeout(1, Duration::from_millis(20)));
    drive(&fabric, &[ea.clone(), eb.clone()], || {
        flag.is_done() && counter.total() == 1
    });
    assert_eq!(flag.wait_timeout(Duration::from_millis(1)), Some(Ok(())));
    assert!(counter.wait_for_timeout(1, Duration::ZERO));
    assert_eq!(dst.bytes(0, 4096), src.bytes(0, 4096));
    ea.shutdown();
    eb.shutdown();
}

/// `stats()` shows requests waiting in the queue, then transfers in
/// flight, then nothing; per NIC it shows the WRs and bytes each NIC of a
/// two-NIC group carried of a sharded write, adding up to the write.
#[test]
fn stats_show_queue_depth_in_flight_and_nic_balance() {
    let fabric = Fabric::new(FabricConfig::ideal(4));
    let ea = engine(&fabric, fabric.add_host(2), 2, test_config(), true);
    let eb = engine(&fabric, fabric.add_host(2), 2, test_config(), true);
    let len: u64 = 4 << 20;
    let src = mem::patterned(6, len as usize);
    let dst = mem::zeroed(len as usize);
    let (sh, _) = ea.reg_mr(src.region()).unwrap();
    let (_, dd) = eb.reg_mr(dst.region()).unwrap();
    let before = ea.stats();
    assert_eq!(before.groups.len(), 1);
    assert_eq!(before.groups[0].nics.len(), 2);
    assert_eq!(before.groups[0].queued, 0);
    let done = Arc::new(DoneCounter::new());
    let writes = 3u64;
    for _ in 0..writes {
        ea.submit_single_write(len, Some(1), (&sh, 0), (&dd, 0), OnDone::counter(&done))
            .unwrap();
    }
    assert_eq!(ea.stats().groups[0].queued, writes as usize);
    assert_eq!(ea.stats().groups[0].in_flight, 0);
    // One iteration takes the requests: they are in flight, not queued.
    ea.progress();
    let mid = ea.stats();
    assert_eq!(mid.groups[0].queued, 0);
    assert_eq!(mid.groups[0].in_flight, writes as usize);
    assert_eq!(
        mid.groups[0]
            .nics
            .iter()
            .map(|n| n.wrs_completed)
            .sum::<u64>(),
        0,
        "nothing completed before a poll"
    );
    drive(&fabric, &[ea.clone(), eb.clone()], || {
        done.total() == writes
    });
    ea.progress();
    let after = ea.stats();
    assert_eq!(done.failed(), 0, "{:?}", done.first_error());
    assert_eq!(after.groups[0].in_flight, 0);
    assert_eq!(after.groups[0].pending_wrs, 0);
    let nics = &after.groups[0].nics;
    let pieces = ea.imm_counts(0).unwrap().single_write(len);
    assert!(pieces >= 2, "a {len}-byte write is sharded over both NICs");
    assert_eq!(
        nics.iter().map(|n| n.bytes_posted).sum::<u64>(),
        writes * len,
        "{nics:?}"
    );
    assert_eq!(
        nics.iter().map(|n| n.wrs_posted).sum::<u64>(),
        writes * pieces,
        "{nics:?}"
    );
    assert!(nics.iter().all(|n| n.bytes_posted > 0), "{nics:?}");
    assert!(
        nics.iter().all(|n| n.wrs_completed == n.wrs_posted),
        "every posted WR completed: {nics:?}"
    );
    ea.shutdown();
    eb.shutdown();
}

/// Counts are `u64` on both sides: a sum of `ImmCounts` results goes
/// straight into `expect_imm_count`, and one a round cannot hold is a
/// typed error, not a truncation.
#[test]
fn imm_counts_past_u32_are_refused_with_a_typed_error() {
    let fabric = Fabric::new(FabricConfig::ideal(5));
    let e = engine(&fabric, fabric.add_host(1), 1, test_config(), true);
    let imm = e.alloc_imm().unwrap();
    let too_many = u64::from(u32::MAX) + 1;
    assert_eq!(
        e.expect_imm_count(imm, too_many, |_| {}),
        Err(EngineError::ImmCountTooLarge {
            imm,
            count: too_many,
            max: u32::MAX
        })
    );
    assert!(!e.imm_armed(imm));
    e.expect_imm_count(imm, u64::from(u32::MAX), |_| {})
        .unwrap();
    assert!(e.imm_armed(imm));
    e.shutdown();
}

/// `reserve_imm` takes a chosen value that `alloc_imm` then never hands
/// out, refuses a value in use, and serves as a value free on every member
/// of a peer group: a scatter carrying it completes each member's round.
#[test]
fn reserved_imm_values_serve_a_whole_peer_group() {
    let fabric = Fabric::new(FabricConfig::ideal(6));
    let engines: Vec<_> = (0..3)
        .map(|_| engine(&fabric, fabric.add_host(1), 1, test_config(), true))
        .collect();
    let cap = engines[0].imm_capacity();
    let group_imm = cap - 1;
    for e in &engines {
        e.reserve_imm(group_imm).unwrap();
    }
    let e0 = &engines[0];
    assert_eq!(
        e0.reserve_imm(group_imm),
        Err(EngineError::ImmInUse { imm: group_imm })
    );
    assert!(matches!(
        e0.reserve_imm(cap),
        Err(EngineError::InvalidArgument { .. })
    ));
    let a = e0.alloc_imm().unwrap();
    assert_eq!(e0.reserve_imm(a), Err(EngineError::ImmInUse { imm: a }));
    e0.free_imm(a);
    e0.reserve_imm(a).unwrap();
    // Every other value is handed out; the reserved ones never are.
    let mut got = Vec::new();
    while let Ok(v) = e0.alloc_imm() {
        got.push(v);
    }
    assert_eq!(got.len() as u32, cap - 2);
    assert!(!got.contains(&group_imm) && !got.contains(&a));
    for v in got {
        e0.free_imm(v);
    }

    // The group-wide value used by a scatter to both other members.
    let src = mem::patterned(7, 2048);
    let (sh, _) = e0.reg_mr(src.region()).unwrap();
    let dsts: Vec<_> = engines[1..].iter().map(|_| mem::zeroed(1024)).collect();
    let descs: Vec<MrDesc> = engines[1..]
        .iter()
        .zip(&dsts)
        .map(|(e, d)| e.reg_mr(d.region()).unwrap().1)
        .collect();
    let fired = Arc::new(AtomicU64::new(0));
    for e in &engines[1..] {
        let counts = e.imm_counts(0).unwrap();
        let f = fired.clone();
        e.expect_imm_count(
            group_imm,
            counts.scatter_dst(1024, weft_engine::ScatterMode::ByPeer),
            move |r| {
                if r.is_ok() {
                    f.fetch_add(1, Ordering::SeqCst);
                }
            },
        )
        .unwrap();
    }
    let members: Vec<_> = engines[1..].iter().map(|e| e.main_address()).collect();
    let group = e0.add_peer_group(&members).unwrap();
    let scatter: Vec<ScatterDst> = descs
        .iter()
        .enumerate()
        .map(|(j, d)| ScatterDst {
            len: 1024,
            src_offset: 1024 * j as u64,
            dst: d.clone(),
            dst_offset: 0,
        })
        .collect();
    let (od, flag) = OnDone::flag();
    e0.submit_scatter_mode(
        &group,
        od,
        Some(group_imm),
        &sh,
        &scatter,
        weft_engine::ScatterMode::ByPeer,
    )
    .unwrap();
    drive(&fabric, &engines, || {
        flag.is_done() && fired.load(Ordering::SeqCst) == 2
    });
    assert_eq!(flag.result(), Some(Ok(())));
    for (j, d) in dsts.iter().enumerate() {
        assert_eq!(d.bytes(0, 1024), src.bytes(1024 * j, 1024));
    }
    for e in &engines {
        e.shutdown();
    }
}

/// A value reserved above everything `alloc_imm` has handed out, freed,
/// and reserved again is never handed out by `alloc_imm` while reserved;
/// once freed for good it is handed out exactly once.
#[test]
fn a_freed_reservation_is_handed_out_once() {
    let fabric = Fabric::new(FabricConfig::ideal(7));
    let e = engine(&fabric, fabric.add_host(1), 1, test_config(), true);
    let cap = e.imm_capacity();
    let high = cap - 1;
    e.reserve_imm(high).unwrap();
    e.free_imm(high);
    e.reserve_imm(high).unwrap();
    let mut held = Vec::new();
    while let Ok(v) = e.alloc_imm() {
        held.push(v);
    }
    assert!(!held.contains(&high), "a reserved value was handed out");
    assert_eq!(held.len() as u32, cap - 1);
    for v in held {
        e.free_imm(v);
    }
    e.free_imm(high);
    let mut got = Vec::new();
    while let Ok(v) = e.alloc_imm() {
        got.push(v);
    }
    got.sort_unstable();
    let n = got.len();
    got.dedup();
    assert_eq!(got.len(), n, "a value was handed out twice");
    assert_eq!(n as u32, cap, "every value is handed out once");
    e.shutdown();
}

/// The value of the sample of `name` whose labels include every one of
/// `want` in a Prometheus text page.
fn sample(page: &str, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            (n == name
                && want
                    .iter()
                    .all(|(k, v)| labels.split(',').any(|kv| kv == format!("{k}=\"{v}\""))))
            .then(|| value.parse().ok())?
        })
        .next()
}

/// `metrics_text()` counts bytes and WRs per peer, successful transfers,
/// failures by kind (a forged rkey: `remote_access`), and names the data
/// path of every NIC; each family appears once with its HELP and TYPE.
#[test]
fn metrics_count_per_peer_and_failures_by_kind() {
    let fabric = Fabric::new(FabricConfig::ideal(7));
    let ea = engine(&fabric, fabric.add_host(1), 1, test_config(), true);
    let eb = engine(&fabric, fabric.add_host(1), 1, test_config(), true);
    let ec = engine(&fabric, fabric.add_host(1), 1, test_config(), true);
    let src = mem::patterned(9, 8192);
    let (db, dc) = (mem::zeroed(8192), mem::zeroed(8192));
    let (sh, _) = ea.reg_mr(src.region()).unwrap();
    let (_, ddb) = eb.reg_mr(db.region()).unwrap();
    let (_, ddc) = ec.reg_mr(dc.region()).unwrap();
    let mut forged: MrDesc = ddb.clone();
    forged.rkeys[0].1 .0 ^= 0x5a5a;
    let done = Arc::new(DoneCounter::new());
    ea.submit_single_write(4096, None, (&sh, 0), (&ddb, 0), OnDone::counter(&done))
        .unwrap();
    ea.submit_single_write(1000, None, (&sh, 0), (&ddc, 0), OnDone::counter(&done))
        .unwrap();
    let (od, bad) = OnDone::flag();
    ea.submit_single_write(64, None, (&sh, 0), (&forged, 0), od)
        .unwrap();
    drive(&fabric, &[ea.clone(), eb.clone(), ec.clone()], || {
        done.total() == 2 && bad.is_done()
    });
    let err = bad.result().unwrap().unwrap_err();
    assert_eq!(err.kind(), "remote_access", "{err}");
    let page = ea.metrics_text();
    let (b, c) = (ddb.rkeys[0].0.to_string(), ddc.rkeys[0].0.to_string());
    let peer =
        |p: &str, name: &str| sample(&page, name, &[("group", "0"), ("nic", "0"), ("peer", p)]);
    assert_eq!(
        peer(&b, "weft_peer_bytes_posted_total"),
        Some(4096.0 + 64.0),
        "{page}"
    );
    assert_eq!(
        peer(&c, "weft_peer_bytes_posted_total"),
        Some(1000.0),
        "{page}"
    );
    assert_eq!(peer(&b, "weft_peer_wrs_posted_total"), Some(2.0), "{page}");
    assert_eq!(peer(&c, "weft_peer_wrs_posted_total"), Some(1.0), "{page}");
    assert_eq!(
        sample(&page, "weft_transfers_ok_total", &[("group", "0")]),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &page,
            "weft_transfers_failed_total",
            &[("group", "0"), ("kind", "remote_access")]
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(
            &page,
            "weft_bytes_posted_total",
            &[("group", "0"), ("nic", "0")]
        ),
        Some(4096.0 + 1000.0 + 64.0)
    );
    assert_eq!(
        sample(
            &page,
            "weft_data_path_info",
            &[("group", "0"), ("provider", "loopback")]
        ),
        Some(1.0),
        "{page}"
    );
    // A receiver that only received: its failures family is declared,
    // with no sample.
    let quiet = eb.metrics_text();
    assert!(quiet.contains("# TYPE weft_transfers_failed_total counter\n"));
    assert_eq!(sample(&quiet, "weft_transfers_failed_total", &[]), None);
    for family in [
        "weft_peer_bytes_posted_total",
        "weft_transfers_failed_total",
    ] {
        assert_eq!(
            page.matches(&format!("# TYPE {family} counter\n")).count(),
            1
        );
    }
    for e in [ea, eb, ec] {
        e.shutdown();
    }
}
