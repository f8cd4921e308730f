//! Hostile records: bytes a store hands back are not trusted. A record
//! that does not decode, or whose name disagrees with its key, is skipped
//! (and counted), never fatal to a listing, and never reported under the
//! name it claims.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use weft_rendezvous::{
    DirOptions, DirStore, MemStore, Namespace, PeerRecord, Records, Session, Store, StoreError,
    FORMAT_VERSION,
};
use weft_transport::NetAddr;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A fresh directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let p = std::env::temp_dir().join(format!(
            "weft-rdv-hostile-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A well-formed record of `rec` as the store holds it.
fn record_bytes(rec: &PeerRecord) -> Vec<u8> {
    postcard::to_stdvec(&(FORMAT_VERSION, rec)).unwrap()
}

fn peer(name: &str, generation: u64, addr: u8) -> PeerRecord {
    PeerRecord {
        name: name.into(),
        generation,
        groups: vec![vec![NetAddr(vec![addr; 6])]],
    }
}

/// Two real peers `a` and `b`, then garbage and a record under key `c`
/// that claims to be `b`: listing returns exactly `a` and `b` (the real
/// `b`), and looking up `c` does not hand out the impostor as `b`.
fn listing_survives_bad_records(store: Arc<dyn Store>) {
    let session = Session::new(store.clone(), Duration::from_secs(5)).unwrap();
    let ns = Namespace::new(store.clone(), "hostile");
    ns.publish_peer(&session, "a", 1, &peer("a", 1, 1).groups)
        .unwrap();
    ns.publish_peer(&session, "b", 2, &peer("b", 2, 2).groups)
        .unwrap();
    let garbage: [&[u8]; 4] = [
        b"",
        b"\x02",
        b"\x02\x00not a record at all",
        // A length prefix claiming 2^60 bytes of name.
        &[2, 0, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x10],
    ];
    for (i, g) in garbage.iter().enumerate() {
        store
            .put(&format!("weft/hostile/peers/junk{i}"), g, None)
            .unwrap();
    }
    store
        .put(
            "weft/hostile/peers/c",
            &record_bytes(&peer("b", 99, 66)),
            None,
        )
        .unwrap();

    let peers = ns.peers().expect("a listing with bad records in it");
    let names: Vec<&str> = peers.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["a", "b"], "{peers:?}");
    assert_eq!(peers[1], peer("b", 2, 2), "the real b");
    assert_eq!(
        ns.skipped_records(),
        5,
        "four garbage records, one impostor"
    );
    assert!(
        matches!(ns.peer("c"), Err(StoreError::Record { ref key, .. }) if key.ends_with("/c")),
        "the impostor under key c"
    );
    assert!(matches!(ns.peer("junk2"), Err(StoreError::Record { .. })));
    assert_eq!(ns.skipped_records(), 7, "look-ups count too");
    assert_eq!(ns.peer("b").unwrap(), Some(peer("b", 2, 2)));
    // A clone shares the count.
    assert_eq!(ns.clone().skipped_records(), 7);
}

#[test]
fn mem_store_listing_survives_bad_records() {
    listing_survives_bad_records(Arc::new(MemStore::new()));
}

#[test]
fn dir_store_listing_survives_bad_records() {
    let d = TempDir::new();
    let store: Arc<dyn Store> = Arc::new(DirStore::open(&d.0, DirOptions::default()).unwrap());
    listing_survives_bad_records(store);
}

/// Files planted in a `dir:` store by hand (not through `put`): a file
/// too short to hold a lease id, and one of garbage after an empty lease.
#[test]
fn dir_store_listing_survives_planted_files() {
    let d = TempDir::new();
    let store: Arc<dyn Store> = Arc::new(DirStore::open(&d.0, DirOptions::default()).unwrap());
    let session = Session::new(store.clone(), Duration::from_secs(5)).unwrap();
    let ns = Namespace::new(store.clone(), "hostile");
    ns.publish_peer(&session, "a", 1, &peer("a", 1, 1).groups)
        .unwrap();
    let kv = d.0.join("kv");
    std::fs::write(kv.join("weft%2Fhostile%2Fpeers%2Fshort"), b"abc").unwrap();
    let mut junk = vec![0u8; 8];
    junk.extend_from_slice(&[0xff; 64]);
    std::fs::write(kv.join("weft%2Fhostile%2Fpeers%2Fjunk"), &junk).unwrap();
    let peers = ns.peers().expect("a listing with planted files");
    assert_eq!(peers, vec![peer("a", 1, 1)]);
    // The store itself drops the file too short to hold a lease id.
    assert_eq!(ns.skipped_records(), 1);
}

/// Peer `b` is live; a record planted under key `c` claims to be `b`
/// (another generation, other addresses). Neither listing nor watching
/// reports it under `b`'s name.
fn impostor_is_not_reported_under_the_claimed_name(store: Arc<dyn Store>) {
    let session = Session::new(store.clone(), Duration::from_secs(5)).unwrap();
    let ns = Namespace::new(store.clone(), "impostor");
    ns.publish_peer(&session, "b", 2, &peer("b", 2, 2).groups)
        .unwrap();
    store
        .put(
            "weft/impostor/peers/c",
            &record_bytes(&peer("b", 99, 66)),
            None,
        )
        .unwrap();
    let peers = ns.peers().expect("a listing");
    assert_eq!(peers, vec![peer("b", 2, 2)], "the impostor was listed");
    let w = ns.watch_peers().unwrap();
    let mut seen = Vec::new();
    while let Ok(Some(ev)) = w.recv_timeout(Duration::from_millis(300)) {
        seen.push(ev);
    }
    assert_eq!(
        seen,
        vec![weft_rendezvous::PeerEvent::Joined(peer("b", 2, 2))],
        "the watch reported the impostor"
    );
    assert_eq!(ns.skipped_records(), 2, "once listed, once watched");
    // An update to garbage is skipped too: the watcher keeps the last good
    // record; a leave is still reported.
    store
        .put("weft/impostor/peers/b", b"\x02\x00garbage", None)
        .unwrap();
    assert!(matches!(
        w.recv_timeout(Duration::from_millis(300)),
        Ok(None)
    ));
    assert_eq!(ns.skipped_records(), 3);
    assert!(store.delete("weft/impostor/peers/b").unwrap());
    assert!(matches!(
        w.recv_timeout(Duration::from_secs(5)),
        Ok(Some(weft_rendezvous::PeerEvent::Left { ref name })) if name == "b"
    ));
}

/// An application's records: a garbage value and a value of another type
/// under the same kind are skipped and counted by `list` and `watch`; the
/// good ones are all there.
fn app_records_skip_bad_values(store: Arc<dyn Store>) {
    let session = Session::new(store.clone(), Duration::from_secs(5)).unwrap();
    let ns = Namespace::new(store.clone(), "apps");
    let ranks: Records<(u32, String)> = Records::new(&ns, "ranks");
    let w = ranks.watch().unwrap();
    ranks.publish(&session, "r0", &(0, "zero".into())).unwrap();
    store
        .put("weft/apps/app/ranks/r1", b"\x02\x00\xff\xff\xff", None)
        .unwrap();
    let other: Records<Vec<u64>> = Records::new(&ns, "ranks");
    other.publish(&session, "r2", &vec![1u64; 40]).unwrap();
    ranks.publish(&session, "r3", &(3, "three".into())).unwrap();
    let list = ranks.list().expect("a listing");
    assert_eq!(
        list,
        vec![
            ("r0".to_string(), (0, "zero".to_string())),
            ("r3".to_string(), (3, "three".to_string()))
        ]
    );
    assert_eq!(ns.skipped_records(), 2);
    let mut names = Vec::new();
    while let Ok(Some(ev)) = w.recv_timeout(Duration::from_millis(300)) {
        names.push(ev.name().to_string());
    }
    assert_eq!(names, ["r0", "r3"]);
    assert_eq!(ns.skipped_records(), 4);
}

#[test]
fn mem_store_app_records_skip_bad_values() {
    app_records_skip_bad_values(Arc::new(MemStore::new()));
}

#[test]
fn dir_store_app_records_skip_bad_values() {
    let d = TempDir::new();
    let opts = DirOptions::default().with_poll_interval(Duration::from_millis(10));
    let store: Arc<dyn Store> = Arc::new(DirStore::open(&d.0, opts).unwrap());
    app_records_skip_bad_values(store);
}

#[test]
fn mem_store_impostor_is_not_reported_under_the_claimed_name() {
    impostor_is_not_reported_under_the_claimed_name(Arc::new(MemStore::new()));
}

#[test]
fn dir_store_impostor_is_not_reported_under_the_claimed_name() {
    let d = TempDir::new();
    let opts = DirOptions::default().with_poll_interval(Duration::from_millis(10));
    let store: Arc<dyn Store> = Arc::new(DirStore::open(&d.0, opts).unwrap());
    impostor_is_not_reported_under_the_claimed_name(store);
}
