//! Peer removal at the libfabric domain, in one process, over tcp (on
//! `lo`) and shm: a peer domain that goes away is removed and replaced by a
//! new one (a restart: a new address), 20 times; every incarnation gets a
//! verified write with one immediate, and after each removal the domain's
//! peer table is back to its baseline, and so is the address vector on tcp
//! (the removed peer's AV entry is `fi_av_remove`d once nothing uses it;
//! shm keeps its entries: removing one crashes shm 1.17). On shm the
//! domain writes to each peer on an endpoint of its own (a region in
//! `/dev/shm`), closed once the peer is removed: open per-peer endpoints
//! and this process's regions in `/dev/shm` are back to their baseline
//! after every removal (tcp opens none). The shm loop runs in a child
//! process of its own, so the count is not disturbed by the binary's other
//! shm tests.

use crate::common::one_nic_provider as provider;
use std::time::Duration;

use weft_libfabric::LibfabricDomain;
use weft_testkit::mem::{self, HostBufferExt};
use weft_transport::{Access, Completion, Domain, RemoteSlice, TransportError, WrId, WriteWr};

/// Bound on every wait (it only catches hangs).
const DEADLINE: Duration = Duration::from_secs(30);

/// This process's shm regions (`/dev/shm/<pid>:...`).
fn own_shm_regions() -> usize {
    let prefix = format!("{}:", std::process::id());
    std::fs::read_dir("/dev/shm").map_or(0, |d| {
        d.flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .count()
    })
}

fn restart_loop(name: &str) {
    let Some(p) = provider(name) else { return };
    let src = mem::patterned(7, 4096);
    let mut a: LibfabricDomain = p.open_domain(0).expect("open a");
    let smr = a.register(&src.region(), Access::LocalOnly).unwrap();
    let regions = own_shm_regions();
    let per_peer = usize::from(name == "shm");
    for k in 0..20u32 {
        // A new incarnation: fresh domain, fresh memory, new address.
        let dst = mem::zeroed(4096);
        let mut b: LibfabricDomain = p.open_domain(0).expect("open b");
        let dmr = b.register(&dst.region(), Access::RemoteWrite).unwrap();
        let peer = a.add_peer(&b.local_addr().clone()).unwrap();
        // shm keeps the entries of removed peers.
        let kept = if name == "shm" { k as usize } else { 0 };
        assert_eq!(
            (a.peer_count(), a.av_entries()),
            (1, kept + 1),
            "{name} #{k}"
        );
        let wr = WriteWr {
            wr: WrId(u64::from(k)),
            peer,
            src: smr.slice(0, 4096).unwrap(),
            dst: RemoteSlice {
                base: dmr.addr,
                offset: 0,
                rkey: dmr.rkey,
            },
            imm: Some(k),
        };
        a.post_write(&wr).unwrap();
        let (mut oa, mut ob) = (Vec::new(), Vec::new());
        weft_testkit::wait_until(&format!("{name} #{k}: write"), DEADLINE, || {
            a.poll(&mut oa).unwrap();
            b.poll(&mut ob).unwrap();
            !oa.is_empty() && !ob.is_empty()
        });
        assert!(
            matches!(oa[..], [Completion::Write { result: Ok(()), .. }]),
            "{name} #{k}: {oa:?}"
        );
        assert!(
            matches!(ob[..], [Completion::Imm { imm }] if imm == k),
            "{name} #{k}: {ob:?}"
        );
        assert_eq!(dst.bytes(0, 4096), src.bytes(0, 4096), "{name} #{k}");
        assert_eq!(
            a.peer_endpoints(),
            per_peer,
            "{name} #{k}: per-peer endpoints"
        );

        // It goes away (nothing in flight) and is removed.
        drop(b);
        drop(dst);
        a.remove_peer(peer).unwrap();
        let e = a.post_write(&wr).unwrap_err();
        assert!(
            matches!(e, TransportError::PeerRemoved { .. }),
            "{name} #{k}: {e}"
        );
        assert_eq!(a.peer_count(), 0, "{name} #{k}");
        let mut out = Vec::new();
        weft_testkit::wait_until(&format!("{name} #{k}: AV entry retired"), DEADLINE, || {
            a.poll(&mut out).unwrap();
            a.av_entries() == if name == "shm" { kept + 1 } else { 0 }
        });
        // Past the next sweeps nothing more comes (shm: the entry stays).
        for _ in 0..64 {
            a.poll(&mut out).unwrap();
        }
        assert!(
            out.is_empty(),
            "{name} #{k}: unexpected completions {out:?}"
        );
        assert_eq!(
            a.peer_endpoints(),
            0,
            "{name} #{k}: per-peer endpoint closed"
        );
        if name == "shm" {
            // (Only here: the tcp loop may run alongside the shm one.)
            assert_eq!(own_shm_regions(), regions, "{name} #{k}: /dev/shm regions");
        }
    }
}

#[test]
fn tcp_removed_peers_free_their_av_entries() {
    restart_loop("tcp");
}

/// The child of [`shm_removed_peers_are_forgotten`].
#[test]
fn lifecycle_entry() {
    if weft_testkit::child::role().is_some() {
        restart_loop("shm");
        weft_testkit::child::send_line("done").unwrap();
    }
}

#[test]
fn shm_removed_peers_are_forgotten() {
    let mut c = weft_testkit::child::spawn_role("lifecycle_entry", "shm", &[]).expect("spawn");
    let line = c
        .recv_line_timeout(Duration::from_secs(300))
        .expect("child line");
    let status = c.wait().expect("wait");
    assert!(
        status.success() && line.as_deref() == Some("done"),
        "the shm restart loop failed in its process ({status}; see its output above)"
    );
}

/// Peers that only sent this domain a message (passive peers) are bounded
/// by `max_passive_peers`: six senders in turn, each a new address, each
/// one message; with room for two, the oldest idle one is removed for each
/// new sender, every message is still delivered and answered, the peers
/// known stay at two, the address vector at two once the removed one's
/// entry is retired, and the peer table reuses the removed ones' slots.
#[test]
fn tcp_passive_peers_are_bounded() {
    let cfg = weft_libfabric::LibfabricConfig::new("tcp")
        .with_domains(["lo"])
        .with_max_passive_peers(2);
    let p = match weft_libfabric::LibfabricProvider::with_config(cfg) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIP: libfabric provider tcp unavailable: {e}");
            return;
        }
    };
    let mut b: LibfabricDomain = p.open_domain(0).expect("open b");
    let rbuf = mem::zeroed(6 * 64);
    let rmr = b.register(&rbuf.region(), Access::LocalOnly).unwrap();
    for k in 0..6u64 {
        b.post_recv(WrId(100 + k), rmr.slice(64 * k, 64).unwrap())
            .unwrap();
    }
    let mut senders = Vec::new();
    let mut ob = Vec::new();
    for k in 0..6u64 {
        let src = mem::patterned(k + 1, 64);
        let mut a: LibfabricDomain = p.open_domain(0).expect("open a");
        let smr = a.register(&src.region(), Access::LocalOnly).unwrap();
        let peer = a.add_peer(&b.local_addr().clone()).unwrap();
        a.post_send(WrId(k), peer, smr.slice(0, 64).unwrap())
            .unwrap();
        let mut oa = Vec::new();
        weft_testkit::wait_until(&format!("message {k}"), DEADLINE, || {
            a.poll(&mut oa).unwrap();
            b.poll(&mut ob).unwrap();
            !oa.is_empty() && ob.len() > k as usize
        });
        assert!(
            matches!(oa[..], [Completion::Send { result: Ok(()), .. }]),
            "message {k}: {oa:?}"
        );
        assert!(
            matches!(ob[k as usize], Completion::Recv { wr, result: Ok(64), .. } if wr == WrId(100 + k)),
            "message {k}: {ob:?}"
        );
        assert_eq!(
            rbuf.bytes(64 * k as usize, 64),
            src.bytes(0, 64),
            "message {k}"
        );
        // Its answer leaves, and the AV entry of the peer removed for it
        // is retired, before the next sender comes.
        weft_testkit::wait_until(&format!("message {k}: AV entries"), DEADLINE, || {
            b.poll(&mut ob).unwrap();
            b.av_entries() <= 2
        });
        assert!(b.peer_count() <= 2, "message {k}: {} peers", b.peer_count());
        assert!(b.peer_slots() <= 3, "message {k}: {} slots", b.peer_slots());
        senders.push((a, src));
    }
    assert_eq!(b.passive_evicted(), 4);
    assert_eq!(b.passive_refused(), 0);
    assert_eq!(ob.len(), 6, "nothing else arrived: {ob:?}");
}

/// Polls the domain of each `senders` entry into the matching `out`.
fn poll_each<B, M>(senders: &mut [(LibfabricDomain, B, M)], out: &mut [Vec<Completion>]) {
    for ((a, _, _), o) in senders.iter_mut().zip(out) {
        a.poll(o).unwrap();
    }
}

/// The other side of the bound: while every passive peer is busy (here, a
/// message of each waits for a receive buffer), a message from a new
/// address is dropped unanswered and counted, its sender's SEND fails after
/// its `ack_timeout`, and nobody is evicted; once the held messages are
/// placed, the next new sender gets a peer by evicting an idle one.
#[test]
fn tcp_busy_passive_peers_refuse_new_senders() {
    // Held messages wait for buffers (and their senders for an answer)
    // for as long as the test needs; the refused sender, on a provider of
    // its own, gives up after 300 ms.
    let cfg = weft_libfabric::LibfabricConfig::new("tcp")
        .with_domains(["lo"])
        .with_max_passive_peers(2)
        .with_rnr_timeout(DEADLINE * 2)
        .with_ack_timeout(DEADLINE * 2);
    let quick = cfg.clone().with_ack_timeout(Duration::from_millis(300));
    let (p, q) = match (
        weft_libfabric::LibfabricProvider::with_config(cfg),
        weft_libfabric::LibfabricProvider::with_config(quick),
    ) {
        (Ok(p), Ok(q)) => (p, q),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("SKIP: libfabric provider tcp unavailable: {e}");
            return;
        }
    };
    let mut b: LibfabricDomain = p.open_domain(0).expect("open b");
    let rbuf = mem::zeroed(4 * 64);
    let rmr = b.register(&rbuf.region(), Access::LocalOnly).unwrap();
    let mut ob = Vec::new();
    let b_addr = b.local_addr().clone();
    // Sends one 64 B message from a new domain; returns the domain, its
    // buffer and registration.
    let send = |p: &weft_libfabric::LibfabricProvider, k: u64| {
        let src = mem::patterned(k + 1, 64);
        let mut a: LibfabricDomain = p.open_domain(0).expect("open a");
        let smr = a.register(&src.region(), Access::LocalOnly).unwrap();
        let peer = a.add_peer(&b_addr).unwrap();
        a.post_send(WrId(k), peer, smr.slice(0, 64).unwrap())
            .unwrap();
        (a, src, smr)
    };
    // Two senders fill the bound; their messages are held (no buffer).
    let mut busy = Vec::new();
    let mut done = [Vec::new(), Vec::new()];
    for k in 0..2u64 {
        busy.push(send(&p, k));
        weft_testkit::wait_until(&format!("passive peer {k}"), DEADLINE, || {
            poll_each(&mut busy, &mut done);
            b.poll(&mut ob).unwrap();
            b.peer_count() == k as usize + 1
        });
    }
    assert!(ob.is_empty(), "nothing placed yet: {ob:?}");
    // A third is refused: its SEND fails, no one is evicted.
    let (mut c, _csrc, _cmr) = send(&q, 2);
    let mut oc = Vec::new();
    weft_testkit::wait_until("refused sender's SEND fails", DEADLINE, || {
        c.poll(&mut oc).unwrap();
        poll_each(&mut busy, &mut done);
        b.poll(&mut ob).unwrap();
        !oc.is_empty() && b.passive_refused() == 1
    });
    assert!(
        matches!(
            oc[..],
            [Completion::Send {
                wr: WrId(2),
                result: Err(_)
            }]
        ),
        "refused sender: {oc:?}"
    );
    assert_eq!(b.passive_refused(), 1);
    assert_eq!(b.passive_evicted(), 0);
    assert_eq!(b.peer_count(), 2);
    assert!(ob.is_empty(), "nothing placed: {ob:?}");
    assert!(
        done.iter().all(|d| d.is_empty()),
        "held senders answered early: {done:?}"
    );
    // Buffers come: the held messages are placed and answered.
    for k in 0..4u64 {
        b.post_recv(WrId(100 + k), rmr.slice(64 * k, 64).unwrap())
            .unwrap();
    }
    weft_testkit::wait_until("held messages placed and answered", DEADLINE, || {
        b.poll(&mut ob).unwrap();
        poll_each(&mut busy, &mut done);
        ob.len() == 2 && done.iter().all(|d| !d.is_empty())
    });
    for (i, d) in done.iter().enumerate() {
        assert!(
            matches!(d[..], [Completion::Send { result: Ok(()), .. }]),
            "held sender {i}: {d:?}"
        );
    }
    let mut placed: Vec<_> = (0..2).map(|k| rbuf.bytes(64 * k, 64)).collect();
    placed.sort();
    let mut sent: Vec<_> = busy.iter().map(|(_, s, _)| s.bytes(0, 64)).collect();
    sent.sort();
    assert_eq!(placed, sent, "the two held messages, each once");
    // Now both passive peers are idle: a new sender evicts the oldest.
    let (mut e, esrc, _emr) = send(&p, 3);
    let mut oe = Vec::new();
    weft_testkit::wait_until("sender after the flood", DEADLINE, || {
        e.poll(&mut oe).unwrap();
        b.poll(&mut ob).unwrap();
        !oe.is_empty() && ob.len() == 3
    });
    assert!(
        matches!(oe[..], [Completion::Send { result: Ok(()), .. }]),
        "sender after the flood: {oe:?}"
    );
    assert_eq!(rbuf.bytes(128, 64), esrc.bytes(0, 64));
    assert_eq!(b.passive_evicted(), 1);
    assert_eq!(b.passive_refused(), 1);
    // A refusal is not a drop of a bad message.
    assert_eq!(
        b.dropped_messages(),
        weft_libfabric::DroppedMessages::default()
    );
}
