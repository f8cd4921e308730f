//! Wire protocol between decoder and prefiller: postcard-encoded messages.

use crate::{KvError, KvLayout};
use serde::{Deserialize, Serialize};
use weft_engine::{GroupAddress, MrDesc};

/// One transfer request, decoder → prefiller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvRequest {
    /// Request id (unique per decoder).
    pub id: u64,
    /// Where the prefiller sends acks and heartbeats.
    pub reply_to: GroupAddress,
    /// The layout the decoder expects.
    pub layout: KvLayout,
    /// Decoder KvCache region.
    pub kv: MrDesc,
    /// Pages per head in the decoder KvCache.
    pub num_pages: u32,
    /// Destination page indices, in prompt order.
    pub pages: Vec<u32>,
    /// Decoder tail region and offset of this request's tail slot.
    pub tail: MrDesc,
    /// Offset of the tail slot in `tail`.
    pub tail_off: u64,
    /// Immediate every write carries.
    pub imm: u32,
    /// Prompt identity (drives the "computed" content).
    pub prompt_seed: u64,
}

/// Wire messages (postcard).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Decoder announces itself (prefiller starts heartbeating it).
    Hello {
        /// Decoder address.
        from: GroupAddress,
    },
    /// A transfer request.
    Request(KvRequest),
    /// Cancel a request.
    Cancel {
        /// Decoder address.
        from: GroupAddress,
        /// Request id.
        id: u64,
    },
    /// No write of request `id` can land any more.
    CancelAck {
        /// Request id.
        id: u64,
    },
    /// The prefiller refused or aborted a request.
    Failed {
        /// Request id.
        id: u64,
        /// Why.
        reason: String,
    },
    /// Liveness.
    Heartbeat,
}

pub(crate) fn encode(m: &Msg) -> Result<Vec<u8>, KvError> {
    postcard::to_stdvec(m).map_err(|e| KvError::Codec(e.to_string()))
}
