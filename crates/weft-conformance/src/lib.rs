//! # weft-conformance: one suite for every weft backend
//!
//! The semantics contract of [`weft_transport`] (reliable, unordered across
//! and within writes, immediate only after payload, delivery-complete write
//! completions, failures without immediates, peer death, receive rules, flow
//! control) written as executable cases. The cases are written once against
//! the [`Domain`](weft_transport::Domain) trait and run unchanged for every
//! backend: the loopback simulator, libfabric (tcp/shm, endpoints possibly in
//! separate processes) and verbs over a simulated device.
//!
//! ## Plugging a backend in
//!
//! 1. Implement [`Harness`] (or, when every host lives in the test process,
//!    the smaller [`InProcessBackend`] and wrap it in [`InProcess`]). The
//!    suite does *everything* through the harness: memory is allocated,
//!    filled, read and registered by the harness, domains are reached through
//!    [`Harness::domain`] (which may return a proxy to another process), and
//!    time advances only through [`Harness::progress`].
//! 2. Add one test file to the backend crate:
//!
//! ```ignore
//! // backends/weft-foo/tests/conformance.rs
//! weft_conformance::conformance_tests!(|seed| my_harness(seed), seeds = 0..50, heavy_seeds = 0..3);
//! ```
//!
//! This generates one `#[test]` per case (named like the case), each running
//! the case once per seed on a fresh harness. [`Weight::Heavy`] cases (64 MiB
//! writes) use `heavy_seeds`. `conformance_tests!(factory)` alone runs every
//! case with seed 0.
//!
//! Failures name the backend ([`Harness::name`]), the case and the seed.
//! A case that needs a hook the harness lacks (e.g. [`Harness::kill_host`])
//! is skipped with a message written straight to stderr (visible even when
//! the test harness captures output), never passed silently.
//!
//! ## What the cases check
//!
//! Every case also checks, on every poll: each completion belongs to a WR
//! posted on that domain and not yet completed, with the right kind;
//! `poll` returns the number it appended; every immediate was expected
//! (counted per value and target NIC, never exceeded); registered payload
//! checks run at the instant an immediate or a write completion is polled.
//! Most cases end with a quiescence check (settle, then nothing more may
//! arrive, every SEND/WRITE completed, immediate counts exact).
//!
//! | case | checks |
//! |---|---|
//! | `capabilities_sane` | limits ≥ 1, stable; addresses non-empty and distinct; `add_peer` idempotent; `poll` appends; empty batch |
//! | `send_recv_sizes` | 0 B, 1 B, odd sizes .. `max_send_len` (≤ 8 MiB): exact-size buffers (nothing written past), then all at once |
//! | `recv_buffer_pool` | 8 buffers, 240 SENDs from 2 senders, reposted on completion; each message once, intact, buffer identified by WR id |
//! | `message_too_long` | SEND > buffer fails `MessageTooLong`, nothing past the buffer; SEND > `max_send_len` rejected |
//! | `receiver_not_ready` | SEND with no buffer fails `ReceiverNotReady`; later traffic fine, failed message never delivered |
//! | `write_sizes` | 0 B .. 1 MiB+17, odd offsets, with/without imm; guards untouched |
//! | `write_large` (heavy) | 16 MiB+5 and 64 MiB, byte for byte |
//! | `imm_only_writes` | zero-length writes with/without imm (also at the region's end); memory untouched |
//! | `batch_writes_queue_full` | flood without polling stops by `max_inflight`, ≤ `max_batch` per call, QueueFull/short counts retried; nothing lost |
//! | `imm_exactly_once` | repeated imm values from 2 senders, exact counts at quiescence |
//! | `payload_visible_at_imm` | multi-chunk writes: all bytes in place when the imm (and the write completion) is polled |
//! | `concurrent_writes` | 3 senders, private + overlapping targets: every byte from some covering write |
//! | `multi_nic` | NIC i → peer NIC i with per-NIC rkeys; imm on the receiving NIC only; SEND on NIC 1 |
//! | `remote_access_violations` | out of bounds, overflow, foreign rkey, local-only, deregistered: `RemoteAccess`, nothing written, no imm |
//! | `usable_after_remote_error` | same peer works after a rejected write |
//! | `local_access_errors` | bad local slices/keys (incl. another NIC's key) for WRITE/SEND/RECV: `LocalAccess`, nothing touched |
//! | `deregistered_memory` | stale lkey → `LocalAccess`; double/unknown deregister → error; write into deregistered region → `RemoteAccess`; re-register works |
//! | `unknown_peer` | unreachable address → `PeerUnreachable`; malformed addresses → errors; never hangs |
//! | `peer_death` | in-flight ops to a killed host: once, Ok or `PeerUnreachable`; later ops `PeerUnreachable`; survivors unaffected |
//! | `peer_removal` | `remove_peer`: WRITE/SEND naming the removed handle fail `PeerRemoved`, write nothing; removing again is a no-op; re-adding the address gives a new handle that works (bytes, one immediate) |
//!
//! ## Engine scenarios and hosts in other processes
//!
//! - [`engine`]: the same idea one level up — `TransferEngine` scenarios
//!   (scatter, paged writes, barrier, send/recv pools, early immediates,
//!   peer death, shutdown with work in flight) written once against
//!   [`engine::EngineHarness`] and expanded per backend by
//!   [`engine_scenarios!`].
//! - [`xproc`]: harnesses whose hosts are child processes (the test binary
//!   re-executed), for any backend implementing [`xproc::XprocBackend`]:
//!   [`xproc::CrossProcess`] for the cases above, [`xproc::XprocEngines`]
//!   for the engine scenarios.
//!
//! Both are built on `weft-testkit` (patterns, child processes re-running
//! the test binary) and [`weft_transport::HostBuffer`] (the memory engines
//! register).
//!
//! ## Bounded waits
//!
//! Every wait polls the domains involved and calls [`Harness::progress`] at
//! most [`Harness::wait_budget`] times, then fails with what is still
//! outstanding. No case reads a clock.

#![deny(unsafe_code)]

mod cases;
mod ctx;
pub mod data_path;
pub mod engine;
mod harness;
mod memory;
mod pattern;
pub mod xproc;

pub use harness::{
    BufId, Harness, HarnessError, HostId, InProcess, InProcessBackend, DEFAULT_SETTLE_ROUNDS,
    DEFAULT_WAIT_BUDGET,
};
pub use memory::{host_memory, TestMemory};

use std::fmt;
use std::io::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Why a case did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CaseFailure {
    /// The backend broke the contract (or hung): what, where, which WR.
    Failed(String),
    /// The harness cannot run this case (missing fault hook, too few NICs).
    Skipped(String),
}

impl fmt::Display for CaseFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaseFailure::Failed(m) => write!(f, "FAILED: {m}"),
            CaseFailure::Skipped(m) => write!(f, "SKIPPED: {m}"),
        }
    }
}

impl std::error::Error for CaseFailure {}

/// How expensive a case is; lets backends run heavy ones on fewer seeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weight {
    /// Cheap enough to run under every seed.
    Normal,
    /// Large transfers (tens of MiB); run under fewer seeds in debug builds.
    Heavy,
}

/// One conformance case.
#[derive(Clone, Copy)]
pub struct Case {
    /// Stable name (also the generated `#[test]`'s name).
    pub name: &'static str,
    /// Cost class.
    pub weight: Weight,
    /// The case body.
    pub run: fn(&mut dyn Harness) -> Result<(), CaseFailure>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case")
            .field("name", &self.name)
            .field("weight", &self.weight)
            .finish()
    }
}

/// The case list, the single source of truth for [`cases`] and
/// [`conformance_tests!`]. Calls `$crate::$cb! { {args} name: Weight, ... }`.
#[doc(hidden)]
#[macro_export]
macro_rules! __weft_conformance_cases {
    ($cb:ident { $($args:tt)* }) => {
        $crate::$cb! { { $($args)* }
            capabilities_sane: Normal,
            send_recv_sizes: Normal,
            recv_buffer_pool: Normal,
            message_too_long: Normal,
            receiver_not_ready: Normal,
            write_sizes: Normal,
            write_large: Heavy,
            imm_only_writes: Normal,
            batch_writes_queue_full: Normal,
            imm_exactly_once: Normal,
            payload_visible_at_imm: Normal,
            concurrent_writes: Normal,
            multi_nic: Normal,
            remote_access_violations: Normal,
            usable_after_remote_error: Normal,
            local_access_errors: Normal,
            deregistered_memory: Normal,
            unknown_peer: Normal,
            peer_death: Normal,
            peer_removal: Normal,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __weft_conformance_table {
    ({} $($name:ident : $w:ident),* $(,)?) => {
        /// Every case of the suite, in a stable order.
        pub fn cases() -> Vec<Case> {
            vec![$(Case { name: stringify!($name), weight: Weight::$w, run: cases::$name }),*]
        }
    };
}

__weft_conformance_cases!(__weft_conformance_table {});

#[doc(hidden)]
#[macro_export]
macro_rules! __weft_conformance_gen_tests {
    ({ ($factory:expr) ($seeds:expr) ($heavy:expr) } $($name:ident : $w:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let seeds: ::std::vec::Vec<u64> = match $crate::Weight::$w {
                    $crate::Weight::Heavy => ::std::iter::IntoIterator::into_iter($heavy).collect(),
                    $crate::Weight::Normal => ::std::iter::IntoIterator::into_iter($seeds).collect(),
                };
                $crate::run_case_for_seeds(&$factory, stringify!($name), seeds);
            }
        )*
    };
}

/// Generates one `#[test]` per conformance case.
///
/// `factory` is an expression of a type `Fn(u64) -> H` with `H:`
/// [`Harness`]; it is called once per seed for a fresh harness.
///
/// ```ignore
/// weft_conformance::conformance_tests!(|seed| make(seed), seeds = 0..50, heavy_seeds = 0..3);
/// weft_conformance::conformance_tests!(|_| make_real());   // seed 0 only
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr $(,)?) => {
        $crate::conformance_tests!($factory, seeds = 0..1u64, heavy_seeds = 0..1u64);
    };
    ($factory:expr, seeds = $seeds:expr, heavy_seeds = $heavy:expr $(,)?) => {
        $crate::__weft_conformance_cases!(__weft_conformance_gen_tests { ($factory) ($seeds) ($heavy) });
    };
}

/// The case called `name`.
pub fn case(name: &str) -> Option<Case> {
    cases().into_iter().find(|c| c.name == name)
}

/// Runs one case on one harness.
pub fn run_case(h: &mut dyn Harness, case: &Case) -> Result<(), CaseFailure> {
    (case.run)(h)
}

/// The outcome of one case under one seed.
#[derive(Debug, Clone)]
pub struct SeedOutcome {
    /// Case name.
    pub case: &'static str,
    /// Seed the harness was built with.
    pub seed: u64,
    /// Backend name as reported by the harness (`?` if the factory panicked).
    pub backend: String,
    /// `Ok` or why not.
    pub result: Result<(), CaseFailure>,
}

impl fmt::Display for SeedOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.result {
            Ok(()) => write!(
                f,
                "[{}] case {} seed {}: ok",
                self.backend, self.case, self.seed
            ),
            Err(e) => write!(
                f,
                "[{}] case {} seed {}: {e}",
                self.backend, self.case, self.seed
            ),
        }
    }
}

/// Runs `case` once on a fresh harness from `factory(seed)`, catching panics
/// (of the backend or the harness) as failures.
pub fn run_seed<H: Harness, F: Fn(u64) -> H>(factory: &F, case: &Case, seed: u64) -> SeedOutcome {
    let mut backend = String::from("?");
    let result = catch_failure(|| {
        let mut h = factory(seed);
        backend = h.name();
        run_case(&mut h, case)
    });
    SeedOutcome {
        case: case.name,
        seed,
        backend,
        result,
    }
}

/// Runs a case or scenario body, turning a panic into
/// [`CaseFailure::Failed`] with the panic message.
fn catch_failure(body: impl FnOnce() -> Result<(), CaseFailure>) -> Result<(), CaseFailure> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "non-string panic".into());
        Err(CaseFailure::Failed(format!("panicked: {msg}")))
    })
}

fn note(line: &str) {
    // Straight to the process's stderr, bypassing libtest's output capture,
    // so skips are visible in every test run.
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Runs the case `name` for every seed (fresh harness each) and panics with
/// backend, case and seed of every failing seed. Skips are printed.
pub fn run_case_for_seeds<H: Harness, F: Fn(u64) -> H>(
    factory: &F,
    name: &str,
    seeds: impl IntoIterator<Item = u64>,
) {
    let Some(case) = case(name) else {
        panic!("weft-conformance: no case named {name:?}");
    };
    let mut failed = Vec::new();
    let mut ran = 0usize;
    for seed in seeds {
        ran += 1;
        let o = run_seed(factory, &case, seed);
        match &o.result {
            Ok(()) => {}
            Err(CaseFailure::Skipped(_)) => note(&format!("weft-conformance {o}")),
            Err(CaseFailure::Failed(_)) => failed.push(o),
        }
    }
    if !failed.is_empty() {
        let seeds: Vec<String> = failed.iter().map(|o| o.seed.to_string()).collect();
        let details: Vec<String> = failed.iter().take(5).map(|o| o.to_string()).collect();
        panic!(
            "weft-conformance: case {name} failed for {} of {ran} seeds (seeds: {})\n{}",
            failed.len(),
            seeds.join(", "),
            details.join("\n")
        );
    }
}

/// Runs every case for `seeds` (heavy cases for `heavy_seeds`) and returns
/// every outcome, in case order then seed order. Does not panic.
pub fn run_suite<H: Harness, F: Fn(u64) -> H>(
    factory: &F,
    seeds: &[u64],
    heavy_seeds: &[u64],
) -> Vec<SeedOutcome> {
    let mut out = Vec::new();
    for case in cases() {
        let s = match case.weight {
            Weight::Normal => seeds,
            Weight::Heavy => heavy_seeds,
        };
        for &seed in s {
            out.push(run_seed(factory, &case, seed));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_scenario_table_is_consistent() {
        let all = engine::scenarios();
        let mut names: Vec<_> = all.iter().map(|c| c.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "duplicate scenario names");
        assert!(all.len() >= 7);
        assert!(engine::scenario("peer_death").is_some());
        assert!(engine::scenario("no_such_scenario").is_none());
    }

    #[test]
    fn engine_regions_are_checked_byte_for_byte() {
        let buf = weft_testkit::mem::from_bytes(&weft_testkit::pattern::pattern_at(9, 10, 100));
        let ok = engine::Region {
            src_off: 10,
            dst_off: 0,
            len: 100,
            seed: 9,
        };
        assert_eq!(engine::check_regions(&buf, &[ok]), Ok(()));
        assert!(buf.write(50, &[!weft_testkit::pattern_byte(9, 60)]));
        assert!(engine::check_regions(&buf, &[ok]).is_err());
        let outside = engine::Region { len: 101, ..ok };
        assert!(engine::check_regions(&buf, &[outside]).is_err());
    }

    #[test]
    fn case_table_is_consistent() {
        let all = cases();
        let mut names: Vec<_> = all.iter().map(|c| c.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "duplicate case names");
        assert!(all.len() >= 19);
        assert_eq!(case("write_large").map(|c| c.weight), Some(Weight::Heavy));
        assert_eq!(case("write_sizes").map(|c| c.weight), Some(Weight::Normal));
        assert!(case("no_such_case").is_none());
    }
}
