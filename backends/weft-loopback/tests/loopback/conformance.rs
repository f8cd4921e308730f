//! The weft conformance suite (`weft-conformance`) over the loopback fabric.
//!
//! `adversarial`: every case under seeds 0..50 with the adversarial profile
//! (chunked, shuffled, jittered, lossy delivery; random receive matching);
//! the heavy case (16 MiB + 64 MiB writes) only under seeds 0..3 to keep the
//! debug-build test time modest. `ideal`: every case once with the ideal
//! profile. Each case runs in step mode: `progress` is one simulated event,
//! `settle` runs the event queue dry.

use std::sync::{Arc, Mutex};
use weft_conformance::{HarnessError, HostId, InProcess, InProcessBackend};
use weft_loopback::{Fabric, FabricConfig};
use weft_transport::Domain;
use weft_transport::{
    Access, Capabilities, Completion, Imm, LocalMr, LocalSlice, MemRegion, MrKey, NetAddr, NicInfo,
    PeerId, PostError, TransportError, WrId, WriteWr,
};

/// The loopback fabric in step mode, as a conformance backend.
struct Loopback {
    fabric: Fabric,
    profile: &'static str,
    seed: u64,
    hosts: Vec<weft_loopback::HostId>,
    /// Deliberate bug injected around every domain (suite self-test only).
    mutant: Option<Mutation>,
    early_imms: EarlyImms,
    /// Pretend the fault hook is missing (self-test of skipping).
    no_kill_hook: bool,
}

impl InProcessBackend for Loopback {
    fn name(&self) -> String {
        format!("loopback/{}", self.profile)
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn add_host(
        &mut self,
        host: HostId,
        nics: usize,
    ) -> Result<Vec<Box<dyn Domain>>, HarnessError> {
        let h = self.fabric.add_host(nics);
        if self.hosts.len() != host.0 {
            return Err(HarnessError::Failed(format!(
                "host ids out of step: {host} vs {}",
                self.hosts.len()
            )));
        }
        self.hosts.push(h);
        (0..nics)
            .map(|n| {
                self.fabric
                    .open(h, n)
                    .map(|d| match self.mutant {
                        None => Box::new(d) as Box<dyn Domain>,
                        Some(m) => Box::new(Mutant::new(Box::new(d), m, self.early_imms.clone())),
                    })
                    .map_err(|e| HarnessError::Failed(format!("open {host}/nic{n}: {e}")))
            })
            .collect()
    }

    fn progress(&mut self) {
        self.fabric.step();
    }

    fn wait_budget(&self) -> u64 {
        // Mutants that lose completions must fail fast, not after 2M rounds.
        if self.mutant.is_some() {
            20_000
        } else {
            weft_conformance::DEFAULT_WAIT_BUDGET
        }
    }

    fn settle(&mut self) {
        self.fabric.run_until_idle();
    }

    fn kill_host(&mut self, host: HostId) -> Result<(), HarnessError> {
        if self.no_kill_hook {
            return Err(HarnessError::Unsupported("kill hook disabled".into()));
        }
        let h = self
            .hosts
            .get(host.0)
            .ok_or_else(|| HarnessError::Failed(format!("no {host}")))?;
        self.fabric.kill_host(*h);
        Ok(())
    }

    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        // A well-formed loopback address of a host that is never created.
        Ok(Fabric::nic_addr(weft_loopback::HostId(1_000_000), 0))
    }
}

fn loopback(profile: &'static str, config: FabricConfig, seed: u64) -> InProcess<Loopback> {
    InProcess::new(Loopback {
        fabric: Fabric::new(config),
        profile,
        seed,
        hosts: Vec::new(),
        mutant: None,
        early_imms: EarlyImms::default(),
        no_kill_hook: false,
    })
}

mod adversarial {
    weft_conformance::conformance_tests!(
        |seed| super::loopback(
            "adversarial",
            weft_loopback::FabricConfig::adversarial(seed),
            seed
        ),
        seeds = 0..50u64,
        heavy_seeds = 0..3u64,
    );
}

mod ideal {
    weft_conformance::conformance_tests!(|seed| super::loopback(
        "ideal",
        weft_loopback::FabricConfig::ideal(seed),
        seed
    ));
}

// ---- Suite self-test: deliberately broken backends must fail the suite ----

/// A deliberate contract violation, injected by wrapping every domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutation {
    /// Every immediate is reported twice.
    DuplicateImm,
    /// Failed WRITEs are reported as successful.
    ErrorsBecomeOk,
    /// Every 7th WRITE completion is never reported.
    LoseWriteCompletions,
    /// The immediate is reported at the target as soon as the WRITE is
    /// posted, before its payload has landed.
    ImmBeforePayload,
}

/// Immediates "sent ahead" by [`Mutation::ImmBeforePayload`]: (target address, imm).
type EarlyImms = Arc<Mutex<Vec<(NetAddr, Imm)>>>;

struct Mutant {
    inner: Box<dyn Domain>,
    m: Mutation,
    writes_seen: u64,
    peers: Vec<(PeerId, NetAddr)>,
    early: EarlyImms,
}

impl Mutant {
    fn new(inner: Box<dyn Domain>, m: Mutation, early: EarlyImms) -> Self {
        Self {
            inner,
            m,
            writes_seen: 0,
            peers: Vec::new(),
            early,
        }
    }
}

impl Domain for Mutant {
    fn info(&self) -> &NicInfo {
        self.inner.info()
    }
    fn capabilities(&self) -> &Capabilities {
        self.inner.capabilities()
    }
    fn register(&mut self, region: &MemRegion, access: Access) -> Result<LocalMr, TransportError> {
        self.inner.register(region, access)
    }
    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError> {
        self.inner.deregister(mr)
    }
    fn add_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError> {
        let p = self.inner.add_peer(addr)?;
        self.peers.push((p, addr.clone()));
        Ok(p)
    }
    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError> {
        self.inner.post_send(wr, peer, src)
    }
    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError> {
        self.inner.post_recv(wr, buf)
    }
    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError> {
        if self.m != Mutation::ImmBeforePayload {
            return self.inner.post_writes(wrs);
        }
        let stripped: Vec<WriteWr> = wrs.iter().map(|w| WriteWr { imm: None, ..*w }).collect();
        let r = self.inner.post_writes(&stripped);
        let n = match &r {
            Ok(n) => *n,
            Err(e) => e.posted,
        };
        for w in &wrs[..n] {
            if let (Some(imm), Some((_, addr))) = (w.imm, self.peers.iter().find(|p| p.0 == w.peer))
            {
                self.early.lock().unwrap().push((addr.clone(), imm));
            }
        }
        r
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        let start = out.len();
        let mut got = Vec::new();
        self.inner.poll(&mut got)?;
        if self.m == Mutation::ImmBeforePayload {
            let me = self.inner.local_addr().clone();
            let mut q = self.early.lock().unwrap();
            q.retain(|(a, imm)| {
                let mine = *a == me;
                if mine {
                    got.push(Completion::Imm { imm: *imm });
                }
                !mine
            });
        }
        for c in got {
            match (self.m, c) {
                (Mutation::DuplicateImm, c @ Completion::Imm { .. }) => {
                    out.push(c.clone());
                    out.push(c);
                }
                (Mutation::ErrorsBecomeOk, Completion::Write { wr, result: Err(_) }) => {
                    out.push(Completion::Write { wr, result: Ok(()) });
                }
                (Mutation::LoseWriteCompletions, c @ Completion::Write { .. }) => {
                    self.writes_seen += 1;
                    if !self.writes_seen.is_multiple_of(7) {
                        out.push(c);
                    }
                }
                (_, c) => out.push(c),
            }
        }
        Ok(out.len() - start)
    }
}

mod mutants {
    use super::*;

    fn failure(m: Mutation, case: &str) -> String {
        let factory = |seed| {
            let mut h = loopback("mutant", FabricConfig::adversarial(seed), seed);
            h.backend().mutant = Some(m);
            h
        };
        let case = weft_conformance::case(case).expect("case exists");
        let o = weft_conformance::run_seed(&factory, &case, 1);
        match o.result {
            Err(weft_conformance::CaseFailure::Failed(msg)) => msg,
            other => panic!("mutant {m:?} passed case {} (seed 1): {other:?}", case.name),
        }
    }

    #[test]
    fn duplicate_imm_is_caught() {
        let msg = failure(Mutation::DuplicateImm, "imm_exactly_once");
        assert!(msg.contains("(duplicate, or an immediate"), "{msg}");
    }

    #[test]
    fn swallowed_remote_errors_are_caught() {
        let msg = failure(Mutation::ErrorsBecomeOk, "remote_access_violations");
        assert!(msg.contains("completed successfully"), "{msg}");
    }

    #[test]
    fn lost_completions_fail_instead_of_hanging() {
        let msg = failure(Mutation::LoseWriteCompletions, "write_sizes");
        assert!(msg.contains("gave up waiting"), "{msg}");
    }

    #[test]
    fn imm_before_payload_is_caught() {
        let msg = failure(Mutation::ImmBeforePayload, "payload_visible_at_imm");
        assert!(msg.contains("when that immediate was polled"), "{msg}");
    }

    #[test]
    fn missing_fault_hook_skips_instead_of_passing() {
        let factory = |seed| {
            let mut h = loopback("no-kill-hook", FabricConfig::ideal(seed), seed);
            h.backend().no_kill_hook = true;
            h
        };
        let case = weft_conformance::case("peer_death").expect("case exists");
        let o = weft_conformance::run_seed(&factory, &case, 0);
        assert!(
            matches!(o.result, Err(weft_conformance::CaseFailure::Skipped(_))),
            "{o}"
        );
    }
}
