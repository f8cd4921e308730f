//! The engine scenario suite (`weft_conformance::engine`) over the loopback
//! fabric: manual-mode engines in step mode on the adversarial profile
//! (chunked, shuffled, jittered, lossy delivery), one host per engine with
//! 1..=3 NICs depending on the seed; a killed host can be revived at the
//! same NIC addresses (`peer_restart_in_place`). Every scenario runs under
//! several seeds; a failure prints the seed, which alone reproduces it (step mode is
//! deterministic).

use std::sync::Arc;
use std::time::Duration;
use weft_conformance::engine::{EngineBackend, InProcessEngines};
use weft_conformance::HarnessError;
use weft_engine::{DomainGroupSpec, EngineConfig, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};

/// Loopback hosts in step mode, one engine each.
struct Loopback {
    fabric: Fabric,
    seed: u64,
    nics: usize,
    hosts: Vec<weft_loopback::HostId>,
}

impl Loopback {
    fn new(seed: u64) -> Self {
        Self {
            fabric: Fabric::new(FabricConfig::adversarial(seed)),
            seed,
            nics: 1 + (seed % 3) as usize,
            hosts: Vec::new(),
        }
    }

    /// A manual-mode engine over every NIC of `host`.
    fn build(&self, host: weft_loopback::HostId) -> Result<TransferEngine, HarnessError> {
        let cfg = {
            let mut c = EngineConfig::default();
            c.queue_capacity = 256;
            c.send_slots = 16;
            c.send_slot_len = 8192;
            c.imm_capacity = 4096;
            // Step mode: nothing moves while a manual engine drains at
            // shutdown, so in-flight work fails after this.
            c.drain_timeout = Duration::from_millis(20);
            c
        };
        TransferEngine::builder()
            .group(DomainGroupSpec::new(
                Arc::new(self.fabric.provider(host)),
                (0..self.nics).collect::<Vec<_>>(),
            ))
            .config(cfg)
            .manual()
            .build()
            .map_err(|e| HarnessError::Failed(format!("engine: {e}")))
    }
}

impl EngineBackend for Loopback {
    fn name(&self) -> String {
        format!("loopback/adversarial/{}-nic", self.nics)
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn engine(&mut self, _host: usize) -> Result<TransferEngine, HarnessError> {
        let host = self.fabric.add_host(self.nics);
        self.hosts.push(host);
        self.build(host)
    }

    fn revives_hosts(&self) -> bool {
        true
    }

    fn revive_host(
        &mut self,
        host: usize,
        _old: &TransferEngine,
    ) -> Result<TransferEngine, HarnessError> {
        let h = *self
            .hosts
            .get(host)
            .ok_or_else(|| HarnessError::Failed(format!("no host {host}")))?;
        self.fabric
            .revive_host(h)
            .map_err(|e| HarnessError::Failed(format!("revive host {host}: {e}")))?;
        self.build(h)
    }

    fn progress(&mut self, engines: &[TransferEngine]) {
        let mut moved = false;
        for e in engines {
            moved |= e.progress();
        }
        if !moved {
            self.fabric.step();
        }
    }

    fn wait_budget(&self) -> u64 {
        2_000_000
    }

    fn kill_host(&mut self, host: usize, _engine: &TransferEngine) -> Result<(), HarnessError> {
        let h = self
            .hosts
            .get(host)
            .ok_or_else(|| HarnessError::Failed(format!("no host {host}")))?;
        self.fabric.kill_host(*h);
        Ok(())
    }
}

weft_conformance::engine_scenarios!(
    |seed| InProcessEngines::new(Loopback::new(seed)),
    seeds = [1u64, 2, 3, 4, 5, 6]
);
