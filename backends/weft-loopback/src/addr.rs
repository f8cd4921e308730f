//! Loopback NIC addresses: `"lo"` + host (u32 BE) + NIC (u16 BE), 8 bytes.

use crate::HostId;
use weft_transport::NetAddr;

const MAGIC: [u8; 2] = *b"lo";

/// Encodes (host, NIC). NIC indices above `u16::MAX` saturate (such NICs
/// cannot exist).
pub(crate) fn encode(host: u32, nic: u32) -> NetAddr {
    let nic = u16::try_from(nic).unwrap_or(u16::MAX);
    let mut v = Vec::with_capacity(8);
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&host.to_be_bytes());
    v.extend_from_slice(&nic.to_be_bytes());
    NetAddr(v)
}

/// Decodes a loopback address; `None` if it is not one.
pub(crate) fn decode(a: &NetAddr) -> Option<(u32, u32)> {
    let b = a.as_bytes();
    if b.len() != 8 || b[..2] != MAGIC {
        return None;
    }
    let host = u32::from_be_bytes([b[2], b[3], b[4], b[5]]);
    let nic = u16::from_be_bytes([b[6], b[7]]);
    Some((host, u32::from(nic)))
}

/// Splits a loopback [`NetAddr`] into host and NIC index; `None` when the
/// bytes are not a loopback address. The inverse of
/// [`crate::Fabric::nic_addr`].
pub fn parse_addr(a: &NetAddr) -> Option<(HostId, usize)> {
    decode(a).map(|(h, n)| (HostId(h), n as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_rejects() {
        for (h, n) in [(0, 0), (1, 3), (u32::MAX, u32::from(u16::MAX))] {
            assert_eq!(decode(&encode(h, n)), Some((h, n)));
        }
        assert_eq!(decode(&NetAddr(vec![])), None);
        assert_eq!(decode(&NetAddr(b"lo\0\0\0\0\0".to_vec())), None);
        assert_eq!(decode(&NetAddr(b"xx\0\0\0\0\0\0".to_vec())), None);
        assert_eq!(
            parse_addr(&encode(7, 2)),
            Some((HostId(7), 2)),
            "printable: {}",
            encode(7, 2)
        );
        let printed = encode(7, 2).to_string();
        assert_eq!(
            printed.parse::<NetAddr>().ok().and_then(|a| decode(&a)),
            Some((7, 2))
        );
    }
}
