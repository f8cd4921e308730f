//! The verbs [`NetAddr`] encoding and the UD handshake message.
//!
//! Both are fixed little-endian layouts, parsed with checked slicing: any
//! bytes from the network decode to an error, never a panic.

use crate::ops::Gid;
use weft_transport::NetAddr;

/// A decoded verbs address: how to reach a domain's UD QP.
///
/// Encoding (24 bytes): `b'V'`, version `1`, GID (16), LID (u16 LE),
/// UD QPN (u32 LE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VerbsAddr {
    /// Port GID (RoCE: the selected RoCE v2 GID; IB: the port GID).
    pub gid: Gid,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// QPN of the domain's UD (handshake) QP.
    pub ud_qpn: u32,
}

/// Length of an encoded [`VerbsAddr`].
pub const ADDR_LEN: usize = 24;

impl VerbsAddr {
    /// The wire form.
    pub fn encode(&self) -> NetAddr {
        let mut v = Vec::with_capacity(ADDR_LEN);
        v.push(b'V');
        v.push(1);
        v.extend_from_slice(&self.gid.0);
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.ud_qpn.to_le_bytes());
        NetAddr(v)
    }

    /// Parses the wire form.
    pub fn decode(bytes: &[u8]) -> Result<Self, &'static str> {
        if bytes.len() != ADDR_LEN {
            return Err("wrong length for a verbs address");
        }
        if bytes[0] != b'V' || bytes[1] != 1 {
            return Err("not a version-1 verbs address");
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&bytes[2..18]);
        Ok(Self {
            gid: Gid(gid),
            lid: u16::from_le_bytes([bytes[18], bytes[19]]),
            ud_qpn: u32::from_le_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]),
        })
    }
}

/// The QPNs and starting PSNs of one side's two RC QPs toward a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpPair {
    /// SEND/RECV QP number.
    pub send_qpn: u32,
    /// WRITE/WRITEIMM QP number.
    pub write_qpn: u32,
    /// Starting PSN of the SEND/RECV QP.
    pub send_psn: u32,
    /// Starting PSN of the WRITE/WRITEIMM QP.
    pub write_psn: u32,
}

/// One handshake datagram.
///
/// `ready`: the sender's QPs are in RTR/RTS, connected to the recipient's
/// QPNs given in `peer_send_qpn`/`peer_write_qpn`. `ack`: the sender knows
/// the recipient is ready. A message with `ack == false` asks for a reply.
/// The sender also echoes the recipient's random starting PSNs
/// (`peer_send_psn`/`peer_write_psn`), which only a sender that received
/// the recipient's handshake knows: the recipient counts `ready` only with
/// them (48 random bits), so a datagram claiming a made-up address cannot
/// complete a connection by guessing QPNs. Version 2 (version 1 had no
/// echo).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handshake {
    /// The sender's encoded address.
    pub from: VerbsAddr,
    /// The sender's QPs.
    pub qps: QpPair,
    /// The recipient's QPNs the sender is connected to (0 when none).
    pub peer_send_qpn: u32,
    /// See `peer_send_qpn`.
    pub peer_write_qpn: u32,
    /// The recipient's starting PSN of its SEND/RECV QP, as the sender
    /// learned it from the recipient's handshake (0 when none).
    pub peer_send_psn: u32,
    /// See `peer_send_psn` (its WRITE/WRITEIMM QP).
    pub peer_write_psn: u32,
    /// Sender is RTR/RTS toward the recipient's QPNs above.
    pub ready: bool,
    /// Sender knows the recipient is ready.
    pub ack: bool,
    /// The sender's active MTU (`enum ibv_mtu`).
    pub mtu: u8,
}

const MAGIC: &[u8; 4] = b"WVHS";
/// Encoded handshake length.
pub const HANDSHAKE_LEN: usize = 4 + 1 + 1 + ADDR_LEN + 16 + 16 + 1;

/// The handshake version this build speaks.
const VERSION: u8 = 2;

impl Handshake {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HANDSHAKE_LEN);
        v.extend_from_slice(MAGIC);
        v.push(VERSION);
        v.push(u8::from(self.ready) | (u8::from(self.ack) << 1));
        v.extend_from_slice(&self.from.encode().0);
        for x in [
            self.qps.send_qpn,
            self.qps.write_qpn,
            self.qps.send_psn,
            self.qps.write_psn,
            self.peer_send_qpn,
            self.peer_write_qpn,
            self.peer_send_psn,
            self.peer_write_psn,
        ] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.push(self.mtu);
        v
    }

    /// Parses untrusted bytes.
    pub fn decode(b: &[u8]) -> Result<Self, &'static str> {
        if b.len() != HANDSHAKE_LEN {
            return Err("wrong handshake length");
        }
        if &b[..4] != MAGIC || b[4] != VERSION {
            return Err("not a version-2 weft handshake");
        }
        let flags = b[5];
        let from = VerbsAddr::decode(&b[6..6 + ADDR_LEN])?;
        let mut words = [0u32; 8];
        let base = 6 + ADDR_LEN;
        for (i, w) in words.iter_mut().enumerate() {
            let o = base + 4 * i;
            *w = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        }
        Ok(Self {
            from,
            qps: QpPair {
                send_qpn: words[0],
                write_qpn: words[1],
                send_psn: words[2] & 0xff_ffff,
                write_psn: words[3] & 0xff_ffff,
            },
            peer_send_qpn: words[4],
            peer_write_qpn: words[5],
            peer_send_psn: words[6] & 0xff_ffff,
            peer_write_psn: words[7] & 0xff_ffff,
            ready: flags & 1 != 0,
            ack: flags & 2 != 0,
            mtu: b[base + 32],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_roundtrip_and_garbage() {
        let a = VerbsAddr {
            gid: Gid([7; 16]),
            lid: 0x1234,
            ud_qpn: 0xabcdef,
        };
        let n = a.encode();
        assert_eq!(n.0.len(), ADDR_LEN);
        assert_eq!(VerbsAddr::decode(&n.0), Ok(a));
        assert!(VerbsAddr::decode(&n.0[..23]).is_err());
        let mut bad = n.0.clone();
        bad[1] = 2;
        assert!(VerbsAddr::decode(&bad).is_err());
    }

    #[test]
    fn handshake_roundtrip_and_garbage() {
        let h = Handshake {
            from: VerbsAddr {
                gid: Gid([1; 16]),
                lid: 3,
                ud_qpn: 99,
            },
            qps: QpPair {
                send_qpn: 10,
                write_qpn: 11,
                send_psn: 0x123456,
                write_psn: 0x654321,
            },
            peer_send_qpn: 20,
            peer_write_qpn: 21,
            peer_send_psn: 0xabcdef,
            peer_write_psn: 0x13579b,
            ready: true,
            ack: false,
            mtu: 5,
        };
        let b = h.encode();
        assert_eq!(b.len(), HANDSHAKE_LEN);
        assert_eq!(Handshake::decode(&b), Ok(h));
        for n in 0..b.len() {
            let _ = Handshake::decode(&b[..n]);
        }
        let mut x = b.clone();
        x[0] ^= 1;
        assert!(Handshake::decode(&x).is_err());
    }
}
