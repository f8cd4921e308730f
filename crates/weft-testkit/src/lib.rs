//! # weft-testkit: what weft's test suites share
//!
//! One implementation, instead of a copy per test suite, of:
//!
//! - [`seed`]: the seeds a randomized test runs, `WEFT_SEED=N` to replay one,
//!   and the `seed=N (replay with WEFT_SEED=N)` line printed when a seeded
//!   test panics; a ChaCha RNG per seed.
//! - [`wait`]: bounded waits for threaded tests ([`wait_until`]); the bound
//!   only detects hangs, it never asserts on speed.
//! - [`mod@pattern`]: deterministic data patterns and a comparison that reports
//!   the first mismatch.
//! - [`drive`]: step-mode loops that progress domains or engines until a
//!   condition holds, failing when everything went idle first.
//! - [`mem`]: [`weft_transport::HostBuffer`] constructors and accessors that
//!   panic on test bugs instead of returning errors.
//! - [`etcd`]: a private etcd server on a free port for rendezvous tests.
//! - [`fuzz`]: the case counts, mutations of valid encodings and the
//!   allocation probe of the wire decoders' fuzz properties.
//! - [`peer_memory`]: a host-memory `PeerMemory` for the one-sided path of
//!   same-host backends without a GPU.
//! - [`child`]: re-executing the current test binary as a child process in a
//!   role, talking to it in lines over its stdin/stdout (with or without a
//!   bound on the wait), signalling and killing it.
//!
//! This crate is for tests: it is a dev-dependency of the crates whose tests
//! use it (and a normal dependency only of the test-support crate
//! `weft-conformance`), never of a library.

#![deny(unsafe_code)]
// `peer_memory` copies between registered host ranges (its own allow).

pub mod child;
pub mod drive;
pub mod etcd;
pub mod fuzz;
pub mod mem;
pub mod pattern;
pub mod peer_memory;
pub mod seed;
pub mod wait;

pub use drive::{drive_until, poll_rounds};
pub use mem::HostBufferExt;
pub use pattern::{check_pattern, pattern, pattern_byte, Mismatch};
pub use seed::{for_seeds, run_seeded, seeds, seeds_or, with_seed, SeedGuard, SEED_ENV};
pub use wait::wait_until;
