//! Shared helpers of the verbs tests: simulated hosts with registered memory.
#![allow(dead_code)]

use std::ptr::NonNull;
use weft_transport::{
    Access, Completion, Device, Domain, LocalMr, MemRegion, NetAddr, PeerId, WrId, WriteWr,
};
use weft_verbs::ops::VerbsLib;
use weft_verbs::sim::{SimConfig, SimFabric, SimLib};
use weft_verbs::{VerbsConfig, VerbsDomain};

/// Runs `body` with `seed`, printing the seed if it panics.
pub fn with_seed(seed: u64, body: impl FnOnce(u64) + std::panic::UnwindSafe) {
    if let Err(e) = std::panic::catch_unwind(move || body(seed)) {
        eprintln!("verbs sim test failed with seed {seed} (rerun with this seed)");
        std::panic::resume_unwind(e);
    }
}

/// Config suited to the simulator's microsecond clock.
pub fn sim_cfg() -> VerbsConfig {
    VerbsConfig {
        handshake_timeout_ns: 40_000,
        handshake_tries: 12,
        ..VerbsConfig::default()
    }
}

/// Heap memory for tests, freed on drop (after the domains: declare it first).
pub struct Buf {
    ptr: NonNull<u8>,
    len: usize,
}

impl Buf {
    pub fn new(len: usize) -> Self {
        let b = vec![0u8; len.max(1)].into_boxed_slice();
        let ptr = NonNull::new(Box::into_raw(b) as *mut u8).unwrap();
        Self { ptr, len }
    }
    pub fn region(&self) -> MemRegion {
        // SAFETY: the buffer outlives the domains in every test (declared
        // before them) and is only accessed through raw pointers.
        unsafe { MemRegion::new(self.ptr, self.len, Device::Host) }
    }
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: in bounds.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(off), data.len())
        }
    }
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        let mut v = vec![0u8; len];
        // SAFETY: in bounds.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len) };
        v
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let s = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len.max(1));
        // SAFETY: allocated in `new` with this length.
        drop(unsafe { Box::from_raw(s) });
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
        for _ in 0..max {
            if done(out) {
                return true;
            }
            self.round(out);
        }
        done(out)
    }

    pub fn outs(&self) -> Vec<Vec<Completion>> {
        vec![Vec::new(); self.hosts.len()]
    }

    pub fn reg(&mut self, i: usize, buf: &Buf, access: Access) -> LocalMr {
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
