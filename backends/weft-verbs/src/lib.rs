//! # weft-verbs: the verbs backend (ConnectX and any RC NIC)
//!
//! Implements the [`weft_transport`] contract over libibverbs:
//!
//! - **Two RC QPs per peer**: a SEND/RECV QP whose receives come from a
//!   domain-wide SRQ holding the user's receive buffers, and a
//!   WRITE/WRITEIMM QP attached to a second SRQ of zero-byte receives that
//!   WRITE_WITH_IMM consumes (replenished on every poll). RECV and WRITEIMM
//!   completions can never steal each other's work requests.
//! - **Connection set-up by handshakes over one UD QP per domain**: the first
//!   operation to an unknown peer creates its QPs (RESET→INIT) and sends a
//!   handshake (QPNs, random 24-bit PSNs, address); the receiver brings its
//!   QPs to RTS and answers; a third message confirms. Handshakes are
//!   retransmitted every [`VerbsConfig::handshake_timeout_ns`], duplicates
//!   are harmless, and after [`VerbsConfig::handshake_tries`] the peer is
//!   declared unreachable and its queued operations fail with
//!   `PeerUnreachable`. Operations posted meanwhile wait in per-peer queues.
//!   A handshake from an address the domain was not asked to reach creates
//!   a *passive* peer; at most [`VerbsConfig::max_half_open`] of them are
//!   half-open (not connected) at once: at the bound the oldest one whose
//!   handshakes ran out is evicted, or the new handshake is refused (a real
//!   peer retransmits). A connection completes only when the other side
//!   echoes this side's random starting PSNs, which only a peer that got
//!   its handshake knows, so datagrams claiming made-up addresses hold at
//!   most `max_half_open` peers' QPs.
//! - **WR chaining**: up to [`VerbsConfig::chain_len`] (4) WRs linked per
//!   `ibv_post_send`; a partial post (`bad_wr`) keeps the unposted WRs queued
//!   and posts them when the send queue has room.
//! - **Long writes** are split into WRs of at most 2^31-1 bytes (or the
//!   port's `max_msg_sz`); RC executes one QP in order, so the immediate
//!   rides on the last piece and the user sees one completion.
//! - **Registrations** use `IBV_ACCESS_RELAXED_ORDERING`; GPU memory goes
//!   through `ibv_reg_dmabuf_mr` when a [`DmaBufExporter`] is configured,
//!   else `ibv_reg_mr` when a peer-memory client is loaded, else
//!   `Unsupported`.
//! - **CQ sizing**: one send CQ of `hw_send_budget` + UD entries, one receive
//!   CQ of both SRQ depths + UD receives; the domain never has more WRs
//!   outstanding than that, so the CQs cannot overrun.
//! - **Errors**: completion statuses map to typed errors for the right
//!   [`weft_transport::WrId`] (retry exceeded → `PeerUnreachable`, RNR retry
//!   exceeded → `ReceiverNotReady`, remote access → `RemoteAccess`, remote
//!   invalid request on a SEND → `MessageTooLong`, local protection →
//!   `LocalAccess`). A QP in ERR takes its connection out of service: WRs
//!   flushed behind the failing one were not executed and are resent on a
//!   new connection; retry-exceeded marks the peer unreachable and fails all
//!   its work.
//!
//! Everything sits on the [`ops::VerbsOps`] seam. Its two implementations:
//! [`ffi`] (libibverbs loaded at run time with `libloading`; builds without
//! rdma-core) and, with the `sim` feature, a simulated RC/UD device.
//!
//! Unsafe code is denied crate-wide; it is allowed only in [`ffi`], in the
//! domain's UD handshake buffer and in the simulator's byte copies.

#![deny(unsafe_code)]

mod domain;
pub mod ffi;
pub mod ops;
#[cfg(feature = "sim")]
pub mod sim;
pub mod wire;

pub use domain::{
    DmaBufExporter, DomainStats, VerbsConfig, VerbsDomain, MAX_VERBS_WR_LEN, WEFT_QKEY,
};

use ops::VerbsLib;
use weft_transport::{Domain, NicInfo, Provider, TransportError};

/// A [`Provider`] of verbs domains over any [`VerbsLib`] (the real
/// libibverbs by default).
pub struct VerbsProvider<L: VerbsLib = ffi::IbvLib> {
    lib: L,
    cfg: VerbsConfig,
}

impl VerbsProvider<ffi::IbvLib> {
    /// The real libibverbs (loaded on first use) with `cfg`; honours the
    /// `WEFT_VERBS_GID_INDEX` and `WEFT_VERBS_PORT` environment variables
    /// when `cfg` leaves them unset / default.
    pub fn new(mut cfg: VerbsConfig) -> Self {
        if cfg.gid_index.is_none() {
            cfg.gid_index = std::env::var("WEFT_VERBS_GID_INDEX")
                .ok()
                .and_then(|v| v.trim().parse().ok());
        }
        if let Some(p) = std::env::var("WEFT_VERBS_PORT")
            .ok()
            .and_then(|v| v.trim().parse().ok())
        {
            cfg.port = p;
        }
        Self {
            lib: ffi::IbvLib::new(),
            cfg,
        }
    }
}

impl<L: VerbsLib> VerbsProvider<L> {
    /// A provider over `lib` (e.g. the simulator).
    pub fn with_lib(lib: L, cfg: VerbsConfig) -> Self {
        Self { lib, cfg }
    }

    /// Opens a domain with its concrete type (tests use the counters).
    pub fn open_domain(&self, nic: usize) -> Result<VerbsDomain<L::Ops>, TransportError> {
        let devs = self.lib.devices()?;
        let dev = devs.get(nic).ok_or_else(|| TransportError::NoDevice {
            what: if devs.is_empty() {
                "RDMA (verbs)".to_string()
            } else {
                format!("verbs device index {nic} (have {})", devs.len())
            },
        })?;
        let ops = self.lib.open(nic)?;
        VerbsDomain::open(ops, self.cfg.clone(), dev.numa_node)
    }
}

impl<L: VerbsLib> Provider for VerbsProvider<L> {
    fn name(&self) -> &str {
        "verbs"
    }

    /// Lists devices. The addresses here carry UD QPN 0: the real address
    /// exists only once a domain is open ([`Domain::info`]).
    fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
        Ok(self
            .lib
            .devices()?
            .into_iter()
            .map(|d| NicInfo {
                name: format!("{}:{}", d.name, self.cfg.port),
                addr: weft_transport::NetAddr(Vec::new()),
                numa_node: d.numa_node,
                link_gbps: None,
            })
            .collect())
    }

    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
        Ok(Box::new(self.open_domain(nic)?))
    }
}
