//! End-to-end: TransferEngines (manual mode) over verbs on the simulated
//! device, several NICs per host: sharded single writes, paged writes,
//! scatter, barrier and two-sided messages, completion via ImmCounter.

mod common;

use common::{with_seed, Buf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use weft_engine::{DomainGroupSpec, OnDone, Pages, ScatterDst, TransferEngine};
use weft_verbs::sim::{SimConfig, SimFabric};
use weft_verbs::{VerbsConfig, VerbsProvider};

fn engine(fabric: &SimFabric, host: usize, nics: usize) -> TransferEngine {
    let cfg = VerbsConfig {
        handshake_timeout_ns: 40_000,
        handshake_tries: 40,
        max_wr_len: Some(64 * 1024),
        ..VerbsConfig::default()
    };
    let lib = fabric.add_host(&format!("h{host}"), nics);
    let p = Arc::new(VerbsProvider::with_lib(lib, cfg));
    TransferEngine::builder()
        .group(DomainGroupSpec::new(p, (0..nics).collect::<Vec<_>>()))
        .manual()
        .build()
        .expect("engine over verbs/sim builds")
}

fn drive(
    fabric: &SimFabric,
    engines: &[TransferEngine],
    seed: u64,
    mut done: impl FnMut() -> bool,
) {
    for _ in 0..500_000 {
        if done() {
            return;
        }
        for e in engines {
            e.progress();
        }
        fabric.step();
    }
    panic!("seed {seed}: engines never reached the condition");
}

fn pat(seed: u64, i: usize) -> u8 {
    ((i as u64).wrapping_mul(31).wrapping_add(seed) % 251) as u8
}

#[test]
fn engine_single_paged_scatter_barrier_send_over_verbs() {
    for seed in [1u64, 2] {
        with_seed(seed, |seed| {
            let mut sc = SimConfig::new(seed);
            sc.ud_drop_prob = 0.1;
            let fabric = SimFabric::new(sc);
            const LEN: usize = 600_000;
            let src = Buf::new(LEN);
            let dsts: Vec<Buf> = (0..2).map(|_| Buf::new(LEN)).collect();
            let data: Vec<u8> = (0..LEN).map(|i| pat(seed, i)).collect();
            src.write(0, &data);
            let engines: Vec<TransferEngine> = (0..3).map(|h| engine(&fabric, h, 2)).collect();
            let (ea, eb, ec) = (&engines[0], &engines[1], &engines[2]);
            let (sh, _) = ea.reg_mr(src.region()).unwrap();
            let (_, db) = eb.reg_mr(dsts[0].region()).unwrap();
            let (_, dc) = ec.reg_mr(dsts[1].region()).unwrap();
            assert_eq!(db.rkeys.len(), 2);

            // A sharded single write with an immediate counted by B.
            let counts = eb.imm_counts(0).unwrap();
            let len = 300_001u64;
            let imm = eb.alloc_imm().unwrap();
            let fired = Arc::new(AtomicBool::new(false));
            let f2 = fired.clone();
            eb.expect_imm_count(imm, counts.single_write(len) as u32, move |r| {
                assert!(r.is_ok());
                f2.store(true, Ordering::SeqCst);
            })
            .unwrap();
            let (od, flag) = OnDone::flag();
            ea.submit_single_write(len, Some(imm), (&sh, 5), (&db, 11), od)
                .unwrap();
            drive(&fabric, &engines, seed, || {
                flag.is_done() && fired.load(Ordering::SeqCst)
            });
            assert_eq!(flag.result(), Some(Ok(())), "seed {seed}");
            assert_eq!(dsts[0].read(11, len as usize), data[5..5 + len as usize]);

            // Paged writes.
            let page = 20_000u64;
            let sp = Pages {
                indices: (0..12).rev().collect(),
                stride: page,
                offset: 0,
            };
            let dp = Pages {
                indices: (0..12).map(|i| (i * 5) % 13).collect(),
                stride: page + 64,
                offset: 32,
            };
            let imm = eb.alloc_imm().unwrap();
            let fired = Arc::new(AtomicBool::new(false));
            let f2 = fired.clone();
            eb.expect_imm_count(imm, counts.paged_writes(page, 12) as u32, move |_| {
                f2.store(true, Ordering::SeqCst)
            })
            .unwrap();
            let (od, flag) = OnDone::flag();
            ea.submit_paged_writes(page, Some(imm), (&sh, &sp), (&db, &dp), od)
                .unwrap();
            drive(&fabric, &engines, seed, || {
                flag.is_done() && fired.load(Ordering::SeqCst)
            });
            assert_eq!(flag.result(), Some(Ok(())), "seed {seed}");
            for i in 0..12 {
                let s = sp.page_offset(i).unwrap() as usize;
                let d = dp.page_offset(i).unwrap() as usize;
                assert_eq!(
                    dsts[0].read(d, page as usize),
                    data[s..s + page as usize],
                    "seed {seed}: page {i}"
                );
            }

            // Scatter to B and C, then a barrier.
            let group = ea
                .add_peer_group(&[eb.main_address(), ec.main_address()])
                .unwrap();
            let imm_b = eb.alloc_imm().unwrap();
            // The scatter carries one imm value: reserve the same one on C.
            assert!(
                (0..16).any(|_| ec.alloc_imm().unwrap() == imm_b),
                "seed {seed}"
            );
            let hits = Arc::new(AtomicUsize::new(0));
            let sdst = [
                ScatterDst {
                    len: 50_000,
                    src_offset: 0,
                    dst: db.clone(),
                    dst_offset: 400_000,
                },
                ScatterDst {
                    len: 70_000,
                    src_offset: 1000,
                    dst: dc.clone(),
                    dst_offset: 0,
                },
            ];
            for (e, d) in [(eb, &sdst[0]), (ec, &sdst[1])] {
                let n = e
                    .imm_counts(0)
                    .unwrap()
                    .scatter_dst(d.len, Default::default());
                let h = hits.clone();
                e.expect_imm_count(imm_b, n as u32, move |_| {
                    h.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            }
            let (od, flag) = OnDone::flag();
            ea.submit_scatter(&group, od, Some(imm_b), &sh, &sdst)
                .unwrap();
            drive(&fabric, &engines, seed, || {
                flag.is_done() && hits.load(Ordering::SeqCst) == 2
            });
            assert_eq!(flag.result(), Some(Ok(())));
            assert_eq!(dsts[0].read(400_000, 50_000), data[..50_000]);
            assert_eq!(dsts[1].read(0, 70_000), data[1000..71_000]);
            let bimm = eb.alloc_imm().unwrap();
            assert!(
                (0..16).any(|_| ec.alloc_imm().unwrap() == bimm),
                "seed {seed}"
            );
            let hits = Arc::new(AtomicUsize::new(0));
            for e in [eb, ec] {
                let h = hits.clone();
                e.expect_imm_count(bimm, 1, move |_| {
                    h.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            }
            let (od, flag) = OnDone::flag();
            ea.submit_barrier(&group, od, bimm, &[db.clone(), dc.clone()])
                .unwrap();
            drive(&fabric, &engines, seed, || {
                flag.is_done() && hits.load(Ordering::SeqCst) == 2
            });
            assert_eq!(flag.result(), Some(Ok(())));

            // Two-sided: C sends B a message.
            let got = Arc::new(parking_lot_free::Slot::default());
            let g2 = got.clone();
            eb.submit_recvs(256, 4, move |r| g2.put(r.map(|b| b.to_vec()).ok()))
                .unwrap();
            let (od, flag) = OnDone::flag();
            ec.submit_send(&eb.main_address(), b"over verbs", od)
                .unwrap();
            drive(&fabric, &engines, seed, || flag.is_done() && got.is_set());
            assert_eq!(flag.result(), Some(Ok(())), "seed {seed}");
            assert_eq!(got.take(), Some(b"over verbs".to_vec()));
        });
    }
}

mod parking_lot_free {
    use std::sync::Mutex;

    /// A one-value mailbox filled by a callback.
    #[derive(Default)]
    pub struct Slot(Mutex<Option<Option<Vec<u8>>>>);

    impl Slot {
        pub fn put(&self, v: Option<Vec<u8>>) {
            *self.0.lock().unwrap() = Some(v);
        }
        pub fn is_set(&self) -> bool {
            self.0.lock().unwrap().is_some()
        }
        pub fn take(&self) -> Option<Vec<u8>> {
            self.0.lock().unwrap().take().flatten()
        }
    }
}
