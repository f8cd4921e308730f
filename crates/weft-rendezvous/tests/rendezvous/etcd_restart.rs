//! etcd restarted (with its data, and wiped) while two engines transfer
//! over the loopback fabric: the transfers are unaffected, the sessions
//! reconnect (and re-grant and re-put when etcd lost its state), and a
//! watch that was open across the restart goes on reporting.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use weft_engine::{DomainGroupSpec, DoneCounter, OnDone, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};
use weft_rendezvous::{EtcdOptions, EtcdStore, Namespace, PeerEvent, Session, Store};
use weft_testkit::etcd::Etcd;
use weft_testkit::{mem, wait_until, SeedGuard};

const WAIT: Duration = Duration::from_secs(60);
const CHUNK: u64 = 16 * 1024;
const CHUNKS: u64 = 64;

fn client(etcd: &Etcd) -> Arc<dyn Store> {
    let opts = EtcdOptions::default().with_max_backoff(Duration::from_millis(200));
    Arc::new(EtcdStore::new(&etcd.url(), opts).unwrap())
}

fn next_peer_event(w: &weft_rendezvous::PeerWatch, what: &str, pred: impl Fn(&PeerEvent) -> bool) {
    loop {
        match w.recv_timeout(WAIT).unwrap() {
            Some(e) if pred(&e) => return,
            Some(_) => {}
            None => panic!("hang: {what} not seen"),
        }
    }
}

fn restart_during_transfers(wipe: bool) {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let seed = 7;
    let _g = SeedGuard::new(seed, "etcd restart during transfers");
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(seed));
    let engine = |h| {
        TransferEngine::builder()
            .group(DomainGroupSpec::new(
                Arc::new(fabric.provider(h)),
                vec![0, 1],
            ))
            .build()
            .unwrap()
    };
    let (ha, hb) = (fabric.add_host(2), fabric.add_host(2));
    let (writer, reader) = (engine(ha), engine(hb));

    // The reader publishes its address and its buffer; the writer finds them.
    let dst = Arc::new(mem::zeroed((CHUNK * CHUNKS) as usize));
    let (_dst_h, dst_desc) = reader.reg_mr(dst.region()).unwrap();
    let ttl = Duration::from_secs(2);
    let rs = Session::new(client(&etcd), ttl).unwrap();
    let ns = Namespace::new(client(&etcd), "restart");
    ns.publish_peer(&rs, "reader", 1, &[reader.group_address(0).unwrap().nics])
        .unwrap();
    ns.publish_mr(&rs, "reader", "dst", 1, &dst_desc).unwrap();
    let ws = Session::new(client(&etcd), ttl).unwrap();
    let wns = Namespace::new(client(&etcd), "restart");
    wns.publish_peer(&ws, "writer", 1, &[writer.group_address(0).unwrap().nics])
        .unwrap();
    let desc = wns.wait_mr("reader", "dst", WAIT).unwrap().desc;
    let watch = wns.watch_peers().unwrap();
    next_peer_event(
        &watch,
        "reader joined",
        |e| matches!(e, PeerEvent::Joined(r) if r.name == "reader"),
    );

    // Transfers run on their own thread, round after round, until told to stop.
    let src = Arc::new(mem::patterned(seed, (CHUNK * CHUNKS) as usize));
    let (src_h, _) = writer.reg_mr(src.region()).unwrap();
    let done = Arc::new(DoneCounter::new());
    let stop = Arc::new(AtomicBool::new(false));
    let submitted = std::thread::scope(|s| {
        let t = s.spawn(|| {
            let mut n = 0u64;
            while !stop.load(Ordering::Acquire) {
                let off = (n % CHUNKS) * CHUNK;
                writer
                    .submit_single_write(
                        CHUNK,
                        None,
                        (&src_h, off),
                        (&desc, off),
                        OnDone::counter(&done),
                    )
                    .unwrap();
                n += 1;
                // Keep a bounded number in flight.
                while n - done.total() > 32 {
                    std::thread::yield_now();
                }
            }
            n
        });
        wait_until("transfers under way", WAIT, || done.ok() > 50);
        etcd.stop();
        // etcd is down: the store says so, transfers go on.
        assert!(ns.peer("reader").unwrap_err().is_transient());
        let before = done.ok();
        wait_until("transfers while etcd is down", WAIT, || {
            done.ok() > before + 200
        });
        wait_until("the writer's session notices", WAIT, || !ws.is_healthy());
        if wipe {
            etcd.restart_wiped();
        } else {
            etcd.restart();
        }
        let before = done.ok();
        wait_until("transfers after the restart", WAIT, || {
            done.ok() > before + 200
        });
        stop.store(true, Ordering::Release);
        t.join().unwrap()
    });
    assert!(
        done.wait_for_timeout(submitted, WAIT),
        "every transfer completes"
    );
    assert_eq!(done.failed(), 0, "{:?}", done.first_error());
    assert_eq!(
        src.read(0, src.len()),
        dst.read(0, dst.len()),
        "every byte landed"
    );

    // The sessions reconnected; after a wipe they re-granted and re-put.
    wait_until("sessions healthy again", WAIT, || {
        rs.is_healthy() && ws.is_healthy()
    });
    if wipe {
        wait_until("re-grants", WAIT, || {
            rs.regrants() >= 1 && ws.regrants() >= 1
        });
    }
    wait_until("records back", WAIT, || {
        ns.peer("writer").ok().flatten().is_some()
            && ns.mr("reader", "dst").ok().flatten().is_some()
    });
    assert_eq!(ns.mr("reader", "dst").unwrap().unwrap().desc, dst_desc);
    // The watch opened before the restart still reports joins.
    let late = Session::new(client(&etcd), ttl).unwrap();
    ns.publish_peer(&late, "late", 1, &[]).unwrap();
    next_peer_event(
        &watch,
        "late joined",
        |e| matches!(e, PeerEvent::Joined(r) if r.name == "late"),
    );
    late.close().unwrap();
    next_peer_event(
        &watch,
        "late left",
        |e| matches!(e, PeerEvent::Left { name } if name == "late"),
    );
    writer.shutdown();
    reader.shutdown();
}

#[test]
fn etcd_restarted_during_transfers() {
    restart_during_transfers(false);
}

#[test]
fn etcd_restarted_without_its_data_during_transfers() {
    restart_during_transfers(true);
}
