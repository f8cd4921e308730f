//! Polled receive pools (`TransferEngine::recv_queue`): every message once,
//! intact, from several senders over the adversarial fabric; the backlog
//! bound with messages held by the caller; a dropped queue that keeps
//! peers' SENDs completing; a sleeping receiver woken by a late message and
//! by shutdown. Each message names the engine that sent it, to a polled
//! queue and to a receive callback (`submit_recvs_from`).

use crate::common::*;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use weft_engine::{DoneCounter, EngineError, OnDone, RecvMsg};
use weft_loopback::{Fabric, FabricConfig};

/// A message `seq` from sender `s`: `[s, seq (4 bytes LE), pattern...]`.
fn message(s: u8, seq: u32, len: usize) -> Vec<u8> {
    let mut m = vec![s];
    m.extend_from_slice(&seq.to_le_bytes());
    m.extend((5..len).map(|i| pattern_byte(u64::from(seq) ^ u64::from(s), i as u64)));
    m
}

/// Checks a received message against [`message`]; its (sender, seq).
fn check(m: &[u8]) -> Result<(u8, u32), String> {
    if m.len() < 5 {
        return Err(format!("short message of {} bytes", m.len()));
    }
    let (s, seq) = (m[0], u32::from_le_bytes([m[1], m[2], m[3], m[4]]));
    if m != message(s, seq, m.len()).as_slice() {
        return Err(format!("bad bytes in message {s}/{seq}"));
    }
    Ok((s, seq))
}

#[test]
fn polled_messages_arrive_once_and_intact_from_several_senders() {
    for seed in seeds_or([5, 6, 7]) {
        let _g = SeedGuard::new(
            seed,
            "polled_messages_arrive_once_and_intact_from_several_senders",
        );
        // 600 SENDs at once into 16 buffers: senders wait for buffers
        // longer than the adversarial profile's RNR timeout would allow.
        let fabric = Fabric::new_realtime(FabricConfig {
            rnr_timeout: Duration::from_secs(60),
            ..FabricConfig::adversarial(seed)
        });
        let rx = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
        let q = rx.recv_queue(2048, 16).unwrap();
        assert_eq!(q.max_message(), 2048);
        let senders: Vec<_> = (0..3)
            .map(|_| engine(&fabric, fabric.add_host(1), 1, test_config(), false))
            .collect();
        let per = 200u32;
        let sent = Arc::new(DoneCounter::new());
        let to = rx.main_address();
        let mut rng = weft_testkit::seed::rng(seed);
        for seq in 0..per {
            for (s, e) in senders.iter().enumerate() {
                let len = 5 + (rand::Rng::gen_range(&mut rng, 0..2044usize));
                e.submit_send(&to, &message(s as u8, seq, len), OnDone::counter(&sent))
                    .unwrap();
            }
        }
        let total = 3 * per as usize;
        let addrs: Vec<_> = senders.iter().map(|e| e.main_address()).collect();
        let mut got = BTreeSet::new();
        while got.len() < total {
            match q.recv_timeout(HANG) {
                Some(Ok(m)) => {
                    let key = check(&m).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
                    // The message names its sender, and only that one.
                    let from = m.sender().expect("a sender");
                    assert_eq!(from.incarnation, addrs[key.0 as usize].incarnation);
                    for (s, a) in addrs.iter().enumerate() {
                        assert_eq!(
                            m.is_from(a),
                            s == key.0 as usize,
                            "seed {seed}: message {key:?} is_from sender {s}"
                        );
                    }
                    assert!(got.insert(key), "seed {seed}: duplicate message {key:?}");
                }
                Some(Err(e)) => panic!("seed {seed}: receive error {e}"),
                None => panic!(
                    "seed {seed}: {} of {total} messages arrived; sends: {} done, {} failed ({:?})",
                    got.len(),
                    sent.total(),
                    sent.failed(),
                    sent.first_error()
                ),
            }
        }
        wait_until("sends complete", HANG, || sent.total() == total as u64);
        assert_eq!(sent.failed(), 0, "seed {seed}: {:?}", sent.first_error());
        assert!(q.try_recv().is_none(), "seed {seed}: a message too many");
        for e in senders {
            e.shutdown();
        }
        rx.shutdown();
    }
}

/// Messages the caller holds count against `recv_backlog_bytes` as queued
/// ones do: with both at the bound, peers' SENDs wait; dropping the held
/// messages lets the rest in, each once.
#[test]
fn held_messages_bound_the_backlog() {
    for seed in seeds_or([82]) {
        let _g = SeedGuard::new(seed, "held_messages_bound_the_backlog");
        let fabric = Fabric::new_realtime(FabricConfig {
            rnr_timeout: Duration::from_secs(60),
            ..FabricConfig::ideal(seed)
        });
        let mut cfg = test_config();
        cfg.recv_backlog_bytes = 3 * 64;
        let rx = engine(&fabric, fabric.add_host(1), 1, cfg, false);
        let tx = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
        let q = rx.recv_queue(64, 2).unwrap();
        let sent = Arc::new(DoneCounter::new());
        let to = rx.main_address();
        let n = 12u32;
        for seq in 0..n {
            tx.submit_send(&to, &message(0, seq, 16), OnDone::counter(&sent))
                .unwrap();
        }
        // Two buffers, a bound of three messages out: four are copied out
        // and queued before both buffers are held back; the rest wait.
        wait_until("four SENDs delivered", HANG, || sent.total() >= 4);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            sent.total(),
            4,
            "seed {seed}: SENDs kept landing past the bound"
        );
        // Taking messages out of the queue but holding them frees nothing.
        let held: Vec<RecvMsg> = (0..3).map(|_| q.try_recv().unwrap().unwrap()).collect();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(sent.total(), 4, "seed {seed}: held messages did not count");
        let mut got: BTreeSet<u32> = held.iter().map(|m| check(m).unwrap().1).collect();
        drop(held);
        while got.len() < n as usize {
            let m = q.recv_timeout(HANG).expect("a message").expect("no error");
            assert!(got.insert(check(&m).unwrap().1), "seed {seed}: duplicate");
        }
        wait_until("all sent", HANG, || sent.total() == u64::from(n));
        assert_eq!(sent.failed(), 0, "{:?}", sent.first_error());
        tx.shutdown();
        rx.shutdown();
    }
}

/// Dropping the queue discards what it held and everything after, and the
/// buffers keep serving peers: their SENDs all complete.
#[test]
fn a_dropped_queue_discards_and_peers_still_complete() {
    // The held first message keeps the pool at its bound between discards,
    // so a SEND may wait a moment for a buffer: longer than the ideal
    // profile's RNR timeout on a loaded machine.
    let fabric = Fabric::new_realtime(FabricConfig {
        rnr_timeout: Duration::from_secs(60),
        ..FabricConfig::ideal(83)
    });
    let mut cfg = test_config();
    cfg.recv_backlog_bytes = 2 * 64;
    let rx = engine(&fabric, fabric.add_host(1), 1, cfg, false);
    let tx = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
    let q = rx.recv_queue(64, 2).unwrap();
    let sent = Arc::new(DoneCounter::new());
    let to = rx.main_address();
    tx.submit_send(&to, &message(0, 0, 8), OnDone::counter(&sent))
        .unwrap();
    let first = q.recv_timeout(HANG).expect("first").expect("no error");
    drop(q);
    for seq in 1..40 {
        tx.submit_send(&to, &message(0, seq, 8), OnDone::counter(&sent))
            .unwrap();
    }
    wait_until("all sent", HANG, || sent.total() == 40);
    assert_eq!(sent.failed(), 0, "{:?}", sent.first_error());
    assert_eq!(
        check(&first).unwrap(),
        (0, 0),
        "a held message outlives its queue"
    );
    drop(first);
    tx.shutdown();
    rx.shutdown();
}

/// A receiver asleep in `recv_timeout` is woken by a message sent after it
/// went to sleep, and by its engine's shutdown; a short timeout with
/// nothing sent returns `None`.
#[test]
fn recv_timeout_wakes_for_a_late_message_and_for_shutdown() {
    let fabric = Fabric::new_realtime(FabricConfig::ideal(84));
    let rx = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
    let tx = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
    let q = Arc::new(rx.recv_queue(64, 4).unwrap());
    assert!(q.recv_timeout(Duration::from_millis(20)).is_none());
    let q2 = Arc::clone(&q);
    let waiter = std::thread::spawn(move || q2.recv_timeout(HANG).map(|r| r.map(|m| m.to_vec())));
    std::thread::sleep(Duration::from_millis(100));
    tx.submit_send(&rx.main_address(), b"late", OnDone::Ignore)
        .unwrap();
    let got = waiter.join().unwrap();
    assert_eq!(got.expect("woken").expect("no error"), b"late");
    let q2 = Arc::clone(&q);
    let waiter = std::thread::spawn(move || q2.recv_timeout(HANG).map(|r| r.map(|m| m.len())));
    std::thread::sleep(Duration::from_millis(100));
    rx.shutdown();
    assert!(
        matches!(waiter.join().unwrap(), Some(Err(EngineError::ShutDown))),
        "a sleeping receiver learns of the shutdown"
    );
    tx.shutdown();
}

/// A receive callback registered with `submit_recvs_from` is told who sent
/// each message: every message from two senders over the adversarial
/// fabric names its own sender, and only that one.
#[test]
fn receive_callbacks_are_told_the_sender() {
    for seed in seeds_or([8, 9]) {
        let _g = SeedGuard::new(seed, "receive_callbacks_are_told_the_sender");
        let fabric = Fabric::new_realtime(FabricConfig {
            rnr_timeout: Duration::from_secs(60),
            ..FabricConfig::adversarial(seed)
        });
        let rx = engine(&fabric, fabric.add_host(1), 1, test_config(), false);
        let senders: Vec<_> = (0..2)
            .map(|_| engine(&fabric, fabric.add_host(1), 1, test_config(), false))
            .collect();
        let addrs: Vec<_> = senders.iter().map(|e| e.main_address()).collect();
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let (s2, a2) = (seen.clone(), addrs.clone());
        rx.submit_recvs_from(256, 8, move |r| {
            let entry = match r {
                Ok((m, from)) => check(m).map(|key| {
                    let named: Vec<bool> =
                        a2.iter().map(|a| from.is_some_and(|f| f.is(a))).collect();
                    (key, named)
                }),
                Err(e) => Err(e.to_string()),
            };
            s2.lock().push(entry);
        })
        .unwrap();
        let to = rx.main_address();
        let sent = Arc::new(DoneCounter::new());
        let per = 50u32;
        for seq in 0..per {
            for (s, e) in senders.iter().enumerate() {
                e.submit_send(&to, &message(s as u8, seq, 64), OnDone::counter(&sent))
                    .unwrap();
            }
        }
        let total = 2 * per as usize;
        wait_until("messages arrive", HANG, || seen.lock().len() >= total);
        let mut got = BTreeSet::new();
        for entry in seen.lock().drain(..) {
            let (key, named) = entry.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            let want: Vec<bool> = (0..2).map(|s| s == key.0 as usize).collect();
            assert_eq!(
                named, want,
                "seed {seed}: message {key:?} names its sender only"
            );
            assert!(got.insert(key), "seed {seed}: duplicate message {key:?}");
        }
        assert_eq!(got.len(), total, "seed {seed}");
        wait_until("sends complete", HANG, || sent.total() == total as u64);
        assert_eq!(sent.failed(), 0, "seed {seed}: {:?}", sent.first_error());
        for e in senders {
            e.shutdown();
        }
        rx.shutdown();
    }
}
