//! TransferEngine end to end over libfabric `tcp` (`tcp;ofi_rxm` on `lo`),
//! every engine in this process with one group of 2 NICs (two endpoints of
//! `lo`). Skipped (printed) when libfabric is unavailable.

use std::sync::{Arc, Mutex};
use std::time::Duration;
use weft_engine::{
    DomainGroupSpec, EngineConfig, Imm, OnDone, Pages, ScatterDst, ScatterMode, TransferEngine,
};
use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::Provider;

#[path = "support/host_buf.rs"]
mod host_buf;
#[path = "support/wait.rs"]
mod wait;
use host_buf::HostBuf;
use wait::{wait_flag, wait_until};

fn pat(seed: u64, i: usize) -> u8 {
    let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
    (x >> 29) as u8
}

/// A tcp provider with 2 endpoints of `lo`, or `None` (printed).
fn provider() -> Option<Arc<dyn Provider>> {
    let cfg = LibfabricConfig::new("tcp")
        .with_domains(["lo", "lo"])
        .with_connect_timeout(Duration::from_secs(3));
    match LibfabricProvider::with_config(cfg) {
        Ok(p) => Some(Arc::new(p)),
        Err(e) => {
            eprintln!("SKIP: libfabric provider tcp unavailable: {e}");
            None
        }
    }
}

/// `n` engines, each with one group of 2 tcp NICs, or `None` (printed).
fn engines(n: usize) -> Option<Vec<TransferEngine>> {
    let mut v = Vec::new();
    for _ in 0..n {
        let p = provider()?;
        let cfg = EngineConfig {
            idle_sleep: Some(Duration::from_micros(500)),
            ..EngineConfig::default()
        };
        let e = TransferEngine::builder()
            .group(DomainGroupSpec::new(p, vec![0, 1]))
            .config(cfg)
            .build()
            .expect("engine over tcp builds");
        assert_eq!(e.nic_count(0).expect("group 0"), 2, "2 NICs per engine");
        v.push(e);
    }
    Some(v)
}

type Slot = Arc<Mutex<Option<Result<(), String>>>>;

/// Arms `imm` on `rx` for `n` immediates; the callback checks every
/// `(src offset, dst offset, len)` region is in place.
fn arm_check(
    rx: &TransferEngine,
    imm: Imm,
    n: u64,
    src: &Arc<HostBuf>,
    dst: &Arc<HostBuf>,
    regions: Vec<(usize, usize, usize)>,
) -> Slot {
    let slot: Slot = Arc::default();
    let (s2, src, dst) = (slot.clone(), src.clone(), dst.clone());
    let n32 = u32::try_from(n).expect("imm count fits u32");
    rx.expect_imm_count(imm, n32, move |r| {
        let res = match r {
            Err(e) => Err(format!("imm round failed: {e}")),
            Ok(()) => regions
                .iter()
                .find(|&&(so, d_o, l)| {
                    src.read(so, l).expect("source range in bounds")
                        != dst.read(d_o, l).expect("destination range in bounds")
                })
                .map_or(Ok(()), |r| {
                    Err(format!("bytes not in place at imm time: {r:?}"))
                }),
        };
        *s2.lock().expect("slot") = Some(res);
    })
    .expect("arm imm");
    slot
}

fn wait_slot(what: &str, s: &Slot) {
    wait_until(what, || s.lock().expect("slot").is_some());
    if let Some(Err(e)) = s.lock().expect("slot").take() {
        panic!("{what}: {e}");
    }
}

#[test]
fn two_engines_writes_paged_and_send_recv() {
    let Some(es) = engines(2) else { return };
    let (a, b) = (&es[0], &es[1]);
    const LEN: usize = 4 << 20;
    let src = Arc::new(HostBuf::from_fn(LEN, |i| pat(1, i)));
    let dst = Arc::new(HostBuf::new(LEN));
    let (smr, _) = a.reg_mr(src.region()).expect("reg src");
    let (_, ddesc) = b.reg_mr(dst.region()).expect("reg dst");
    let imm = b.alloc_imm().expect("imm");
    let counts = b.imm_counts(0).expect("imm counts");
    let sizes = [
        1usize,
        7,
        4095,
        4097,
        65_535,
        65_539,
        200_001,
        (1 << 20) + 13,
        3 * 1024 * 1024 + 777,
    ];
    for (k, &len) in sizes.iter().enumerate() {
        let so = 3 + 5 * k;
        let d_o = 11 * k;
        let n = counts.single_write(len as u64);
        if len >= 65_536 {
            assert!(
                n >= 2,
                "len {len}: expected sharding over 2 NICs, {n} pieces"
            );
        }
        let slot = arm_check(b, imm, n, &src, &dst, vec![(so, d_o, len)]);
        let (od, flag) = OnDone::flag();
        a.submit_single_write(
            len as u64,
            Some(imm),
            (&smr, so as u64),
            (&ddesc, d_o as u64),
            od,
        )
        .expect("submit single write");
        let what = format!("single write of {len} bytes");
        wait_flag(&what, &flag).unwrap_or_else(|e| panic!("{what} failed: {e}"));
        wait_slot(&what, &slot);
    }

    // Paged writes: odd page length, scattered source and destination pages.
    let page = 5000u64;
    let sp = Pages {
        indices: vec![5, 0, 9, 2, 7, 3, 11, 1],
        stride: 8192,
        offset: 17,
    };
    let dp = Pages {
        indices: vec![3, 6, 0, 7, 1, 5, 2, 4],
        stride: 6000,
        offset: 2 << 20,
    };
    let regions = (0..sp.indices.len())
        .map(|i| {
            (
                sp.page_offset(i).expect("src page") as usize,
                dp.page_offset(i).expect("dst page") as usize,
                page as usize,
            )
        })
        .collect();
    let n = counts.paged_writes(page, sp.indices.len() as u64);
    let slot = arm_check(b, imm, n, &src, &dst, regions);
    let (od, flag) = OnDone::flag();
    a.submit_paged_writes(page, Some(imm), (&smr, &sp), (&ddesc, &dp), od)
        .expect("submit paged writes");
    wait_flag("paged writes", &flag).unwrap_or_else(|e| panic!("paged writes failed: {e}"));
    wait_slot("paged writes", &slot);

    // Send / receive.
    let got: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let g2 = got.clone();
    b.submit_recvs(8192, 4, move |r| match r {
        Ok(m) => g2.lock().expect("got").push(m.to_vec()),
        Err(e) => g2
            .lock()
            .expect("got")
            .push(format!("ERR {e}").into_bytes()),
    })
    .expect("submit recvs");
    let mut msgs: Vec<Vec<u8>> = [1usize, 100, 4096, 8000, 33]
        .iter()
        .enumerate()
        .map(|(k, &l)| (0..l).map(|i| pat(100 + k as u64, i)).collect())
        .collect();
    let mut flags = Vec::new();
    for m in &msgs {
        let (od, flag) = OnDone::flag();
        a.submit_send(&b.main_address(), m, od)
            .expect("submit send");
        flags.push(flag);
    }
    for f in &flags {
        wait_flag("send", f).unwrap_or_else(|e| panic!("send failed: {e}"));
    }
    wait_until("all messages received", || {
        got.lock().expect("got").len() >= msgs.len()
    });
    let mut got = got.lock().expect("got").clone();
    got.sort();
    msgs.sort();
    assert_eq!(got, msgs, "received messages differ from the sent ones");
    a.shutdown();
    b.shutdown();
}

#[test]
fn scatter_and_barrier_to_three_peers() {
    let Some(es) = engines(4) else { return };
    let (s, peers) = (&es[0], &es[1..]);
    const LEN: usize = 1 << 20;
    let src = Arc::new(HostBuf::from_fn(LEN, |i| pat(7, i)));
    let (smr, _) = s.reg_mr(src.region()).expect("reg src");
    let dsts: Vec<Arc<HostBuf>> = peers.iter().map(|_| Arc::new(HostBuf::new(LEN))).collect();
    let descs: Vec<_> = peers
        .iter()
        .zip(&dsts)
        .map(|(p, d)| p.reg_mr(d.region()).expect("reg dst").1)
        .collect();
    let imms: Vec<Imm> = peers.iter().map(|p| p.alloc_imm().expect("imm")).collect();
    let bimms: Vec<Imm> = peers.iter().map(|p| p.alloc_imm().expect("imm")).collect();
    assert!(
        imms.iter().all(|&i| i == imms[0]) && bimms.iter().all(|&i| i == bimms[0]),
        "fresh engines should hand out the same imm values: {imms:?} {bimms:?}"
    );
    let addrs: Vec<_> = peers.iter().map(|p| p.main_address()).collect();
    let h = s.add_peer_group(&addrs).expect("add peer group");
    for (round, mode) in [ScatterMode::ByPeer, ScatterMode::ByBytes]
        .into_iter()
        .enumerate()
    {
        let lens = [70_001usize + round, 3, 200_000 + 4096 * round];
        let sd: Vec<ScatterDst> = (0..3)
            .map(|j| ScatterDst {
                len: lens[j] as u64,
                src_offset: (j * 300_000 + round) as u64,
                dst: descs[j].clone(),
                dst_offset: (13 * j + 100_000 * round) as u64,
            })
            .collect();
        let slots: Vec<Slot> = (0..3)
            .map(|j| {
                let n = peers[j]
                    .imm_counts(0)
                    .expect("counts")
                    .scatter_dst(lens[j] as u64, mode);
                let r = (
                    sd[j].src_offset as usize,
                    sd[j].dst_offset as usize,
                    lens[j],
                );
                arm_check(&peers[j], imms[j], n, &src, &dsts[j], vec![r])
            })
            .collect();
        let (od, flag) = OnDone::flag();
        s.submit_scatter_mode(&h, od, Some(imms[0]), &smr, &sd, mode)
            .expect("submit scatter");
        let what = format!("scatter {mode:?}");
        wait_flag(&what, &flag).unwrap_or_else(|e| panic!("{what} failed: {e}"));
        for (j, sl) in slots.iter().enumerate() {
            wait_slot(&format!("{what} at peer {j}"), sl);
        }
        // Barrier after the scatter.
        let bslots: Vec<Slot> = (0..3)
            .map(|j| {
                let n = peers[j].imm_counts(0).expect("counts").barrier();
                arm_check(&peers[j], bimms[j], n, &src, &dsts[j], vec![])
            })
            .collect();
        let (od, flag) = OnDone::flag();
        s.submit_barrier(&h, od, bimms[0], &descs)
            .expect("submit barrier");
        wait_flag("barrier", &flag).unwrap_or_else(|e| panic!("barrier failed: {e}"));
        for (j, sl) in bslots.iter().enumerate() {
            wait_slot(&format!("barrier at peer {j}"), sl);
        }
    }
    for e in &es {
        e.shutdown();
    }
}
