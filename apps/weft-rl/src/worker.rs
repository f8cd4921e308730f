//! `weft-rl run`: N trainer ranks → M inference ranks, each in its own
//! process (libfabric `tcp` / `shm`) or thread (`loopback`), driven by a
//! parent over text lines. Shared by the CLI and the tests (which spawn
//! the ranks with weft-testkit's `child::spawn_role`).
//!
//! Lines, parent → rank: `dir …` (every rank's descriptors), `p2p V D` /
//! `rank0 V D` (push version `V` of the weights of data step `D`),
//! `check D` (inference: compare the live buffer with the reference of
//! data step `D`), `recover`, `quit`. Rank → parent: `ep …` once, then
//! `done ok`, `done err MESSAGE`, `checked BAD`, `recovered`.
//!
//! With a rendezvous store ([`Spec::rendezvous`]) a rank publishes its
//! descriptors there ([`RankRecord`], kind `rl-ranks`) and says `ep rdv GEN`;
//! the `dir` line then carries `rdv GEN` per rank and each rank reads the
//! descriptors from the store at exactly those generations.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::rendezvous::{self, Namespace, Records, RendezvousSpec, Session, Store};
use weft::{
    DomainGroupSpec, LibfabricOptions, MrDesc, ProviderConfig, ProviderSpec, TransferEngine,
};
use weft_rl::exec::{
    Directory, InferEndpoint, Inference, Rank0Directory, Rank0Inference, Rank0Trainer, StepConfig,
    Trainer, TrainerEndpoint,
};
use weft_rl::models::{self, InferLayout, TrainLayout};
use weft_rl::{plan, ModelLayout, Plan, PlanConfig};

use crate::demo;

/// What every rank builds identically.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    /// Provider spec (`loopback`, `libfabric:tcp`, `libfabric:shm`).
    pub provider: String,
    /// Model name.
    pub model: String,
    /// Training layout.
    pub train: TrainLayout,
    /// Inference layout.
    pub infer: InferLayout,
    /// NICs per rank.
    pub nics: usize,
    /// Planner knobs.
    pub unit_bytes: u64,
    /// Watermark.
    pub watermark: u64,
    /// Step deadline (ms).
    pub timeout_ms: u64,
    /// Rendezvous store spec and namespace: ranks publish their descriptors
    /// there (`ep rdv GEN`) and read each other's from it.
    pub rendezvous: Option<(String, String)>,
}

impl Spec {
    /// `k=v;k=v` form (no spaces).
    pub fn encode(&self) -> String {
        format!(
            "provider={};model={};fsdp={};pp={};ep={};inf={};instance={};tp={};nics={};unit={};wm={};timeout={}",
            self.provider,
            self.model,
            self.train.fsdp,
            self.train.pp,
            self.train.ep,
            self.infer.ranks,
            self.infer.instance,
            self.infer.attn_tp,
            self.nics,
            self.unit_bytes,
            self.watermark,
            self.timeout_ms
        ) + &self
            .rendezvous
            .as_ref()
            .map_or(String::new(), |(r, ns)| format!(";rdv={r};ns={ns}"))
    }

    /// Parses [`Self::encode`]. Strict, since the line comes from another
    /// process: every key once, no unknown key, numbers in range (a number
    /// too large for its field is refused, never truncated).
    pub fn decode(s: &str) -> Result<Spec, String> {
        const KEYS: [&str; 14] = [
            "provider", "model", "fsdp", "pp", "ep", "inf", "instance", "tp", "nics", "unit", "wm",
            "timeout", "rdv", "ns",
        ];
        let mut m = std::collections::BTreeMap::new();
        for kv in s.split(';') {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("bad spec item {kv:?}"))?;
            if !KEYS.contains(&k) {
                return Err(format!("unknown spec key {k:?}"));
            }
            if m.insert(k.to_string(), v.to_string()).is_some() {
                return Err(format!("spec key {k:?} given twice"));
            }
        }
        let get = |k: &str| m.get(k).cloned().ok_or_else(|| format!("spec lacks {k}"));
        let num =
            |k: &str| -> Result<u64, String> { get(k)?.parse().map_err(|e| format!("{k}: {e}")) };
        let small = |k: &str| -> Result<u32, String> {
            u32::try_from(num(k)?).map_err(|_| format!("{k}: too large"))
        };
        Ok(Spec {
            provider: get("provider")?,
            model: get("model")?,
            train: TrainLayout {
                fsdp: small("fsdp")?,
                pp: small("pp")?,
                ep: small("ep")?,
                tp: 1,
                replicas: 1,
            },
            infer: InferLayout {
                ranks: small("inf")?,
                instance: small("instance")?,
                attn_tp: small("tp")?,
                pp: 1,
            },
            nics: usize::try_from(small("nics")?).map_err(|_| "nics: too large".to_string())?,
            unit_bytes: num("unit")?,
            watermark: num("wm")?,
            timeout_ms: num("timeout")?,
            rendezvous: match (m.get("rdv"), m.get("ns")) {
                (Some(r), Some(ns)) => Some((r.clone(), ns.clone())),
                (None, None) => None,
                _ => return Err("spec has one of rdv / ns without the other".into()),
            },
        })
    }

    /// The model layout and plan (deterministic: the same on every rank).
    pub fn build(&self) -> Result<(ModelLayout, Plan), String> {
        let m = models::load(&self.model).map_err(|e| e.to_string())?;
        let ml = models::build(&m, self.train, self.infer).map_err(|e| e.to_string())?;
        let pc = PlanConfig {
            unit_bytes: self.unit_bytes,
            watermark: self.watermark,
            min_direct_bytes: 16 << 10,
            ..PlanConfig::default()
        };
        let p = plan(&ml, &pc).map_err(|e| e.to_string())?;
        Ok((ml, p))
    }

    /// Step options.
    pub fn step_config(&self) -> StepConfig {
        StepConfig {
            timeout: Duration::from_millis(self.timeout_ms),
        }
    }
}

/// Opens the provider of `spec` (tcp on `lo`, shm on `shm`).
pub fn backend(spec: &Spec) -> Result<weft::Backend, String> {
    let ps: ProviderSpec = spec.provider.parse().map_err(|e| format!("{e}"))?;
    let mut pc = ProviderConfig::default().with_nics(spec.nics);
    if let (Some(p), "libfabric") = (ps.arg(), ps.name()) {
        pc = pc.with_libfabric(LibfabricOptions::same_machine(p));
    }
    weft::provider_with(&ps, &pc).map_err(|e| format!("{e}"))
}

/// One engine on a fresh host of `b`.
pub fn engine(b: &weft::Backend, nics: usize) -> Result<Arc<TransferEngine>, String> {
    let host = b.host().map_err(|e| format!("{e}"))?;
    let e = TransferEngine::builder()
        .group(DomainGroupSpec::new(host, (0..nics).collect::<Vec<_>>()))
        .build()
        .map_err(|e| format!("{e}"))?;
    Ok(Arc::new(e))
}

pub(crate) fn hex(d: &MrDesc) -> String {
    weft::encode(d)
        .map(|b| b.iter().map(|x| format!("{x:02x}")).collect())
        .unwrap_or_default()
}

/// A descriptor from its hex word (`-`: none). Strict: an even number of
/// hex digits (no signs, no other characters), then the postcard
/// descriptor with nothing after it.
pub(crate) fn unhex(s: &str) -> Result<Option<MrDesc>, String> {
    if s == "-" {
        return Ok(None);
    }
    if !s.len().is_multiple_of(2) || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "hex: not an even number of hex digits ({} chars)",
            s.len()
        ));
    }
    let b: Result<Vec<u8>, _> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
        .collect();
    let b = b.map_err(|e| format!("hex: {e}"))?;
    weft::decode(&b).map(Some).map_err(|e| format!("{e}"))
}

/// The rendezvous record of one rank: its memory descriptors in the
/// order of its `ep` line (`None` where that line has `-`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RankRecord {
    /// Unique per rank process (a replaced rank publishes a new one).
    pub generation: u64,
    /// The descriptors.
    pub descs: Vec<Option<MrDesc>>,
}

/// The store `spec` names: `mem` is this process's one in-memory store
/// (loopback ranks are threads of one process).
pub fn open_store(spec: &Spec) -> Result<Option<Records<RankRecord>>, String> {
    static MEM: std::sync::OnceLock<Arc<dyn Store>> = std::sync::OnceLock::new();
    let Some((r, ns)) = &spec.rendezvous else {
        return Ok(None);
    };
    let rs: RendezvousSpec = r.parse().map_err(|e| format!("{e}"))?;
    let store = match rs {
        RendezvousSpec::Mem => MEM
            .get_or_init(|| Arc::new(rendezvous::MemStore::new()))
            .clone(),
        other => rendezvous::open(&other).map_err(|e| e.to_string())?,
    };
    let ns = Namespace::new(store, ns);
    Ok(Some(Records::new(&ns, "rl-ranks")))
}

/// A generation no other rank process of this run has: the process id and
/// a per-process counter.
fn generation() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    (u64::from(std::process::id()) << 32)
        | (NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0xffff_ffff)
}

/// Announces a rank's descriptors: with a store, publishes them and
/// returns `rdv GEN`; without, the hex words.
fn announce(
    rdv: &Option<(Records<RankRecord>, Session)>,
    name: &str,
    descs: Vec<Option<MrDesc>>,
) -> Result<String, String> {
    match rdv {
        Some((recs, session)) => {
            let generation = generation();
            recs.publish(session, name, &RankRecord { generation, descs })
                .map_err(|e| format!("publishing {name}: {e}"))?;
            Ok(format!("rdv {generation}"))
        }
        None => Ok(descs
            .iter()
            .map(|d| d.as_ref().map_or("-".into(), hex))
            .collect::<Vec<_>>()
            .join(" ")),
    }
}

/// A `dir rdv G0 rdv G1 ...` line's descriptors, read from the store
/// (trainers then inference ranks, each at the generation the controller
/// relayed), as the hex words of a plain `dir` line.
fn resolve_dir(
    recs: &Records<RankRecord>,
    w: &[&str],
    nt: usize,
    ni: usize,
    wait: Duration,
) -> Result<Vec<String>, String> {
    if w.len() != 1 + 2 * (nt + ni) {
        return Err(format!(
            "dir rdv line has {} words, want {}",
            w.len(),
            1 + 2 * (nt + ni)
        ));
    }
    let names = (0..nt)
        .map(|k| format!("trainer-{k}"))
        .chain((0..ni).map(|k| format!("inference-{k}")));
    let mut out = vec![w[0].to_string()];
    for (k, name) in names.enumerate() {
        let g: u64 = w[2 + 2 * k]
            .parse()
            .map_err(|e| format!("generation of {name}: {e}"))?;
        let deadline = Instant::now() + wait;
        let rec = loop {
            match recs.get(&name) {
                Ok(Some(r)) if r.generation == g => break r,
                Ok(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                Ok(r) => {
                    return Err(format!(
                        "{name} generation {g} not in the store (found {:?})",
                        r.map(|r| r.generation)
                    ))
                }
                Err(e) => return Err(format!("reading {name}: {e}")),
            }
        };
        out.extend(rec.descs.iter().map(|d| d.as_ref().map_or("-".into(), hex)));
    }
    Ok(out)
}

enum Role {
    T(Arc<Trainer>, Arc<Rank0Trainer>),
    I(Arc<Inference>, Arc<Rank0Inference>),
}

/// A rank's life: `send` a line to the parent, `recv` the next one.
pub fn serve(
    role: &str,
    rank: u32,
    spec: &Spec,
    engine: Arc<TransferEngine>,
    send: &mut dyn FnMut(&str),
    recv: &mut dyn FnMut() -> Option<String>,
) -> Result<(), String> {
    let (ml, plan) = spec.build()?;
    let (ml, plan) = (Arc::new(ml), Arc::new(plan));
    let cfg = spec.step_config();
    let e = |x: weft_rl::RlError| x.to_string();
    // With a store: a session (the records leave with this rank).
    let rdv = match open_store(spec)? {
        Some(recs) => {
            let session = Session::new(recs.namespace().store().clone(), Duration::from_secs(5))
                .map_err(|e| format!("rendezvous session: {e}"))?;
            Some((recs, session))
        }
        None => None,
    };
    let me = if role == "trainer" {
        let t = Trainer::new(engine.clone(), rank, plan.clone(), cfg).map_err(e)?;
        let t0 =
            Rank0Trainer::new(engine.clone(), rank, ml.clone(), plan.clone(), cfg).map_err(e)?;
        let ep = t.endpoint();
        let descs = vec![
            Some(ep.shards),
            Some(ep.arena),
            Some(t0.ack_desc()),
            t0.full_desc(),
        ];
        send(&format!(
            "ep {}",
            announce(&rdv, &format!("trainer-{rank}"), descs)?
        ));
        Role::T(Arc::new(t), Arc::new(t0))
    } else {
        let i = Inference::new(engine.clone(), rank, plan.clone(), cfg).map_err(e)?;
        let i0 = Rank0Inference::new(engine.clone(), rank, plan.clone(), cfg).map_err(e)?;
        let ep = i.endpoint();
        let w0 = i0.weights_desc();
        let [a, b] = ep.weights;
        let [c, d] = w0;
        let descs = vec![Some(a), Some(b), Some(c), Some(d), i0.staging_desc()];
        send(&format!(
            "ep {}",
            announce(&rdv, &format!("inference-{rank}"), descs)?
        ));
        Role::I(Arc::new(i), Arc::new(i0))
    };
    let nt = spec.train.ranks() as usize;
    let ni = spec.infer.ranks as usize;
    let mut dirs: Option<(Directory, Rank0Directory)> = None;
    while let Some(line) = recv() {
        let mut w: Vec<&str> = line.split_whitespace().collect();
        let resolved;
        if let (Some(&"dir"), Some(&"rdv"), Some((recs, _))) = (w.first(), w.get(1), &rdv) {
            let wait = Duration::from_millis(spec.timeout_ms * 3 + 30_000);
            resolved = resolve_dir(recs, &w, nt, ni, wait)?;
            w = resolved.iter().map(String::as_str).collect();
        }
        match (w.first().copied(), &me) {
            (Some("dir"), _) => {
                let need = 1 + 4 * nt + 5 * ni;
                if w.len() != need {
                    return Err(format!("dir line has {} words, want {need}", w.len()));
                }
                let d = |s: &str| {
                    unhex(s).and_then(|x| x.ok_or_else(|| "missing descriptor".to_string()))
                };
                let mut trainers = Vec::new();
                let mut acks = Vec::new();
                let mut full = None;
                for k in 0..nt {
                    let b = 1 + 4 * k;
                    trainers.push(TrainerEndpoint {
                        shards: d(w[b])?,
                        arena: d(w[b + 1])?,
                    });
                    acks.push(d(w[b + 2])?);
                    if k == 0 {
                        full = unhex(w[b + 3])?;
                    }
                }
                let mut inference = Vec::new();
                let mut weights = Vec::new();
                let mut staging = None;
                for k in 0..ni {
                    let b = 1 + 4 * nt + 5 * k;
                    inference.push(InferEndpoint {
                        weights: [d(w[b])?, d(w[b + 1])?],
                    });
                    weights.push([d(w[b + 2])?, d(w[b + 3])?]);
                    if k == 0 {
                        staging = unhex(w[b + 4])?;
                    }
                }
                let r0 = Rank0Directory {
                    full: full.ok_or("no rank0 full buffer")?,
                    trainer_acks: acks,
                    staging: staging.ok_or("no rank0 staging")?,
                    weights,
                };
                dirs = Some((
                    Directory {
                        trainers,
                        inference,
                    },
                    r0,
                ));
                send("dir ok");
            }
            (Some(kind @ ("p2p" | "rank0")), _) => {
                let v: u64 = w.get(1).and_then(|x| x.parse().ok()).ok_or("bad version")?;
                let data: u64 = w
                    .get(2)
                    .and_then(|x| x.parse().ok())
                    .ok_or("bad data step")?;
                let (dir, r0) = dirs.as_ref().ok_or("step before dir")?;
                let res = match &me {
                    Role::T(t, t0) => {
                        let img = demo::trainer_image(&plan, rank as usize, data);
                        let buf = if kind == "p2p" {
                            t.shards()
                        } else {
                            t0.shards()
                        };
                        if !buf.write(0, &img) {
                            return Err("shard image does not fit".into());
                        }
                        if kind == "p2p" {
                            t.step(v, dir).map(|_| ())
                        } else {
                            t0.step(v, r0)
                        }
                    }
                    Role::I(i, i0) => {
                        if kind == "p2p" {
                            i.step(v, dir)
                        } else {
                            i0.step(v, r0)
                        }
                    }
                };
                match res {
                    Ok(()) => send("done ok"),
                    Err(x) => send(&format!("done err {}", x.to_string().replace('\n', " "))),
                }
            }
            (Some("check"), Role::I(i, i0)) => {
                let data: u64 = w
                    .get(1)
                    .and_then(|x| x.parse().ok())
                    .ok_or("bad data step")?;
                let want = demo::reference_region(&ml, &plan, rank as usize, data);
                let got = if w.get(2) == Some(&"rank0") {
                    i0.buffer(w.get(3).and_then(|x| x.parse().ok()).unwrap_or(0))
                        .and_then(|b| b.read(0, b.len()))
                } else {
                    i.weights().and_then(|(_, b)| b.read(0, b.len()))
                };
                let bad = match got {
                    Some(g) => want
                        .iter()
                        .enumerate()
                        .filter(|(k, x)| x.is_some_and(|x| g.get(*k) != Some(&x)))
                        .count(),
                    None => want.len(),
                };
                send(&format!("checked {bad} live {:?}", i.live()));
            }
            (Some("recover"), _) => {
                match &me {
                    Role::T(t, t0) => {
                        t.recover().map_err(e)?;
                        t0.recover().map_err(e)?;
                    }
                    Role::I(i, i0) => {
                        i.recover().map_err(e)?;
                        i0.recover().map_err(e)?;
                    }
                }
                send("recovered");
            }
            (Some("quit"), _) | (None, _) => break,
            (Some(x), _) => return Err(format!("unknown command {x}")),
        }
    }
    engine.shutdown();
    Ok(())
}

/// Starts a rank: `(role, rank)` → its handle.
pub type SpawnFn<'a> = dyn FnMut(&str, u32) -> Result<Box<dyn Peer>, String> + 'a;

/// The parent's handle on one rank.
pub trait Peer {
    /// Sends a line.
    fn send(&mut self, line: &str) -> Result<(), String>;
    /// The next line, or `None` after `timeout`.
    fn recv(&mut self, timeout: Duration) -> Result<Option<String>, String>;
    /// Kills the rank (SIGKILL for a process).
    fn kill(&mut self);
}

/// A running cluster: trainers then inference ranks.
pub struct Cluster {
    /// Trainer handles.
    pub trainers: Vec<Box<dyn Peer>>,
    /// Inference handles.
    pub inference: Vec<Box<dyn Peer>>,
    eps: Vec<String>,
    /// How long the parent waits for a line.
    pub wait: Duration,
}

fn expect_line(p: &mut dyn Peer, wait: Duration, what: &str) -> Result<String, String> {
    p.recv(wait)?
        .ok_or_else(|| format!("no {what} line within {wait:?}"))
}

impl Cluster {
    /// Starts every rank with `spawn(role, rank)` and exchanges descriptors.
    pub fn start(spec: &Spec, spawn: &mut SpawnFn<'_>) -> Result<Cluster, String> {
        let wait = Duration::from_millis(spec.timeout_ms * 3 + 30_000);
        let mut c = Cluster {
            trainers: Vec::new(),
            inference: Vec::new(),
            eps: Vec::new(),
            wait,
        };
        for r in 0..spec.train.ranks() {
            c.trainers.push(spawn("trainer", r)?);
        }
        for r in 0..spec.infer.ranks {
            c.inference.push(spawn("inference", r)?);
        }
        for p in c.trainers.iter_mut().chain(c.inference.iter_mut()) {
            let l = expect_line(p.as_mut(), wait, "ep")?;
            c.eps.push(
                l.strip_prefix("ep ")
                    .ok_or_else(|| format!("want ep, got {l}"))?
                    .to_string(),
            );
        }
        c.send_dir()?;
        Ok(c)
    }

    fn send_dir(&mut self) -> Result<(), String> {
        let line = format!("dir {}", self.eps.join(" "));
        let wait = self.wait;
        for p in self.trainers.iter_mut().chain(self.inference.iter_mut()) {
            p.send(&line)?;
            let l = expect_line(p.as_mut(), wait, "dir ok")?;
            if l != "dir ok" {
                return Err(format!("dir: {l}"));
            }
        }
        Ok(())
    }

    /// Replaces trainer `r` (after it died) and re-sends the directory.
    pub fn replace_trainer(&mut self, r: u32, spawn: &mut SpawnFn<'_>) -> Result<(), String> {
        let mut p = spawn("trainer", r)?;
        let l = expect_line(p.as_mut(), self.wait, "ep")?;
        self.eps[r as usize] = l
            .strip_prefix("ep ")
            .ok_or_else(|| format!("want ep, got {l}"))?
            .to_string();
        self.trainers[r as usize] = p;
        self.send_dir()
    }

    /// One update on every rank; per rank `Ok(())` or its error text, and
    /// the parent's wall time. `during` runs right after the steps started.
    pub fn step(
        &mut self,
        kind: &str,
        version: u64,
        data: u64,
        during: &mut dyn FnMut(&mut Cluster),
    ) -> Result<(Vec<Result<(), String>>, Duration), String> {
        let line = format!("{kind} {version} {data}");
        let t0 = Instant::now();
        for p in self.inference.iter_mut().chain(self.trainers.iter_mut()) {
            p.send(&line)?;
        }
        during(self);
        let wait = self.wait;
        let mut out = Vec::new();
        for p in self.trainers.iter_mut().chain(self.inference.iter_mut()) {
            out.push(match p.recv(wait) {
                Ok(Some(l)) if l == "done ok" => Ok(()),
                Ok(Some(l)) => Err(l.strip_prefix("done err ").unwrap_or(&l).to_string()),
                Ok(None) => Err("no answer (dead?)".into()),
                Err(e) => Err(e),
            });
        }
        Ok((out, t0.elapsed()))
    }

    /// Bytes that differ from data step `data`'s reference, per inference
    /// rank (`rank0 = Some(buffer)`: the Rank0 path's buffer).
    pub fn check(&mut self, data: u64, rank0: Option<usize>) -> Result<Vec<u64>, String> {
        let wait = self.wait;
        let mut out = Vec::new();
        for p in self.inference.iter_mut() {
            match rank0 {
                Some(b) => p.send(&format!("check {data} rank0 {b}"))?,
                None => p.send(&format!("check {data}"))?,
            }
            let l = expect_line(p.as_mut(), wait, "checked")?;
            let n = l
                .split_whitespace()
                .nth(1)
                .and_then(|x| x.parse().ok())
                .ok_or_else(|| format!("bad check line {l}"))?;
            out.push(n);
        }
        Ok(out)
    }

    /// `recover` on every rank.
    pub fn recover(&mut self) -> Result<(), String> {
        let wait = self.wait;
        for p in self.trainers.iter_mut().chain(self.inference.iter_mut()) {
            p.send("recover")?;
            let l = expect_line(p.as_mut(), wait, "recovered")?;
            if l != "recovered" {
                return Err(format!("recover: {l}"));
            }
        }
        Ok(())
    }

    /// `quit` to every rank.
    pub fn quit(mut self) {
        for p in self.trainers.iter_mut().chain(self.inference.iter_mut()) {
            let _ = p.send("quit");
        }
    }
}

/// In-process ranks (threads) talking over channels: the loopback runs.
pub struct ThreadPeer {
    tx: std::sync::mpsc::Sender<String>,
    rx: std::sync::mpsc::Receiver<String>,
    engine: Arc<TransferEngine>,
    dead: bool,
}

impl ThreadPeer {
    /// Starts `role`/`rank` on its own thread with an engine of `backend`.
    pub fn spawn(
        spec: &Spec,
        backend: &weft::Backend,
        role: &str,
        rank: u32,
    ) -> Result<ThreadPeer, String> {
        let (ptx, crx) = std::sync::mpsc::channel::<String>();
        let (ctx, prx) = std::sync::mpsc::channel::<String>();
        let eng = engine(backend, spec.nics)?;
        let keep = eng.clone();
        let (spec, role) = (spec.clone(), role.to_string());
        std::thread::spawn(move || {
            let c2 = ctx.clone();
            let mut send = move |l: &str| {
                let _ = c2.send(l.to_string());
            };
            let mut recv = move || crx.recv().ok();
            if let Err(e) = serve(&role, rank, &spec, eng, &mut send, &mut recv) {
                let _ = ctx.send(format!("fatal {e}"));
            }
        });
        Ok(ThreadPeer {
            tx: ptx,
            rx: prx,
            engine: keep,
            dead: false,
        })
    }
}

impl Peer for ThreadPeer {
    fn send(&mut self, line: &str) -> Result<(), String> {
        self.tx
            .send(line.to_string())
            .map_err(|_| "rank thread gone".to_string())
    }
    fn recv(&mut self, timeout: Duration) -> Result<Option<String>, String> {
        if self.dead {
            return Ok(None);
        }
        Ok(self.rx.recv_timeout(timeout).ok())
    }
    /// The in-process stand-in for a killed process: the rank's engine
    /// shuts down (its NICs close; its transfers and peers' transfers to it
    /// fail) and its thread is no longer listened to.
    fn kill(&mut self) {
        self.dead = true;
        self.engine.shutdown();
    }
}
