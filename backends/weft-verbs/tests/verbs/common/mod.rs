//! Shared helpers of the verbs tests: simulated hosts with registered memory.
#![allow(dead_code, unused_imports)]

pub use weft_testkit::mem::{self, HostBufferExt};
pub use weft_transport::HostBuffer;
use weft_transport::{Access, Completion, Domain, LocalMr, NetAddr, PeerId, WrId, WriteWr};
use weft_verbs::ops::VerbsLib;
use weft_verbs::sim::{SimConfig, SimFabric, SimLib};
use weft_verbs::{VerbsConfig, VerbsDomain};

/// Runs `body` with `seed`, printing the replay line if it panics.
pub fn with_seed(seed: u64, body: impl FnOnce(u64)) {
    weft_testkit::with_seed(seed, || body(seed));
}

/// Config suited to the simulator's microsecond clock.
pub fn sim_cfg() -> VerbsConfig {
    VerbsConfig {
        handshake_timeout_ns: 40_000,
        handshake_tries: 12,
        ..VerbsConfig::default()
    }
}

/// Hosts on one simulated fabric.
pub struct Sim {
    pub fabric: SimFabric,
    pub hosts: Vec<VerbsDomain<weft_verbs::sim::SimDevice>>,
    pub names: Vec<String>,
    pub seed: u64,
}

impl Sim {
    pub fn new(seed: u64, n: usize) -> Self {
        Self::with(SimConfig::new(seed), sim_cfg(), n)
    }

    pub fn with(sc: SimConfig, cfg: VerbsConfig, n: usize) -> Self {
        let seed = sc.seed;
        let fabric = SimFabric::new(sc);
        let mut hosts = Vec::new();
        let mut names = Vec::new();
        for i in 0..n {
            let name = format!("sim{i}");
            let lib: SimLib = fabric.add_device(&name);
            let ops = lib.open(0).unwrap();
            hosts.push(VerbsDomain::open(ops, cfg.clone(), Some(0)).unwrap());
            names.push(name);
        }
        Self {
            fabric,
            hosts,
            names,
            seed,
        }
    }

    pub fn addr(&self, i: usize) -> NetAddr {
        self.hosts[i].local_addr().clone()
    }

    pub fn peer(&mut self, from: usize, to: usize) -> PeerId {
        let a = self.addr(to);
        self.hosts[from].add_peer(&a).unwrap()
    }

    /// Polls every (alive) host once and steps the fabric; returns
    /// completions per host.
    pub fn round(&mut self, out: &mut [Vec<Completion>]) {
        for (i, h) in self.hosts.iter_mut().enumerate() {
            let _ = h.poll(&mut out[i]);
        }
        self.fabric.step();
    }

    /// Runs rounds until `done(out)` holds (at most `max` rounds).
    pub fn run_until(
        &mut self,
        max: u64,
        out: &mut [Vec<Completion>],
        mut done: impl FnMut(&[Vec<Completion>]) -> bool,
    ) -> bool {
        weft_testkit::poll_rounds(
            max,
            &mut (self, out),
            |(sim, out)| sim.round(out),
            |(_, out)| done(out),
        )
    }

    pub fn outs(&self) -> Vec<Vec<Completion>> {
        vec![Vec::new(); self.hosts.len()]
    }

    pub fn reg(&mut self, i: usize, buf: &HostBuffer, access: Access) -> LocalMr {
        self.hosts[i].register(&buf.region(), access).unwrap()
    }

    /// Connects `from` to `to` with a zero-length write and waits for it.
    pub fn connect(&mut self, from: usize, to: usize, src: &LocalMr, dst: &LocalMr) -> PeerId {
        let p = self.peer(from, to);
        let wr = WriteWr {
            wr: WrId(u64::MAX),
            peer: p,
            src: src.slice(0, 0).unwrap(),
            dst: remote(dst, 0),
            imm: None,
        };
        self.hosts[from].post_write(&wr).unwrap();
        let mut out = self.outs();
        assert!(
            self.run_until(10_000, &mut out, |o| writes(&o[from])
                .contains(&(WrId(u64::MAX), true))),
            "seed {}: connect {from}->{to} timed out: {:?}",
            self.seed,
            out
        );
        p
    }
}

pub fn remote(mr: &LocalMr, off: u64) -> weft_transport::RemoteSlice {
    weft_transport::RemoteSlice {
        base: mr.addr,
        offset: off,
        rkey: mr.rkey,
    }
}

/// `(wr, ok)` of every write completion.
pub fn writes(c: &[Completion]) -> Vec<(WrId, bool)> {
    c.iter()
        .filter_map(|c| match c {
            Completion::Write { wr, result } => Some((*wr, result.is_ok())),
            _ => None,
        })
        .collect()
}

pub fn imms(c: &[Completion]) -> Vec<u32> {
    c.iter()
        .filter_map(|c| match c {
            Completion::Imm { imm } => Some(*imm),
            _ => None,
        })
        .collect()
}
