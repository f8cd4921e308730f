//! Where a handshake datagram really came from, as the receiving device
//! reports it, against the address the handshake claims.
//!
//! A handshake names its sender (`wire::VerbsAddr`: GID, LID, UD QPN) in
//! its payload, and anyone who can send a UD datagram with the weft Q_Key
//! can write any address there. The device, though, reports the sending
//! QP's number with every UD receive (`ibv_wc.src_qp`), and the sending
//! port's GID in the GRH area in front of the payload (RoCE: always;
//! InfiniBand: when routed globally) or its LID (`ibv_wc.slid`, InfiniBand
//! without a GRH). A handshake whose claimed address differs from its
//! source is dropped
//! ([`DomainStats::handshakes_spoofed`](super::DomainStats)): so a sender
//! on another host can make this domain create QPs for, or retire the
//! connection of, no address but its own.
//!
//! What this does not stop: on RoCE v2 the source QPN is a field of a UDP
//! packet, so a process that can send UDP from a peer's host (no privilege
//! needed) can claim any QPN at that host's GID; claiming another host's
//! GID takes spoofing its IP address. The PSN echo of the handshake
//! (`wire::Handshake`) still keeps a sender that does not receive the
//! answers from completing a connection.

use crate::ops::{Gid, GRH_LEN, GRH_SGID};
use crate::wire::VerbsAddr;

/// The source of one UD receive, from its completion and GRH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct UdSource {
    /// The sending QP's number (`ibv_wc.src_qp`).
    pub(super) qpn: u32,
    /// The sending port.
    pub(super) port: SourcePort,
}

/// The sending port of a UD receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SourcePort {
    /// Its GID, from the GRH area in front of the payload.
    Gid(Gid),
    /// Its LID (`ibv_wc.slid`): no GRH came.
    Lid(u16),
    /// The completion flagged a GRH, but the GRH area holds neither an
    /// IPv4 nor an IPv6 header (no device writes that): matches nothing.
    Unreadable,
}

impl UdSource {
    /// The source of a receive whose completion reported `src_qp` and
    /// `slid`, with `grh` the 40 bytes in front of the payload when the
    /// completion flagged a GRH.
    pub(super) fn new(src_qp: u32, slid: u16, grh: Option<&[u8]>) -> Self {
        let port = match grh {
            Some(area) => grh_source_gid(area).map_or(SourcePort::Unreadable, SourcePort::Gid),
            None => SourcePort::Lid(slid),
        };
        UdSource { qpn: src_qp, port }
    }

    /// Whether `claimed` is this source: the same QPN, and the same GID
    /// (with a GRH) or LID (without one).
    pub(super) fn is(&self, claimed: &VerbsAddr) -> bool {
        claimed.ud_qpn == self.qpn
            && match self.port {
                SourcePort::Gid(g) => g == claimed.gid,
                SourcePort::Lid(l) => claimed.lid == l,
                SourcePort::Unreadable => false,
            }
    }
}

/// The source GID in a UD receive's 40-byte GRH area, decided as
/// rdma-core's `ibv_init_ah_from_wc` does. RoCE v2 over IPv4 writes only
/// the area's last 20 bytes, an IPv4 header (its source address becomes
/// the IPv4-mapped GID `::ffff:a.b.c.d`), and leaves the first 20 as the
/// buffer held them; so an IPv4 header with a valid checksum there wins.
/// Otherwise InfiniBand and RoCE v1 / v2 over IPv6 wrote an IPv6-format
/// GRH over all 40 (version 6; source GID at bytes 8..24). `None` if
/// neither is there. (The domain also zeroes the area before each post,
/// so a version-6 header of an earlier datagram cannot linger.)
fn grh_source_gid(grh: &[u8]) -> Option<Gid> {
    let grh: &[u8; GRH_LEN] = grh.get(..GRH_LEN)?.try_into().ok()?;
    if is_ipv4_header(&grh[20..]) {
        return Some(Gid::ipv4_mapped([grh[32], grh[33], grh[34], grh[35]]));
    }
    if grh[0] >> 4 == 6 {
        let mut g = [0u8; 16];
        g.copy_from_slice(&grh[GRH_SGID]);
        return Some(Gid(g));
    }
    None
}

/// Whether `h` (20 bytes) is an IPv4 header without options (version 4,
/// header length 5 words) whose checksum is right: its ten 16-bit words
/// add up, with end-around carry, to 0xffff.
fn is_ipv4_header(h: &[u8]) -> bool {
    h.len() == 20 && h[0] == 0x45 && ones_complement_sum(h) == 0xffff
}

/// The 16-bit one's complement sum of `h`'s big-endian words (the IPv4
/// header checksum's arithmetic).
fn ones_complement_sum(h: &[u8]) -> u16 {
    let mut sum: u32 = h
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// An IPv4 header (no options) of a UDP datagram of `payload_len` bytes
/// from `src` to `dst`, with its checksum: what a RoCE v2 device writes
/// into the last 20 bytes of a UD receive's GRH area. For the simulated
/// device.
#[cfg(any(test, feature = "sim"))]
pub(crate) fn ipv4_header(src: [u8; 4], dst: [u8; 4], payload_len: u16) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&20u16.saturating_add(payload_len).to_be_bytes());
    h[8] = 64; // TTL
    h[9] = 17; // UDP
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    let sum = ones_complement_sum(&h);
    h[10..12].copy_from_slice(&(!sum).to_be_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(gid: [u8; 16], lid: u16, ud_qpn: u32) -> VerbsAddr {
        VerbsAddr {
            gid: Gid(gid),
            lid,
            ud_qpn,
        }
    }

    fn mapped(ip: [u8; 4]) -> [u8; 16] {
        Gid::ipv4_mapped(ip).0
    }

    #[test]
    fn ipv6_grh_gives_the_source_gid() {
        let mut grh = [0u8; 40];
        grh[0] = 0x60;
        grh[8..24].copy_from_slice(&[0xfe; 16]);
        let s = UdSource::new(17, 0, Some(&grh));
        assert_eq!(s.port, SourcePort::Gid(Gid([0xfe; 16])));
        assert!(s.is(&addr([0xfe; 16], 0, 17)));
        assert!(!s.is(&addr([0xfe; 16], 0, 18)), "another QPN");
        let mut other = [0xfe; 16];
        other[15] = 1;
        assert!(!s.is(&addr(other, 0, 17)), "another GID");
    }

    #[test]
    fn ipv4_header_gives_the_mapped_gid() {
        let mut grh = [0u8; 40];
        grh[20..].copy_from_slice(&ipv4_header([10, 0, 0, 7], [10, 0, 0, 1], 100));
        let s = UdSource::new(5, 0, Some(&grh));
        assert_eq!(s.port, SourcePort::Gid(Gid(mapped([10, 0, 0, 7]))));
        assert!(s.is(&addr(mapped([10, 0, 0, 7]), 0, 5)));
        assert!(!s.is(&addr(mapped([10, 0, 0, 8]), 0, 5)));
        assert!(!s.is(&addr(mapped([10, 0, 0, 7]), 0, 6)));
    }

    #[test]
    fn an_ipv4_header_wins_over_a_stale_version_6_byte() {
        // RoCE v2 over IPv4 leaves the area's first 20 bytes alone: here
        // they still hold the start of an earlier IPv6 GRH.
        let mut grh = [0u8; 40];
        grh[0] = 0x60;
        grh[8..20].copy_from_slice(&[0xfe; 12]);
        grh[20..].copy_from_slice(&ipv4_header([10, 0, 0, 7], [10, 0, 0, 1], 100));
        let s = UdSource::new(5, 0, Some(&grh));
        assert_eq!(s.port, SourcePort::Gid(Gid(mapped([10, 0, 0, 7]))));
        // A version-4 byte with a wrong checksum is no IPv4 header: the
        // version-6 reading stands.
        grh[30] ^= 1;
        let s = UdSource::new(5, 0, Some(&grh));
        assert!(matches!(s.port, SourcePort::Gid(g) if g.0[..8] == [0xfe; 8]));
    }

    #[test]
    fn without_a_grh_the_lid_is_compared() {
        let s = UdSource::new(9, 0x12, None);
        assert!(s.is(&addr([1; 16], 0x12, 9)));
        assert!(!s.is(&addr([1; 16], 0x13, 9)));
        assert!(!s.is(&addr([1; 16], 0x12, 8)));
    }

    #[test]
    fn a_flagged_grh_that_is_neither_version_matches_nothing() {
        let s = UdSource::new(9, 0, Some(&[0u8; 40]));
        assert_eq!(s.port, SourcePort::Unreadable);
        assert!(!s.is(&addr([0; 16], 0, 9)));
    }
}
