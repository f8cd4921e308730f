//! Wire protocol between decoder and prefiller: postcard frames, each
//! starting with the protocol version (a varint `u16`) and the sender's
//! address, so a peer of another version is told apart from garbage.

use crate::{HeadMap, KvLayout, Refusal};
use serde::{Deserialize, Serialize};
use weft::{GroupAddress, MrDesc};

/// Version of the wire protocol this build speaks (2: addresses and
/// descriptors carry the peer engine's incarnation; 3: the
/// `Refusal::DuplicateHead` refusal; 4: the `Refusal::Busy` refusal).
pub const WIRE_VERSION: u16 = 4;

/// Errors decoding a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The frame is of another protocol version.
    #[error("wire version {got}, this build speaks {want}")]
    Version {
        /// Version in the frame.
        got: u16,
        /// [`WIRE_VERSION`].
        want: u16,
    },
    /// The bytes are not a valid frame.
    #[error("undecodable frame ({len} bytes): {error}")]
    Decode {
        /// Frame length.
        len: usize,
        /// postcard's error.
        error: String,
    },
    /// A message could not be encoded.
    #[error("encoding: {error}")]
    Encode {
        /// postcard's error.
        error: String,
    },
}

/// One source's part of a transfer, decoder → prefiller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvRequest {
    /// Request id (unique per decoder).
    pub id: u64,
    /// The decoder's cache layout.
    pub layout: KvLayout,
    /// Decoder KV region.
    pub kv: MrDesc,
    /// Decoder tail region.
    pub tail: MrDesc,
    /// Heads this prefiller sends: its head `src` → the decoder's head `dst`.
    pub heads: Vec<HeadMap>,
    /// Destination page indices, in prompt order.
    pub pages: Vec<u32>,
    /// The decoder's tail slot, when this prefiller writes the tail.
    pub tail_slot: Option<u32>,
    /// Immediate every write carries.
    pub imm: u32,
    /// Opaque application data (prompt id, token ids, ...).
    pub meta: Vec<u8>,
}

/// Why a prefiller stopped serving a request before it was complete (it
/// sends this only once none of its writes can land any more).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Failure {
    /// It refused the request.
    Refused(Refusal),
    /// A write failed.
    Write {
        /// `layer N` or `tail`.
        step: String,
        /// The engine error, rendered.
        error: String,
    },
}

/// Wire messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Decoder announces itself (the prefiller starts heartbeating it).
    Hello,
    /// A transfer request.
    Request(KvRequest),
    /// Cancel a request.
    Cancel {
        /// Request id.
        id: u64,
    },
    /// No write of request `id` can land any more (answer to a cancel).
    CancelAck {
        /// Request id.
        id: u64,
    },
    /// The prefiller refused or aborted a request; none of its writes can
    /// land any more.
    Failed {
        /// Request id.
        id: u64,
        /// Why.
        failure: Failure,
    },
    /// Liveness.
    Heartbeat,
}

#[derive(Serialize)]
struct FrameRef<'a> {
    version: u16,
    from: &'a GroupAddress,
    msg: &'a Msg,
}

#[derive(Deserialize)]
struct Body {
    from: GroupAddress,
    msg: Msg,
}

/// Encodes a frame of `msg` from `from`.
pub fn encode(from: &GroupAddress, msg: &Msg) -> Result<Vec<u8>, WireError> {
    postcard::to_stdvec(&FrameRef {
        version: WIRE_VERSION,
        from,
        msg,
    })
    .map_err(|e| WireError::Encode {
        error: e.to_string(),
    })
}

/// Decodes a frame: its sender and message.
pub fn decode(bytes: &[u8]) -> Result<(GroupAddress, Msg), WireError> {
    let bad = |e: postcard::Error| WireError::Decode {
        len: bytes.len(),
        error: e.to_string(),
    };
    let (version, rest) = postcard::take_from_bytes::<u16>(bytes).map_err(bad)?;
    if version != WIRE_VERSION {
        return Err(WireError::Version {
            got: version,
            want: WIRE_VERSION,
        });
    }
    let body: Body = postcard::from_bytes(rest).map_err(bad)?;
    Ok((body.from, body.msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_version_check() {
        let from = GroupAddress {
            nics: Vec::new(),
            incarnation: weft::Incarnation(5),
        };
        for m in [
            Msg::Hello,
            Msg::Cancel { id: 7 },
            Msg::Failed {
                id: 3,
                failure: Failure::Refused(Refusal::Duplicate),
            },
        ] {
            let b = encode(&from, &m).unwrap();
            assert_eq!(decode(&b).unwrap(), (from.clone(), m));
        }
        let mut b = encode(&from, &Msg::Heartbeat).unwrap();
        b[0] = 9;
        assert_eq!(
            decode(&b),
            Err(WireError::Version {
                got: 9,
                want: WIRE_VERSION
            })
        );
        assert!(matches!(
            decode(&[WIRE_VERSION as u8, 0xff]),
            Err(WireError::Decode { .. })
        ));
        assert!(matches!(decode(&[]), Err(WireError::Decode { .. })));
    }
}
