//! Peer removal and restart on the simulated device: a peer killed with
//! writes in flight is removed (its QPs flushed and destroyed, its work
//! failed with `PeerRemoved`) and comes back, alternately, as a new device
//! (new UD QPN, so a new address) or as the same device revived at the same
//! address (`SimFabric::revive`): new QPs and a new handshake, 20 times,
//! with the domain's QP count back to zero after every removal.

use crate::common::*;
use weft_transport::{Access, Completion, Domain, TransportError, WrId, WriteWr};
use weft_verbs::ops::VerbsLib;
use weft_verbs::sim::SimLib;
use weft_verbs::VerbsDomain;

const RESTARTS: u64 = 20;
const INFLIGHT: u64 = 4;

#[test]
fn removed_peer_restarts_with_new_qps_and_nothing_leaks() {
    with_seed(2201, |seed| {
        let src = mem::patterned(seed, 4096);
        let mut s = Sim::new(seed, 2);
        let smr = s.reg(0, &src, Access::LocalOnly);
        let mut dst = mem::zeroed(4096);
        let mut dmr = s.reg(1, &dst, Access::RemoteWrite);
        let mut addrs = vec![s.addr(1)];
        let mut old_peers = Vec::new();
        for k in 0..RESTARTS {
            // A fresh incarnation: connect (new QPs, new handshake), then a
            // write whose bytes and single immediate are checked.
            let connects = s.hosts[0].stats().connects;
            let p = s.connect(0, 1, &smr, &dmr);
            assert!(!old_peers.contains(&p), "seed {seed}: handle reused");
            assert_eq!(s.hosts[0].stats().connects, connects + 1);
            assert_eq!(s.hosts[0].live_qps(), 2, "seed {seed}: one connection");
            let wr = |i: u64, imm| WriteWr {
                wr: WrId(k * 100 + i),
                peer: p,
                src: smr.slice(i * 256, 256).unwrap(),
                dst: remote(&dmr, i * 256),
                imm,
            };
            s.hosts[0].post_write(&wr(0, Some(k as u32))).unwrap();
            let mut out = s.outs();
            assert!(s.run_until(100_000, &mut out, |o| {
                writes(&o[0]).contains(&(WrId(k * 100), true)) && !imms(&o[1]).is_empty()
            }));
            assert_eq!(imms(&out[1]), vec![k as u32], "seed {seed}: one immediate");
            assert_eq!(dst.bytes(0, 256), src.bytes(0, 256));

            // Writes in flight, then the peer dies and is removed.
            for i in 1..=INFLIGHT {
                s.hosts[0].post_write(&wr(i, Some(1000))).unwrap();
            }
            s.fabric.kill(&s.names[1]);
            s.hosts[0].remove_peer(p).unwrap();
            s.hosts[0].remove_peer(p).unwrap(); // a no-op
            let mut out = s.outs();
            let mut polls = 0;
            while writes(&out[0]).len() < INFLIGHT as usize || s.hosts[0].live_qps() > 0 {
                let _ = s.hosts[0].poll(&mut out[0]);
                s.fabric.step();
                polls += 1;
                assert!(
                    polls < 100_000,
                    "seed {seed}: removal never settled: {out:?}"
                );
            }
            for c in &out[0] {
                match c {
                    Completion::Write { result: Ok(()), .. }
                    | Completion::Write {
                        result: Err(TransportError::PeerRemoved { .. }),
                        ..
                    } => {}
                    c => panic!("seed {seed}: write pending at the removal: {c:?}"),
                }
            }
            assert_eq!(s.hosts[0].stats().peers_removed, k + 1);
            let e = s.hosts[0].post_write(&wr(9, None)).unwrap_err();
            assert!(
                matches!(e, TransportError::PeerRemoved { .. }),
                "seed {seed}: post to a removed handle: {e}"
            );
            old_peers.push(p);

            // Restart with fresh memory: on even rounds a new device (a
            // new process at a new address), on odd rounds the same device
            // revived at the same address (same GID, LID and UD QPN), as a
            // process given its predecessor's address would be. Either way
            // the next round connects anew and nothing of the old
            // incarnation's QPs answers.
            let lib: SimLib = if k % 2 == 0 {
                let name = format!("sim1-{k}");
                let lib = s.fabric.add_device(&name);
                s.names[1] = name;
                lib
            } else {
                // The old incarnation's domain goes first (its QPN is about
                // to be reused).
                s.hosts.truncate(1);
                s.fabric.revive(&[s.names[1].as_str()]).unwrap()
            };
            let d = VerbsDomain::open(lib.open(0).unwrap(), sim_cfg(), Some(0)).unwrap();
            s.hosts.truncate(1);
            s.hosts.push(d);
            dst = mem::zeroed(4096);
            dmr = s.reg(1, &dst, Access::RemoteWrite);
            let a = s.addr(1);
            if k % 2 == 0 {
                assert!(
                    !addrs.contains(&a),
                    "seed {seed}: a new device reuses an address"
                );
            } else {
                assert_eq!(
                    addrs.last(),
                    Some(&a),
                    "seed {seed}: the revived device has its old address"
                );
            }
            addrs.push(a);
        }
        assert_eq!(s.hosts[0].live_qps(), 0);
    });
}
