//! Where a handshake datagram really came from, as the receiving device
//! reports it, against the address the handshake claims.
//!
//! A handshake names its sender (`wire::VerbsAddr`: GID, LID, UD QPN) in
//! its payload, and anyone who can send a UD datagram with the weft Q_Key
//! can write any address there. The device, though, reports the sending
//! QP's number with every UD receive (`ibv_wc.src_qp`), and the sending
//! port's GID in the GRH in front of the payload (RoCE: always; InfiniBand:
//! when routed globally) or its LID (`ibv_wc.slid`, InfiniBand without a
//! GRH). Neither is chosen by an unprivileged sender. A handshake whose
//! claimed address differs from its source is dropped
//! ([`DomainStats::handshakes_spoofed`](super::DomainStats)): so nobody can
//! make this domain create QPs for, or retire the connection of, an
//! address that is not their own.

use crate::ops::Gid;
use crate::wire::VerbsAddr;

/// The source of one UD receive, from its completion and GRH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct UdSource {
    /// The sending QP's number (`ibv_wc.src_qp`).
    pub(super) qpn: u32,
    /// The sending port's GID, when a GRH preceded the payload.
    pub(super) gid: Option<Gid>,
    /// The sending port's LID (`ibv_wc.slid`; meaningful without a GRH).
    pub(super) lid: u16,
}

impl UdSource {
    /// The source of a receive whose completion reported `src_qp` and
    /// `slid`, with `grh` the 40 bytes in front of the payload when the
    /// completion flagged a GRH.
    pub(super) fn new(src_qp: u32, slid: u16, grh: Option<&[u8]>) -> Self {
        UdSource {
            qpn: src_qp,
            gid: grh.and_then(grh_source_gid),
            lid: slid,
        }
    }

    /// Whether `claimed` is this source: the same QPN, and the same GID
    /// (with a GRH) or LID (without one).
    pub(super) fn is(&self, claimed: &VerbsAddr) -> bool {
        claimed.ud_qpn == self.qpn
            && match self.gid {
                Some(g) => g == claimed.gid,
                None => claimed.lid == self.lid,
            }
    }
}

/// The source GID in a UD receive's 40-byte GRH area. RoCE v2 over IPv4
/// puts the IPv4 header in the area's last 20 bytes (its source address
/// becomes the IPv4-mapped GID `::ffff:a.b.c.d`); InfiniBand and RoCE over
/// IPv6 put an IPv6-format GRH in all 40 (source GID at bytes 8..24). The
/// version nibbles tell them apart, as rdma-core's `ibv_init_ah_from_wc`
/// does. `None` if neither version is there.
fn grh_source_gid(grh: &[u8]) -> Option<Gid> {
    let grh: &[u8; 40] = grh.get(..40)?.try_into().ok()?;
    if grh[0] >> 4 == 6 {
        let mut g = [0u8; 16];
        g.copy_from_slice(&grh[8..24]);
        return Some(Gid(g));
    }
    if grh[20] >> 4 == 4 {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&grh[32..36]);
        return Some(Gid(g));
    }
    None
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

    #[test]
    fn ipv6_grh_gives_the_source_gid() {
        let mut grh = [0u8; 40];
        grh[0] = 0x60;
        grh[8..24].copy_from_slice(&[0xfe; 16]);
        let s = UdSource::new(17, 0, Some(&grh));
        assert_eq!(s.gid, Some(Gid([0xfe; 16])));
        assert!(s.is(&addr([0xfe; 16], 0, 17)));
        assert!(!s.is(&addr([0xfe; 16], 0, 18)), "another QPN");
        let mut other = [0xfe; 16];
        other[15] = 1;
        assert!(!s.is(&addr(other, 0, 17)), "another GID");
    }

    #[test]
    fn ipv4_header_gives_the_mapped_gid() {
        let mut grh = [0u8; 40];
        grh[20] = 0x45;
        grh[32..36].copy_from_slice(&[10, 0, 0, 7]);
        let s = UdSource::new(5, 0, Some(&grh));
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 0, 0, 7]);
        assert_eq!(s.gid, Some(Gid(g)));
        assert!(s.is(&addr(g, 0, 5)));
        g[15] = 8;
        assert!(!s.is(&addr(g, 0, 5)));
    }

    #[test]
    fn without_a_grh_the_lid_is_compared() {
        let s = UdSource::new(9, 0x12, None);
        assert!(s.is(&addr([1; 16], 0x12, 9)));
        assert!(!s.is(&addr([1; 16], 0x13, 9)));
        // A GRH area with neither version is no GID: the LID decides.
        let s = UdSource::new(9, 0x12, Some(&[0u8; 40]));
        assert_eq!(s.gid, None);
        assert!(s.is(&addr([1; 16], 0x12, 9)));
    }
}
