//! Focused tests of the verbs backend logic over the simulated device, and
//! of the real libibverbs path as far as a machine without RDMA devices
//! allows.

use crate::common::*;
use weft_transport::{
    Access, Completion, Domain, Provider, RemoteAccessReason, Rkey, TransportError, WrId, WriteWr,
};
use weft_verbs::ops::*;
use weft_verbs::sim::{SimConfig, SimFabric, SimLib};
use weft_verbs::{VerbsConfig, VerbsDomain, VerbsProvider};

#[test]
fn real_libibverbs_lists_no_device_or_is_unavailable() {
    let lib = weft_verbs::ffi::IbvLib::new();
    match lib.devices() {
        Ok(devs) => {
            // This machine's kernel has no RDMA devices. On a machine that
            // has some, listing must still work and name them.
            for d in &devs {
                assert!(!d.name.is_empty());
            }
            if devs.is_empty() {
                match lib.open(0) {
                    Err(TransportError::NoDevice { .. }) => {}
                    Err(e) => panic!("expected NoDevice, got {e}"),
                    Ok(_) => panic!("opened a device that was not listed"),
                }
            }
        }
        Err(TransportError::LibraryUnavailable { library, .. }) => {
            assert_eq!(library, "libibverbs.so.1")
        }
        Err(e) => panic!("unexpected error listing devices: {e}"),
    }
    let p = VerbsProvider::new(VerbsConfig::default());
    assert_eq!(p.name(), "verbs");
    match (p.nics(), p.open(0)) {
        (Ok(n), Err(TransportError::NoDevice { .. })) if n.is_empty() => {}
        (Ok(n), _) if !n.is_empty() => {} // real hardware present
        (
            Err(TransportError::LibraryUnavailable { .. }),
            Err(TransportError::LibraryUnavailable { .. }),
        ) => {}
        (a, b) => panic!("unclean result without devices: {a:?} / {:?}", b.err()),
    }
}

#[test]
fn no_device_is_a_clean_error() {
    let f = SimFabric::new(SimConfig::new(1));
    let p = VerbsProvider::with_lib(SimLib::empty(&f), VerbsConfig::default());
    assert_eq!(p.nics().unwrap(), vec![]);
    assert!(matches!(p.open(0), Err(TransportError::NoDevice { .. })));
}

#[test]
fn writes_with_imm_land_and_chain_four_per_doorbell() {
    with_seed(11, |seed| {
        let src = mem::zeroed(4096);
        let dst = mem::zeroed(4096);
        let mut s = Sim::new(seed, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let p = s.connect(0, 1, &smr, &dmr);
        let before = s.fabric.stats("sim0").rc_chain_lens.len();
        for i in 0..10u8 {
            src.put(usize::from(i) * 100, &[i + 1; 100]);
        }
        let wrs: Vec<WriteWr> = (0..10u64)
            .map(|i| WriteWr {
                wr: WrId(i),
                peer: p,
                src: smr.slice(i * 100, 100).unwrap(),
                dst: remote(&dmr, i * 100),
                imm: Some(1000 + i as u32),
            })
            .collect();
        assert_eq!(s.hosts[0].post_writes(&wrs).unwrap(), 10);
        let chains = s.fabric.stats("sim0").rc_chain_lens[before..].to_vec();
        assert_eq!(chains, vec![4, 4, 2], "seed {seed}");
        let mut out = s.outs();
        assert!(s.run_until(10_000, &mut out, |o| writes(&o[0]).len() == 10
            && imms(&o[1]).len() == 10));
        assert!(
            writes(&out[0]).iter().all(|(_, ok)| *ok),
            "seed {seed}: {:?}",
            out[0]
        );
        let mut got = imms(&out[1]);
        got.sort();
        assert_eq!(got, (1000..1010).collect::<Vec<_>>());
        for i in 0..10u8 {
            assert_eq!(dst.bytes(usize::from(i) * 100, 100), vec![i + 1; 100]);
        }
    });
}

#[test]
fn doorbells_respect_configured_chain_length() {
    with_seed(12, |seed| {
        let src = mem::zeroed(4096);
        let dst = mem::zeroed(4096);
        let cfg = VerbsConfig {
            chain_len: 3,
            ..sim_cfg()
        };
        let mut s = Sim::with(SimConfig::new(seed), cfg, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let p = s.connect(0, 1, &smr, &dmr);
        let st0 = s.fabric.stats("sim0");
        let wrs: Vec<WriteWr> = (0..7u64)
            .map(|i| WriteWr {
                wr: WrId(i),
                peer: p,
                src: smr.slice(i, 1).unwrap(),
                dst: remote(&dmr, i),
                imm: None,
            })
            .collect();
        assert_eq!(s.hosts[0].post_writes(&wrs).unwrap(), 7);
        let st = s.fabric.stats("sim0");
        assert_eq!(st.rc_doorbells - st0.rc_doorbells, 3);
        assert_eq!(st.rc_chain_lens[st0.rc_chain_lens.len()..], [3, 3, 1]);
    });
}

#[test]
fn ops_wait_while_connecting_and_handshake_survives_loss() {
    for seed in 20..24 {
        with_seed(seed, |seed| {
            let src = mem::zeroed(64);
            let dst = mem::zeroed(64);
            let mut s = Sim::new(seed, 2);
            // The first two datagrams to each side are lost.
            s.fabric.drop_ud_to("sim1", 2);
            s.fabric.drop_ud_to("sim0", 1);
            let smr = s.reg(0, &src, Access::LocalOnly);
            let dmr = s.reg(1, &dst, Access::RemoteWrite);
            src.put(0, b"hello");
            let p = s.peer(0, 1);
            let wr = WriteWr {
                wr: WrId(7),
                peer: p,
                src: smr.slice(0, 5).unwrap(),
                dst: remote(&dmr, 0),
                imm: Some(9),
            };
            s.hosts[0].post_write(&wr).unwrap();
            assert!(!s.hosts[0].is_connected(p));
            let mut out = s.outs();
            assert!(
                s.run_until(20_000, &mut out, |o| !writes(&o[0]).is_empty()
                    && !imms(&o[1]).is_empty()),
                "seed {seed}"
            );
            assert_eq!(writes(&out[0]), vec![(WrId(7), true)]);
            assert_eq!(imms(&out[1]), vec![9]);
            assert_eq!(dst.bytes(0, 5), b"hello");
            assert!(
                s.hosts[0].stats().handshakes_sent >= 3,
                "seed {seed}: retransmitted"
            );
            assert_eq!(
                s.fabric.stats("sim1").ud_dropped + s.fabric.stats("sim0").ud_dropped,
                3
            );
        });
    }
}

#[test]
fn lossy_handshakes_duplicates_and_simultaneous_open() {
    for seed in 30..36 {
        with_seed(seed, |seed| {
            let mut sc = SimConfig::new(seed);
            sc.ud_drop_prob = 0.4;
            let n = 4;
            let mut cfg = sim_cfg();
            cfg.handshake_tries = 60;
            let mut s = Sim::with(sc, cfg, n);
            let bufs: Vec<HostBuffer> = (0..n).map(|_| mem::zeroed(64 * n)).collect();
            let mrs: Vec<_> = (0..n)
                .map(|i| s.reg(i, &bufs[i], Access::RemoteWrite))
                .collect();
            // Everyone writes to everyone at once: simultaneous opens.
            for i in 0..n {
                for j in 0..n {
                    if i == j {
                        continue;
                    }
                    bufs[i].put(64 * j, &[(i * 16 + j) as u8; 8]);
                    let p = s.peer(i, j);
                    let wr = WriteWr {
                        wr: WrId(j as u64),
                        peer: p,
                        src: mrs[i].slice(64 * j as u64, 8).unwrap(),
                        dst: remote(&mrs[j], 64 * i as u64 + 32),
                        imm: Some((i * 16 + j) as u32),
                    };
                    s.hosts[i].post_write(&wr).unwrap();
                }
            }
            let mut out = s.outs();
            let ok = s.run_until(200_000, &mut out, |o| {
                (0..n).all(|i| writes(&o[i]).len() == n - 1 && imms(&o[i]).len() == n - 1)
            });
            assert!(ok, "seed {seed}: {out:?}");
            for i in 0..n {
                assert!(writes(&out[i]).iter().all(|(_, ok)| *ok), "seed {seed}");
                let mut got = imms(&out[i]);
                got.sort();
                let mut want: Vec<u32> = (0..n)
                    .filter(|j| *j != i)
                    .map(|j| (j * 16 + i) as u32)
                    .collect();
                want.sort();
                assert_eq!(got, want, "seed {seed}: each imm exactly once");
                for j in (0..n).filter(|j| *j != i) {
                    assert_eq!(bufs[i].bytes(64 * j + 32, 8), vec![(j * 16 + i) as u8; 8]);
                }
            }
            let total_rx: u64 = s.hosts.iter().map(|h| h.stats().handshakes_received).sum();
            let connects: u64 = s.hosts.iter().map(|h| h.stats().connects).sum();
            assert_eq!(
                connects,
                (n * (n - 1)) as u64,
                "seed {seed}: one connection per ordered pair"
            );
            assert!(total_rx >= connects, "seed {seed}");
            // Nothing more arrives afterwards (no duplicate completions).
            for _ in 0..2_000 {
                s.round(&mut out);
            }
            for o in &out {
                assert_eq!(imms(o).len(), n - 1, "seed {seed}: duplicate imm");
                assert_eq!(writes(o).len(), n - 1, "seed {seed}: duplicate completion");
            }
        });
    }
}

#[test]
fn peer_that_never_answers_fails_cleanly() {
    with_seed(40, |seed| {
        let src = mem::zeroed(64);
        let mut s = Sim::new(seed, 1);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let ghost = weft_verbs::wire::VerbsAddr {
            gid: Gid([0xee; 16]),
            lid: 999,
            ud_qpn: 1234,
        }
        .encode();
        let p = s.hosts[0].add_peer(&ghost).unwrap();
        assert_eq!(s.hosts[0].add_peer(&ghost).unwrap(), p, "idempotent");
        s.hosts[0]
            .post_write(&WriteWr {
                wr: WrId(1),
                peer: p,
                src: smr.slice(0, 8).unwrap(),
                dst: weft_transport::RemoteSlice {
                    base: 0x1000,
                    offset: 0,
                    rkey: Rkey(5),
                },
                imm: Some(1),
            })
            .unwrap();
        s.hosts[0]
            .post_send(WrId(2), p, smr.slice(0, 8).unwrap())
            .unwrap();
        let mut out = s.outs();
        assert!(
            s.run_until(100_000, &mut out, |o| o[0].len() == 2),
            "seed {seed}"
        );
        for c in &out[0] {
            match c {
                Completion::Write {
                    result: Err(TransportError::PeerUnreachable { .. }),
                    ..
                }
                | Completion::Send {
                    result: Err(TransportError::PeerUnreachable { .. }),
                    ..
                } => {}
                c => panic!("seed {seed}: {c:?}"),
            }
        }
        assert_eq!(s.hosts[0].stats().handshakes_sent, 12);
        // Later posts fail at once.
        let e = s.hosts[0]
            .post_send(WrId(3), p, smr.slice(0, 8).unwrap())
            .unwrap_err();
        assert!(matches!(e, TransportError::PeerUnreachable { .. }));
        assert!(s.hosts[0]
            .add_peer(&weft_transport::NetAddr(vec![1, 2, 3]))
            .is_err());
    });
}

#[test]
fn partial_post_is_recovered() {
    with_seed(50, |seed| {
        let src = mem::zeroed(4096);
        let dst = mem::zeroed(4096);
        let mut s = Sim::new(seed, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let p = s.connect(0, 1, &smr, &dmr);
        for i in 0..6u8 {
            src.put(usize::from(i) * 10, &[i + 50; 10]);
        }
        let before = s.fabric.stats("sim0").rc_chain_lens.len();
        s.fabric.fail_next_post_send("sim0", 2);
        let wrs: Vec<WriteWr> = (0..6u64)
            .map(|i| WriteWr {
                wr: WrId(i),
                peer: p,
                src: smr.slice(i * 10, 10).unwrap(),
                dst: remote(&dmr, i * 10),
                imm: Some(i as u32),
            })
            .collect();
        assert_eq!(s.hosts[0].post_writes(&wrs).unwrap(), 6);
        assert_eq!(s.hosts[0].stats().partial_posts, 1);
        let mut out = s.outs();
        assert!(s.run_until(10_000, &mut out, |o| writes(&o[0]).len() == 6
            && imms(&o[1]).len() == 6));
        assert!(writes(&out[0]).iter().all(|(_, ok)| *ok), "seed {seed}");
        let mut got = imms(&out[1]);
        got.sort();
        assert_eq!(
            got,
            vec![0, 1, 2, 3, 4, 5],
            "seed {seed}: every WR exactly once"
        );
        let chains = s.fabric.stats("sim0").rc_chain_lens[before..].to_vec();
        assert_eq!(chains.iter().sum::<usize>(), 6, "seed {seed}: {chains:?}");
        assert_eq!(
            chains[0], 2,
            "seed {seed}: the prefix before bad_wr was posted"
        );
        for i in 0..6u8 {
            assert_eq!(dst.bytes(usize::from(i) * 10, 10), vec![i + 50; 10]);
        }
    });
}

#[test]
fn remote_access_error_fails_only_its_wr_and_flushed_wrs_are_resent() {
    with_seed(60, |seed| {
        let src = mem::zeroed(4096);
        let dst = mem::zeroed(256);
        let mut s = Sim::new(seed, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let p = s.connect(0, 1, &smr, &dmr);
        src.put(0, &[7; 64]);
        let good = |i: u64| WriteWr {
            wr: WrId(i),
            peer: p,
            src: smr.slice(0, 16).unwrap(),
            dst: remote(&dmr, i * 16),
            imm: Some(100 + i as u32),
        };
        let mut bad_oob = good(1);
        bad_oob.dst = remote(&dmr, 250);
        let mut bad_key = good(3);
        bad_key.dst.rkey = Rkey(dmr.rkey.0 ^ 0x5555);
        let wrs = vec![good(0), bad_oob, good(2), bad_key, good(4), good(5)];
        assert_eq!(s.hosts[0].post_writes(&wrs).unwrap(), 6);
        let mut out = s.outs();
        assert!(
            s.run_until(50_000, &mut out, |o| writes(&o[0]).len() == 6),
            "seed {seed}: {:?}",
            out[0]
        );
        for c in &out[0] {
            if let Completion::Write { wr, result } = c {
                match wr.0 {
                    1 | 3 => assert!(
                        matches!(
                            result,
                            Err(TransportError::RemoteAccess {
                                reason: RemoteAccessReason::Unspecified,
                                ..
                            })
                        ),
                        "seed {seed}: {c:?}"
                    ),
                    _ => assert!(result.is_ok(), "seed {seed}: {c:?}"),
                }
            }
        }
        for _ in 0..1000 {
            s.round(&mut out);
        }
        let mut got = imms(&out[1]);
        got.sort();
        assert_eq!(
            got,
            vec![100, 102, 104, 105],
            "seed {seed}: no imm for failed writes, others once"
        );
        assert!(s.hosts[0].stats().resets >= 2);
        assert!(s.hosts[0].stats().requeued_ops >= 1);
        assert!(s.fabric.stats("sim0").flush_cqes >= 1);
        for i in [0usize, 2, 4, 5] {
            assert_eq!(dst.bytes(i * 16, 16), vec![7; 16]);
        }
        assert_eq!(
            dst.bytes(16, 16),
            vec![0; 16],
            "nothing written by the failed write"
        );
    });
}

#[test]
fn rnr_then_receiver_not_ready_and_recovery() {
    with_seed(70, |seed| {
        let src = mem::zeroed(256);
        let rbuf = mem::zeroed(256);
        let mut s = Sim::new(seed, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let rmr = s.reg(1, &rbuf, Access::LocalOnly);
        let p = s.peer(0, 1);
        src.put(0, b"ping");
        s.hosts[0]
            .post_send(WrId(1), p, smr.slice(0, 4).unwrap())
            .unwrap();
        let mut out = s.outs();
        assert!(s.run_until(50_000, &mut out, |o| !o[0].is_empty()));
        assert!(
            matches!(
                out[0][0],
                Completion::Send {
                    wr: WrId(1),
                    result: Err(TransportError::ReceiverNotReady { .. })
                }
            ),
            "seed {seed}: {:?}",
            out[0]
        );
        assert!(s.fabric.stats("sim0").rnr_naks >= 6);
        // With a buffer posted the next SEND goes through (on a rebuilt
        // connection).
        s.hosts[1]
            .post_recv(WrId(9), rmr.slice(0, 64).unwrap())
            .unwrap();
        s.hosts[0]
            .post_send(WrId(2), p, smr.slice(0, 4).unwrap())
            .unwrap();
        let mut out = s.outs();
        assert!(s.run_until(50_000, &mut out, |o| !o[0].is_empty() && !o[1].is_empty()));
        assert_eq!(
            out[0],
            vec![Completion::Send {
                wr: WrId(2),
                result: Ok(())
            }],
            "seed {seed}"
        );
        assert_eq!(
            out[1],
            vec![Completion::Recv {
                wr: WrId(9),
                result: Ok(4),
                from: Some(s.hosts[0].local_addr().clone()),
            }]
        );
        assert_eq!(rbuf.bytes(0, 4), b"ping");
    });
}

#[test]
fn recv_and_writeimm_never_steal_each_others_receives() {
    with_seed(75, |seed| {
        let src = mem::zeroed(256);
        let dst = mem::zeroed(256);
        let mut s = Sim::new(seed, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let p = s.connect(0, 1, &smr, &dmr);
        // One user receive posted; many WRITE_WITH_IMMs arrive first.
        s.hosts[1]
            .post_recv(WrId(50), dmr.slice(128, 64).unwrap())
            .unwrap();
        let wrs: Vec<WriteWr> = (0..20u64)
            .map(|i| WriteWr {
                wr: WrId(i),
                peer: p,
                src: smr.slice(0, 4).unwrap(),
                dst: remote(&dmr, 0),
                imm: Some(i as u32),
            })
            .collect();
        let mut posted = 0;
        let mut out = s.outs();
        while posted < wrs.len() {
            posted += s.hosts[0].post_writes(&wrs[posted..]).unwrap();
            s.round(&mut out);
        }
        s.hosts[0]
            .post_send(WrId(99), p, smr.slice(0, 8).unwrap())
            .unwrap();
        assert!(s.run_until(50_000, &mut out, |o| writes(&o[0]).len() == 20
            && imms(&o[1]).len() == 20
            && o[0].len() == 21));
        assert!(
            out[1].contains(&Completion::Recv {
                wr: WrId(50),
                result: Ok(8),
                from: Some(s.hosts[0].local_addr().clone()),
            }),
            "seed {seed}: {:?}",
            out[1]
        );
        assert!(out[0].contains(&Completion::Send {
            wr: WrId(99),
            result: Ok(())
        }));
    });
}

#[test]
fn long_writes_are_split_and_imm_rides_on_the_last_piece() {
    with_seed(80, |seed| {
        let src = mem::zeroed(10_000);
        let dst = mem::zeroed(10_000);
        let cfg = VerbsConfig {
            max_wr_len: Some(1000),
            ..sim_cfg()
        };
        let mut s = Sim::with(SimConfig::new(seed), cfg, 2);
        assert_eq!(s.hosts[0].max_wr_len(), 1000);
        assert_eq!(s.hosts[0].capabilities().max_write_len, u64::MAX);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let p = s.connect(0, 1, &smr, &dmr);
        let data: Vec<u8> = (0..9_500u32).map(|i| (i % 251) as u8).collect();
        src.put(0, &data);
        let before = s.fabric.stats("sim0").rc_chain_lens.len();
        s.hosts[0]
            .post_write(&WriteWr {
                wr: WrId(1),
                peer: p,
                src: smr.slice(0, 9_500).unwrap(),
                dst: remote(&dmr, 300),
                imm: Some(77),
            })
            .unwrap();
        let mut out = s.outs();
        assert!(s.run_until(50_000, &mut out, |o| !writes(&o[0]).is_empty()));
        for _ in 0..500 {
            s.round(&mut out);
        }
        assert_eq!(writes(&out[0]), vec![(WrId(1), true)], "seed {seed}");
        assert_eq!(
            imms(&out[1]),
            vec![77],
            "seed {seed}: one imm for the whole write"
        );
        assert_eq!(dst.bytes(300, 9_500), data);
        let chains = s.fabric.stats("sim0").rc_chain_lens[before..].to_vec();
        assert_eq!(
            chains.iter().sum::<usize>(),
            10,
            "seed {seed}: 10 pieces of <= 1000 bytes: {chains:?}"
        );
        assert!(chains.iter().all(|c| *c <= 4));
    });
}

#[test]
fn default_wr_length_is_below_2_pow_31() {
    with_seed(81, |seed| {
        let mut sc = SimConfig::new(seed);
        sc.max_msg_sz = u32::MAX;
        let s = Sim::with(sc, sim_cfg(), 1);
        assert_eq!(s.hosts[0].max_wr_len(), (1 << 31) - 1);
        assert_eq!(s.hosts[0].capabilities().max_send_len, (1 << 31) - 1);
    });
}

#[test]
fn dead_peer_fails_pending_and_later_work() {
    with_seed(90, |seed| {
        let src = mem::zeroed(256);
        let dst = mem::zeroed(256);
        let mut s = Sim::new(seed, 3);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let dst2 = mem::zeroed(256);
        let dmr2 = s.reg(2, &dst2, Access::RemoteWrite);
        let p = s.connect(0, 1, &smr, &dmr);
        let p2 = s.connect(0, 2, &smr, &dmr2);
        s.fabric.kill("sim1");
        for i in 0..3u64 {
            s.hosts[0]
                .post_write(&WriteWr {
                    wr: WrId(i),
                    peer: p,
                    src: smr.slice(0, 8).unwrap(),
                    dst: remote(&dmr, 0),
                    imm: Some(1),
                })
                .unwrap();
        }
        s.hosts[0]
            .post_write(&WriteWr {
                wr: WrId(10),
                peer: p2,
                src: smr.slice(0, 8).unwrap(),
                dst: remote(&dmr2, 0),
                imm: None,
            })
            .unwrap();
        let mut out = s.outs();
        let mut rounds = 0;
        while writes(&out[0]).len() < 4 && rounds < 100_000 {
            let _ = s.hosts[0].poll(&mut out[0]);
            let _ = s.hosts[2].poll(&mut out[2]);
            s.fabric.step();
            rounds += 1;
        }
        for c in &out[0] {
            match c {
                Completion::Write {
                    wr: WrId(10),
                    result,
                } => assert!(result.is_ok(), "seed {seed}: other peers unaffected"),
                Completion::Write {
                    result: Err(TransportError::PeerUnreachable { .. }),
                    ..
                } => {}
                c => panic!("seed {seed}: {c:?}"),
            }
        }
        assert_eq!(writes(&out[0]).len(), 4);
        assert!(s.fabric.stats("sim0").retries >= 7);
        let e = s.hosts[0]
            .post_writes(&[WriteWr {
                wr: WrId(20),
                peer: p,
                src: smr.slice(0, 8).unwrap(),
                dst: remote(&dmr, 0),
                imm: None,
            }])
            .unwrap_err();
        assert_eq!(e.posted, 0);
        assert!(matches!(e.error, TransportError::PeerUnreachable { .. }));
    });
}

#[test]
fn qp_error_flushes_and_work_is_resent_on_a_new_connection() {
    with_seed(95, |seed| {
        let src = mem::zeroed(256);
        let dst = mem::zeroed(256);
        let mut s = Sim::new(seed, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let p = s.connect(0, 1, &smr, &dmr);
        src.put(0, &[3; 32]);
        let wrs: Vec<WriteWr> = (0..4u64)
            .map(|i| WriteWr {
                wr: WrId(i),
                peer: p,
                src: smr.slice(0, 8).unwrap(),
                dst: remote(&dmr, i * 8),
                imm: Some(i as u32),
            })
            .collect();
        assert_eq!(s.hosts[0].post_writes(&wrs).unwrap(), 4);
        // The local QPs die before anything executes: everything flushes.
        s.fabric.error_all_qps("sim0");
        let mut out = s.outs();
        assert!(
            s.run_until(50_000, &mut out, |o| writes(&o[0]).len() == 4
                && imms(&o[1]).len() == 4),
            "seed {seed}: {out:?}"
        );
        assert!(writes(&out[0]).iter().all(|(_, ok)| *ok));
        assert!(s.fabric.stats("sim0").flush_cqes >= 4);
        assert!(s.hosts[0].stats().requeued_ops >= 1);
        assert_eq!(dst.bytes(0, 32), vec![3; 32]);
    });
}

#[test]
fn send_longer_than_receive_buffer_fails_both_sides() {
    with_seed(100, |seed| {
        let src = mem::zeroed(256);
        let rbuf = mem::zeroed(256);
        let mut s = Sim::new(seed, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let rmr = s.reg(1, &rbuf, Access::LocalOnly);
        let p = s.peer(0, 1);
        s.hosts[1]
            .post_recv(WrId(5), rmr.slice(0, 16).unwrap())
            .unwrap();
        s.hosts[0]
            .post_send(WrId(1), p, smr.slice(0, 64).unwrap())
            .unwrap();
        let mut out = s.outs();
        assert!(s.run_until(50_000, &mut out, |o| !o[0].is_empty() && !o[1].is_empty()));
        assert!(
            matches!(
                out[0][0],
                Completion::Send {
                    wr: WrId(1),
                    result: Err(TransportError::MessageTooLong { len: 64, .. })
                }
            ),
            "seed {seed}: {out:?}"
        );
        assert!(
            matches!(
                out[1][0],
                Completion::Recv {
                    wr: WrId(5),
                    result: Err(TransportError::MessageTooLong { capacity: 16, .. }),
                    from: None,
                }
            ),
            "seed {seed}: {out:?}"
        );
    });
}

#[test]
fn local_errors_and_flow_control() {
    with_seed(110, |seed| {
        let src = mem::zeroed(256);
        let dst = mem::zeroed(256);
        let cfg = VerbsConfig {
            max_inflight: 3,
            ..sim_cfg()
        };
        let mut s = Sim::with(SimConfig::new(seed), cfg, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        let p = s.peer(0, 1);
        let mut bad = smr.slice(0, 8).unwrap();
        bad.len = 1000;
        let e = s.hosts[0].post_send(WrId(1), p, bad).unwrap_err();
        assert!(matches!(e, TransportError::LocalAccess { .. }));
        let wrs: Vec<WriteWr> = (0..5u64)
            .map(|i| WriteWr {
                wr: WrId(i),
                peer: p,
                src: smr.slice(0, 8).unwrap(),
                dst: remote(&dmr, 0),
                imm: None,
            })
            .collect();
        assert!(matches!(
            s.hosts[0].post_writes(&[WriteWr { peer: weft_transport::PeerId(77), ..wrs[0] }]),
            Err(e) if e.posted == 0 && matches!(e.error, TransportError::InvalidArgument { .. })
        ));
        assert_eq!(
            s.hosts[0].post_writes(&wrs).unwrap(),
            3,
            "short count at max_inflight"
        );
        assert!(matches!(
            s.hosts[0].post_write(&wrs[3]),
            Err(TransportError::QueueFull { .. })
        ));
        let mut out = s.outs();
        assert!(
            s.run_until(50_000, &mut out, |o| writes(&o[0]).len() == 3),
            "seed {seed}"
        );
        assert_eq!(s.hosts[0].post_writes(&wrs[3..]).unwrap(), 2);
        s.hosts[1].deregister(dmr.key).unwrap();
        assert!(s.hosts[1].deregister(dmr.key).is_err());
    });
}

#[test]
fn cq_depths_cover_every_outstanding_wr() {
    with_seed(120, |seed| {
        let cfg = VerbsConfig {
            hw_send_budget: 64,
            recv_pool: 32,
            imm_pool: 48,
            sq_depth: 16,
            max_inflight: 1000,
            ..sim_cfg()
        };
        let src = mem::zeroed(4096);
        let dst = mem::zeroed(4096);
        let mut s = Sim::with(SimConfig::new(seed), cfg, 5);
        let (scq, rcq) = s.hosts[0].cq_depths();
        assert!(scq >= 64 && rcq >= 32 + 48);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let mut dsts = Vec::new();
        for j in 1..5 {
            dsts.push(s.reg(j, &dst, Access::RemoteWrite));
        }
        // Far more work than the send CQ holds, to four peers, nobody
        // polling the sender for a while: the CQ must never overrun.
        let mut wrs = Vec::new();
        for k in 0..400u64 {
            let j = (k % 4) as usize;
            let p = s.peer(0, j + 1);
            wrs.push(WriteWr {
                wr: WrId(k),
                peer: p,
                src: smr.slice(0, 8).unwrap(),
                dst: remote(&dsts[j], 0),
                imm: Some(k as u32),
            });
        }
        let mut posted = 0;
        while posted < wrs.len() {
            posted += s.hosts[0].post_writes(&wrs[posted..]).unwrap();
        }
        for _ in 0..300 {
            s.fabric.step();
            for j in 1..5 {
                let mut o = Vec::new();
                s.hosts[j].poll(&mut o).unwrap();
            }
        }
        let mut out = s.outs();
        assert!(
            s.run_until(200_000, &mut out, |o| writes(&o[0]).len() == 400),
            "seed {seed}: {} {:?} {:?}",
            writes(&out[0]).len(),
            out[0].last(),
            s.hosts[0].stats()
        );
        assert!(
            writes(&out[0]).iter().all(|(_, ok)| *ok),
            "seed {seed}: {:?}",
            out[0]
                .iter()
                .find(|c| matches!(c, Completion::Write { result: Err(_), .. }))
        );
    });
}

#[test]
fn sim_qp_state_machine_rejects_invalid_transitions() {
    let f = SimFabric::new(SimConfig::new(1));
    let mut d = f.add_device("x").open(0).unwrap();
    let pd = d.alloc_pd().unwrap();
    let cq = d.create_cq(4).unwrap();
    let init = QpInit {
        qp_type: QpType::Rc,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        max_send_wr: 4,
        max_recv_wr: 4,
        max_sge: 1,
    };
    let qp = d.create_qp(pd, &init).unwrap().qp;
    let ah = AhAttr {
        dlid: 1,
        is_global: true,
        dgid: Gid::default(),
        sgid_index: 0,
        hop_limit: 1,
        traffic_class: 0,
        sl: 0,
        port: 1,
    };
    let rtr = ModifyQp::RtrRc {
        path_mtu: 5,
        dest_qpn: 1,
        rq_psn: 0,
        ah,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 1,
    };
    let rts = ModifyQp::Rts {
        sq_psn: 0,
        timeout: 1,
        retry_cnt: 1,
        rnr_retry: 1,
        max_rd_atomic: 1,
        rc: true,
    };
    assert_eq!(d.modify_qp(qp, &rtr).unwrap_err().code, 22, "RESET->RTR");
    assert_eq!(d.modify_qp(qp, &rts).unwrap_err().code, 22, "RESET->RTS");
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sge: None,
        signaled: true,
    };
    assert_eq!(
        d.post_send(qp, &[wr]).unwrap_err().bad_index,
        0,
        "post in RESET"
    );
    d.modify_qp(
        qp,
        &ModifyQp::Init {
            port: 1,
            pkey_index: 0,
            access: 0,
            qkey: None,
        },
    )
    .unwrap();
    assert!(
        d.modify_qp(qp, &ModifyQp::RtrUd).is_err(),
        "UD transition on RC"
    );
    assert!(d.modify_qp(qp, &rts).is_err(), "INIT->RTS");
    assert!(d.post_send(qp, &[wr]).is_err(), "post in INIT");
    d.modify_qp(qp, &rtr).unwrap();
    assert!(d.modify_qp(qp, &rtr).is_err(), "RTR->RTR");
    d.modify_qp(qp, &rts).unwrap();
    // Post in RTS works; move to ERR: posted WRs flush.
    d.post_send(qp, &[wr, wr]).unwrap();
    d.modify_qp(qp, &ModifyQp::Err).unwrap();
    assert!(d.modify_qp(qp, &rtr).is_err(), "ERR->RTR");
    let mut wcs = Vec::new();
    d.poll_cq(cq, 16, &mut wcs).unwrap();
    assert_eq!(wcs.len(), 2);
    assert!(wcs.iter().all(|w| w.status == WcStatus::WrFlushErr));
    d.modify_qp(qp, &ModifyQp::Reset).unwrap();
    d.modify_qp(
        qp,
        &ModifyQp::Init {
            port: 1,
            pkey_index: 0,
            access: 0,
            qkey: None,
        },
    )
    .unwrap();
    // SQ depth: the 5th WR of a chain is the bad_wr.
    assert!(d.destroy_cq(cq).is_err(), "CQ in use");
    d.destroy_qp(qp).unwrap();
    d.destroy_cq(cq).unwrap();
}

#[test]
fn sim_detects_cq_overrun() {
    let f = SimFabric::new(SimConfig::new(2));
    let mut d = f.add_device("x").open(0).unwrap();
    let pd = d.alloc_pd().unwrap();
    let cq = d.create_cq(2).unwrap();
    let qp = d
        .create_qp(
            pd,
            &QpInit {
                qp_type: QpType::Rc,
                send_cq: cq,
                recv_cq: cq,
                srq: None,
                max_send_wr: 8,
                max_recv_wr: 8,
                max_sge: 1,
            },
        )
        .unwrap()
        .qp;
    let wr = RecvWr {
        wr_id: 1,
        sge: None,
    };
    d.modify_qp(
        qp,
        &ModifyQp::Init {
            port: 1,
            pkey_index: 0,
            access: 0,
            qkey: None,
        },
    )
    .unwrap();
    d.post_recv(qp, &[wr, wr, wr]).unwrap();
    let full = d.post_recv(qp, &[wr; 6]).unwrap_err();
    assert_eq!(full.bad_index, 5, "receive queue of 8 holds 5 more");
    d.modify_qp(qp, &ModifyQp::Err).unwrap();
    let mut wcs = Vec::new();
    let e = d.poll_cq(cq, 16, &mut wcs).unwrap_err();
    assert_eq!(e.code, 75, "EOVERFLOW: 8 flushes into a CQ of 2");
}

#[test]
fn gid_selection_prefers_roce_v2_and_honours_configuration() {
    with_seed(130, |seed| {
        let s = Sim::new(seed, 1);
        assert_eq!(s.hosts[0].gid_index(), 3, "IPv4-mapped RoCE v2 GID");
        assert_eq!(s.hosts[0].mtu(), 4096);
        let cfg = VerbsConfig {
            gid_index: Some(1),
            ..sim_cfg()
        };
        let s = Sim::with(SimConfig::new(seed), cfg, 1);
        assert_eq!(s.hosts[0].gid_index(), 1);
        let f = SimFabric::new(SimConfig::new(seed));
        let lib = f.add_device("y");
        let cfg = VerbsConfig {
            gid_index: Some(9),
            ..sim_cfg()
        };
        assert!(
            VerbsDomain::open(lib.open(0).unwrap(), cfg, None).is_err(),
            "missing GID index"
        );
        let mut sc = SimConfig::new(seed);
        sc.link_layer = LinkLayer::InfiniBand;
        sc.active_mtu = 4;
        let s = Sim::with(sc, sim_cfg(), 2);
        assert_eq!(s.hosts[0].gid_index(), 0, "IB GID");
        assert_eq!(s.hosts[0].mtu(), 2048);
    });
}

#[test]
fn ib_link_layer_connects_by_lid() {
    with_seed(140, |seed| {
        let mut sc = SimConfig::new(seed);
        sc.link_layer = LinkLayer::InfiniBand;
        let src = mem::zeroed(64);
        let dst = mem::zeroed(64);
        let mut s = Sim::with(sc, sim_cfg(), 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        s.connect(0, 1, &smr, &dmr);
    });
}

#[test]
fn gpu_memory_is_unsupported_on_the_sim() {
    with_seed(150, |seed| {
        let mut s = Sim::new(seed, 1);
        assert!(!s.hosts[0].capabilities().device_memory);
        let b = mem::zeroed(64);
        // SAFETY: never dereferenced: registration is refused.
        let r = unsafe {
            weft_transport::MemRegion::new(b.region().ptr(), 64, weft_transport::Device::Cuda(0))
        };
        assert!(matches!(
            s.hosts[0].register(&r, Access::RemoteWrite),
            Err(TransportError::Unsupported { .. })
        ));
    });
}

/// A raw UD sender on a simulated fabric: sends any bytes to a verbs
/// domain's handshake QP, as anyone with the weft Q_Key could.
struct RawUd {
    dev: weft_verbs::sim::SimDevice,
    qp: Qp,
    cq: Cq,
    ah: Ah,
    lkey: u32,
    /// `SEND_SLOTS` send slots of `SEND_SLOT` bytes, then a receive buffer
    /// at `RECV_OFF`.
    buf: HostBuffer,
    target: weft_verbs::wire::VerbsAddr,
    /// This sender's own address (its GID and UD QPN).
    own: weft_verbs::wire::VerbsAddr,
    sent: u64,
}

/// Where [`RawUd`]'s receive buffer starts in its `buf`.
const RECV_OFF: u64 = SEND_SLOT * SEND_SLOTS;
/// Bytes of one of [`RawUd`]'s send slots (a datagram of at most 200).
const SEND_SLOT: u64 = 256;
/// [`RawUd`]'s send slots: as many as its send queue holds, so every send
/// in flight has bytes of its own.
const SEND_SLOTS: u64 = 16;
/// Size of [`RawUd`]'s buffer.
const RAW_BUF: u64 = RECV_OFF + 256;
/// Work request id of [`RawUd`]'s receive.
const RECV_ID: u64 = 1 << 40;

impl RawUd {
    fn new(s: &Sim, to: usize) -> Self {
        let target = weft_verbs::wire::VerbsAddr::decode(&s.addr(to).0).unwrap();
        let buf = mem::zeroed(RAW_BUF as usize);
        let mut dev = s.fabric.add_device("raw").open(0).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(64).unwrap();
        let created = dev
            .create_qp(
                pd,
                &QpInit {
                    qp_type: QpType::Ud,
                    send_cq: cq,
                    recv_cq: cq,
                    srq: None,
                    max_send_wr: SEND_SLOTS as u32,
                    max_recv_wr: 1,
                    max_sge: 1,
                },
            )
            .unwrap();
        let qp = created.qp;
        let own = weft_verbs::wire::VerbsAddr {
            gid: dev.query_gid(1, 3).unwrap().gid,
            lid: 0,
            ud_qpn: created.qpn,
        };
        dev.modify_qp(
            qp,
            &ModifyQp::Init {
                port: 1,
                pkey_index: 0,
                access: 0,
                qkey: Some(weft_verbs::WEFT_QKEY),
            },
        )
        .unwrap();
        dev.modify_qp(qp, &ModifyQp::RtrUd).unwrap();
        dev.modify_qp(
            qp,
            &ModifyQp::Rts {
                sq_psn: 0,
                timeout: 0,
                retry_cnt: 0,
                rnr_retry: 0,
                max_rd_atomic: 0,
                rc: false,
            },
        )
        .unwrap();
        let (_, lkey, _) = dev
            .reg_mr(pd, buf.region().addr(), RAW_BUF, access::LOCAL_WRITE)
            .unwrap();
        let ah = dev
            .create_ah(
                pd,
                &AhAttr {
                    dlid: 0,
                    is_global: true,
                    dgid: target.gid,
                    sgid_index: 3,
                    hop_limit: 64,
                    traffic_class: 0,
                    sl: 0,
                    port: 1,
                },
            )
            .unwrap();
        Self {
            dev,
            qp,
            cq,
            ah,
            lkey,
            buf,
            target,
            own,
            sent: 0,
        }
    }

    /// Posts the one receive buffer (a datagram plus its 40-byte GRH).
    fn post_recv(&mut self) {
        let wr = RecvWr {
            wr_id: RECV_ID,
            sge: Some(Sge {
                addr: self.buf.region().addr() + RECV_OFF,
                length: 256,
                lkey: self.lkey,
            }),
        };
        self.dev.post_recv(self.qp, &[wr]).unwrap();
    }

    /// The handshake received, if one arrived (its send completions are
    /// reaped on the way).
    fn take_handshake(&mut self) -> Option<weft_verbs::wire::Handshake> {
        let mut wcs = Vec::new();
        self.dev.poll_cq(self.cq, 64, &mut wcs).unwrap();
        let wc = wcs.iter().find(|w| w.wr_id == RECV_ID)?;
        assert_eq!(wc.status, WcStatus::Success);
        let len = wc.byte_len as usize - 40;
        let b = self.buf.bytes(RECV_OFF as usize + 40, len);
        Some(weft_verbs::wire::Handshake::decode(&b).unwrap())
    }

    /// Sends [`hello`] from this sender's own address, with made-up QPs
    /// `k`.
    fn send_hello(&mut self, k: u32) {
        let h = hello(self.own, k).encode();
        self.send(&h);
    }

    /// Sends `bytes` (at most 200) as one datagram, staged in a send slot
    /// of its own (up to `SEND_SLOTS` sends between fabric rounds); its
    /// send completion is reaped, so any number can be sent.
    fn send(&mut self, bytes: &[u8]) {
        let at = (self.sent % SEND_SLOTS) * SEND_SLOT;
        self.buf.put(at as usize, bytes);
        let len = bytes.len() as u32;
        let wr = SendWr {
            wr_id: self.sent,
            op: SendOp::UdSend {
                ah: self.ah,
                remote_qpn: self.target.ud_qpn,
                remote_qkey: weft_verbs::WEFT_QKEY,
            },
            sge: (len > 0).then_some(Sge {
                addr: self.buf.region().addr() + at,
                length: len,
                lkey: self.lkey,
            }),
            signaled: true,
        };
        self.dev.post_send(self.qp, &[wr]).unwrap();
        self.sent += 1;
    }
}

#[test]
fn malformed_handshake_datagrams_are_dropped() {
    with_seed(160, |seed| {
        let src = mem::zeroed(64);
        let dst = mem::zeroed(64);
        let mut s = Sim::new(seed, 2);
        let mut raw = RawUd::new(&s, 1);
        assert!(
            weft_verbs::wire::Handshake::decode(&[0; weft_verbs::wire::HANDSHAKE_LEN]).is_err(),
            "all-zero bytes are not a handshake"
        );
        let hl = weft_verbs::wire::HANDSHAKE_LEN;
        for (k, len) in [0usize, 1, 5, hl - 1, hl, hl + 1, 200]
            .into_iter()
            .enumerate()
        {
            raw.send(&[k as u8 ^ 0x5a; 200][..len]);
            let mut out = s.outs();
            s.round(&mut out);
        }
        let mut out = s.outs();
        for _ in 0..200 {
            s.round(&mut out);
        }
        assert_eq!(s.hosts[1].stats().handshakes_malformed, 7, "seed {seed}");
        assert_eq!(s.hosts[1].stats().handshakes_received, 0);
        // Still fully usable.
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        s.connect(0, 1, &smr, &dmr);
    });
}

/// A made-up address `k`, nobody's.
fn made_up(k: u32) -> weft_verbs::wire::VerbsAddr {
    let mut gid = [0xfe; 16];
    gid[12..].copy_from_slice(&k.to_be_bytes());
    weft_verbs::wire::VerbsAddr {
        gid: Gid(gid),
        lid: 0,
        ud_qpn: 7000 + k,
    }
}

/// A well-formed first handshake claiming to come from `from`, with
/// made-up QPs `k`.
fn hello(from: weft_verbs::wire::VerbsAddr, k: u32) -> weft_verbs::wire::Handshake {
    weft_verbs::wire::Handshake {
        from,
        qps: weft_verbs::wire::QpPair {
            send_qpn: 9000 + 2 * k,
            write_qpn: 9001 + 2 * k,
            send_psn: k,
            write_psn: k,
        },
        peer_send_qpn: 0,
        peer_write_qpn: 0,
        peer_send_psn: 0,
        peer_write_psn: 0,
        ready: false,
        ack: false,
        mtu: 3,
    }
}

#[test]
fn forged_handshakes_hold_at_most_max_half_open_peers() {
    with_seed(165, |seed| {
        let src = mem::zeroed(64);
        let dst = mem::zeroed(64);
        let mut cfg = sim_cfg();
        cfg.max_half_open = 4;
        let mut s = Sim::with(SimConfig::new(seed), cfg.clone(), 2);
        let name = s.names[1].clone();
        // Forty senders, each with an address of its own (a handshake must
        // come from the address it claims), none of which will answer.
        let mut raws: Vec<RawUd> = (0..40).map(|_| RawUd::new(&s, 1)).collect();
        let mut out = s.outs();
        // Ten of them: four get QPs, six are refused while those four are
        // still retransmitting.
        for (k, raw) in raws.iter_mut().enumerate().take(10) {
            raw.send_hello(k as u32);
            s.round(&mut out);
        }
        let st = s.hosts[1].stats();
        assert_eq!(st.handshakes_received, 10, "seed {seed}");
        assert_eq!(st.handshakes_refused, 6, "seed {seed}");
        assert_eq!(
            s.fabric.rc_qps(&name),
            8,
            "seed {seed}: two QPs per half-open peer"
        );
        // Their retransmissions run out (tries x timeout of simulated time).
        let spent = cfg.handshake_tries as u64 * cfg.handshake_timeout_ns / 1_000 + 10;
        for _ in 0..spent {
            s.round(&mut out);
        }
        // Ten more: each of the first four evicts a spent one, the rest are
        // refused; the QPs stay bounded.
        for (k, raw) in raws.iter_mut().enumerate().take(20).skip(10) {
            raw.send_hello(k as u32);
            s.round(&mut out);
        }
        let st = s.hosts[1].stats();
        assert_eq!(st.half_open_evicted, 4, "seed {seed}");
        assert_eq!(st.handshakes_refused, 12, "seed {seed}");
        assert_eq!(s.fabric.rc_qps(&name), 8, "seed {seed}");
        assert_eq!(st.connects, 0, "seed {seed}");
        assert_eq!(s.hosts[1].half_open_peers(), 4, "seed {seed}");
        // A real peer gets in once a forged one is spent: one of them is
        // evicted for it.
        for _ in 0..spent {
            s.round(&mut out);
        }
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        s.connect(0, 1, &smr, &dmr);
        let st = s.hosts[1].stats();
        assert_eq!((st.connects, st.half_open_evicted), (1, 5), "seed {seed}");
        // Connected, it is no longer half-open ...
        assert_eq!(s.hosts[1].half_open_peers(), 3, "seed {seed}");
        assert_eq!(s.fabric.rc_qps(&name), 8, "seed {seed}");
        // ... so a later flood cannot evict it: it takes the free place and
        // the three spent ones, then is refused; writes keep working.
        for _ in 0..spent {
            s.round(&mut out);
        }
        for (k, raw) in raws.iter_mut().enumerate().take(40).skip(20) {
            raw.send_hello(k as u32);
            s.round(&mut out);
        }
        let st = s.hosts[1].stats();
        assert_eq!(s.hosts[1].half_open_peers(), 4, "seed {seed}");
        assert_eq!(
            (st.half_open_evicted, st.handshakes_refused),
            (8, 28),
            "seed {seed}"
        );
        assert_eq!(
            s.fabric.rc_qps(&name),
            10,
            "seed {seed}: 4 half-open peers and the real one"
        );
        src.put(0, &[0xab; 8]);
        let p = s.peer(0, 1);
        let wr = WriteWr {
            wr: WrId(5),
            peer: p,
            src: smr.slice(0, 8).unwrap(),
            dst: remote(&dmr, 8),
            imm: None,
        };
        s.hosts[0].post_write(&wr).unwrap();
        let mut out = s.outs();
        assert!(
            s.run_until(10_000, &mut out, |o| writes(&o[0])
                .contains(&(WrId(5), true))),
            "seed {seed}: write after the flood: {out:?}"
        );
        assert_eq!(dst.bytes(8, 8), vec![0xab; 8]);
    });
}

/// A handshake is taken only from the address it claims (the device
/// reports the sending QPN and, in the GRH, the sending GID): one claiming
/// a made-up address makes no peer and no QPs, and one claiming a
/// connected peer's address with other QPs does not retire that peer's
/// connection; writes keep flowing.
#[test]
fn handshakes_claiming_another_address_are_dropped() {
    with_seed(167, |seed| {
        let src = mem::zeroed(64);
        let dst = mem::zeroed(64);
        let mut s = Sim::new(seed, 2);
        let name = s.names[1].clone();
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(1, &dst, Access::RemoteWrite);
        s.connect(0, 1, &smr, &dmr);
        let before = s.hosts[1].stats().clone();
        let qps = s.fabric.rc_qps(&name);
        let mut raw = RawUd::new(&s, 1);
        let mut out = s.outs();
        // Made-up addresses, and host 0's address (its real GID and UD
        // QPN) with other QPs, ready, as a restarted host 0 would say.
        let host0 = weft_verbs::wire::VerbsAddr::decode(&s.addr(0).0).unwrap();
        for k in 0..5 {
            raw.send(&hello(made_up(k), k).encode());
            s.round(&mut out);
        }
        let mut claim = hello(host0, 9);
        claim.ready = true;
        raw.send(&claim.encode());
        // Its own GID with another QPN (host 0's) is not its address ...
        raw.send(
            &hello(
                weft_verbs::wire::VerbsAddr {
                    ud_qpn: host0.ud_qpn,
                    ..raw.own
                },
                11,
            )
            .encode(),
        );
        // ... nor is its own QPN with host 0's GID.
        raw.send(
            &hello(
                weft_verbs::wire::VerbsAddr {
                    ud_qpn: raw.own.ud_qpn,
                    ..host0
                },
                10,
            )
            .encode(),
        );
        for _ in 0..50 {
            s.round(&mut out);
        }
        let st = s.hosts[1].stats();
        assert_eq!(st.handshakes_spoofed, 8, "seed {seed}");
        assert_eq!(
            st.handshakes_received, before.handshakes_received,
            "seed {seed}"
        );
        assert_eq!(
            st.resets, before.resets,
            "seed {seed}: the real connection was retired"
        );
        assert_eq!(s.hosts[1].half_open_peers(), 0, "seed {seed}");
        assert_eq!(s.fabric.rc_qps(&name), qps, "seed {seed}: QPs for a claim");
        // The real connection still carries writes.
        src.put(0, &[0x5c; 8]);
        let p = s.peer(0, 1);
        s.hosts[0]
            .post_write(&WriteWr {
                wr: WrId(9),
                peer: p,
                src: smr.slice(0, 8).unwrap(),
                dst: remote(&dmr, 0),
                imm: None,
            })
            .unwrap();
        let mut out = s.outs();
        assert!(
            s.run_until(10_000, &mut out, |o| writes(&o[0])
                .contains(&(WrId(9), true))),
            "seed {seed}: write after the claims: {out:?}"
        );
        assert_eq!(dst.bytes(0, 8), vec![0x5c; 8]);
        // The same sender, claiming its own address, is heard.
        raw.send_hello(11);
        for _ in 0..5 {
            s.round(&mut out);
        }
        assert_eq!(s.hosts[1].half_open_peers(), 1, "seed {seed}");
        assert_eq!(s.hosts[1].stats().handshakes_spoofed, 8, "seed {seed}");
    });
}

/// Connecting takes the target's random PSNs echoed back, not only its
/// QPNs: a sender that does not read the answers sent to its address and
/// guesses the QPNs the target gives it (sequential here: learnt from a
/// first, honest exchange) and says `ready` stays half-open.
#[test]
fn a_forged_handshake_that_guesses_qpns_cannot_connect() {
    with_seed(168, |seed| {
        let mut s = Sim::new(seed, 1);
        let mut raw = RawUd::new(&s, 0);
        // The second sender's UD QP is made now: QPNs come from one
        // counter, so the target's next QPNs follow its first ones.
        let mut blind = RawUd::new(&s, 0);
        let mut out = s.outs();
        // Honest first contact from the raw sender's own address: the
        // target answers with its QPNs and PSNs.
        raw.post_recv();
        raw.send_hello(0);
        let mut answer = None;
        for _ in 0..50 {
            s.round(&mut out);
            if let Some(h) = raw.take_handshake() {
                answer = Some(h);
                break;
            }
        }
        let a = answer.unwrap_or_else(|| panic!("seed {seed}: no answer"));
        assert_eq!(s.hosts[0].half_open_peers(), 1, "seed {seed}");
        // Now a second sender, which never reads the answers to its
        // address, ready, naming the QPNs the target will create next, but
        // not its PSNs.
        let name = s.names[0].clone();
        let qps = s.fabric.rc_qps(&name);
        let mut forged = hello(blind.own, 1);
        forged.ready = true;
        forged.peer_send_qpn = a.qps.write_qpn + 1;
        forged.peer_write_qpn = a.qps.write_qpn + 2;
        blind.send(&forged.encode());
        for _ in 0..20 {
            s.round(&mut out);
        }
        assert_eq!(s.fabric.rc_qps(&name), qps + 2, "seed {seed}");
        // The guess was right: the target answered with those QPNs.
        blind.post_recv();
        let mut answer = None;
        for _ in 0..200 {
            s.round(&mut out);
            if let Some(h) = blind.take_handshake() {
                answer = Some(h);
                break;
            }
        }
        let b = answer.unwrap_or_else(|| panic!("seed {seed}: no retransmitted answer"));
        assert_eq!(
            (b.qps.send_qpn, b.qps.write_qpn),
            (forged.peer_send_qpn, forged.peer_write_qpn),
            "seed {seed}: the QPNs were not guessed right, so this test would not test the PSNs"
        );
        let st = s.hosts[0].stats();
        assert_eq!(st.handshakes_received, 2, "seed {seed}");
        assert_eq!(
            st.connects, 0,
            "seed {seed}: a guessed connection completed"
        );
        assert_eq!(s.hosts[0].half_open_peers(), 2, "seed {seed}");
    });
}

#[test]
fn a_domain_can_write_to_itself() {
    with_seed(170, |seed| {
        let src = mem::zeroed(64);
        let dst = mem::zeroed(64);
        let mut s = Sim::new(seed, 1);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let dmr = s.reg(0, &dst, Access::RemoteWrite);
        src.put(0, b"self");
        let p = s.peer(0, 0);
        s.hosts[0]
            .post_write(&WriteWr {
                wr: WrId(1),
                peer: p,
                src: smr.slice(0, 4).unwrap(),
                dst: remote(&dmr, 0),
                imm: Some(3),
            })
            .unwrap();
        let mut out = s.outs();
        assert!(
            s.run_until(20_000, &mut out, |o| writes(&o[0]).len() == 1
                && imms(&o[0]).len() == 1),
            "seed {seed}: {out:?}"
        );
        assert_eq!(writes(&out[0]), vec![(WrId(1), true)]);
        assert_eq!(dst.bytes(0, 4), b"self");
    });
}
