//! Test support shared by the libfabric test binaries:
//!
//! - [`provider`]: a [`LibfabricProvider`] for `tcp` (on `lo`) or `shm`, or
//!   `None` with a printed SKIP line when libfabric is not installed;
//! - [`LfInProcess`]: the conformance suite's [`InProcessBackend`] with every
//!   host in the test process;
//! - [`LfXproc`]: the [`XprocBackend`] that puts libfabric hosts into child
//!   processes (this test binary re-executed, see [`child_entry`]) for the
//!   generic cross-process harnesses of `weft_conformance::xproc`:
//!   [`CrossProcess`] (conformance cases, domains are proxies) and
//!   [`XprocEngines`] (engine scenarios, peers are engines in children);
//! - [`engines`]: engines over libfabric for the engine scenario suite.
#![allow(dead_code)]

pub mod engines;
pub mod xflow;

use std::io::Write;
use std::time::Duration;

use weft_conformance::xproc::XprocBackend;
use weft_conformance::{HarnessError, HostId, InProcessBackend};
use weft_engine::TransferEngine;
use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::{Domain, NetAddr, Provider};

/// Most NICs a test host opens.
pub const MAX_NICS: usize = 4;

/// A provider for `name` (`"tcp"` on `lo`, or `"shm"`) with `MAX_NICS`
/// endpoints of the same NIC, or `None` (printed) when libfabric is missing.
pub fn provider(name: &str) -> Option<LibfabricProvider> {
    let domain = match name {
        "tcp" => "lo",
        other => other,
    };
    let cfg = LibfabricConfig::new(name)
        .with_domains(vec![domain; MAX_NICS])
        .with_connect_timeout(Duration::from_secs(3));
    open_or_skip(name, cfg)
}

/// A provider for `name` (`"tcp"` on `lo`, or `"shm"`) with one endpoint,
/// or `None` (printed) when libfabric is missing.
pub fn one_nic_provider(name: &str) -> Option<LibfabricProvider> {
    let cfg = match name {
        "tcp" => LibfabricConfig::new("tcp").with_domains(["lo"]),
        other => LibfabricConfig::new(other),
    };
    open_or_skip(name, cfg)
}

/// The provider `cfg` describes, or `None` with a printed SKIP line.
fn open_or_skip(name: &str, cfg: LibfabricConfig) -> Option<LibfabricProvider> {
    match LibfabricProvider::with_config(cfg) {
        Ok(p) => Some(p),
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "SKIP: libfabric provider {name} unavailable: {e}"
            );
            None
        }
    }
}

/// An engine with one group on [`one_nic_provider`]`(name)`, built with
/// `cfg`; `None` when libfabric is missing.
pub fn one_nic_engine(name: &str, cfg: weft_engine::EngineConfig) -> Option<TransferEngine> {
    let p = std::sync::Arc::new(one_nic_provider(name)?);
    Some(
        TransferEngine::builder()
            .group(weft_engine::DomainGroupSpec::new(p, vec![0]))
            .config(cfg)
            .build()
            .expect("engine builds"),
    )
}

fn unreachable_addr_for(provider: &LibfabricProvider, name: &str) -> Result<NetAddr, HarnessError> {
    if name == "shm" {
        // A well-formed shm name whose region does not exist.
        return Ok(NetAddr(b"fi_shm://999999999:7:7\0".to_vec()));
    }
    // A tcp endpoint that existed and is closed again: its port refuses.
    let d = provider
        .open(0)
        .map_err(|e| HarnessError::Failed(format!("open for unreachable_addr: {e}")))?;
    let addr = d.local_addr().clone();
    drop(d);
    Ok(addr)
}

// ---------------------------------------------------------------------------
// In-process
// ---------------------------------------------------------------------------

/// Every host in this process.
pub struct LfInProcess {
    pub name: String,
    pub provider: Option<LibfabricProvider>,
    pub seed: u64,
}

impl LfInProcess {
    /// The conformance harness for provider `name` (cases are skipped with
    /// a message when libfabric is missing).
    pub fn harness(name: &str, seed: u64) -> weft_conformance::InProcess<LfInProcess> {
        weft_conformance::InProcess::new(LfInProcess {
            name: name.to_string(),
            provider: provider(name),
            seed,
        })
    }
}

fn missing() -> HarnessError {
    HarnessError::Unsupported("libfabric is not installed (apt-get install libfabric1)".into())
}

impl InProcessBackend for LfInProcess {
    fn name(&self) -> String {
        format!("libfabric:{}/in-process", self.name)
    }
    fn seed(&self) -> u64 {
        self.seed
    }
    fn add_host(
        &mut self,
        _host: HostId,
        nics: usize,
    ) -> Result<Vec<Box<dyn Domain>>, HarnessError> {
        if nics > MAX_NICS {
            return Err(HarnessError::Unsupported(format!(
                "{nics} NICs per host (max {MAX_NICS})"
            )));
        }
        let provider = self.provider.as_ref().ok_or_else(missing)?;
        (0..nics)
            .map(|i| {
                provider
                    .open(i)
                    .map_err(|e| HarnessError::Failed(format!("open nic {i}: {e}")))
            })
            .collect()
    }
    fn progress(&mut self) {
        std::thread::yield_now();
    }
    fn kill_host(&mut self, host: HostId) -> Result<(), HarnessError> {
        Err(HarnessError::Unsupported(format!(
            "{host} shares this process (the cross-process harness kills hosts)"
        )))
    }
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        unreachable_addr_for(self.provider.as_ref().ok_or_else(missing)?, &self.name)
    }
}

// ---------------------------------------------------------------------------
// Cross-process
// ---------------------------------------------------------------------------

/// The conformance harness with every host in its own child process.
pub type CrossProcess = weft_conformance::xproc::CrossProcess<LfXproc>;

/// The engine-suite harness with every peer engine in its own child process.
pub type XprocEngines = weft_conformance::xproc::XprocEngines<LfXproc>;

/// The body of the `peer_process_entry` test every test binary using
/// [`CrossProcess`] or [`XprocEngines`] defines: serves the parent in a
/// child, checks the proxy codec when run normally.
pub fn child_entry() {
    weft_conformance::xproc::child_entry::<LfXproc>();
}

/// libfabric hosts in child processes. The profile is the provider name
/// (`tcp` or `shm`), optionally followed by `;write_timeout_ms=N` (engines
/// of that profile fail a WRITE that is not acknowledged within N ms).
pub struct LfXproc {
    name: String,
    write_timeout: Option<Duration>,
    provider: LibfabricProvider,
}

impl XprocBackend for LfXproc {
    fn from_profile(profile: &str) -> Result<Self, HarnessError> {
        let mut parts = profile.split(';');
        let name = parts.next().unwrap_or_default().to_string();
        let mut write_timeout = None;
        for p in parts {
            match p.strip_prefix("write_timeout_ms=").map(str::parse::<u64>) {
                Some(Ok(ms)) => write_timeout = Some(Duration::from_millis(ms)),
                _ => return Err(HarnessError::Failed(format!("bad profile part {p:?}"))),
            }
        }
        let provider = provider(&name).ok_or_else(missing)?;
        Ok(Self {
            name,
            write_timeout,
            provider,
        })
    }
    fn name(&self) -> String {
        format!("libfabric:{}", self.name)
    }
    fn max_nics(&self) -> usize {
        MAX_NICS
    }
    fn open_domains(&self, nics: usize) -> Result<Vec<Box<dyn Domain>>, String> {
        (0..nics)
            .map(|i| {
                self.provider
                    .open(i)
                    .map_err(|e| format!("open nic {i}: {e}"))
            })
            .collect()
    }
    fn engine(&self) -> Result<TransferEngine, String> {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
        let wt = self.write_timeout;
        let p = engines::lf_provider(&self.name, |c| match wt {
            Some(t) => c.with_write_timeout(t),
            None => c,
        })
        .map_err(|e| e.to_string())?;
        engines::lf_engine(p)
    }
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        unreachable_addr_for(&self.provider, &self.name)
    }
    fn reaped(&mut self, pid: u32) {
        remove_shm_regions(pid);
    }
}

/// Removes the shm regions (`/dev/shm/<pid>:<n>:<n>`) and weft's key
/// tables and doorbells next to them (`weft-keys.<pid>:...`, `weft-bell.`) a reaped child left behind:
/// SIGKILL skips the clean-up, and the files would pile up (16 MiB of tmpfs
/// per region) until a later process reclaims them.
fn remove_shm_regions(pid: u32) {
    let prefix = format!("{pid}:");
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for e in dir.flatten() {
        if e.file_name().to_str().is_some_and(|n| {
            n.strip_prefix("weft-keys.")
                .or_else(|| n.strip_prefix("weft-bell."))
                .unwrap_or(n)
                .starts_with(&prefix)
        }) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Generates one `#[test]` per conformance case (seed 0) for `$factory`;
/// cases listed under `known_failures` are `#[ignore]`d with the provider
/// limitation that breaks them, in a `known_failures` module (run them with
/// `-- --ignored known_failures`). A further
/// test checks that every case of the suite is listed exactly once.
#[macro_export]
macro_rules! lf_conformance {
    ($factory:expr; pass: $($name:ident),* $(,)?; known_failures: $($iname:ident = $why:literal),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                weft_conformance::run_case_for_seeds(&$factory, stringify!($name), [0u64]);
            }
        )*
        /// Cases the provider cannot satisfy: ignored with the reason, and
        /// skipped by `cargo xtask test` (which runs every other ignored test).
        mod known_failures {
            $(
                #[test]
                #[ignore = $why]
                fn $iname() {
                    weft_conformance::run_case_for_seeds(&$factory, stringify!($iname), [0u64]);
                }
            )*
        }
        #[test]
        fn every_case_listed() {
            let mut listed: Vec<&str> = vec![$(stringify!($name),)* $(stringify!($iname),)*];
            listed.sort_unstable();
            let mut all: Vec<&str> = weft_conformance::cases().iter().map(|c| c.name).collect();
            all.sort_unstable();
            assert_eq!(listed, all, "conformance case list out of date");
        }
    };
}
