//! The backend's message layer on the wire: every SEND travels as one
//! libfabric message of a [`Header`] followed by the payload, into one of
//! the receiver's internal bounce buffers; the receiver answers each with a
//! header-only ACK that says whether the message went into a posted receive
//! buffer (and if not, why). The sender's SEND completes on that answer, so
//! a SEND completion means what the transport contract says (the message is
//! in a receive buffer) and `ReceiverNotReady` / `MessageTooLong` reach the
//! sender, which libfabric's RDM providers (tcp;ofi_rxm, shm, efa: all
//! buffer unexpected messages) never report themselves.
//!
//! Layout (little-endian), padded to a multiple of 8 bytes:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `WFM1` |
//! | 4 | kind: 1 = DATA, 2 = ACK |
//! | 5 | ACK status (0 for DATA) |
//! | 6..8 | length of the sender's endpoint name |
//! | 8..16 | sequence number (the sender's slot and generation) |
//! | 16..24 | DATA: payload length; ACK `TooLong`: receive buffer capacity |
//! | 24.. | the sender's endpoint name (where the answer goes) |
#![forbid(unsafe_code)]

/// `WFM1`.
const MAGIC: [u8; 4] = *b"WFM1";
/// Fixed part of a header.
const FIXED: usize = 24;
/// Longest endpoint name a header carries.
pub(crate) const MAX_ADDR: usize = HDR_MAX - FIXED;
/// Longest header: a bounce buffer holds this plus `max_send_len`.
pub(crate) const HDR_MAX: usize = 256;

const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;

/// What the receiver did with a DATA message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AckStatus {
    /// Copied into a posted receive buffer.
    Delivered,
    /// No receive buffer was posted within the receiver's RNR timeout; the
    /// message was dropped.
    NotReady,
    /// The first posted receive buffer (of `capacity` bytes) was too small;
    /// the message was dropped.
    TooLong {
        /// The buffer's capacity.
        capacity: u64,
    },
}

impl AckStatus {
    fn code(self) -> (u8, u64) {
        match self {
            AckStatus::Delivered => (0, 0),
            AckStatus::NotReady => (1, 0),
            AckStatus::TooLong { capacity } => (2, capacity),
        }
    }

    fn from_code(code: u8, arg: u64) -> Option<AckStatus> {
        Some(match code {
            0 => AckStatus::Delivered,
            1 => AckStatus::NotReady,
            2 => AckStatus::TooLong { capacity: arg },
            _ => return None,
        })
    }
}

/// A decoded header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Header {
    /// A message of `len` payload bytes following the header.
    Data {
        /// The sender's sequence number, echoed in the ACK.
        seq: u64,
        /// Payload bytes.
        len: u64,
        /// The sender's endpoint name.
        from: Vec<u8>,
    },
    /// The answer to DATA `seq`.
    Ack {
        /// The DATA message's sequence number.
        seq: u64,
        /// What happened to it.
        status: AckStatus,
        /// The answering endpoint's name.
        from: Vec<u8>,
    },
}

/// Why a received header was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BadHeader {
    /// Shorter than the fixed part or than its own address.
    #[error("message of {0} bytes is shorter than its header")]
    Short(usize),
    /// Wrong magic: not a weft message.
    #[error("not a weft message (bad magic)")]
    Magic,
    /// Unknown kind or status byte.
    #[error("unknown message kind {0} / status {1}")]
    Kind(u8, u8),
    /// Endpoint name longer than [`MAX_ADDR`].
    #[error("endpoint name of {0} bytes")]
    Addr(usize),
}

/// Header length for an endpoint name of `addr_len` bytes.
pub(crate) fn header_len(addr_len: usize) -> usize {
    (FIXED + addr_len).next_multiple_of(8)
}

fn encode(kind: u8, status: u8, seq: u64, arg: u64, from: &[u8]) -> Vec<u8> {
    let mut v = vec![0u8; header_len(from.len())];
    v[0..4].copy_from_slice(&MAGIC);
    v[4] = kind;
    v[5] = status;
    // Callers pass our own endpoint name, checked against MAX_ADDR at open.
    let alen = u16::try_from(from.len()).unwrap_or(u16::MAX);
    v[6..8].copy_from_slice(&alen.to_le_bytes());
    v[8..16].copy_from_slice(&seq.to_le_bytes());
    v[16..24].copy_from_slice(&arg.to_le_bytes());
    v[FIXED..FIXED + from.len()].copy_from_slice(from);
    v
}

/// The header of a DATA message of `len` bytes from `from`.
pub(crate) fn data(seq: u64, len: u64, from: &[u8]) -> Vec<u8> {
    encode(KIND_DATA, 0, seq, len, from)
}

/// An ACK of `seq` from `from`.
pub(crate) fn ack(seq: u64, status: AckStatus, from: &[u8]) -> Vec<u8> {
    let (code, arg) = status.code();
    encode(KIND_ACK, code, seq, arg, from)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Decodes the header at the start of `b` (a received message); returns it
/// with the offset where the payload starts.
pub(crate) fn decode(b: &[u8]) -> Result<(Header, usize), BadHeader> {
    if b.len() < FIXED {
        return Err(BadHeader::Short(b.len()));
    }
    if b[0..4] != MAGIC {
        return Err(BadHeader::Magic);
    }
    let alen = usize::from(u16::from_le_bytes([b[6], b[7]]));
    if alen > MAX_ADDR {
        return Err(BadHeader::Addr(alen));
    }
    let hlen = header_len(alen);
    if b.len() < hlen {
        return Err(BadHeader::Short(b.len()));
    }
    let seq = u64_at(b, 8);
    let arg = u64_at(b, 16);
    let from = b[FIXED..FIXED + alen].to_vec();
    let h = match (b[4], b[5]) {
        (KIND_DATA, 0) => Header::Data {
            seq,
            len: arg,
            from,
        },
        (KIND_ACK, code) => Header::Ack {
            seq,
            status: AckStatus::from_code(code, arg).ok_or(BadHeader::Kind(b[4], code))?,
            from,
        },
        (k, s) => return Err(BadHeader::Kind(k, s)),
    };
    Ok((h, hlen))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn data_and_ack_round_trip() {
        let from = b"fi_shm://1234:0".to_vec();
        let d = data(7 << 32 | 3, 4096, &from);
        assert_eq!(d.len() % 8, 0);
        let (h, off) = decode(&d).unwrap();
        assert_eq!(off, d.len());
        assert_eq!(
            h,
            Header::Data {
                seq: 7 << 32 | 3,
                len: 4096,
                from: from.clone()
            }
        );
        for status in [
            AckStatus::Delivered,
            AckStatus::NotReady,
            AckStatus::TooLong { capacity: 16 },
        ] {
            let a = ack(9, status, &from);
            let (h, _) = decode(&a).unwrap();
            assert_eq!(
                h,
                Header::Ack {
                    seq: 9,
                    status,
                    from: from.clone()
                }
            );
        }
    }

    #[test]
    fn malformed_headers_are_rejected() {
        let mut d = data(1, 2, &[1, 2, 3]);
        assert_eq!(decode(&d[..10]), Err(BadHeader::Short(10)));
        assert_eq!(decode(&d[..FIXED + 1]), Err(BadHeader::Short(FIXED + 1)));
        d[4] = 9;
        assert_eq!(decode(&d), Err(BadHeader::Kind(9, 0)));
        d[4] = KIND_ACK;
        d[5] = 200;
        assert_eq!(decode(&d), Err(BadHeader::Kind(KIND_ACK, 200)));
        d[0] = b'X';
        assert_eq!(decode(&d), Err(BadHeader::Magic));
        let mut long = data(1, 2, &[]);
        long[6..8].copy_from_slice(&(MAX_ADDR as u16 + 1).to_le_bytes());
        assert_eq!(decode(&long), Err(BadHeader::Addr(MAX_ADDR + 1)));
    }

    proptest! {
        /// Arbitrary bytes never panic the decoder, and whatever decodes
        /// re-encodes to the same header bytes.
        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok((h, _)) = decode(&b) {
                let (again, alen) = match &h {
                    Header::Data { seq, len, from } => (data(*seq, *len, from), from.len()),
                    Header::Ack { seq, status, from } => (ack(*seq, *status, from), from.len()),
                };
                prop_assert_eq!(&again[..16], &b[..16]);
                prop_assert_eq!(&again[FIXED..FIXED + alen], &b[FIXED..FIXED + alen]);
            }
        }
    }
}
