//! Wire protocol between decoder and prefiller: postcard frames, each
//! starting with the protocol version (a varint `u16`), then the sender's
//! claimed address and its [`Auth`] (see the crate's "Who may say what":
//! the address is a claim, the proof is what makes it believed), then the
//! message. A peer of another version is told apart from garbage; a frame
//! longer than [`MAX_FRAME`] is not decoded at all, and no decoded list is
//! longer than the frame's bytes, so garbage costs at most a bounded
//! allocation and never a panic.

use crate::{HeadMap, KvLayout, Refusal};
use serde::{Deserialize, Serialize};
use weft::{GroupAddress, MrDesc};

/// Version of the wire protocol this build speaks (2: addresses and
/// descriptors carry the peer engine's incarnation; 3: the
/// `Refusal::DuplicateHead` refusal; 4: the `Refusal::Busy` refusal;
/// 5: every frame carries an [`Auth`], and the `Refusal::Stale` refusal;
/// 6: per-layer KV regions and an optional tail region).
pub const WIRE_VERSION: u16 = 6;

/// The longest frame decoded (1 MiB); longer ones are refused unread.
pub const MAX_FRAME: usize = 1 << 20;

/// What makes a frame's claimed sender believed (see the crate docs, "Who
/// may say what"): each side derives a secret *grant* per peer address and
/// sends it only to that address; a frame is authentic when it carries, as
/// its `proof`, the grant its receiver derived for the frame's sender.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Auth {
    /// The grant the receiver gave the sender (0: none known yet).
    pub proof: u64,
    /// The grant the sender gives the receiver: what the receiver's frames
    /// to the sender must carry as their proof.
    pub grant: u64,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The address the sender claims.
    pub from: GroupAddress,
    /// Its proof and grant.
    pub auth: Auth,
    /// The message.
    pub msg: Msg,
}

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
    /// The frame is longer than [`MAX_FRAME`].
    #[error("frame of {len} bytes, at most {max} are decoded")]
    TooLong {
        /// Frame length.
        len: usize,
        /// [`MAX_FRAME`].
        max: usize,
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
    /// Decoder KV regions: one holding every layer, or one per layer.
    pub kv: Vec<MrDesc>,
    /// Decoder tail region (`None` when it has none).
    pub tail: Option<MrDesc>,
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
    auth: Auth,
    msg: &'a Msg,
}

#[derive(Deserialize)]
struct Body {
    from: GroupAddress,
    auth: Auth,
    msg: Msg,
}

/// Encodes a frame of `msg` from `from` with `auth`.
pub fn encode(from: &GroupAddress, auth: Auth, msg: &Msg) -> Result<Vec<u8>, WireError> {
    postcard::to_stdvec(&FrameRef {
        version: WIRE_VERSION,
        from,
        auth,
        msg,
    })
    .map_err(|e| WireError::Encode {
        error: e.to_string(),
    })
}

/// Decodes a frame. Never panics; allocates at most a small multiple of
/// the frame's length (postcard checks every length prefix against the
/// bytes left before it fills a list, and frames over [`MAX_FRAME`] are
/// refused first).
pub fn decode(bytes: &[u8]) -> Result<Frame, WireError> {
    if bytes.len() > MAX_FRAME {
        return Err(WireError::TooLong {
            len: bytes.len(),
            max: MAX_FRAME,
        });
    }
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
    Ok(Frame {
        from: body.from,
        auth: body.auth,
        msg: body.msg,
    })
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
            let auth = Auth { proof: 9, grant: 1 };
            let b = encode(&from, auth, &m).unwrap();
            let f = decode(&b).unwrap();
            assert_eq!((f.from, f.auth, f.msg), (from.clone(), auth, m));
        }
        let mut b = encode(&from, Auth::default(), &Msg::Heartbeat).unwrap();
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
        assert!(matches!(
            decode(&vec![0; MAX_FRAME + 1]),
            Err(WireError::TooLong { .. })
        ));
    }
}
