//! [`PeerMemory`]: memory that other processes on the same host can map,
//! and the asynchronous copies that move bytes into a peer's mapped memory.
//!
//! A same-host backend (`weft-nvlink`) writes into a peer's registered
//! memory one-sidedly when both sides have a `PeerMemory` for the region's
//! device: the target *exports* the registration (a description any process
//! on the host can open), the initiator *imports* it and copies into it with
//! [`PeerMemory::start_copy`]. `weft-cuda` implements it with CUDA IPC and
//! the copy engines (per-peer streams, completion by event); tests implement
//! it over shared host memory.

use crate::{Device, DeviceCopy, TransportError};
use std::any::Any;

/// A registration made openable by other processes: the description a peer
/// passes to [`PeerMemory::import`], plus whatever keeps it openable (an
/// open file descriptor, an IPC handle). Dropping it withdraws the export.
pub struct Exported {
    /// The description, untrusted for whoever receives it.
    pub desc: Vec<u8>,
    /// Kept alive as long as peers may import `desc`.
    pub keep: Box<dyn Any + Send>,
}

impl std::fmt::Debug for Exported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exported")
            .field("desc_len", &self.desc.len())
            .finish_non_exhaustive()
    }
}

/// An asynchronous copy started by [`PeerMemory::start_copy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CopyTicket(pub u64);

/// Memory of one device that peer processes on this host can map (see the
/// module docs). Every method is non-blocking except the synchronous
/// [`DeviceCopy::copy`] between this process's memories (the staged path of
/// a backend that moves bytes through host memory).
pub trait PeerMemory: DeviceCopy {
    /// Short name for data-path reports, e.g. `"cuda-ipc"`.
    fn name(&self) -> &str;

    /// Whether memory of `device` can be exported and imported here.
    fn serves(&self, device: Device) -> bool;

    /// Makes `[addr, addr+len)` of `device` openable by other processes.
    /// Memory that cannot be shared is [`TransportError::Unsupported`].
    fn export(&self, addr: u64, len: u64, device: Device) -> Result<Exported, TransportError>;

    /// Maps a description a peer exported (cached per `peer` and
    /// allocation) and returns the address of its first byte in this
    /// process, usable as a [`PeerMemory::start_copy`] destination. A
    /// description that cannot be mapped (forged, stale, of a peer that is
    /// gone) is an error; the caller then does not write.
    fn import(&self, peer: u64, desc: &[u8]) -> Result<u64, TransportError>;

    /// Unmaps everything imported for `peer` (removed or dead). Copies into
    /// its mappings must have completed.
    fn forget_peer(&self, peer: u64);

    /// Starts copying `len` bytes from `src` (memory of `src_dev` in this
    /// process) to `dst` (an imported peer address, or memory of this
    /// process) on the copy lane of `peer` (a CUDA stream per peer).
    fn start_copy(
        &self,
        peer: u64,
        dst: u64,
        src: u64,
        src_dev: Device,
        len: u64,
    ) -> Result<CopyTicket, TransportError>;

    /// Whether the copy has finished: `Ok(true)` once its bytes are
    /// visible at the destination (the ticket is then spent), `Ok(false)`
    /// while it runs, an error when it failed.
    fn copy_done(&self, ticket: CopyTicket) -> Result<bool, TransportError>;
}
