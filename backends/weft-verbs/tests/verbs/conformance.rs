//! The conformance suite over verbs on the simulated RC device.

use weft_conformance::{HarnessError, HostId, InProcess, InProcessBackend};
use weft_transport::{Domain, NetAddr};
use weft_verbs::ops::{Gid, VerbsLib};
use weft_verbs::sim::{SimConfig, SimFabric};
use weft_verbs::wire::VerbsAddr;
use weft_verbs::{VerbsConfig, VerbsDomain};

/// Verbs domains on simulated devices: one device per NIC, all on one fabric.
struct VerbsSim {
    fabric: SimFabric,
    seed: u64,
    cfg: VerbsConfig,
    devices: Vec<Vec<String>>,
}

impl VerbsSim {
    fn new(seed: u64) -> Self {
        let mut sc = SimConfig::new(seed);
        // Lose some handshakes: connection set-up must retransmit.
        sc.ud_drop_prob = 0.1;
        let cfg = VerbsConfig {
            handshake_timeout_ns: 40_000,
            handshake_tries: 40,
            // Exercise splitting of long writes (64 MiB = 64 pieces).
            max_wr_len: Some(1 << 20),
            ..VerbsConfig::default()
        };
        Self {
            fabric: SimFabric::new(sc),
            seed,
            cfg,
            devices: Vec::new(),
        }
    }
}

impl InProcessBackend for VerbsSim {
    fn name(&self) -> String {
        "verbs/sim".into()
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn add_host(
        &mut self,
        host: HostId,
        nics: usize,
    ) -> Result<Vec<Box<dyn Domain>>, HarnessError> {
        let mut out: Vec<Box<dyn Domain>> = Vec::new();
        let mut names = Vec::new();
        for n in 0..nics {
            let name = format!("h{}n{n}", host.0);
            let lib = self.fabric.add_device(&name);
            let ops = lib
                .open(0)
                .map_err(|e| HarnessError::Failed(e.to_string()))?;
            let d = VerbsDomain::open(ops, self.cfg.clone(), Some(0))
                .map_err(|e| HarnessError::Failed(e.to_string()))?;
            out.push(Box::new(d));
            names.push(name);
        }
        self.devices.push(names);
        Ok(out)
    }

    fn progress(&mut self) {
        self.fabric.step();
    }

    fn kill_host(&mut self, host: HostId) -> Result<(), HarnessError> {
        let names = self
            .devices
            .get(host.0)
            .ok_or_else(|| HarnessError::Failed(format!("no {host}")))?;
        for n in names {
            self.fabric.kill(n);
        }
        Ok(())
    }

    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        Ok(VerbsAddr {
            gid: Gid([0xee; 16]),
            lid: 0xfffe,
            ud_qpn: 0x77,
        }
        .encode())
    }
}

weft_conformance::conformance_tests!(
    |seed| InProcess::new(VerbsSim::new(seed)),
    seeds = 0..6u64,
    heavy_seeds = 0..1u64
);
