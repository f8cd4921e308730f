//! End-to-end: the engine scenario suite (`weft_conformance::engine`) over
//! verbs on the simulated RC device: manual-mode TransferEngines, one host
//! of 2 devices (NICs) per engine, 10% of the UD handshakes lost (connection
//! set-up retransmits), writes split at 64 KiB (`max_wr_len`). Sharded
//! single writes, paged writes, scatter, barrier, two-sided messages with a
//! receive pool, early immediates, peer death (the host's devices are
//! killed) and shutdown with work in flight; completion via ImmCounter,
//! bytes checked by every receiver; a killed host can be revived at the
//! same addresses (`peer_restart_in_place`). A failure prints the seed.

use std::sync::Arc;
use std::time::Duration;
use weft_conformance::engine::{EngineBackend, InProcessEngines};
use weft_conformance::HarnessError;
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_verbs::sim::{SimConfig, SimFabric};
use weft_verbs::{VerbsConfig, VerbsProvider};

const NICS: usize = 2;

/// Simulated hosts on one fabric, one manual-mode engine each.
struct VerbsSim {
    fabric: SimFabric,
    seed: u64,
    hosts: usize,
}

impl VerbsSim {
    fn new(seed: u64) -> Self {
        let mut sc = SimConfig::new(seed);
        sc.ud_drop_prob = 0.1;
        Self {
            fabric: SimFabric::new(sc),
            seed,
            hosts: 0,
        }
    }

    /// A manual-mode engine over the devices `lib` lists.
    fn build(lib: weft_verbs::sim::SimLib) -> Result<TransferEngine, HarnessError> {
        let cfg = VerbsConfig {
            handshake_timeout_ns: 40_000,
            handshake_tries: 40,
            max_wr_len: Some(64 * 1024),
            ..VerbsConfig::default()
        };
        let p = Arc::new(VerbsProvider::with_lib(lib, cfg));
        let ecfg = {
            let mut c = EngineConfig::default();
            // Nothing moves while a manual engine drains at shutdown.
            c.drain_timeout = Duration::from_millis(20);
            c
        };
        TransferEngine::builder()
            .group(DomainGroupSpec::new(p, (0..NICS).collect::<Vec<_>>()))
            .config(ecfg)
            .manual()
            .build()
            .map_err(|e| HarnessError::Failed(format!("engine over verbs/sim: {e}")))
    }
}

impl EngineBackend for VerbsSim {
    fn name(&self) -> String {
        format!("verbs/sim/{NICS}-nic")
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn engine(&mut self, host: usize) -> Result<TransferEngine, HarnessError> {
        let lib = self.fabric.add_host(&format!("h{host}"), NICS);
        self.hosts += 1;
        Self::build(lib)
    }

    fn revives_hosts(&self) -> bool {
        true
    }

    fn revive_host(
        &mut self,
        host: usize,
        _old: &TransferEngine,
    ) -> Result<TransferEngine, HarnessError> {
        let names: Vec<String> = (0..NICS).map(|n| format!("h{host}n{n}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let lib = self
            .fabric
            .revive(&names)
            .map_err(|e| HarnessError::Failed(format!("revive host {host}: {e}")))?;
        Self::build(lib)
    }

    fn progress(&mut self, engines: &[TransferEngine]) {
        for e in engines {
            e.progress();
        }
        self.fabric.step();
    }

    fn wait_budget(&self) -> u64 {
        500_000
    }

    fn kill_host(&mut self, host: usize, _engine: &TransferEngine) -> Result<(), HarnessError> {
        if host >= self.hosts {
            return Err(HarnessError::Failed(format!("no host {host}")));
        }
        for n in 0..NICS {
            self.fabric.kill(&format!("h{host}n{n}"));
        }
        Ok(())
    }
}

weft_conformance::engine_scenarios!(
    |seed| InProcessEngines::new(VerbsSim::new(seed)),
    seeds = [1u64, 2, 3, 6]
);
