//! Real multi-process updates: every trainer and inference rank is its own
//! process (this test binary re-executed with weft-testkit's
//! `child::spawn_role`), over libfabric `tcp` (on `lo`) and `shm`. P2P and
//! Rank0 side by side, checked bit-exact (fp8 values and scales included);
//! a trainer SIGKILLed during an update fails the step on every rank, the
//! previous weights stay live, a replacement trainer joins and the retry
//! succeeds.

#[path = "../src/demo.rs"]
mod demo;
#[path = "../src/worker.rs"]
mod worker;

use std::time::Duration;

use weft_rl::models::{InferLayout, TrainLayout};
use weft_testkit::child::{self, ChildProcess};
use worker::{Cluster, Peer, Spec};

#[test]
fn rank_entry() {
    let Some(role) = child::role() else { return };
    let w: Vec<&str> = role.split_whitespace().collect();
    let (r, rank, spec) = (w[0], w[1].parse().unwrap(), Spec::decode(w[2]).unwrap());
    let b = worker::backend(&spec).unwrap();
    let e = worker::engine(&b, spec.nics).unwrap();
    let mut send = |l: &str| child::send_line(l).unwrap();
    let mut recv = || child::recv_line().ok().flatten();
    if let Err(e) = worker::serve(r, rank, &spec, e, &mut send, &mut recv) {
        panic!("{role}: {e}");
    }
    std::process::exit(0);
}

struct Tk(ChildProcess);

impl Peer for Tk {
    fn send(&mut self, line: &str) -> Result<(), String> {
        self.0.send_line(line).map_err(|e| e.to_string())
    }
    fn recv(&mut self, timeout: Duration) -> Result<Option<String>, String> {
        Ok(self.0.recv_line_timeout(timeout).ok().flatten())
    }
    fn kill(&mut self) {
        let _ = self.0.kill();
    }
}

fn available(provider: &str) -> bool {
    let spec: weft::ProviderSpec = provider.parse().unwrap();
    match worker::backend(&Spec {
        provider: provider.into(),
        ..spec_for(
            provider,
            "tiny-moe",
            TrainLayout {
                fsdp: 1,
                pp: 1,
                ep: 1,
            },
            InferLayout {
                ranks: 1,
                instance: 1,
                attn_tp: 1,
            },
        )
    }) {
        Ok(b) => b.host().is_ok(),
        Err(e) => {
            println!("SKIP {spec}: {e}");
            false
        }
    }
}

fn spec_for(provider: &str, model: &str, train: TrainLayout, infer: InferLayout) -> Spec {
    Spec {
        provider: provider.into(),
        model: model.into(),
        train,
        infer,
        nics: 1,
        unit_bytes: 64 << 10,
        watermark: 1 << 20,
        timeout_ms: 4000,
    }
}

fn run(spec: &Spec, kill: bool) {
    let s = spec.encode();
    let mut spawn = move |role: &str, rank: u32| -> Result<Box<dyn Peer>, String> {
        let c = child::spawn_role("rank_entry", &format!("{role} {rank} {s}"), &[])
            .map_err(|e| e.to_string())?;
        Ok(Box::new(Tk(c)))
    };
    let mut c = Cluster::start(spec, &mut spawn).unwrap();
    let ok = |r: &[Result<(), String>]| {
        for (k, x) in r.iter().enumerate() {
            assert!(x.is_ok(), "rank {k}: {x:?}");
        }
    };
    for v in 0..2u64 {
        let (r, _) = c.step("p2p", v, 10 + v, &mut |_| {}).unwrap();
        ok(&r);
        assert!(
            c.check(10 + v, None).unwrap().iter().all(|&b| b == 0),
            "p2p bytes differ"
        );
        let (r, _) = c.step("rank0", v, 10 + v, &mut |_| {}).unwrap();
        ok(&r);
        assert!(
            c.check(10 + v, Some((v % 2) as usize))
                .unwrap()
                .iter()
                .all(|&b| b == 0),
            "rank0 bytes differ"
        );
    }
    if kill {
        let (r, _) = c
            .step("p2p", 2, 50, &mut |c| {
                std::thread::sleep(Duration::from_millis(5));
                c.trainers[1].kill();
            })
            .unwrap();
        for (k, x) in r.iter().enumerate() {
            let e = x.as_ref().expect_err("every rank fails the step");
            assert!(
                k == 1
                    || e.contains("no completion")
                    || e.contains("transfer")
                    || e.contains("rank"),
                "rank {k}: untyped failure {e}"
            );
        }
        assert!(
            c.check(11, None).unwrap().iter().all(|&b| b == 0),
            "old weights damaged"
        );
        c.replace_trainer(1, &mut spawn).unwrap();
        c.recover().unwrap();
        let (r, _) = c.step("p2p", 2, 50, &mut |_| {}).unwrap();
        ok(&r);
        assert!(
            c.check(50, None).unwrap().iter().all(|&b| b == 0),
            "retry bytes differ"
        );
    }
    c.quit();
}

#[test]
fn tcp_four_trainers_to_two_with_a_killed_trainer() {
    if !available("libfabric:tcp") {
        return;
    }
    let s = spec_for(
        "libfabric:tcp",
        "tiny-moe",
        TrainLayout {
            fsdp: 2,
            pp: 1,
            ep: 2,
        },
        InferLayout {
            ranks: 2,
            instance: 2,
            attn_tp: 2,
        },
    );
    run(&s, true);
}

#[test]
fn shm_eight_trainers_to_four() {
    if !available("libfabric:shm") {
        return;
    }
    let s = spec_for(
        "libfabric:shm",
        "tiny-mla",
        TrainLayout {
            fsdp: 2,
            pp: 2,
            ep: 2,
        },
        InferLayout {
            ranks: 4,
            instance: 2,
            attn_tp: 2,
        },
    );
    run(&s, false);
}
