//! # The engine scenario suite: one set of `TransferEngine` scenarios for
//! every backend
//!
//! Where the [`Harness`](crate::Harness) cases drive single domains, these
//! scenarios drive whole [`TransferEngine`]s: one *initiator* engine in the
//! test process submits to one or more *peer* engines (in this process or in
//! child processes), and every peer verifies the bytes of each round in its
//! `expect_imm_count` callback.
//!
//! ## Plugging a backend in
//!
//! Implement [`EngineHarness`] — or, when every engine lives in the test
//! process, the smaller [`EngineBackend`] and wrap it in [`InProcessEngines`];
//! for peers in child processes use
//! [`XprocEngines`](crate::xproc::XprocEngines) — and add one test file:
//!
//! ```ignore
//! weft_conformance::engine_scenarios!(|seed| my_engine_harness(seed), seeds = [1, 2, 3]);
//! ```
//!
//! This generates one `#[test]` per scenario, each running the scenario
//! once per seed on a fresh harness; failures name the backend, the scenario
//! and the seed. A scenario that needs a hook the harness lacks (e.g.
//! [`EngineHarness::kill_peer`]) is skipped with a message printed to
//! stderr, never passed silently.
//!
//! | scenario | checks |
//! |---|---|
//! | `single_writes` | sharded single writes of 1 B .. 3 MiB+777 to 2 peers at once, each size its own imm round; bytes at imm time; ≥ 2 pieces above the sharding threshold with ≥ 2 NICs |
//! | `paged_writes` | odd page length, scattered source and destination pages, a different permutation per peer; every page at imm time |
//! | `scatter_and_barrier` | scatter to 3 peers in both modes (one imm value shared by fresh engines), each followed by a barrier; bytes and counts per peer |
//! | `send_recv_pools` | a pool of 4 receive buffers re-posted while 12 messages (1 B .. 8000 B) arrive from the initiator; each message once, intact |
//! | `send_recv_polled` | the same with a polled pool (`recv_queue`) drained by the peer |
//! | `imm_early_arrival` | rounds whose immediates arrive (all, or some) before `expect_imm_count` is armed: each fires exactly once, with every byte in place |
//! | `peer_death` | writes pending to a peer whose host dies: each resolves once, with success or `PeerUnreachable` (all fail when the harness can stop the peer first); later writes to it fail; writes to the survivor complete byte-exact, before and after |
//! | `peer_restart` | a peer killed with writes in flight, removed (`remove_peer`) and restarted (at a new address or, where the backend reuses one, the same), 20 times, a survivor alongside: every incarnation differs; each incarnation's round fires once with every byte; pending writes resolve once (ok, `PeerUnreachable` or `PeerRemoved`); the old descriptor fails `PeerRemoved`; resolved peer count back to baseline |
//! | `peer_restart_in_place` | a peer killed with writes in flight and restarted at the same NIC addresses ([`EngineHarness::restart_peer_in_place`]), 6 times, a survivor alongside: the new incarnation is newer; it replaces the old only once the old is known to have ended — even restarts: a write to the dead peer fails `PeerUnreachable` first, and the first write to the new one replaces the old; odd restarts: the first write to the new one may fail `IncarnationUnproven` (nothing sent), then `remove_peer` of the old; its rounds fire once with every byte (an immediate aimed at the old is never delivered: writes to the old descriptor fail `PeerRemoved`, never posted); peer groups with the old fail `PeerRemoved`; resolved peer count unchanged |
//! | `shutdown_in_flight` | initiator shut down with writes in flight: every accepted transfer resolves, later submits fail `ShutDown`; a peer shut down with an armed round resolves it with an error |
//!
//! ## Waits
//!
//! Every wait checks its condition, then calls [`EngineHarness::progress`],
//! at most [`EngineHarness::wait_budget`] times, then fails the scenario
//! with what it was waiting for.

mod lifecycle;
mod local;
mod run;
mod scenarios;

pub use local::{EngineBackend, InProcessEngines, LocalPeer};

use crate::{CaseFailure, HarnessError};
use serde::{Deserialize, Serialize};
use std::fmt;
use weft_engine::{GroupAddress, Imm, ImmCounts, MrDesc, ScatterMode, TransferEngine};
use weft_testkit::check_pattern;

/// Immediate values every peer allocates at start-up (fresh engines hand
/// out the same ones, which scatter and barrier rely on).
pub const PEER_IMMS: usize = 4;

/// What one submit produces at the receiver; the peer turns it into an
/// immediate count with its own [`ImmCounts`], as a real receiver does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// `submit_single_write` of `len` bytes.
    Single {
        /// Bytes.
        len: u64,
    },
    /// `submit_paged_writes` of `pages` pages of `page_len` bytes.
    Paged {
        /// Page length.
        page_len: u64,
        /// Page count.
        pages: u64,
    },
    /// One scatter destination of `len` bytes.
    Scatter {
        /// Bytes to this destination.
        len: u64,
        /// [`ScatterMode::ByBytes`] (else `ByPeer`).
        by_bytes: bool,
    },
    /// One barrier.
    Barrier,
}

impl Kind {
    /// The immediates this submit delivers to a receiver with `counts`.
    pub fn count(&self, counts: &ImmCounts) -> u64 {
        match *self {
            Kind::Single { len } => counts.single_write(len),
            Kind::Paged { page_len, pages } => counts.paged_writes(page_len, pages),
            Kind::Scatter { len, by_bytes } => counts.scatter_dst(
                len,
                if by_bytes {
                    ScatterMode::ByBytes
                } else {
                    ScatterMode::ByPeer
                },
            ),
            Kind::Barrier => counts.barrier(),
        }
    }
}

/// `len` bytes at `dst_off` of the peer's buffer must equal the pattern of
/// `seed` ([`weft_testkit::pattern()`]) from source offset `src_off`: a
/// receiver in another process needs only these numbers to check the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Offset in the initiator's source buffer.
    pub src_off: u64,
    /// Offset in the peer's buffer.
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
    /// Pattern seed of the source.
    pub seed: u64,
}

/// Checks every region of `buf` against the source pattern.
pub fn check_regions(buf: &dyn crate::TestMemory, regions: &[Region]) -> Result<(), String> {
    for r in regions {
        let got = buf
            .read(r.dst_off as usize, r.len as usize)
            .ok_or_else(|| format!("{r:?} outside the peer's buffer"))?;
        check_pattern(r.seed, r.src_off, &got).map_err(|m| format!("{r:?}: {m}"))?;
    }
    Ok(())
}

/// One peer host: an engine with one registered buffer, somewhere (this
/// process or another). All methods return without blocking on the fabric.
pub trait EnginePeer {
    /// The peer engine's main address (group 0).
    fn address(&self) -> GroupAddress;
    /// Descriptor of the peer's registered buffer.
    fn desc(&self) -> MrDesc;
    /// The [`PEER_IMMS`] immediate values the peer allocated at start-up.
    fn imms(&self) -> Vec<Imm>;
    /// Arms `imm` for the immediates of every submit in `kinds` (counted
    /// with the peer's own [`ImmCounts`]); when the round fires, the peer
    /// checks `regions` and records the result under `tag`. Returns the
    /// armed count.
    fn expect(
        &mut self,
        tag: u64,
        imm: Imm,
        kinds: Vec<Kind>,
        regions: Vec<Region>,
    ) -> Result<u64, HarnessError>;
    /// Every round result recorded so far, as `(tag, result)` in firing
    /// order, removed from the peer. A round that fires twice shows twice.
    fn take_rounds(&mut self) -> Vec<(u64, Result<(), String>)>;
    /// Posts a pool of `count` receive buffers of `len` bytes (re-posted by
    /// the engine after each message): a callback pool (`submit_recvs`), or
    /// when `polled` a queue the peer drains in
    /// [`take_received`](EnginePeer::take_received) (`recv_queue`).
    fn post_recvs(&mut self, len: u64, count: u32, polled: bool) -> Result<(), HarnessError>;
    /// Messages (or receive errors) received so far, removed from the peer.
    fn take_received(&mut self) -> Vec<Result<Vec<u8>, String>>;
    /// Shuts the peer's engine down (armed rounds then resolve with an
    /// error, visible in [`take_rounds`](EnginePeer::take_rounds)).
    fn shutdown(&mut self) -> Result<(), HarnessError>;
}

/// What a backend provides so the engine suite can drive it.
pub trait EngineHarness {
    /// Backend and profile for messages, e.g. `"loopback/adversarial"`.
    fn name(&self) -> String;
    /// The seed this harness was built with (printed on failure).
    fn seed(&self) -> u64;
    /// The initiator engine, in this process (built on the first call).
    fn initiator(&mut self) -> Result<TransferEngine, HarnessError>;
    /// Adds a peer host with a fresh engine and a registered zeroed buffer
    /// of `buf_len` bytes; returns its index (0, 1, ... in call order).
    fn add_peer(&mut self, buf_len: usize) -> Result<usize, HarnessError>;
    /// Peer `ix` (panics on an unknown one: a suite bug).
    fn peer(&mut self, ix: usize) -> &mut dyn EnginePeer;
    /// Lets everything make progress between two checks of a wait: steps a
    /// simulated fabric and manual-mode engines, or sleeps briefly when the
    /// engines run their own threads.
    fn progress(&mut self);
    /// How many checks + [`progress`](EngineHarness::progress) calls one
    /// wait may take before the scenario fails as hung.
    fn wait_budget(&self) -> u64;
    /// Fault hook: the host of peer `ix` dies now (its NICs stop answering;
    /// a child process is SIGKILLed). Default: unsupported (skips).
    fn kill_peer(&mut self, ix: usize) -> Result<(), HarnessError> {
        Err(HarnessError::Unsupported(format!(
            "no fault hook to kill peer {ix}"
        )))
    }
    /// Whether [`restart_peer_in_place`](EngineHarness::restart_peer_in_place)
    /// is supported (checked before a scenario kills anything). Default:
    /// false.
    fn restarts_in_place(&self) -> bool {
        false
    }
    /// Fault hook: killed peer `ix` comes back as a new peer at the same
    /// NIC addresses (a restarted process given its predecessor's
    /// address): a fresh engine (so a new incarnation) with a zeroed buffer
    /// of `buf_len` bytes. Returns the new peer's index. Default:
    /// unsupported (the scenario that needs it skips).
    fn restart_peer_in_place(&mut self, ix: usize, buf_len: usize) -> Result<usize, HarnessError> {
        let _ = buf_len;
        Err(HarnessError::Unsupported(format!(
            "no fault hook to restart peer {ix} at its address"
        )))
    }
    /// Fault hook: peer `ix` stops making progress but stays connected
    /// (SIGSTOP), so nothing sent to it can complete. Optional; the
    /// peer-death scenario then knows every write to it is pending.
    fn stop_peer(&mut self, ix: usize) -> Result<(), HarnessError> {
        Err(HarnessError::Unsupported(format!(
            "no fault hook to stop peer {ix}"
        )))
    }
}

/// One engine scenario.
#[derive(Clone, Copy)]
pub struct Scenario {
    /// Stable name (also the generated `#[test]`'s name).
    pub name: &'static str,
    /// The body.
    pub run: fn(&mut dyn EngineHarness) -> Result<(), CaseFailure>,
}

impl fmt::Debug for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .finish()
    }
}

/// The scenario list, single source of truth for [`scenarios`] and
/// [`engine_scenarios!`](crate::engine_scenarios).
#[doc(hidden)]
#[macro_export]
macro_rules! __weft_engine_scenarios {
    ($cb:ident { $($args:tt)* }) => {
        $crate::$cb! { { $($args)* }
            single_writes,
            paged_writes,
            scatter_and_barrier,
            send_recv_pools,
            send_recv_polled,
            imm_early_arrival,
            peer_death,
            shutdown_in_flight,
            peer_restart,
            peer_restart_in_place,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __weft_engine_table {
    ({} $($name:ident),* $(,)?) => {
        /// Every engine scenario, in a stable order.
        pub fn scenarios() -> Vec<Scenario> {
            vec![$(Scenario { name: stringify!($name), run: scenarios::$name }),*]
        }
    };
}

__weft_engine_scenarios!(__weft_engine_table {});

#[doc(hidden)]
#[macro_export]
macro_rules! __weft_engine_gen_tests {
    ({ ($factory:expr) ($seeds:expr) ($known:expr) } $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let known: &[(&str, &str)] = &$known;
                match known.iter().find(|(n, _)| *n == stringify!($name)) {
                    Some((_, why)) => $crate::engine::skip_known_failure(stringify!($name), why),
                    None => $crate::engine::run_scenario_for_seeds(&$factory, stringify!($name), $seeds),
                }
            }
        )*
    };
}

/// Generates one `#[test]` per engine scenario.
///
/// `factory` is an expression of a type `Fn(u64) -> H` with `H:`
/// [`EngineHarness`]; it is called once per seed for a fresh harness.
///
/// Scenarios listed under `known_failures` (name and the backend
/// limitation that breaks them) are not run; their test prints the reason.
///
/// ```ignore
/// weft_conformance::engine_scenarios!(|seed| make(seed), seeds = [1, 2, 3]);
/// weft_conformance::engine_scenarios!(|_| make_real());   // seed 1 only
/// weft_conformance::engine_scenarios!(|_| make_real(), seeds = [1],
///     known_failures = [("peer_death", "the provider hangs when ...")]);
/// ```
#[macro_export]
macro_rules! engine_scenarios {
    ($factory:expr $(,)?) => {
        $crate::engine_scenarios!($factory, seeds = [1u64]);
    };
    ($factory:expr, seeds = $seeds:expr $(,)?) => {
        $crate::engine_scenarios!($factory, seeds = $seeds, known_failures = []);
    };
    ($factory:expr, seeds = $seeds:expr, known_failures = $known:expr $(,)?) => {
        $crate::__weft_engine_scenarios!(__weft_engine_gen_tests { ($factory) ($seeds) ($known) });
    };
}

/// Prints that scenario `name` is not run because of a known backend
/// limitation (what [`engine_scenarios!`](crate::engine_scenarios) does
/// for `known_failures`). Panics on an unknown name (a stale list).
pub fn skip_known_failure(name: &str, why: &str) {
    assert!(
        scenario(name).is_some(),
        "weft-conformance: no engine scenario named {name:?}"
    );
    crate::note(&format!(
        "weft-conformance engine scenario {name}: KNOWN FAILURE, not run: {why}"
    ));
}

/// The scenario called `name`.
pub fn scenario(name: &str) -> Option<Scenario> {
    scenarios().into_iter().find(|c| c.name == name)
}

/// Environment variable that, when set to a number, replaces the seed list
/// of every scenario (to rerun one failing seed).
pub use weft_testkit::SEED_ENV;

/// Runs scenario `name` once per seed (only the seed in [`SEED_ENV`] when
/// that is set), each on a fresh harness from `factory(seed)`, catching
/// panics; panics with backend, scenario and seed of every failing seed.
/// Skips are printed to stderr.
pub fn run_scenario_for_seeds<H: EngineHarness, F: Fn(u64) -> H>(
    factory: &F,
    name: &str,
    seeds: impl IntoIterator<Item = u64>,
) {
    let Some(sc) = scenario(name) else {
        panic!("weft-conformance: no engine scenario named {name:?}");
    };
    let seeds = weft_testkit::seeds_or(seeds);
    let mut failed = Vec::new();
    let mut ran = 0usize;
    for seed in seeds {
        ran += 1;
        let mut backend = String::from("?");
        let result = crate::catch_failure(|| {
            let mut h = factory(seed);
            backend = h.name();
            (sc.run)(&mut h)
        });
        let line = match &result {
            Ok(()) => continue,
            Err(e) => format!("[{backend}] engine scenario {name} seed {seed}: {e}"),
        };
        match result {
            Err(CaseFailure::Skipped(_)) => crate::note(&format!("weft-conformance {line}")),
            _ => {
                crate::note(&format!(
                    "*** {line}\n*** rerun this seed alone: {SEED_ENV}={seed}"
                ));
                failed.push((seed, line));
            }
        }
    }
    if !failed.is_empty() {
        let seeds: Vec<String> = failed.iter().map(|(s, _)| s.to_string()).collect();
        let details: Vec<&str> = failed.iter().take(5).map(|(_, l)| l.as_str()).collect();
        panic!(
            "weft-conformance: engine scenario {name} failed for {} of {ran} seeds (seeds: {})\n{}",
            failed.len(),
            seeds.join(", "),
            details.join("\n")
        );
    }
}
