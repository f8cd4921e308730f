//! Addresses, descriptors, work requests, completions and capabilities.

use crate::error::TransportError;
use crate::memory::{LocalSlice, Rkey};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// A 32-bit immediate carried by a WRITE (RDMA WRITE_WITH_IMM / remote CQ data).
pub type Imm = u32;

/// An opaque NIC address (an EFA/libfabric endpoint name, a verbs
/// LID/GID+QPN blob, a loopback host/NIC id). Printed and parsed as hex.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NetAddr(pub Vec<u8>);

impl NetAddr {
    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Display for NetAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for NetAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NetAddr({self})")
    }
}

/// A string that is not a hex-encoded [`NetAddr`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid NetAddr {input:?}: {reason}")]
pub struct NetAddrParseError {
    /// The rejected input (truncated to 64 chars).
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl FromStr for NetAddr {
    type Err = NetAddrParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| NetAddrParseError {
            input: s.chars().take(64).collect(),
            reason,
        };
        let s = s.trim();
        if !s.len().is_multiple_of(2) {
            return Err(err("odd number of hex digits"));
        }
        let digits = s.as_bytes();
        let mut out = Vec::with_capacity(digits.len() / 2);
        for pair in digits.chunks_exact(2) {
            let hi = hex_val(pair[0]).ok_or_else(|| err("non-hex character"))?;
            let lo = hex_val(pair[1]).ok_or_else(|| err("non-hex character"))?;
            out.push(hi << 4 | lo);
        }
        Ok(NetAddr(out))
    }
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// The incarnation (generation) of the engine instance that owns a NIC
/// address: distinguishes a restarted process from its predecessor even
/// when both answer at the same [`NetAddr`] (a reused port, a fixed port,
/// the same GID and QPN space).
///
/// Larger is newer: an engine draws its incarnation at build time so that
/// a later restart on the same host gets a larger one (weft-engine's
/// `EngineBuilder` documents how). A receiver of descriptors and addresses
/// holds at most one live incarnation per NIC address: older or removed
/// ones are refused, and a newer one replaces the old only once the old
/// one is known to have ended (removed, or reported unreachable by the
/// transport): the number in a descriptor is a claim, not proof. Hand-built
/// descriptors carry [`Incarnation::default`] (0), the oldest.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Incarnation(pub u64);

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A serializable remote memory descriptor: where a region is and, for each
/// NIC of its owner, the address of that NIC and the rkey valid on it.
///
/// Exchanged out of band. All peers of a deployment use the same NIC count,
/// and entry `i` of `rkeys` belongs to NIC `i` of the owner's domain group: a
/// sender must post a piece carried by its NIC `i` with `rkeys[i]` only.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MrDesc {
    /// Start address of the region in the owner's address space.
    pub addr: u64,
    /// Length of the region in bytes.
    pub len: u64,
    /// One `(NIC address, rkey)` per NIC of the owner.
    pub rkeys: Vec<(NetAddr, Rkey)>,
    /// The owner's incarnation: a descriptor of an incarnation that was
    /// removed or replaced by a newer one at the same addresses is refused
    /// by the engine (never written to whatever answers there now).
    /// (`serde(default)` only helps self-describing formats; in postcard,
    /// the wire format, the field changed the encoding.)
    #[serde(default)]
    pub incarnation: Incarnation,
}

impl MrDesc {
    /// The remote slice `len` bytes at `offset` via NIC `nic`, if it fits.
    pub fn slice(&self, nic: usize, offset: u64, len: u64) -> Option<RemoteSlice> {
        let (_, rkey) = self.rkeys.get(nic)?;
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(RemoteSlice {
            base: self.addr,
            offset,
            rkey: *rkey,
        })
    }
}

/// Remote memory one WRITE targets: registration base, byte offset, key.
///
/// Backends whose NIC addresses remote memory by virtual address use
/// `base + offset`; offset-addressed ones (libfabric without
/// `FI_MR_VIRT_ADDR`) use `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteSlice {
    /// Start address of the target registration.
    pub base: u64,
    /// Byte offset inside the registration.
    pub offset: u64,
    /// Key valid on the target NIC this WRITE goes to.
    pub rkey: Rkey,
}

impl RemoteSlice {
    /// `base + offset`, or `None` on overflow.
    pub fn addr(&self) -> Option<u64> {
        self.base.checked_add(self.offset)
    }
}

/// A set of equally sized pages in one region: page `i` of the set starts at
/// byte `offset + indices[i] * stride`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pages {
    /// Page indices, in transfer order.
    pub indices: Vec<u32>,
    /// Distance between consecutive page indices, in bytes.
    pub stride: u64,
    /// Byte offset of page index 0.
    pub offset: u64,
}

impl Pages {
    /// Byte offset of the `i`-th listed page, or `None` if `i` is out of range
    /// or the offset overflows.
    pub fn page_offset(&self, i: usize) -> Option<u64> {
        self.index_offset(*self.indices.get(i)?)
    }

    /// Byte offset of page index `index` (`offset + index * stride`), or
    /// `None` if it overflows.
    pub fn index_offset(&self, index: u32) -> Option<u64> {
        u64::from(index)
            .checked_mul(self.stride)?
            .checked_add(self.offset)
    }

    /// Number of listed pages.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether no page is listed.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// One destination of a scatter: `len` bytes from `src_offset` of the source
/// go to `dst_offset` of `dst`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ScatterDst {
    /// Bytes to write (0 for an immediate-only write).
    pub len: u64,
    /// Offset in the source region.
    pub src_offset: u64,
    /// The destination region.
    pub dst: MrDesc,
    /// Offset in the destination region.
    pub dst_offset: u64,
}

/// A caller-chosen id that comes back in the completion of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WrId(pub u64);

/// A domain-local handle for a peer, from [`crate::Domain::add_peer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

/// One WRITE work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteWr {
    /// Comes back in the [`Completion::Write`].
    pub wr: WrId,
    /// Target peer.
    pub peer: PeerId,
    /// Source bytes (registered with this domain). Its `len` is the WRITE's
    /// length; 0 means an immediate-only WRITE.
    pub src: LocalSlice,
    /// Target memory.
    pub dst: RemoteSlice,
    /// Immediate to report at the target after the payload has landed.
    pub imm: Option<Imm>,
}

/// What [`crate::Domain::poll`] reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Completion {
    /// A SEND finished (placed into a receive buffer at the peer) or failed.
    Send {
        /// The SEND's id.
        wr: WrId,
        /// Outcome.
        result: Result<(), TransportError>,
    },
    /// A posted receive buffer was filled (with this many bytes) or flushed.
    Recv {
        /// The receive's id.
        wr: WrId,
        /// Received length, or why the buffer came back empty.
        result: Result<u64, TransportError>,
        /// The address of the NIC the message came from, as this domain
        /// attributes it (`None` for a flushed or failed buffer): the
        /// connection it arrived over where the fabric has connections
        /// (verbs RC, nvlink), the sending endpoint where the fabric
        /// reports it (loopback), the endpoint the message layer answers
        /// where the sender names itself (libfabric; see docs/backends.md).
        from: Option<NetAddr>,
    },
    /// A WRITE finished (payload in target memory) or failed.
    Write {
        /// The WRITE's id.
        wr: WrId,
        /// Outcome.
        result: Result<(), TransportError>,
    },
    /// A peer's WRITE with this immediate landed in our memory.
    Imm {
        /// The immediate.
        imm: Imm,
    },
}

/// Static facts about one NIC.
#[derive(Debug, Clone, PartialEq)]
pub struct NicInfo {
    /// Human-readable name, e.g. `rdmap16s27` or `lo/host3/nic1`.
    pub name: String,
    /// Address peers reach this NIC at.
    pub addr: NetAddr,
    /// NUMA node of the NIC, when known.
    pub numa_node: Option<u32>,
    /// Link speed in Gbit/s, when known.
    pub link_gbps: Option<f64>,
}

/// What a domain supports and its limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Capabilities {
    /// Largest WRITE the domain accepts in one WR, in bytes. The engine
    /// shards longer transfers; backends that support more than their native
    /// WR limit split internally and still report one immediate.
    pub max_write_len: u64,
    /// Largest SEND in bytes.
    pub max_send_len: u64,
    /// Outstanding SEND + WRITE WRs the send queue holds.
    pub max_inflight: usize,
    /// Outstanding receive buffers.
    pub max_recvs: usize,
    /// Most WRs accepted by one [`crate::Domain::post_writes`] call.
    pub max_batch: usize,
    /// Whether the fabric happens to deliver in order (RC). Informational:
    /// the engine never relies on it.
    pub ordered: bool,
    /// Whether memory on CUDA devices can be registered.
    pub device_memory: bool,
    /// Whether data moves only while the domain is polled, including the
    /// WRITEs *peers* make into this host's memory (libfabric providers
    /// with manual data progress: tcp, shm). An engine keeps polling such
    /// a NIC instead of sleeping when idle, or incoming transfers stall.
    pub software_progress: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode, encode};
    use proptest::prelude::*;

    #[test]
    fn netaddr_hex_roundtrip() {
        let a = NetAddr(vec![0, 1, 0xab, 0xff]);
        assert_eq!(a.to_string(), "0001abff");
        assert_eq!("0001ABff".parse::<NetAddr>().unwrap(), a);
        assert!("abc".parse::<NetAddr>().is_err());
        assert!("zz".parse::<NetAddr>().is_err());
        assert_eq!("".parse::<NetAddr>().unwrap(), NetAddr(vec![]));
    }

    #[test]
    fn mrdesc_slice_bounds() {
        let d = MrDesc {
            addr: 1000,
            len: 64,
            rkeys: vec![(NetAddr(vec![1]), Rkey(7)), (NetAddr(vec![2]), Rkey(8))],
            incarnation: Incarnation(3),
        };
        let s = d.slice(1, 60, 4).unwrap();
        assert_eq!(s.rkey, Rkey(8));
        assert_eq!(s.addr(), Some(1060));
        assert!(d.slice(1, 61, 4).is_none());
        assert!(d.slice(2, 0, 1).is_none());
        assert!(d.slice(0, u64::MAX, 2).is_none());
    }

    #[test]
    fn pages_offsets() {
        let p = Pages {
            indices: vec![0, 3, u32::MAX],
            stride: 4096,
            offset: 8,
        };
        assert_eq!(p.page_offset(0), Some(8));
        assert_eq!(p.page_offset(1), Some(3 * 4096 + 8));
        assert_eq!(p.page_offset(2), Some(u64::from(u32::MAX) * 4096 + 8));
        assert_eq!(p.page_offset(3), None);
        let huge = Pages {
            indices: vec![u32::MAX],
            stride: u64::MAX,
            offset: 0,
        };
        assert_eq!(huge.page_offset(0), None);
    }

    #[test]
    fn trailing_bytes_rejected() {
        let mut bytes = encode(&NetAddr(vec![1, 2])).unwrap();
        bytes.push(0);
        assert!(decode::<NetAddr>(&bytes).is_err());
    }

    proptest! {
        #[test]
        fn mrdesc_roundtrip(addr: u64, len: u64, inc: u64, keys in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..40), any::<u64>()), 0..8)) {
            let d = MrDesc { addr, len, rkeys: keys.into_iter().map(|(a, k)| (NetAddr(a), Rkey(k))).collect(), incarnation: Incarnation(inc) };
            let bytes = encode(&d).unwrap();
            prop_assert_eq!(decode::<MrDesc>(&bytes).unwrap(), d);
        }

        #[test]
        fn decode_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<MrDesc>(&bytes);
            let _ = decode::<Pages>(&bytes);
            let _ = decode::<ScatterDst>(&bytes);
            let _ = decode::<NetAddr>(&bytes);
        }

        #[test]
        fn netaddr_display_parse_roundtrip(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let a = NetAddr(bytes);
            prop_assert_eq!(a.to_string().parse::<NetAddr>().unwrap(), a);
        }
    }
}
