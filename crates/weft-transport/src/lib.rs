//! # weft-transport: the contract every weft backend implements
//!
//! weft runs on NICs that disagree about ordering: ConnectX RC delivers in
//! order, AWS EFA (SRD) is reliable but **unordered**. This crate writes down
//! the common subset that the engine is allowed to rely on, and the types
//! shared by the engine and every backend.
//!
//! ## The semantics contract (normative)
//!
//! These rules hold for every [`Domain`] implementation and are checked by the
//! `weft-conformance` suite:
//!
//! 1. **Reliable.** Every posted operation completes exactly once on the
//!    initiator, with success or with a [`TransportError`]. Nothing is
//!    duplicated: a payload chunk is written at most once and an immediate is
//!    reported at most once, even when the fabric retransmits.
//! 2. **Unordered.** No ordering holds between operations, not even between two
//!    WRITEs to the same peer on the same domain, and not between the bytes of
//!    one WRITE: a WRITE's payload may land in any order, in pieces. Code above
//!    this crate must never infer "A has landed" from "B (posted after A) has
//!    completed". [`Capabilities::ordered`] reports whether a backend happens to
//!    be ordered; the engine must not depend on it.
//! 3. **Immediate after payload.** A WRITE with an immediate ([`WriteWr::imm`])
//!    produces exactly one [`Completion::Imm`] at the target domain, and only
//!    after the whole payload of that WRITE is visible in target memory.
//!    Zero-length immediate-only WRITEs are valid and carry no payload.
//! 4. **Delivery-complete.** A successful [`Completion::Write`] on the
//!    initiator means the payload is in target memory (and the immediate, if
//!    any, has been or will be reported there). A successful
//!    [`Completion::Send`] means the message was placed into a receive buffer.
//! 5. **Failed operations.** A WRITE that fails (bad rkey, out-of-bounds
//!    access, dead peer, injected fault) reports an error completion on the
//!    initiator and **no** immediate at the target. Whether some of its bytes
//!    were written is unspecified for peer death and for a target region
//!    deregistered while the WRITE is landing; a remote-access violation that
//!    holds for the whole WRITE (unknown or foreign rkey, out of bounds, not
//!    writable, already deregistered) writes nothing.
//! 6. **Peer death.** When a peer becomes unreachable, every operation posted to
//!    it that has not completed fails with [`TransportError::PeerUnreachable`];
//!    later posts to it fail the same way (either at post time or as an error
//!    completion). Other peers are unaffected.
//! 7. **Receives.** A SEND consumes one posted receive buffer at the target, in
//!    any order among posted buffers. A SEND larger than the buffer fails.
//!    A SEND to a peer with no posted buffer waits (receiver-not-ready) and
//!    fails with [`TransportError::ReceiverNotReady`] if no buffer appears in
//!    the backend's RNR timeout.
//! 8. **Flow control.** A domain accepts at most [`Capabilities::max_inflight`]
//!    outstanding SEND + WRITE work requests; posting beyond that returns
//!    [`TransportError::QueueFull`] (or a short count from
//!    [`Domain::post_writes`]), never blocks and never drops work. A work
//!    request stops counting as outstanding when [`Domain::poll`] *returns*
//!    its completion (not when the NIC generates it), so a caller that never
//!    polls can never have more than `max_inflight` WRs accepted.
//! 9. **Progress.** Completions are produced only by [`Domain::poll`]; a
//!    backend may need `poll` to be called to make progress at all.
//! 10. **Peer removal.** [`Domain::remove_peer`] forgets a peer: operations
//!     posted to it that have not completed either complete as usual or fail
//!     with [`TransportError::PeerRemoved`] (backends that hold per-peer
//!     connection state tear it down and fail them), each exactly once;
//!     posts naming the removed [`PeerId`] fail with `PeerRemoved`; a later
//!     [`Domain::add_peer`] of the same address returns a **new** `PeerId`
//!     with fresh connection state. Removing an unknown or already removed
//!     handle is a no-op.
//!
//! ## Sans-IO shape
//!
//! A [`Domain`] is a plain `&mut self` state machine: the caller decides on
//! which thread and when it is polled, so the same engine code runs under the
//! deterministic simulator (step mode) and on real threads.

#![deny(unsafe_code)]

mod error;
mod host_buffer;
mod memory;
mod passive;
mod path;
mod peer_memory;
mod types;
mod wire;

pub use error::{PostError, RemoteAccessReason, TransportError, WireError};
pub use host_buffer::{HostBuffer, HostBufferBuilder, HostBufferError};
pub use memory::{Access, Device, DeviceCopy, LocalMr, LocalSlice, MemRegion, MrKey, Rkey};
pub use passive::PassivePeers;
pub use path::{DataPath, DeviceMemoryPath, DirectKind, ProgressMode};
pub use peer_memory::{CopyTicket, Exported, PeerMemory};
pub use types::{
    Capabilities, Completion, Imm, Incarnation, MrDesc, NetAddr, NetAddrParseError, NicInfo, Pages,
    PeerId, RemoteSlice, ScatterDst, WrId, WriteWr,
};
pub use wire::{decode, encode};

/// A factory for [`Domain`]s of one NIC family on this host (libfabric `efa`,
/// verbs, the loopback fabric, ...).
///
/// The engine opens each domain *on the worker thread that will drive it*,
/// after pinning that thread, so per-domain memory is allocated NUMA-local.
pub trait Provider: Send + Sync {
    /// Short name of the backend, e.g. `"loopback"` or `"libfabric:tcp"`.
    fn name(&self) -> &str;

    /// The NICs this provider can open on this host, in a stable order.
    fn nics(&self) -> Result<Vec<NicInfo>, TransportError>;

    /// Opens one domain (one NIC) by its index in [`Provider::nics`].
    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError>;
}

/// One NIC ("domain"): registration, peers, posting and polling.
///
/// See the crate documentation for the semantics every implementation must
/// provide. All methods are non-blocking.
pub trait Domain: Send {
    /// Static facts about this NIC (name, NUMA node, address, link speed).
    fn info(&self) -> &NicInfo;

    /// The address peers use to reach this domain.
    fn local_addr(&self) -> &NetAddr {
        &self.info().addr
    }

    /// What this domain supports and its queue limits.
    fn capabilities(&self) -> &Capabilities;

    /// The data path this domain really uses (provider, fabric, how GPU
    /// memory reaches the NIC, limits, progress). The default derives it
    /// from [`Domain::capabilities`] with an unnamed provider; backends
    /// override it with what they know.
    fn data_path(&self) -> DataPath {
        DataPath::from_capabilities("unknown", &self.info().name, self.capabilities())
    }

    /// Registers memory with this NIC. With [`Access::RemoteWrite`] the
    /// returned [`LocalMr::rkey`] lets peers WRITE into it.
    ///
    /// The region must stay valid until [`Domain::deregister`] returns (see
    /// [`MemRegion::new`]).
    fn register(&mut self, region: &MemRegion, access: Access) -> Result<LocalMr, TransportError>;

    /// Deregisters memory. Remote WRITEs that arrive afterwards fail with a
    /// remote-access error at their initiator; local work still posted with
    /// this key fails with a local error.
    fn deregister(&mut self, mr: MrKey) -> Result<(), TransportError>;

    /// Resolves a peer address to a handle used in work requests. Idempotent:
    /// the same address gives the same [`PeerId`]. May succeed for an address
    /// nobody listens on; operations to it then fail with
    /// [`TransportError::PeerUnreachable`].
    fn add_peer(&mut self, addr: &NetAddr) -> Result<PeerId, TransportError>;

    /// Forgets `peer` and frees its connection state (contract rule 10):
    /// its handle becomes invalid (posts fail with
    /// [`TransportError::PeerRemoved`]), and adding its address again gives
    /// a new handle with new connection state (a restarted process at the
    /// same address is connected afresh). Unknown or already removed
    /// handles are ignored.
    ///
    /// The default implementation refuses with
    /// [`TransportError::Unsupported`]; every weft backend overrides it.
    fn remove_peer(&mut self, peer: PeerId) -> Result<(), TransportError> {
        Err(TransportError::Unsupported {
            nic: self.info().name.clone(),
            what: format!("remove_peer({})", peer.0),
        })
    }

    /// Posts a two-sided SEND of `src` to `peer`. `src` must lie in memory
    /// registered with this domain and stay untouched until the
    /// [`Completion::Send`] for `wr`.
    fn post_send(&mut self, wr: WrId, peer: PeerId, src: LocalSlice) -> Result<(), TransportError>;

    /// Posts a receive buffer. Buffers are consumed by incoming SENDs in any
    /// order; each produces one [`Completion::Recv`].
    fn post_recv(&mut self, wr: WrId, buf: LocalSlice) -> Result<(), TransportError>;

    /// Posts one WRITE (with optional immediate). Equivalent to
    /// `post_writes(std::slice::from_ref(wr))`.
    fn post_write(&mut self, wr: &WriteWr) -> Result<(), TransportError> {
        match self.post_writes(std::slice::from_ref(wr)) {
            Ok(1) => Ok(()),
            Ok(_) => Err(TransportError::QueueFull {
                nic: self.info().name.clone(),
            }),
            Err(e) => Err(e.error),
        }
    }

    /// Posts a batch of WRITEs in one call, so a backend can chain them behind
    /// one doorbell or reuse a pre-filled template.
    ///
    /// Returns how many WRs from the front of `wrs` were accepted; fewer than
    /// `wrs.len()` means the send queue is full and the rest were not posted
    /// (retry them after polling). On an error, [`PostError::posted`] WRs were
    /// accepted and the WR at that index was rejected; none after it were
    /// posted. At most [`Capabilities::max_batch`] WRs are accepted per call.
    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, PostError>;

    /// Makes progress and appends completions to `out`. Returns how many were
    /// appended. An `Err` means the domain itself is unusable (e.g. its NIC
    /// died); per-operation failures are reported as completions instead.
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError>;

    /// Whether this domain reaches only peers of its own host (a same-host
    /// backend such as `nvlink`). An engine group that mixes it with NIC
    /// domains sends a destination through it when it
    /// [`prefers`](Domain::prefers) the destination's address, and
    /// through the other NICs otherwise. Default `false`.
    fn same_host(&self) -> bool {
        false
    }

    /// Whether `addr` (a peer address of this domain's kind) is best
    /// reached through this domain: a same-host backend says so for peers
    /// on its host. Default `false`.
    fn prefers(&self, addr: &NetAddr) -> bool {
        let _ = addr;
        false
    }

    /// A file descriptor that becomes readable when [`Domain::poll`] may
    /// have something to do (a completion, or data a peer sends that only
    /// a poll moves), for a caller that would rather sleep in `poll(2)`
    /// than poll an idle domain. It stays valid, and the same, for the
    /// domain's life; the caller only waits on it and never reads, writes
    /// or closes it.
    ///
    /// `None` (the default) when the domain has none; hardware domains
    /// whose completions need no software progress may leave it `None`
    /// (their callers can sleep on their own timers). A domain that
    /// returns `Some` must also implement [`Domain::try_wait`].
    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }

    /// Whether the caller may sleep on [`Domain::wait_fd`] now: `true` when
    /// nothing is pending that only another [`Domain::poll`] would move
    /// (no completions queued, no operations of the domain's own in
    /// flight, nothing the provider still has to progress; libfabric's
    /// `fi_trywait`), `false` when the caller must poll again first. Call
    /// it right before sleeping and after the last poll; a `true` stays
    /// valid until the next call into the domain. The default (`false`)
    /// never lets a caller sleep.
    fn try_wait(&mut self) -> bool {
        false
    }
}
