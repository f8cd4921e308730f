//! One engine over two fabrics: each group has a NIC (the simulated
//! fabric) and a same-host NIC (`nvlink`) behind it
//! (`DomainGroupSpec::same_host`). Engines that claim the same host reach
//! each other through nvlink, the others through the NIC; one scatter
//! reaches both kinds, every byte checked, and the per-NIC counters and
//! `paths_to` say which NIC carried what.

use std::sync::Arc;
use std::time::Duration;
use weft::{
    Backend, DomainGroupSpec, HostBuffer, NvlinkOptions, OnDone, Pages, ProviderConfig, ScatterDst,
    TransferEngine,
};
use weft_testkit::wait::wait_until;

const LEN: usize = 1 << 20;
const HANG: Duration = Duration::from_secs(60);

fn nvlink(host: u8) -> Backend {
    weft::provider_with(
        &"nvlink".parse().unwrap(),
        &ProviderConfig::default().with_nvlink(NvlinkOptions::default().with_host([host; 16])),
    )
    .unwrap()
}

fn engine(nic: &Backend, host: u8) -> TransferEngine {
    let mut cfg = weft::EngineConfig::default();
    cfg.idle_sleep = Some(Duration::from_micros(200));
    TransferEngine::builder()
        .group(
            DomainGroupSpec::new(nic.host().unwrap(), vec![0])
                .same_host(nvlink(host).host().unwrap(), 0),
        )
        .config(cfg)
        .build()
        .unwrap()
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn same_host_peers_take_nvlink_and_the_others_the_nic() {
    let fabric =
        weft::provider_with(&"loopback".parse().unwrap(), &ProviderConfig::default()).unwrap();
    // A and B claim host 1, C host 2.
    let (a, b, c) = (engine(&fabric, 1), engine(&fabric, 1), engine(&fabric, 2));
    let src = HostBuffer::new(LEN).unwrap();
    assert!(src.write(0, &pattern(7)));
    let (sh, _) = a.reg_mr(src.region()).unwrap();
    let bufs: Vec<HostBuffer> = (0..2).map(|_| HostBuffer::new(4 * LEN).unwrap()).collect();
    let (_, db) = b.reg_mr(bufs[0].region()).unwrap();
    let (_, dc) = c.reg_mr(bufs[1].region()).unwrap();

    let paths = |d| -> Vec<String> {
        a.paths_to(0, d)
            .unwrap()
            .into_iter()
            .map(|r| r.name)
            .collect()
    };
    let mine: Vec<String> = a
        .data_path_report()
        .nics
        .into_iter()
        .map(|n| n.name)
        .collect();
    assert_eq!(
        paths(&db),
        [mine[1].clone()],
        "B is on this host: nvlink only"
    );
    assert_eq!(paths(&dc), [mine[0].clone()], "C is not: the NIC only");

    // Single writes, paged writes and one scatter to both.
    let counts = b.imm_counts(0).unwrap();
    let per_peer = counts.single_write(LEN as u64)
        + counts.paged_writes(4096, 64)
        + counts.scatter_dst(LEN as u64, weft::ScatterMode::ByPeer);
    let rounds: Vec<_> = [(&b, &db), (&c, &dc)]
        .iter()
        .map(|(e, _)| {
            let imm = e.alloc_imm().unwrap();
            let (od, f) = OnDone::flag();
            e.expect_imm_count_with(imm, per_peer, od).unwrap();
            (imm, f)
        })
        .collect();
    let done = Arc::new(weft::DoneCounter::new());
    for ((d, _), (imm, _)) in [(&db, 0), (&dc, 1)].into_iter().zip(&rounds) {
        a.submit_single_write(
            LEN as u64,
            Some(*imm),
            (&sh, 0),
            (d, 0),
            OnDone::counter(&done),
        )
        .unwrap();
        let sp = Pages {
            indices: (0..64).rev().collect(),
            stride: 4096,
            offset: 0,
        };
        let dp = Pages {
            indices: (0..64).collect(),
            stride: 4096,
            offset: LEN as u64,
        };
        a.submit_paged_writes(
            4096,
            Some(*imm),
            (&sh, &sp),
            (d, &dp),
            OnDone::counter(&done),
        )
        .unwrap();
    }
    // The scatter: one immediate per destination, each its own round.
    let pg = a
        .add_peer_group(&[b.main_address(), c.main_address()])
        .unwrap();
    let dsts: Vec<ScatterDst> = [&db, &dc]
        .iter()
        .map(|d| ScatterDst {
            len: LEN as u64,
            src_offset: 0,
            dst: (*d).clone(),
            dst_offset: 2 * LEN as u64,
        })
        .collect();
    let imms: Vec<_> = rounds.iter().map(|r| r.0).collect();
    assert_eq!(
        imms[0], imms[1],
        "both peers allocated their first immediate alike"
    );
    a.submit_scatter(&pg, OnDone::counter(&done), Some(imms[0]), &sh, &dsts)
        .unwrap();
    wait_until("writes done", HANG, || done.total() == 5);
    assert_eq!(done.failed(), 0, "{:?}", done.first_error());
    for (_, f) in &rounds {
        wait_until("rounds fired", HANG, || f.is_done());
        assert!(matches!(f.result(), Some(Ok(()))), "{:?}", f.result());
    }
    let want = pattern(7);
    for buf in &bufs {
        assert_eq!(buf.read(0, LEN).unwrap(), want, "single write");
        let paged = buf.read(LEN, 64 * 4096).unwrap();
        for j in 0..64 {
            let s = (63 - j) * 4096;
            assert_eq!(
                &paged[j * 4096..(j + 1) * 4096],
                &want[s..s + 4096],
                "page {j}"
            );
        }
        assert_eq!(buf.read(2 * LEN, LEN).unwrap(), want, "scatter");
    }
    // Who carried what: the NIC nothing for B, nvlink nothing for C.
    let st = a.stats();
    let g = &st.groups[0];
    let sent = |nic: usize, addr: &weft::NetAddr| {
        g.peers
            .iter()
            .filter(|p| p.nic == nic && &p.addr == addr)
            .map(|p| p.bytes_posted)
            .sum::<u64>()
    };
    let (b_addrs, c_addrs) = (b.main_address().nics, c.main_address().nics);
    let three = 2 * LEN as u64 + 64 * 4096;
    assert_eq!(sent(1, &b_addrs[1]), three, "B's bytes over nvlink");
    assert_eq!(sent(0, &b_addrs[0]), 0, "none of B's over the NIC");
    assert_eq!(sent(0, &c_addrs[0]), three, "C's bytes over the NIC");
    assert_eq!(sent(1, &c_addrs[1]), 0, "none of C's over nvlink");
    for e in [a, b, c] {
        e.shutdown();
    }
}
