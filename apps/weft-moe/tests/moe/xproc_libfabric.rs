//! Across processes over libfabric (`tcp` on `lo`, and `shm`), EP4 and
//! EP8: every rank is a child process (this test binary re-executed by
//! `weft_testkit::child::spawn_role`) with its own engine. The parent
//! collects each child's [`RankInfo`] (postcard, hex in a line), sends
//! every child the full list, and each child runs three steps on routings
//! generated from the shared seed and checks its own expert tokens and
//! combined tokens byte for byte against the naive reference, which it
//! computes from the same seed. With a rendezvous store (`dir:`, named in
//! the children's environment) the parent relays nothing: each child
//! publishes its `RankInfo` in the store and gathers everyone's from it.
//! Skips (printing SKIP) when libfabric or the provider is unavailable.

use crate::common::{expert_outputs, inputs, Routing};
use std::sync::Arc;
use std::time::Duration;
use weft::rendezvous::{self, Session};
use weft::{DomainGroupSpec, EngineConfig, LibfabricOptions, ProviderConfig, TransferEngine};
use weft_moe::{reference, MoeConfig, MoeRank, MoeRendezvous, RankInfo};
use weft_testkit::child::{self, spawn_role, ChildProcess};

const ENTRY: &str = "moe_rank_entry";
const NICS: usize = 2;
const STEPS: u64 = 3;
/// The environment variable naming the children's rendezvous store.
const RDV_ENV: &str = "WEFT_MOE_TEST_RDV";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

fn cfg(n: u32) -> MoeConfig {
    let mut c = MoeConfig::new(n, 2 * n, 3, 6, 40, 12);
    c.private_tokens = Some(2);
    c.step_timeout = Duration::from_secs(60);
    c
}

/// The provider's backend, or `None` (with the reason) when unavailable.
fn backend(prov: &str) -> Result<weft::Backend, String> {
    let spec = format!("libfabric:{prov}")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let config = ProviderConfig::default().with_nics(NICS).with_libfabric(
        LibfabricOptions::same_machine(prov).with_connect_timeout(Duration::from_secs(10)),
    );
    let b = weft::provider_with(&spec, &config).map_err(|e| e.to_string())?;
    b.host().map_err(|e| e.to_string())?;
    Ok(b)
}

fn engine(prov: &str) -> Arc<TransferEngine> {
    let b = backend(prov).expect("provider (the parent checked it)");
    let cfg = {
        let mut c = EngineConfig::default();
        c.idle_sleep = Some(Duration::from_micros(100));
        c
    };
    Arc::new(
        TransferEngine::builder()
            .group(DomainGroupSpec::new(
                b.host().expect("host"),
                (0..NICS).collect::<Vec<_>>(),
            ))
            .config(cfg)
            .build()
            .expect("engine builds"),
    )
}

/// The child: role `rank/ranks/seed/provider`.
#[test]
fn moe_rank_entry() {
    let Some(role) = child::role() else { return };
    let f: Vec<&str> = role.split('/').collect();
    let (r, n, seed, prov): (u32, u32, u64, &str) = (
        f[0].parse().unwrap(),
        f[1].parse().unwrap(),
        f[2].parse().unwrap(),
        f[3],
    );
    let c = cfg(n);
    let d = c.validate().unwrap();
    let e = engine(prov);
    let (mut rank, info) = MoeRank::prepare(e.clone(), &c, r).expect("prepare");
    let mut session = None;
    let infos: Vec<RankInfo> = match std::env::var(RDV_ENV) {
        // Through the store: publish, gather, nothing from the parent.
        Ok(spec) => {
            let store = rendezvous::open(&spec.parse().expect("spec")).expect("store");
            let s = Session::new(store.clone(), Duration::from_secs(10)).expect("session");
            let rdv = MoeRendezvous::new(store, &format!("xproc-{seed}"));
            rdv.publish(&s, &info).expect("publish");
            session = Some(s);
            let all = rdv.gather(n, Duration::from_secs(120)).expect("gather");
            child::send_line("gathered").unwrap();
            all
        }
        Err(_) => {
            child::send_line(&format!("info {}", hex(&info.to_bytes()))).unwrap();
            let line = child::recv_line().unwrap().expect("peers line");
            line.strip_prefix("peers ")
                .expect("peers")
                .split(',')
                .map(|h| RankInfo::from_bytes(&unhex(h)).expect("rank info"))
                .collect()
        }
    };
    rank.connect(&infos).expect("connect");
    for k in 0..STEPS {
        let ins = inputs(&d, Routing::Random, seed * 1000 + k, k == 1);
        let views: Vec<_> = ins.iter().map(|i| i.input()).collect();
        let want = reference::dispatch(&d, &views).unwrap();
        let (got, layout) = rank.dispatch(&views[r as usize]).expect("dispatch");
        assert_eq!(got, want[r as usize], "rank {r} step {k}: dispatch");
        let outs: Vec<Vec<u8>> = want
            .iter()
            .enumerate()
            .map(|(x, w)| expert_outputs(&d, x as u32, w))
            .collect();
        let y = rank.combine(&outs[r as usize], &layout).expect("combine");
        let want = reference::combine(&d, &views, &outs).unwrap();
        assert_eq!(y, want[r as usize], "rank {r} step {k}: combine");
        child::send_line(&format!("ok {k}")).unwrap();
    }
    let imms = rank.imms();
    rank.shutdown().expect("shutdown");
    for v in imms.all() {
        assert_eq!(e.imm_pending(v), 0);
    }
    assert_eq!(e.stats().imm_excess, 0);
    if let Some(s) = session {
        s.close().expect("leave the store");
    }
    child::send_line("done").unwrap();
    e.shutdown();
    std::process::exit(0);
}

fn expect(c: &mut ChildProcess, what: &str, r: usize) -> String {
    match c.recv_line_timeout(Duration::from_secs(120)) {
        Ok(Some(l)) => l,
        other => {
            let _ = c.kill();
            panic!("rank {r}: no {what} line: {other:?}");
        }
    }
}

fn cluster(prov: &str, n: u32, seed: u64) {
    cluster_with(prov, n, seed, None)
}

/// `rdv`: the children's rendezvous store spec (`dir:/path`).
fn cluster_with(prov: &str, n: u32, seed: u64, rdv: Option<&str>) {
    if let Err(why) = backend(prov) {
        println!("SKIP: libfabric:{prov} unavailable: {why}");
        return;
    }
    let env: Vec<(&str, &std::ffi::OsStr)> = rdv
        .map(|s| (RDV_ENV, std::ffi::OsStr::new(s)))
        .into_iter()
        .collect();
    let mut kids: Vec<ChildProcess> = (0..n)
        .map(|r| spawn_role(ENTRY, &format!("{r}/{n}/{seed}/{prov}"), &env).expect("spawn"))
        .collect();
    if rdv.is_some() {
        for (r, c) in kids.iter_mut().enumerate() {
            assert_eq!(expect(c, "gathered", r), "gathered", "rank {r}");
        }
    } else {
        let mut infos = Vec::new();
        for (r, c) in kids.iter_mut().enumerate() {
            let l = expect(c, "info", r);
            infos.push(l.strip_prefix("info ").expect("info line").to_string());
        }
        let line = format!("peers {}", infos.join(","));
        for c in &mut kids {
            c.send_line(&line).expect("send peers");
        }
    }
    for (r, c) in kids.iter_mut().enumerate() {
        for k in 0..STEPS {
            assert_eq!(expect(c, "step", r), format!("ok {k}"), "rank {r}");
        }
        assert_eq!(expect(c, "done", r), "done", "rank {r}");
    }
    for (r, mut c) in kids.into_iter().enumerate() {
        assert!(c.wait().expect("wait").success(), "rank {r} exit status");
    }
}

#[test]
fn tcp_ep4_ep8() {
    cluster("tcp", 4, 1);
    cluster("tcp", 8, 2);
}

#[test]
fn shm_ep4_ep8() {
    cluster("shm", 4, 3);
    cluster("shm", 8, 4);
}

#[test]
fn tcp_ep4_through_a_dir_store() {
    let dir = std::env::temp_dir().join(format!("weft-moe-rdv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let spec = format!("dir:{}", dir.display());
    cluster_with("tcp", 4, 5, Some(&spec));
    // Every rank left cleanly: nothing of the job stays in the store.
    let store = rendezvous::open(&spec.parse().unwrap()).unwrap();
    assert!(store.list("weft/xproc-5/").unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
