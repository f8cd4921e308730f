//! The wire between two domains: the hand-shake packets on the Unix socket
//! and the frames in the rings (see `ring`). Little-endian throughout.
//!
//! A connection belongs to the initiator that opened it: it creates one
//! shared file with two rings, forward (its WRITE and SEND frames) and back
//! (the target's acknowledgements), and sends it with its doorbell; the
//! target answers with its doorbell and its published key table.

use crate::ring::Frame;
use weft_transport::RemoteAccessReason;

pub(crate) const HELLO: [u8; 4] = *b"WNVH";
pub(crate) const HELLO_ACK: [u8; 4] = *b"WNVA";
pub(crate) const VERSION: u32 = 2;
pub(crate) const CHANNEL_MAGIC: u64 = u64::from_le_bytes(*b"WEFTNVL1");
/// Bytes before the first ring of a channel file.
pub(crate) const CHANNEL_HEADER: usize = 64;

/// A WRITE chunk: op, rkey, target address, total length, chunk offset,
/// flags (bit 0 immediate, bit 1 last) | immediate << 32.
pub(crate) const WRITE: u16 = 1;
/// A SEND chunk: op, total length, chunk offset | last << 63.
pub(crate) const SEND: u16 = 2;
/// The initiator copied a WRITE's bytes itself: op, immediate.
pub(crate) const LANDED: u16 = 3;
/// The target's answer: op, status | detail << 32, extra.
pub(crate) const ACK: u16 = 4;

pub(crate) const F_IMM: u64 = 1;
pub(crate) const F_LAST: u64 = 2;
pub(crate) const LAST_BIT: u64 = 1 << 63;

/// What the target says about an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Ok,
    RemoteAccess(RemoteAccessReason),
    TooLong { capacity: u64 },
    NotReady,
}

impl Status {
    pub(crate) fn encode(self) -> (u64, u64) {
        match self {
            Status::Ok => (0, 0),
            Status::RemoteAccess(r) => (
                1 | (match r {
                    RemoteAccessReason::UnknownKey => 0,
                    RemoteAccessReason::NotWritable => 1,
                    RemoteAccessReason::OutOfBounds => 2,
                    _ => 3,
                }) << 32,
                0,
            ),
            Status::TooLong { capacity } => (2, capacity),
            Status::NotReady => (3, 0),
        }
    }

    /// `None` for a status word no version of the protocol sends.
    pub(crate) fn decode(word: u64, extra: u64) -> Option<Status> {
        Some(match (word as u32, (word >> 32) as u32) {
            (0, _) => Status::Ok,
            (1, d) => Status::RemoteAccess(match d {
                0 => RemoteAccessReason::UnknownKey,
                1 => RemoteAccessReason::NotWritable,
                2 => RemoteAccessReason::OutOfBounds,
                _ => RemoteAccessReason::Unspecified,
            }),
            (2, _) => Status::TooLong { capacity: extra },
            (3, _) => Status::NotReady,
            _ => return None,
        })
    }
}

/// The fixed words of a header.
pub(crate) fn words<const N: usize>(w: [u64; N]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Header word `i` of a frame that must carry at least `n` words, or `None`.
pub(crate) fn need(f: &Frame, n: usize) -> Option<()> {
    (f.hlen >= n * 8).then_some(())
}

/// `HELLO`: version, initiator pid and domain number (its address is
/// then known: the target checks the pid against the socket's peer),
/// forward and back ring capacities.
pub(crate) fn hello(pid: u32, index: u32, fwd: u64, back: u64) -> Vec<u8> {
    let mut v = HELLO.to_vec();
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&pid.to_le_bytes());
    v.extend_from_slice(&index.to_le_bytes());
    v.extend_from_slice(&fwd.to_le_bytes());
    v.extend_from_slice(&back.to_le_bytes());
    v
}

/// A parsed `HELLO`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) pid: u32,
    pub(crate) index: u32,
    pub(crate) fwd: u64,
    pub(crate) back: u64,
}

/// Parses a `HELLO`.
pub(crate) fn parse_hello(b: &[u8]) -> Option<Hello> {
    if b.len() != 32 || b[..4] != HELLO || u32::from_le_bytes(b[4..8].try_into().ok()?) != VERSION {
        return None;
    }
    Some(Hello {
        pid: u32::from_le_bytes(b[8..12].try_into().ok()?),
        index: u32::from_le_bytes(b[12..16].try_into().ok()?),
        fwd: u64::from_le_bytes(b[16..24].try_into().ok()?),
        back: u64::from_le_bytes(b[24..32].try_into().ok()?),
    })
}

/// `HELLO_ACK`: the target's pid.
pub(crate) fn hello_ack(pid: u32) -> Vec<u8> {
    let mut v = HELLO_ACK.to_vec();
    v.extend_from_slice(&pid.to_le_bytes());
    v
}

pub(crate) fn parse_hello_ack(b: &[u8]) -> Option<u32> {
    (b.len() == 8 && b[..4] == HELLO_ACK).then(|| u32::from_le_bytes([b[4], b[5], b[6], b[7]]))
}

/// Ring capacities a channel may have.
pub(crate) fn valid_cap(c: u64) -> bool {
    c.is_power_of_two() && (4096..=(256 << 20)).contains(&c)
}

/// Bytes of a channel file with these ring capacities.
pub(crate) fn channel_len(fwd: u64, back: u64) -> usize {
    CHANNEL_HEADER + 2 * crate::ring::CONTROL + fwd as usize + back as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_roundtrip_and_unknown_words() {
        for s in [
            Status::Ok,
            Status::RemoteAccess(RemoteAccessReason::OutOfBounds),
            Status::RemoteAccess(RemoteAccessReason::UnknownKey),
            Status::RemoteAccess(RemoteAccessReason::NotWritable),
            Status::TooLong { capacity: 17 },
            Status::NotReady,
        ] {
            let (w, x) = s.encode();
            assert_eq!(Status::decode(w, x), Some(s));
        }
        assert_eq!(Status::decode(9, 0), None);
    }

    #[test]
    fn hello_parsing_refuses_garbage() {
        let h = hello(7, 3, 1 << 20, 1 << 16);
        assert_eq!(
            parse_hello(&h),
            Some(Hello {
                pid: 7,
                index: 3,
                fwd: 1 << 20,
                back: 1 << 16
            })
        );
        assert_eq!(parse_hello(&h[..31]), None);
        let mut bad = h.clone();
        bad[4] = 9;
        assert_eq!(parse_hello(&bad), None);
        assert_eq!(parse_hello_ack(&hello_ack(3)), Some(3));
        assert_eq!(parse_hello_ack(b"WNVH\0\0\0\0"), None);
        assert!(valid_cap(4096) && !valid_cap(4095) && !valid_cap(1 << 40));
    }
}
