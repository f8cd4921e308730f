//! # weft-nvlink: the same-host backend
//!
//! Peers on the same host (one process per GPU, as LLM stacks run) reach
//! each other without a NIC. Each pair of domains talks through a shared
//! file holding two rings (frames forward, answers back), set up over a
//! Unix socket in the abstract namespace that also tells each side when the
//! other dies. Bytes move two ways:
//!
//! - **One-sided**, when the target registered memory a [`PeerMemory`]
//!   can export (GPU memory with `weft-cuda`'s CUDA IPC): the target
//!   publishes the registration in a shared key table, the initiator maps
//!   it once per peer and allocation and copies into it on its own copy
//!   lane (a CUDA stream per peer, over NVLink where GPUs have it); the
//!   immediate follows through the ring only after the copy completed.
//! - **Staged** through the ring otherwise (host memory, or an initiator
//!   without a `PeerMemory`): the target checks the key, bounds and access
//!   of every WRITE before copying a byte, so a write it refuses writes
//!   nothing; SEND/RECV always take this path.
//!
//! Addresses carry the host's boot id: a peer on another host is reported
//! unreachable (an engine over two fabrics routes it to a NIC instead).
//!
//! ```no_run
//! use weft_nvlink::{NvlinkConfig, NvlinkProvider};
//! use weft_transport::Provider;
//! let provider = NvlinkProvider::new(NvlinkConfig::default());
//! let mut domain = provider.open(0)?;
//! # Ok::<(), weft_transport::TransportError>(())
//! ```
//!
//! Data moves only while domains are polled (the target copies staged
//! bytes in its `poll`); [`weft_transport::Domain::wait_fd`] lets an idle
//! engine sleep until a peer rings its doorbell.

#![deny(unsafe_code)]

mod conn;
mod domain;
mod inbound;
mod keys;
mod out;
mod proto;
mod ring;
mod sys;

pub use domain::NvlinkDomain;

use std::sync::Arc;
use std::time::Duration;
use weft_transport::{Domain, NetAddr, NicInfo, PeerMemory, Provider, TransportError};

/// Settings of an [`NvlinkProvider`].
#[derive(Clone)]
#[non_exhaustive]
pub struct NvlinkConfig {
    /// Domains ("lanes") one process may open, each with its own rings and
    /// doorbell; [`Provider::nics`] lists this many. Default 2.
    pub lanes: usize,
    /// How long a SEND waits at the target for a receive buffer before it
    /// fails with `ReceiverNotReady`. Default 1 s.
    pub rnr_timeout: Duration,
    /// Bytes of each connection's forward ring (a power of two, 64 KiB to
    /// 256 MiB). Default 4 MiB.
    pub ring_bytes: usize,
    /// Outstanding SEND + WRITE work requests per domain. Default 1024.
    pub max_inflight: usize,
    /// Memory peers may map (GPU memory: `weft_cuda::Gpu::peer_memory`);
    /// without it GPU memory cannot be registered and every byte is staged.
    pub peer_memory: Option<Arc<dyn PeerMemory>>,
    /// The host identity this process's domains put in their addresses
    /// (peers with another one are "on another host"). Default: the
    /// kernel's boot id. Set it where processes of one machine must not
    /// meet through shared memory (separate IPC namespaces), or to stand
    /// in for several hosts on one machine.
    pub host: Option<[u8; 16]>,
}

impl std::fmt::Debug for NvlinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvlinkConfig")
            .field("lanes", &self.lanes)
            .field("rnr_timeout", &self.rnr_timeout)
            .field("ring_bytes", &self.ring_bytes)
            .field("max_inflight", &self.max_inflight)
            .field(
                "peer_memory",
                &self.peer_memory.as_ref().map(|p| p.name().to_string()),
            )
            .field("host", &self.host)
            .finish()
    }
}

impl Default for NvlinkConfig {
    fn default() -> Self {
        NvlinkConfig {
            lanes: 2,
            rnr_timeout: Duration::from_secs(1),
            ring_bytes: 4 << 20,
            max_inflight: 1024,
            peer_memory: None,
            host: None,
        }
    }
}

impl NvlinkConfig {
    /// With `pm` for memory peers may map (see [`NvlinkConfig::peer_memory`]).
    pub fn with_peer_memory(mut self, pm: Arc<dyn PeerMemory>) -> Self {
        self.peer_memory = Some(pm);
        self
    }

    /// With `lanes` lanes (see [`NvlinkConfig::lanes`]).
    pub fn with_lanes(mut self, lanes: usize) -> Self {
        self.lanes = lanes;
        self
    }

    /// With this host identity (see [`NvlinkConfig::host`]).
    pub fn with_host(mut self, host: [u8; 16]) -> Self {
        self.host = Some(host);
        self
    }

    /// With this receiver-not-ready timeout.
    pub fn with_rnr_timeout(mut self, t: Duration) -> Self {
        self.rnr_timeout = t;
        self
    }

    fn validate(&self) -> Result<(), TransportError> {
        let bad = |what: String| TransportError::InvalidArgument {
            nic: "nvlink".into(),
            what,
        };
        if self.lanes == 0 || self.lanes > 64 {
            return Err(bad(format!("lanes {} (1..=64)", self.lanes)));
        }
        if !self.ring_bytes.is_power_of_two() || !(64 << 10..=256 << 20).contains(&self.ring_bytes)
        {
            return Err(bad(format!(
                "ring_bytes {} (a power of two, 64 KiB..256 MiB)",
                self.ring_bytes
            )));
        }
        if self.max_inflight == 0 {
            return Err(bad("max_inflight 0".into()));
        }
        Ok(())
    }
}

/// The same-host provider (see the crate docs).
#[derive(Debug, Clone)]
pub struct NvlinkProvider {
    config: NvlinkConfig,
}

impl NvlinkProvider {
    /// A provider with `config`.
    pub fn new(config: NvlinkConfig) -> Self {
        NvlinkProvider { config }
    }

    /// Whether `addr` is an address of this backend on this host (by the
    /// kernel's boot id; an engine over two fabrics routes such peers
    /// here).
    pub fn is_local(addr: &NetAddr) -> bool {
        Addr::parse(addr).is_some_and(|a| a.host == sys::host_id())
    }

    /// Whether `addr` is an address of this backend at all.
    pub fn is_nvlink_addr(addr: &NetAddr) -> bool {
        Addr::parse(addr).is_some()
    }
}

impl Provider for NvlinkProvider {
    fn name(&self) -> &str {
        "nvlink"
    }

    fn nics(&self) -> Result<Vec<NicInfo>, TransportError> {
        self.config.validate()?;
        Ok((0..self.config.lanes)
            .map(|i| NicInfo {
                name: format!("nvlink{i}"),
                addr: NetAddr(Vec::new()),
                numa_node: None,
                link_gbps: None,
            })
            .collect())
    }

    fn open(&self, nic: usize) -> Result<Box<dyn Domain>, TransportError> {
        self.config.validate()?;
        if nic >= self.config.lanes {
            return Err(TransportError::NoDevice {
                what: format!("nvlink lane {nic} (of {})", self.config.lanes),
            });
        }
        Ok(Box::new(NvlinkDomain::open(self.config.clone(), nic)?))
    }
}

/// A domain's address: magic, host (boot id), pid, domain number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Addr {
    pub(crate) host: [u8; 16],
    pub(crate) pid: u32,
    pub(crate) index: u32,
}

const ADDR_MAGIC: [u8; 4] = *b"WNV1";

impl Addr {
    pub(crate) fn encode(&self) -> NetAddr {
        let mut v = ADDR_MAGIC.to_vec();
        v.extend_from_slice(&self.host);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.index.to_le_bytes());
        NetAddr(v)
    }

    pub(crate) fn parse(a: &NetAddr) -> Option<Addr> {
        let b = &a.0;
        if b.len() != 28 || b[..4] != ADDR_MAGIC {
            return None;
        }
        Some(Addr {
            host: b[4..20].try_into().ok()?,
            pid: u32::from_le_bytes(b[20..24].try_into().ok()?),
            index: u32::from_le_bytes(b[24..28].try_into().ok()?),
        })
    }

    /// The abstract socket name the domain listens on.
    pub(crate) fn socket_name(&self) -> String {
        format!("weft-nvlink.{}.{}", self.pid, self.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_roundtrip_and_garbage_is_refused() {
        let a = Addr {
            host: [7; 16],
            pid: 42,
            index: 3,
        };
        assert_eq!(Addr::parse(&a.encode()), Some(a));
        assert_eq!(Addr::parse(&NetAddr(vec![1, 2, 3])), None);
        let mut bad = a.encode();
        bad.0[0] = b'X';
        assert_eq!(Addr::parse(&bad), None);
        assert!(!NvlinkProvider::is_local(&a.encode()));
    }

    #[test]
    fn config_is_validated() {
        let p = NvlinkProvider::new(NvlinkConfig {
            lanes: 0,
            ..NvlinkConfig::default()
        });
        assert!(matches!(
            p.nics(),
            Err(TransportError::InvalidArgument { .. })
        ));
        let p = NvlinkProvider::new(NvlinkConfig {
            ring_bytes: 1000,
            ..NvlinkConfig::default()
        });
        assert!(p.open(0).is_err());
        let p = NvlinkProvider::new(NvlinkConfig::default());
        assert!(matches!(p.open(5), Err(TransportError::NoDevice { .. })));
    }
}
