//! One suite for every store backend: each test file implements
//! [`Backend`] and invokes [`store_suite!`], which expands to one `#[test]`
//! per case below.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use weft_rendezvous::{Event, LeaseId, Namespace, PeerEvent, Session, Store, StoreError};
use weft_testkit::child;
use weft_transport::{MrDesc, NetAddr, Rkey};

/// Bound on waiting for an event that must come (hang detection only).
pub const WAIT: Duration = Duration::from_secs(30);

/// A store backend under test.
pub trait Backend: Sized {
    /// A fresh, empty store; `None` to skip (prints why).
    fn start() -> Option<Self>;
    /// Another client of the same store.
    fn client(&self) -> Arc<dyn Store>;
    /// The shortest lease TTL the backend honours.
    fn ttl(&self) -> Duration;
    /// Lets `d` pass (real time, or the manual clock of an in-process store).
    fn pass(&self, d: Duration);
    /// Lets leases of [`Backend::ttl`] that are not kept alive run out.
    fn let_leases_expire(&self) {
        self.pass(self.ttl() * 2);
    }
    /// The spec a child process opens the same store with; `None` for
    /// stores that live in one process.
    fn child_spec(&self) -> Option<String>;
}

/// A TTL that a loaded machine (2 cores shared by many builds) does not
/// overrun between two keep-alives of a third of it: the backend's
/// shortest, but at least 3 s. The short one is only used where a lease
/// must run out.
fn safe_ttl<B: Backend>(b: &B) -> Duration {
    b.ttl().max(Duration::from_secs(3))
}

fn next(w: &weft_rendezvous::Watch) -> Event {
    w.recv_timeout(WAIT)
        .unwrap()
        .expect("an event within the bound")
}

fn join(k: &str, v: &[u8]) -> Event {
    Event::Join {
        key: k.into(),
        value: v.to_vec(),
    }
}

pub fn put_get_list_delete<B: Backend>(b: &B) {
    let s = b.client();
    s.put("t/a/1", b"one", None).unwrap();
    s.put("t/a/2", b"two", None).unwrap();
    s.put("t/ab", b"other", None).unwrap();
    s.put("t/a/1", b"uno", None).unwrap();
    assert_eq!(s.get("t/a/1").unwrap().as_deref(), Some(&b"uno"[..]));
    assert_eq!(s.get("t/a/3").unwrap(), None);
    let l = s.list("t/a/").unwrap();
    assert_eq!(
        l,
        vec![
            ("t/a/1".to_string(), b"uno".to_vec()),
            ("t/a/2".to_string(), b"two".to_vec())
        ]
    );
    assert_eq!(s.list("t/").unwrap().len(), 3);
    assert!(s.delete("t/a/1").unwrap());
    assert!(!s.delete("t/a/1").unwrap());
    assert_eq!(s.get("t/a/1").unwrap(), None);
    // Another client sees the same store; empty values and odd bytes in
    // keys round-trip.
    let s2 = b.client();
    s2.put("t/odd key %/ü", b"", None).unwrap();
    assert_eq!(s.get("t/odd key %/ü").unwrap().as_deref(), Some(&b""[..]));
    assert!(matches!(
        s.put("", b"x", None),
        Err(StoreError::InvalidKey { .. })
    ));
}

pub fn watch_reports_existing_then_changes<B: Backend>(b: &B) {
    let s = b.client();
    s.put("w/x/1", b"a", None).unwrap();
    s.put("w/y", b"outside", None).unwrap();
    let w = s.watch("w/x/").unwrap();
    assert_eq!(next(&w), join("w/x/1", b"a"));
    s.put("w/x/2", b"b", None).unwrap();
    assert_eq!(next(&w), join("w/x/2", b"b"));
    s.put("w/x/2", b"c", None).unwrap();
    assert_eq!(
        next(&w),
        Event::Update {
            key: "w/x/2".into(),
            value: b"c".to_vec()
        }
    );
    s.put("w/y", b"still outside", None).unwrap();
    assert!(s.delete("w/x/1").unwrap());
    assert_eq!(
        next(&w),
        Event::Leave {
            key: "w/x/1".into()
        }
    );
    s.put("w/x/3", b"d", None).unwrap();
    // Nothing about w/y came in between.
    assert_eq!(next(&w), join("w/x/3", b"d"));
}

pub fn unknown_lease_is_typed<B: Backend>(b: &B) {
    let s = b.client();
    let bogus = LeaseId(0x1234_5678);
    assert!(
        matches!(s.keep_alive(bogus), Err(StoreError::LeaseNotFound { .. })),
        "keep_alive"
    );
    assert!(
        matches!(
            s.put("l/x", b"v", Some(bogus)),
            Err(StoreError::LeaseNotFound { .. })
        ),
        "put"
    );
    assert!(
        matches!(s.revoke(bogus), Err(StoreError::LeaseNotFound { .. })),
        "revoke"
    );
    assert_eq!(s.get("l/x").unwrap(), None);
}

pub fn lease_not_kept_alive_expires<B: Backend>(b: &B) {
    let s = b.client();
    let w = s.watch("e/").unwrap();
    let lease = s.grant(b.ttl()).unwrap();
    s.put("e/k", b"v", Some(lease)).unwrap();
    s.put("e/forever", b"v", None).unwrap();
    // A polling store may see both puts in one look (then in key order).
    let mut two = vec![next(&w), next(&w)];
    two.sort_by(|a, b| a.key().cmp(b.key()));
    assert_eq!(two, vec![join("e/forever", b"v"), join("e/k", b"v")]);
    b.let_leases_expire();
    assert_eq!(
        w.wait_for(WAIT, "e/k leaves", |e| matches!(e, Event::Leave { .. }))
            .unwrap(),
        Event::Leave { key: "e/k".into() }
    );
    assert_eq!(s.get("e/k").unwrap(), None);
    assert!(matches!(
        s.keep_alive(lease),
        Err(StoreError::LeaseNotFound { .. })
    ));
    assert_eq!(s.get("e/forever").unwrap().as_deref(), Some(&b"v"[..]));
}

pub fn kept_alive_lease_outlives_its_ttl<B: Backend>(b: &B) {
    let s = b.client();
    let ttl = safe_ttl(b);
    let lease = s.grant(ttl).unwrap();
    s.put("k/alive", b"v", Some(lease)).unwrap();
    for _ in 0..8 {
        // A sixth of the TTL passes between keep-alives (1.33 TTL in all).
        b.pass(ttl / 6);
        s.keep_alive(lease).unwrap();
    }
    assert_eq!(s.get("k/alive").unwrap().as_deref(), Some(&b"v"[..]));
    s.revoke(lease).unwrap();
    assert_eq!(s.get("k/alive").unwrap(), None);
}

pub fn clean_leave_is_seen_at_once<B: Backend>(b: &B) {
    let s = b.client();
    let ns = Namespace::new(s.clone(), "leave");
    let w = ns.watch_peers().unwrap();
    let session = Session::new(b.client(), Duration::from_secs(60)).unwrap();
    ns.publish_peer(&session, "p", 1, &[vec![NetAddr(vec![7])]])
        .unwrap();
    match w.recv_timeout(WAIT).unwrap() {
        Some(PeerEvent::Joined(r)) => assert_eq!((r.name.as_str(), r.generation), ("p", 1)),
        other => panic!("expected p to join, got {other:?}"),
    }
    session.close().unwrap();
    assert_eq!(
        w.recv_timeout(WAIT).unwrap(),
        Some(PeerEvent::Left { name: "p".into() })
    );
    assert_eq!(ns.peer("p").unwrap(), None);
}

pub fn late_joiner_finds_published_records<B: Backend>(b: &B) {
    let early = Session::new(b.client(), Duration::from_secs(60)).unwrap();
    let ns = Namespace::new(b.client(), "late");
    let desc = MrDesc {
        addr: 0x1000,
        len: 4096,
        rkeys: vec![(NetAddr(vec![1, 2]), Rkey(9))],
        incarnation: Default::default(),
    };
    ns.publish_peer(&early, "early", 3, &[vec![NetAddr(vec![1, 2])]])
        .unwrap();
    ns.publish_mr(&early, "early", "kv", 3, &desc).unwrap();
    // A process that starts later: a new client, looks up and watches.
    let late_ns = Namespace::new(b.client(), "late");
    let rec = late_ns.wait_peer("early", WAIT).unwrap();
    assert_eq!(rec.generation, 3);
    assert_eq!(rec.groups, vec![vec![NetAddr(vec![1, 2])]]);
    assert_eq!(late_ns.wait_mr("early", "kv", WAIT).unwrap().desc, desc);
    let w = late_ns.watch_peers().unwrap();
    assert!(
        matches!(w.recv_timeout(WAIT).unwrap(), Some(PeerEvent::Joined(r)) if r.name == "early")
    );
    // The late one publishes; the early one's peers() lists both.
    let late = Session::new(b.client(), Duration::from_secs(60)).unwrap();
    late_ns.publish_peer(&late, "late", 1, &[]).unwrap();
    let names: Vec<String> = ns.peers().unwrap().into_iter().map(|p| p.name).collect();
    assert_eq!(names, vec!["early".to_string(), "late".to_string()]);
    assert!(
        matches!(w.recv_timeout(WAIT).unwrap(), Some(PeerEvent::Joined(r)) if r.name == "late")
    );
    // A restart: same name, new generation.
    late_ns.publish_peer(&late, "late", 2, &[]).unwrap();
    assert!(
        matches!(w.recv_timeout(WAIT).unwrap(), Some(PeerEvent::Updated(r)) if r.generation == 2)
    );
    assert!(late_ns
        .wait_peer("nobody", Duration::from_millis(200))
        .is_err());
}

pub fn session_regrants_a_lost_lease<B: Backend>(b: &B) {
    let s = b.client();
    let session = Session::new(b.client(), safe_ttl(b)).unwrap();
    session.put("r/me", b"v").unwrap();
    let old = session.lease();
    // The store loses the lease behind the session's back.
    s.revoke(old).unwrap();
    // The keep-alive thread notices, grants a new lease, puts r/me again.
    weft_testkit::wait_until("the session re-grants", WAIT, || session.regrants() >= 1);
    weft_testkit::wait_until("r/me is back", WAIT, || s.get("r/me").unwrap().is_some());
    let new = session.lease();
    assert_ne!(new, old);
    // r/me lives under the new lease.
    let w = s.watch("r/").unwrap();
    assert_eq!(next(&w), join("r/me", b"v"));
    s.revoke(new).unwrap();
    assert_eq!(next(&w), Event::Leave { key: "r/me".into() });
}

/// Child side of the cross-process cases, by role: `victim` publishes a
/// peer, says `ready` and waits to be killed; `late` finds the `early`
/// peer, publishes itself, says `ready` and leaves cleanly when told.
pub fn child_entry() {
    let Some(role) = child::role() else { return };
    let spec = std::env::var("WEFT_RDV_SPEC").unwrap();
    let ttl_ms: u64 = std::env::var("WEFT_RDV_TTL_MS").unwrap().parse().unwrap();
    let store = weft_rendezvous::open(&spec.parse().unwrap()).unwrap();
    let session = Session::new(store.clone(), Duration::from_millis(ttl_ms)).unwrap();
    if role == "victim" {
        let ns = Namespace::new(store, "kill");
        ns.publish_peer(&session, "victim", 1, &[vec![NetAddr(vec![7])]])
            .unwrap();
        child::send_line("ready").unwrap();
        // Serve until killed (or the parent goes away).
        while child::recv_line().unwrap().is_some() {}
        std::process::exit(0);
    }
    let ns = Namespace::new(store, "xlate");
    let early = ns.wait_peer("early", WAIT).unwrap();
    let mr = ns.wait_mr("early", "kv", WAIT).unwrap();
    child::send_line(&format!("found {} {}", early.generation, mr.desc.len)).unwrap();
    ns.publish_peer(&session, "late", 5, &[]).unwrap();
    child::send_line("ready").unwrap();
    while let Some(line) = child::recv_line().unwrap() {
        if line == "leave" {
            session.close().unwrap();
            child::send_line("left").unwrap();
            break;
        }
    }
    std::process::exit(0);
}

fn spawn<B: Backend>(b: &B, entry: &str, role: &str) -> Option<child::ChildProcess> {
    let Some(spec) = b.child_spec() else {
        println!("SKIP: this store lives in one process");
        return None;
    };
    let ttl = safe_ttl(b).as_millis().to_string();
    Some(
        child::spawn_role(
            entry,
            role,
            &[
                ("WEFT_RDV_SPEC", spec.as_ref()),
                ("WEFT_RDV_TTL_MS", ttl.as_ref()),
            ],
        )
        .unwrap(),
    )
}

pub fn late_process_joins_and_leaves_cleanly<B: Backend>(b: &B, entry: &str) {
    let session = Session::new(b.client(), Duration::from_secs(60)).unwrap();
    let ns = Namespace::new(b.client(), "xlate");
    let desc = MrDesc {
        addr: 64,
        len: 4096,
        rkeys: vec![(NetAddr(vec![3]), Rkey(1))],
        incarnation: Default::default(),
    };
    ns.publish_peer(&session, "early", 2, &[vec![NetAddr(vec![3])]])
        .unwrap();
    ns.publish_mr(&session, "early", "kv", 2, &desc).unwrap();
    let w = ns.watch_peers().unwrap();
    assert!(
        matches!(w.recv_timeout(WAIT).unwrap(), Some(PeerEvent::Joined(r)) if r.name == "early")
    );
    let Some(mut c) = spawn(b, entry, "late") else {
        return;
    };
    assert_eq!(
        c.recv_line_timeout(WAIT).unwrap().as_deref(),
        Some("found 2 4096")
    );
    assert_eq!(c.recv_line_timeout(WAIT).unwrap().as_deref(), Some("ready"));
    match w.recv_timeout(WAIT).unwrap() {
        Some(PeerEvent::Joined(r)) => assert_eq!((r.name.as_str(), r.generation), ("late", 5)),
        other => panic!("expected the late process to join, got {other:?}"),
    }
    c.send_line("leave").unwrap();
    assert_eq!(c.recv_line_timeout(WAIT).unwrap().as_deref(), Some("left"));
    assert_eq!(
        w.recv_timeout(WAIT).unwrap(),
        Some(PeerEvent::Left {
            name: "late".into()
        })
    );
    assert!(c.wait().unwrap().success());
}

pub fn killed_process_expires<B: Backend>(b: &B, entry: &str) {
    let ns = Namespace::new(b.client(), "kill");
    let w = ns.watch_peers().unwrap();
    let Some(mut c) = spawn(b, entry, "victim") else {
        return;
    };
    assert_eq!(c.recv_line_timeout(WAIT).unwrap().as_deref(), Some("ready"));
    assert!(
        matches!(w.recv_timeout(WAIT).unwrap(), Some(PeerEvent::Joined(r)) if r.name == "victim")
    );
    c.kill().unwrap();
    // No clean leave: the lease runs out (the directory store also notices
    // the owner is gone) and the watcher sees it go.
    assert_eq!(
        w.recv_timeout(WAIT * 2).unwrap(),
        Some(PeerEvent::Left {
            name: "victim".into()
        })
    );
    assert_eq!(ns.peer("victim").unwrap(), None);
}

/// The test path, in this binary, of the `child_entry` test of the module
/// whose `module_path!()` is `module` (`rendezvous::dir` →
/// `dir::child_entry`): every backend's module has one, so the bare name
/// would be ambiguous.
pub fn entry(module: &str) -> String {
    let m = module.split_once("::").map_or(module, |(_, m)| m);
    format!("{m}::child_entry")
}

/// Expands to one `#[test]` per suite case for backend `$b`.
#[macro_export]
macro_rules! store_suite {
    ($b:ty) => {
        fn backend() -> Option<$b> {
            <$b as $crate::suite::Backend>::start()
        }
        #[test]
        fn put_get_list_delete() {
            let Some(b) = backend() else { return };
            $crate::suite::put_get_list_delete(&b);
        }
        #[test]
        fn watch_reports_existing_then_changes() {
            let Some(b) = backend() else { return };
            $crate::suite::watch_reports_existing_then_changes(&b);
        }
        #[test]
        fn unknown_lease_is_typed() {
            let Some(b) = backend() else { return };
            $crate::suite::unknown_lease_is_typed(&b);
        }
        #[test]
        fn lease_not_kept_alive_expires() {
            let Some(b) = backend() else { return };
            $crate::suite::lease_not_kept_alive_expires(&b);
        }
        #[test]
        fn kept_alive_lease_outlives_its_ttl() {
            let Some(b) = backend() else { return };
            $crate::suite::kept_alive_lease_outlives_its_ttl(&b);
        }
        #[test]
        fn clean_leave_is_seen_at_once() {
            let Some(b) = backend() else { return };
            $crate::suite::clean_leave_is_seen_at_once(&b);
        }
        #[test]
        fn late_joiner_finds_published_records() {
            let Some(b) = backend() else { return };
            $crate::suite::late_joiner_finds_published_records(&b);
        }
        #[test]
        fn session_regrants_a_lost_lease() {
            let Some(b) = backend() else { return };
            $crate::suite::session_regrants_a_lost_lease(&b);
        }
        #[test]
        fn child_entry() {
            $crate::suite::child_entry();
        }
        #[test]
        fn killed_process_expires() {
            let Some(b) = backend() else { return };
            $crate::suite::killed_process_expires(&b, &$crate::suite::entry(module_path!()));
        }
        #[test]
        fn late_process_joins_and_leaves_cleanly() {
            let Some(b) = backend() else { return };
            $crate::suite::late_process_joins_and_leaves_cleanly(
                &b,
                &$crate::suite::entry(module_path!()),
            );
        }
    };
}
