//! The interface a backend implements to run the suite: [`Harness`], and
//! [`InProcess`], a ready-made [`Harness`] for backends whose hosts all live
//! in the test process.

use std::ops::Range;
use thiserror::Error;
use weft_transport::{Access, Domain, HostBuffer, LocalMr, NetAddr, TransportError};

/// A simulated or real host created by [`Harness::add_host`]. Hosts are
/// numbered by the harness; the suite only passes these ids back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostId(pub usize);

impl std::fmt::Display for HostId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "host{}", self.0)
    }
}

/// A memory buffer allocated on one host by [`Harness::alloc`]. Only
/// meaningful together with the [`HostId`] it was allocated on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufId(pub u64);

/// Why a harness could not do what the suite asked.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// The harness or backend cannot do this at all (e.g. no fault hook to
    /// kill a host, or fewer NICs per host than asked). The case that needed
    /// it is **skipped** with this message printed, never counted as passed
    /// silently.
    #[error("unsupported by this harness: {0}")]
    Unsupported(String),
    /// The harness itself failed (out of memory, child process gone, bad
    /// buffer id, ...). The case fails with this message.
    #[error("harness failure: {0}")]
    Failed(String),
}

/// Default for [`Harness::wait_budget`].
pub const DEFAULT_WAIT_BUDGET: u64 = 2_000_000;

/// Default number of [`Harness::progress`] calls in [`Harness::settle`].
pub const DEFAULT_SETTLE_ROUNDS: u32 = 2_000;

/// What a backend provides so the conformance suite can drive it.
///
/// The suite sees a set of *hosts*, each with one or more NICs; NIC `i` of a
/// host is one [`Domain`]. Everything the suite does goes through this trait:
///
/// - **Memory** lives on a host and is only touched through
///   [`alloc`](Harness::alloc) / [`write_mem`](Harness::write_mem) /
///   [`read_mem`](Harness::read_mem) / [`register`](Harness::register). The
///   suite never dereferences an address, so a host may live in another
///   process (addresses in [`LocalMr`] are that process's addresses and are
///   only copied into work requests).
/// - **Domains** are reached through [`domain`](Harness::domain). The returned
///   `&mut dyn Domain` may be a proxy that forwards each call to another
///   process; the suite calls `info`, `local_addr`, `capabilities`,
///   `deregister`, `add_peer`, `post_send`, `post_recv`, `post_write`,
///   `post_writes` and `poll` on it, **never `register`** (memory of a remote
///   host has no local pointer; registration goes through
///   [`Harness::register`]).
/// - **Progress**: every wait loop of the suite polls the domains it uses,
///   then calls [`progress`](Harness::progress), at most
///   [`wait_budget`](Harness::wait_budget) times, then fails the case. No wall
///   clock is read by the suite.
///
/// All methods are called from one thread. A call that the harness cannot
/// carry out because its own machinery broke (a proxy's child process died,
/// a pipe closed) may panic; the runner catches the panic and reports it with
/// the backend, case and seed. Calls with an unknown host/NIC/buffer id or on
/// a killed host are suite bugs and may panic too.
pub trait Harness {
    /// Backend and profile for messages, e.g. `"loopback/adversarial"`.
    fn name(&self) -> String;

    /// The seed this harness was built with. The suite derives its payload
    /// patterns and random choices from it, and prints it on failure.
    fn seed(&self) -> u64;

    /// Creates a host with `nics` NICs, each opened as one [`Domain`]. All
    /// NICs of all hosts must be able to reach each other. Return
    /// [`HarnessError::Unsupported`] if the backend cannot provide that many
    /// NICs per host (cases needing them are skipped).
    fn add_host(&mut self, nics: usize) -> Result<HostId, HarnessError>;

    /// Allocates `len` bytes of zeroed host memory on `host`, aligned to at
    /// least 64 bytes (4096 recommended), valid until the harness is dropped
    /// (the suite never frees). `len` may be 0.
    fn alloc(&mut self, host: HostId, len: usize) -> Result<BufId, HarnessError>;

    /// Copies `data` into `buf` at byte `offset` (local CPU store on `host`).
    fn write_mem(
        &mut self,
        host: HostId,
        buf: BufId,
        offset: usize,
        data: &[u8],
    ) -> Result<(), HarnessError>;

    /// Reads `len` bytes of `buf` at byte `offset` (local CPU load on `host`).
    /// Called while remote writes may be landing elsewhere in the buffer; the
    /// suite only draws conclusions about bytes the contract says are final.
    fn read_mem(
        &mut self,
        host: HostId,
        buf: BufId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, HarnessError>;

    /// Registers bytes `range` of `buf` with NIC `nic` of `host` (what
    /// [`Domain::register`] does for a local region). An empty range at the
    /// end of the buffer is allowed. Backend errors come back as
    /// [`TransportError`]; a harness failure may be reported as
    /// [`TransportError::Failed`] or panic.
    fn register(
        &mut self,
        host: HostId,
        nic: usize,
        buf: BufId,
        range: Range<usize>,
        access: Access,
    ) -> Result<LocalMr, TransportError>;

    /// The domain of NIC `nic` of `host` (possibly a proxy, see the trait
    /// docs). Panics on an unknown or killed host.
    fn domain(&mut self, host: HostId, nic: usize) -> &mut dyn Domain;

    /// Lets the fabric make progress between two rounds of polls: one step of
    /// simulated time for a simulator, nothing (or a yield, or a short sleep)
    /// for a real backend whose progress happens in `poll`.
    fn progress(&mut self);

    /// How many poll+[`progress`](Harness::progress) rounds one wait of the
    /// suite may take before it fails the case as hung. Generous; it must
    /// cover the backend's RNR timeout and peer-death detection.
    fn wait_budget(&self) -> u64 {
        DEFAULT_WAIT_BUDGET
    }

    /// Runs the fabric until nothing more can happen for work already
    /// delivered (a simulator runs its event queue dry). The suite calls it
    /// after everything it waited for has completed, then polls every domain
    /// and fails on any further completion or immediate. The default calls
    /// [`progress`](Harness::progress) [`DEFAULT_SETTLE_ROUNDS`] times.
    fn settle(&mut self) {
        for _ in 0..DEFAULT_SETTLE_ROUNDS {
            self.progress();
        }
    }

    /// Fault hook: makes `host` die now (all its NICs unreachable; a child
    /// process is killed). The suite never touches the host afterwards. The
    /// default returns [`HarnessError::Unsupported`]: peer-death cases are
    /// skipped with a printed message.
    fn kill_host(&mut self, host: HostId) -> Result<(), HarnessError> {
        Err(HarnessError::Unsupported(format!(
            "no fault hook to kill {host}"
        )))
    }

    /// A well-formed address of this backend that nobody listens on (a host
    /// never created, a closed port). The default returns
    /// [`HarnessError::Unsupported`]; the unknown-peer case then only tries
    /// malformed addresses.
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        Err(HarnessError::Unsupported(
            "no way to name an address nobody listens on".into(),
        ))
    }
}

/// The backend half of [`InProcess`]: hosts whose domains live in this
/// process. [`InProcess`] adds memory management and domain bookkeeping.
pub trait InProcessBackend {
    /// See [`Harness::name`].
    fn name(&self) -> String;
    /// See [`Harness::seed`].
    fn seed(&self) -> u64;
    /// Creates host `host` (ids are handed out 0, 1, 2, ... in call order)
    /// with `nics` NICs and opens one domain per NIC, in NIC order.
    fn add_host(&mut self, host: HostId, nics: usize)
        -> Result<Vec<Box<dyn Domain>>, HarnessError>;
    /// See [`Harness::progress`].
    fn progress(&mut self);
    /// See [`Harness::wait_budget`].
    fn wait_budget(&self) -> u64 {
        DEFAULT_WAIT_BUDGET
    }
    /// See [`Harness::settle`].
    fn settle(&mut self) {
        for _ in 0..DEFAULT_SETTLE_ROUNDS {
            self.progress();
        }
    }
    /// See [`Harness::kill_host`]. [`InProcess`] keeps the host's domains
    /// alive (unused) until it is dropped.
    fn kill_host(&mut self, host: HostId) -> Result<(), HarnessError> {
        Err(HarnessError::Unsupported(format!(
            "no fault hook to kill {host}"
        )))
    }
    /// See [`Harness::unreachable_addr`].
    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        Err(HarnessError::Unsupported(
            "no way to name an address nobody listens on".into(),
        ))
    }
}

struct HostSlot {
    domains: Vec<Box<dyn Domain>>,
    killed: bool,
}

/// A [`Harness`] for backends whose hosts are all in this process (loopback,
/// libfabric with every endpoint in the test process, verbs on a simulated
/// device). Memory is [`HostBuffer`]s owned by the harness.
pub struct InProcess<B: InProcessBackend> {
    // Field order is drop order: domains, then the backend (which may hold
    // registrations), then the memory they point into.
    hosts: Vec<HostSlot>,
    backend: B,
    mem: Vec<Vec<HostBuffer>>,
}

impl<B: InProcessBackend> InProcess<B> {
    /// Wraps a backend.
    pub fn new(backend: B) -> Self {
        Self {
            hosts: Vec::new(),
            backend,
            mem: Vec::new(),
        }
    }

    /// The wrapped backend.
    pub fn backend(&mut self) -> &mut B {
        &mut self.backend
    }

    fn alloc_ref(&self, host: HostId, buf: BufId) -> Result<&HostBuffer, HarnessError> {
        self.mem
            .get(host.0)
            .and_then(|m| m.get(usize::try_from(buf.0).ok()?))
            .ok_or_else(|| HarnessError::Failed(format!("no buffer {buf:?} on {host}")))
    }

    fn outside(a: &HostBuffer, offset: usize, len: usize) -> HarnessError {
        HarnessError::Failed(format!(
            "access [{offset}, +{len}) outside buffer of {} bytes",
            a.len()
        ))
    }
}

impl<B: InProcessBackend> Harness for InProcess<B> {
    fn name(&self) -> String {
        self.backend.name()
    }

    fn seed(&self) -> u64 {
        self.backend.seed()
    }

    fn add_host(&mut self, nics: usize) -> Result<HostId, HarnessError> {
        let id = HostId(self.hosts.len());
        let domains = self.backend.add_host(id, nics)?;
        if domains.len() != nics {
            return Err(HarnessError::Failed(format!(
                "backend opened {} domains for {id}, asked for {nics}",
                domains.len()
            )));
        }
        self.hosts.push(HostSlot {
            domains,
            killed: false,
        });
        self.mem.push(Vec::new());
        Ok(id)
    }

    fn alloc(&mut self, host: HostId, len: usize) -> Result<BufId, HarnessError> {
        let allocs = self
            .mem
            .get_mut(host.0)
            .ok_or_else(|| HarnessError::Failed(format!("no {host}")))?;
        let buf = HostBuffer::new(len)
            .map_err(|e| HarnessError::Failed(format!("allocating {len} bytes: {e}")))?;
        allocs.push(buf);
        Ok(BufId(allocs.len() as u64 - 1))
    }

    fn write_mem(
        &mut self,
        host: HostId,
        buf: BufId,
        offset: usize,
        data: &[u8],
    ) -> Result<(), HarnessError> {
        let a = self.alloc_ref(host, buf)?;
        if a.write(offset, data) {
            Ok(())
        } else {
            Err(Self::outside(a, offset, data.len()))
        }
    }

    fn read_mem(
        &mut self,
        host: HostId,
        buf: BufId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, HarnessError> {
        let a = self.alloc_ref(host, buf)?;
        a.read(offset, len)
            .ok_or_else(|| Self::outside(a, offset, len))
    }

    fn register(
        &mut self,
        host: HostId,
        nic: usize,
        buf: BufId,
        range: Range<usize>,
        access: Access,
    ) -> Result<LocalMr, TransportError> {
        let fail = |what: String| TransportError::Failed {
            nic: format!("{host}/nic{nic}"),
            wr: None,
            what,
        };
        // The buffers in `self.mem` outlive every domain and the backend
        // (field drop order), as `HostBuffer::region` requires.
        let region = {
            let a = self.alloc_ref(host, buf).map_err(|e| fail(e.to_string()))?;
            a.sub_region(range.clone()).ok_or_else(|| {
                fail(format!(
                    "range {range:?} outside buffer of {} bytes",
                    a.len()
                ))
            })?
        };
        self.domain(host, nic).register(&region, access)
    }

    fn domain(&mut self, host: HostId, nic: usize) -> &mut dyn Domain {
        let slot = match self.hosts.get_mut(host.0) {
            Some(s) => s,
            None => panic!("conformance suite bug: unknown {host}"),
        };
        assert!(
            !slot.killed,
            "conformance suite bug: {host} was killed, its domains are gone"
        );
        match slot.domains.get_mut(nic) {
            Some(d) => d.as_mut(),
            None => panic!("conformance suite bug: {host} has no nic{nic}"),
        }
    }

    fn progress(&mut self) {
        self.backend.progress();
    }

    fn wait_budget(&self) -> u64 {
        self.backend.wait_budget()
    }

    fn settle(&mut self) {
        self.backend.settle();
    }

    fn kill_host(&mut self, host: HostId) -> Result<(), HarnessError> {
        if host.0 >= self.hosts.len() {
            return Err(HarnessError::Failed(format!("no {host}")));
        }
        self.backend.kill_host(host)?;
        if let Some(slot) = self.hosts.get_mut(host.0) {
            slot.killed = true;
        }
        Ok(())
    }

    fn unreachable_addr(&mut self) -> Result<NetAddr, HarnessError> {
        self.backend.unreachable_addr()
    }
}
