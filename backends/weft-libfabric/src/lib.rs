//! # weft-libfabric: the libfabric backend (AWS EFA, and tcp/shm everywhere)
//!
//! One [`LibfabricDomain`] per NIC: an `FI_EP_RDM` endpoint with
//! `FI_MSG | FI_RMA` (and `FI_HMEM` on request), its own address vector and
//! one CQ in `FI_CQ_FORMAT_DATA`. WRITEs go out through `fi_writemsg` with a
//! pre-filled `fi_msg_rma` template per operation slot (only addresses,
//! lengths, key and immediate change per post); immediates travel as remote
//! CQ data (`FI_REMOTE_CQ_DATA`, 4 bytes) and come back at the target as
//! [`weft_transport::Completion::Imm`]. SEND/RECV go through the backend's message layer
//! (see [`LibfabricConfig::max_send_len`]): each SEND is one `fi_sendmsg`
//! of a small header and the payload into one of the receiver's internal
//! bounce buffers; the receiver copies it into the next posted receive
//! buffer and answers with a header-only ACK, on which the SEND completes.
//! So a SEND completion means the message is in a receive buffer, a SEND
//! nobody posted a buffer for fails with `ReceiverNotReady` after
//! [`LibfabricConfig::rnr_timeout`], and one larger than the receive buffer
//! fails with `MessageTooLong` — on every provider, although tcp;ofi_rxm,
//! shm and efa all queue unexpected messages and report neither. Receive
//! buffers must be host memory.
//!
//! The provider is chosen by name: `efa` in production, `tcp` (layered as
//! `tcp;ofi_rxm`) and `shm` for CI and single hosts. libfabric itself is
//! loaded at run time, so this crate builds without it; a missing library is
//! reported as [`TransportError::LibraryUnavailable`].
//!
//! ## Progress
//!
//! Software providers (tcp, shm) and EFA's emulated protocols progress only
//! when the CQ is read: **both** sides must keep calling
//! [`weft_transport::Domain::poll`], the target too, even when it expects no
//! completion of its own.
//!
//! ## Delivery-complete
//!
//! Domains are opened with `FI_DELIVERY_COMPLETE` as default TX op flag (and
//! every WRITE passes it), so a WRITE or SEND completion means the data is in
//! the target's memory, as the contract requires. A provider that cannot
//! offer it is only used when [`LibfabricConfig::require_delivery_complete`]
//! is off, with a warning.

#![deny(unsafe_code)]

mod domain;
#[allow(unsafe_code)]
mod ffi;

use std::sync::Arc;
use std::time::Duration;

pub use domain::messages::DroppedMessages;
use domain::DomainOptions;
pub use domain::{freed_dead_shm_locks, LibfabricDomain};
pub use ffi::{restored_dispositions, KEPT_SIGNALS, SA_RESTORER};
use weft_transport::{Domain, NetAddr, NicInfo, Provider, TransportError};

/// How to pick and open NICs.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LibfabricConfig {
    /// libfabric provider name: `"efa"`, `"tcp"` (= `tcp;ofi_rxm`), `"shm"`, ...
    pub provider: String,
    /// Domain names to use, in order; a name may repeat to open several
    /// endpoints on one NIC (e.g. `["lo", "lo"]` for two "NICs" per process
    /// over tcp). `None`: every distinct domain the provider reports.
    pub domains: Option<Vec<String>>,
    /// Ask for `FI_HMEM` so CUDA memory can be registered.
    pub hmem: bool,
    /// Register CUDA memory `FI_HMEM_DEVICE_ONLY`, which lets shm move it
    /// with CUDA IPC (device to device, ~1.3 TB/s on an H100) instead of
    /// staging it through host memory (~0.8 GB/s). Off by default: shm then
    /// completes a WRITE at the *initiator* once the target has issued its
    /// copy from the initiator's buffer, which may still be running, so the
    /// source must not be reused until the target confirms (an immediate
    /// the target answers, for one). Immediates at the target are always
    /// reported after the bytes landed.
    pub hmem_ipc: bool,
    /// Set `FI_MORE` on all but the last WRITE of a batch. Default: on for
    /// `efa`, off for software providers (which gain nothing from it).
    pub fi_more: Option<bool>,
    /// Upper bound on outstanding SEND + WRITE WRs per domain (the provider's
    /// TX queue size bounds it too). Default 1024 for every provider, `shm`
    /// included: WRs the provider answers EAGAIN for (shm's small inject
    /// pool for WRITEs of at most 4 KiB) wait in the domain's backlog at no
    /// cost per `poll`, so a smaller window gains nothing.
    pub max_inflight: usize,
    /// Upper bound on posted receives per domain.
    pub max_recvs: usize,
    /// Largest SEND payload (`Capabilities::max_send_len`). Every domain
    /// keeps [`LibfabricConfig::bounce_buffers`] buffers of this size (plus
    /// a 256-byte header) posted for incoming messages; both sides of a
    /// connection must use the same value. Default 64 KiB.
    pub max_send_len: u64,
    /// Internal receive buffers posted per domain for incoming messages.
    /// Messages beyond them wait in the provider's unexpected-message queue
    /// (nothing is lost). Default 32.
    pub bounce_buffers: usize,
    /// How long an incoming SEND waits for a posted receive buffer before
    /// its sender gets `ReceiverNotReady`. Default 100 ms.
    pub rnr_timeout: Duration,
    /// How long a SEND the provider has completed waits for the receiver's
    /// answer (the receiver must be polling) before it fails and the peer
    /// is declared unreachable. Default 10 s.
    pub ack_timeout: Duration,
    /// Refuse providers that cannot do `FI_DELIVERY_COMPLETE`.
    pub require_delivery_complete: bool,
    /// How long posts to a peer with nothing in flight may keep failing with
    /// `EAGAIN` (the provider still connecting; `tcp;ofi_rxm` retries a
    /// refused connection forever) before the peer is declared unreachable.
    pub connect_timeout: Duration,
    /// How long a peer with operations in flight may go without any of them
    /// completing before it is declared unreachable: every operation to it
    /// then fails with `PeerUnreachable` and later posts to it fail at once.
    /// This is how a peer that stops answering without closing its
    /// connection (a hung process, a host gone without a TCP reset) is
    /// noticed; verbs gets the same from the NIC's retry timeout. It is
    /// measured per peer from its last completion, so a deep queue of WRITEs
    /// that keeps completing never trips it; it must exceed the time one
    /// WRITE of `max_write_len` takes on the slowest path. Default 30 s.
    ///
    /// Unlike a verbs QP going to the error state, libfabric has no way to
    /// take a WRITE back from the provider (`fi_cancel` covers receives,
    /// and `fi_av_remove` leaves tcp;ofi_rxm's connection open). So the
    /// failed operations stay with the provider: if the peer wakes up, they
    /// may still be delivered, and the provider may still read their source
    /// buffers until then. Keep the source memory registered and unchanged
    /// after such a failure if the peer can come back; the domain keeps the
    /// operations' slots reserved until the provider returns them.
    pub write_timeout: Duration,
    /// Most per-peer endpoints a domain keeps open at once, for providers
    /// that issue every operation to a peer on an endpoint of its own
    /// (`shm`: its completions of one endpoint wait for each other, so a
    /// killed peer would block every other; docs/backends.md, "Provider
    /// limitations"). Other providers open none. Each shm endpoint is a
    /// region in `/dev/shm` (sized by the provider's queue sizes; its pages
    /// are allocated as they are used) and an entry in the peer's map of
    /// at most 256 endpoints (`SMR_MAX_PEERS`), which also bounds the
    /// domain's own address vector. A post that would need one more
    /// endpoint fails with `TransportError::Unsupported`; removing peers
    /// (`Domain::remove_peer`, or their death) closes theirs. Default 256.
    pub max_peer_endpoints: usize,
    /// Open each software-progress domain's completion queue with a wait
    /// fd (`FI_WAIT_FD`), so an idle engine worker can sleep in `poll(2)`
    /// instead of polling (`Domain::wait_fd`). Providers that refuse one
    /// are opened without it. Hardware-progress providers (EFA, verbs) are
    /// never given one. Default `true`.
    pub wait_fd: bool,
    /// Most *passive* peers: peers created by an incoming message from an
    /// address this domain was not asked to reach (and not added since).
    /// A message names its sender, so anyone who can reach the endpoint
    /// could otherwise fill the address vector with made-up addresses. At
    /// the bound, a message from a new address removes the oldest idle
    /// passive peer, or is dropped unanswered when none is idle (its
    /// sender's SEND fails after `ack_timeout`). At least 1. Default 1024.
    pub max_passive_peers: usize,
}

impl LibfabricConfig {
    /// Defaults for `provider`.
    pub fn new(provider: impl Into<String>) -> Self {
        LibfabricConfig {
            provider: provider.into(),
            domains: None,
            hmem: false,
            hmem_ipc: false,
            fi_more: None,
            max_inflight: 1024,
            max_recvs: 1024,
            max_send_len: 64 << 10,
            bounce_buffers: 32,
            rnr_timeout: Duration::from_millis(100),
            ack_timeout: Duration::from_secs(10),
            require_delivery_complete: false,
            connect_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
            max_peer_endpoints: 256,
            wait_fd: true,
            max_passive_peers: 1024,
        }
    }

    /// Restricts (and orders) the domains used.
    pub fn with_domains<S: Into<String>>(mut self, domains: impl IntoIterator<Item = S>) -> Self {
        self.domains = Some(domains.into_iter().map(Into::into).collect());
        self
    }

    /// Enables `FI_HMEM` (CUDA memory registration).
    pub fn with_hmem(mut self, hmem: bool) -> Self {
        self.hmem = hmem;
        self
    }

    /// Sets [`LibfabricConfig::hmem_ipc`].
    pub fn with_hmem_ipc(mut self, on: bool) -> Self {
        self.hmem_ipc = on;
        self
    }

    /// Sets [`LibfabricConfig::connect_timeout`].
    pub fn with_connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// Sets [`LibfabricConfig::wait_fd`].
    pub fn with_wait_fd(mut self, on: bool) -> Self {
        self.wait_fd = on;
        self
    }

    /// Sets [`LibfabricConfig::max_peer_endpoints`].
    pub fn with_max_peer_endpoints(mut self, n: usize) -> Self {
        self.max_peer_endpoints = n;
        self
    }

    /// Sets [`LibfabricConfig::max_passive_peers`].
    pub fn with_max_passive_peers(mut self, n: usize) -> Self {
        self.max_passive_peers = n;
        self
    }

    /// Sets the outstanding-WR bound.
    pub fn with_max_inflight(mut self, n: usize) -> Self {
        self.max_inflight = n;
        self
    }

    /// Sets [`LibfabricConfig::rnr_timeout`].
    pub fn with_rnr_timeout(mut self, t: Duration) -> Self {
        self.rnr_timeout = t;
        self
    }

    /// Sets [`LibfabricConfig::write_timeout`].
    pub fn with_write_timeout(mut self, t: Duration) -> Self {
        self.write_timeout = t;
        self
    }

    /// Sets [`LibfabricConfig::ack_timeout`].
    pub fn with_ack_timeout(mut self, t: Duration) -> Self {
        self.ack_timeout = t;
        self
    }

    /// Sets [`LibfabricConfig::max_send_len`].
    pub fn with_max_send_len(mut self, n: u64) -> Self {
        self.max_send_len = n;
        self
    }
}

struct Nic {
    name: String,
    info: Arc<ffi::Info>,
}

/// A [`Provider`] over one libfabric provider (`efa`, `tcp`, `shm`, ...).
pub struct LibfabricProvider {
    config: LibfabricConfig,
    name: String,
    lib: &'static ffi::Lib,
    nics: Vec<Nic>,
    delivery_complete: bool,
}

impl std::fmt::Debug for LibfabricProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibfabricProvider")
            .field("name", &self.name)
            .field(
                "nics",
                &self.nics.iter().map(|n| &n.name).collect::<Vec<_>>(),
            )
            .field("delivery_complete", &self.delivery_complete)
            .finish()
    }
}

/// The loaded libfabric's version as `(major, minor)`, or why it cannot be
/// loaded.
pub fn library_version() -> Result<(u32, u32), TransportError> {
    let lib = ffi::lib()?;
    Ok((lib.version >> 16, lib.version & 0xffff))
}

impl LibfabricProvider {
    /// Discovers all NICs of `provider` with default settings.
    pub fn new(provider: &str) -> Result<Self, TransportError> {
        Self::with_config(LibfabricConfig::new(provider))
    }

    /// Discovers NICs per `config` (runs `fi_getinfo`).
    pub fn with_config(config: LibfabricConfig) -> Result<Self, TransportError> {
        let lib = ffi::lib()?;
        let mut hints = ffi::Hints {
            provider: &config.provider,
            hmem: config.hmem,
            delivery_complete: true,
        };
        let mut infos = ffi::getinfo(lib, &hints)?;
        let mut delivery_complete = true;
        if infos.is_empty() && !config.require_delivery_complete {
            hints.delivery_complete = false;
            infos = ffi::getinfo(lib, &hints)?;
            delivery_complete = false;
            if !infos.is_empty() {
                tracing::warn!(
                    provider = %config.provider,
                    "provider does not offer FI_DELIVERY_COMPLETE: a WRITE completion may \
                     precede placement at the target"
                );
            }
        }
        // Usable entries: 32-bit remote CQ data; one per domain name (the
        // provider lists its preferred address format first).
        let mut distinct: Vec<Arc<ffi::Info>> = Vec::new();
        for info in infos {
            if info.cq_data_size < 4 {
                tracing::debug!(domain = %info.domain_name, "skipped: cq_data_size < 4");
                continue;
            }
            if !distinct.iter().any(|d| d.domain_name == info.domain_name) {
                distinct.push(Arc::new(info));
            }
        }
        let nics = match &config.domains {
            None => distinct
                .into_iter()
                .map(|info| Nic {
                    name: info.domain_name.clone(),
                    info,
                })
                .collect(),
            Some(wanted) => {
                let mut nics = Vec::with_capacity(wanted.len());
                for (k, w) in wanted.iter().enumerate() {
                    let info = distinct
                        .iter()
                        .find(|d| &d.domain_name == w)
                        .cloned()
                        .ok_or_else(|| TransportError::NoDevice {
                            what: format!(
                                "libfabric {} domain {w:?} (available: {})",
                                config.provider,
                                distinct
                                    .iter()
                                    .map(|d| d.domain_name.as_str())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        })?;
                    let repeats = wanted[..k].iter().filter(|x| *x == w).count();
                    let name = if repeats == 0 {
                        w.clone()
                    } else {
                        format!("{w}#{repeats}")
                    };
                    nics.push(Nic { name, info });
                }
                nics
            }
        };
        Ok(LibfabricProvider {
            name: format!("libfabric:{}", config.provider),
            config,
            lib,
            nics,
            delivery_complete,
        })
    }

    /// Whether the NICs were found with `FI_DELIVERY_COMPLETE`.
    pub fn delivery_complete(&self) -> bool {
        self.delivery_complete
    }

    /// Opens NIC `nic` as the concrete domain type.
    pub fn open_domain(&self, nic: usize) -> Result<LibfabricDomain, TransportError> {
        let n = self
            .nics
            .get(nic)
            .ok_or_else(|| TransportError::InvalidArgument {
                nic: self.name.clone(),
                what: format!("NIC index {nic} out of range ({} NICs)", self.nics.len()),
            })?;
        let info = &n.info;
        let tx = if info.tx_size == 0 { 256 } else { info.tx_size };
        let rx = if info.rx_size == 0 { 256 } else { info.rx_size };
        let max_inflight = self.config.max_inflight.clamp(1, tx);
        let opts = DomainOptions {
            max_inflight,
            max_recvs: self.config.max_recvs.max(1),
            max_batch: max_inflight.min(64),
            fi_more: self
                .config
                .fi_more
                .unwrap_or_else(|| info.prov_name.starts_with("efa")),
            hmem: self.config.hmem,
            hmem_ipc: self.config.hmem_ipc,
            connect_timeout: self.config.connect_timeout,
            write_timeout: self.config.write_timeout,
            max_send_len: self.config.max_send_len,
            rnr_timeout: self.config.rnr_timeout,
            ack_timeout: self.config.ack_timeout,
            bounces: self.config.bounce_buffers.clamp(1, rx),
            acks: 64.min(tx),
            max_peer_endpoints: self.config.max_peer_endpoints,
            wait_fd: self.config.wait_fd,
            max_passive_peers: self.config.max_passive_peers,
        };
        LibfabricDomain::open(self.lib, Arc::clone(info), n.name.clone(), opts)
    }
}

impl Provider for LibfabricProvider {
    fn name(&self) -> &str {
        &self.name
    }

    /// The NICs in configuration order. Their `addr` is the provider's
    /// source address before the endpoint exists (for tcp the port is still
    /// 0); the address peers use is [`Domain::local_addr`] of the opened
    /// domain.
    fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
        Ok(self
            .nics
            .iter()
            .map(|n| NicInfo {
                name: n.name.clone(),
                addr: NetAddr(n.info.src_addr.clone()),
                numa_node: None,
                link_gbps: n.info.link_bps.map(|b| b as f64 / 1e9),
            })
            .collect())
    }

    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
        Ok(Box::new(self.open_domain(nic)?))
    }
}
