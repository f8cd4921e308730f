//! What the prefiller's core hands out: requests for the application,
//! writes to post, messages to send.

use crate::wire::{Auth, Msg};
use crate::{HeadMap, KvError};
use weft::{GroupAddress, MrDesc, Pages};

/// A request, named by its decoder and the decoder's id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskKey {
    /// The decoder.
    pub decoder: GroupAddress,
    /// Its request id.
    pub id: u64,
}

/// A request waiting for the application to accept it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    /// Which request.
    pub key: TaskKey,
    /// Pages of the prompt (per head).
    pub pages: u32,
    /// Heads to send (this rank's `src` → the decoder's `dst`).
    pub heads: Vec<HeadMap>,
    /// Whether this prefiller writes the tail.
    pub tail: bool,
    /// The decoder's application data.
    pub meta: Vec<u8>,
}

/// One write to post.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// A layer's paged write.
    Layer {
        /// Layer.
        layer: u32,
        /// Page bytes.
        page_len: u64,
        /// Source pages in this prefiller's KV region.
        src: Pages,
        /// Destination region.
        dst: MrDesc,
        /// Destination pages.
        dst_pages: Pages,
        /// Immediate.
        imm: u32,
    },
    /// The tail.
    Tail {
        /// Bytes.
        len: u64,
        /// Offset in this prefiller's tail region.
        src_off: u64,
        /// Destination region.
        dst: MrDesc,
        /// Offset in it.
        dst_off: u64,
        /// Immediate.
        imm: u32,
    },
}

/// What the driver must do.
#[derive(Debug, Clone)]
pub enum PreAction {
    /// SEND `msg` to `to`, framed with `auth`.
    Send {
        /// Destination.
        to: GroupAddress,
        /// The frame's proof and grant.
        auth: Auth,
        /// Message.
        msg: Msg,
    },
    /// Tell the application about a new request.
    Incoming(Incoming),
    /// Post step `step` of `key`; report it with
    /// [`PrefillerCore::on_posted`](crate::PrefillerCore::on_posted).
    Post {
        /// Request.
        key: TaskKey,
        /// Step.
        step: u32,
        /// The write.
        write: Write,
    },
    /// The request ended (none of its writes can land any more).
    Finish {
        /// Request.
        key: TaskKey,
        /// Outcome.
        result: Result<(), KvError>,
    },
    /// Decoder `peer` is dead: remove it from the engine
    /// (`TransferEngine::remove_peer`), so that its connection state is
    /// freed and nothing reaches that incarnation any more. Writes to it
    /// still posted resolve as the engine's peer removal says.
    Forget {
        /// The dead decoder.
        peer: GroupAddress,
    },
}
