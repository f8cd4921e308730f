//! # Hosts in child processes, for every backend
//!
//! The test binary re-executes itself: each child runs only the binary's
//! [`ENTRY_TEST`] test, which must be defined as
//!
//! ```ignore
//! #[test]
//! fn peer_process_entry() {
//!     weft_conformance::xproc::child_entry::<MyBackend>();
//! }
//! ```
//!
//! Children are started with `weft_testkit::child::spawn_role`; two kinds
//! exist, told apart by their role:
//!
//! - **domain hosts** of [`CrossProcess`], a conformance
//!   [`Harness`](crate::Harness): the child opens the host's domains and
//!   serves the parent's calls over a Unix socket (postcard frames); the
//!   parent sees [`ProxyDomain`]s, and memory is allocated, filled and read
//!   in the child;
//! - **engine peers** of [`XprocEngines`], an engine-suite
//!   [`EngineHarness`](crate::engine::EngineHarness): the child runs a
//!   [`LocalPeer`](crate::engine::LocalPeer) (an engine with a registered
//!   buffer) and talks in the testkit's stdin/stdout lines (postcard in hex,
//!   one message per line): the parent asks it to arm immediate rounds, the
//!   child checks every byte when a round fires and reports back.
//!
//! Killing a host SIGKILLs its process; children exit on their own when the
//! parent goes away, and are killed and reaped by drop guards when a test
//! fails. What is backend-specific (opening domains or an engine in a
//! child, clean-up after a killed child) is the [`XprocBackend`] trait.

mod child;
mod engine_peer;
mod frame;
mod proxy;
mod wire;

pub use engine_peer::{ProcPeer, XprocEngines};
pub use proxy::{CrossProcess, ProxyDomain};

use crate::HarnessError;
use std::io::Write;
use std::time::Duration;
use weft_engine::TransferEngine;
use weft_testkit::child::role;
use weft_transport::{Domain, NetAddr};

/// Name of the `#[test]` every test binary using this module must define
/// (see the module docs).
pub const ENTRY_TEST: &str = "peer_process_entry";

const ENV_PROFILE: &str = "WEFT_XPROC_PROFILE";
const ENV_SOCKET: &str = "WEFT_XPROC_SOCKET";
const ENV_NICS: &str = "WEFT_XPROC_NICS";
const ENV_PEER_BUF: &str = "WEFT_XPROC_PEER_BUF";
const ROLE_DOMAINS: &str = "domains";
const ROLE_ENGINE: &str = "engine";

/// Generous bound on every wall-clock wait for a child (it only catches
/// hangs, never speed).
const DEADLINE: Duration = Duration::from_secs(60);

/// What a backend provides to run hosts in child processes. The backend is
/// built from a *profile* string in the parent and, from the same string, in
/// every child.
pub trait XprocBackend: Sized {
    /// Builds the backend for `profile` (e.g. a provider name).
    /// [`HarnessError::Unsupported`] when it is not available here (cases
    /// are then skipped with the message).
    fn from_profile(profile: &str) -> Result<Self, HarnessError>;
    /// Backend and profile for messages, e.g. `"libfabric:tcp"`.
    fn name(&self) -> String;
    /// Most NICs (domains) one host may open.
    fn max_nics(&self) -> usize;
    /// In a domain-host child: opens `nics` domains (NIC 0, 1, ...).
    fn open_domains(&self, nics: usize) -> Result<Vec<Box<dyn Domain>>, String>;
    /// An engine (in an engine-peer child, and the initiator in the parent).
    fn engine(&self) -> Result<TransferEngine, String>;
    /// See [`Harness::unreachable_addr`](crate::Harness::unreachable_addr).
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        Err(HarnessError::Unsupported(
            "no way to name an address nobody listens on".into(),
        ))
    }
    /// Zeroed memory of `len` bytes for the suites (in a child: what the
    /// parent allocates, fills, reads and registers; an engine peer's
    /// buffer). Host memory unless the backend runs the suites on device
    /// memory.
    fn alloc(&self, len: usize) -> Result<Box<dyn crate::TestMemory>, String> {
        crate::memory::host_memory(len)
    }
    /// Called after a child of this backend was SIGKILLed and reaped, to
    /// clean up what it could not (e.g. shared-memory files).
    fn reaped(&mut self, pid: u32) {
        let _ = pid;
    }
}

/// `"<backend>/cross-process"`, the name of a harness of this module.
fn harness_name<B: XprocBackend>(backend: &Result<B, HarnessError>, profile: &str) -> String {
    match backend {
        Ok(b) => format!("{}/cross-process", b.name()),
        Err(_) => format!("{profile}/cross-process"),
    }
}

/// The body of the [`ENTRY_TEST`] test. In a child started by
/// [`CrossProcess`] or [`XprocEngines`] it serves the parent until the
/// parent goes away, then exits the process. Run normally (not as a child),
/// it checks that the proxy codec round-trips every message kind.
pub fn child_entry<B: XprocBackend>() {
    let Some(role) = role() else {
        child::codec_selftest();
        return;
    };
    let result = std::env::var(ENV_PROFILE)
        .map_err(|e| format!("{ENV_PROFILE}: {e}"))
        .and_then(|p| B::from_profile(&p).map_err(|e| e.to_string()))
        .and_then(|b| match role.as_str() {
            ROLE_DOMAINS => child::serve(&b),
            ROLE_ENGINE => engine_peer::run_peer(&b),
            other => Err(format!("unknown role {other:?}")),
        });
    let code = match result {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "weft-conformance peer process {} ({role}): {e}",
                std::process::id()
            );
            1
        }
    };
    std::process::exit(code);
}
