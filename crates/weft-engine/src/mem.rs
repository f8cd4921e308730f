//! Engine-owned registered buffers (send slots, receive pools) and memory
//! handles.

use crate::error::EngineError;
use crate::frame::{self, Rejected, HEADER_LEN};
use crate::recvq::QueueSink;
use crossbeam_queue::ArrayQueue;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use weft_transport::{Device, Incarnation, MemRegion};

/// A local registration made through the engine: registered with every NIC
/// of one domain group. `Copy`; pass it to submits as the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrHandle {
    /// The engine that registered the memory: another engine refuses the
    /// handle (its slot numbers mean nothing there).
    pub(crate) engine: u64,
    pub(crate) group: u32,
    pub(crate) id: u32,
    /// Generation of slot `id` at registration: a handle kept past its
    /// `unreg_mr` never reaches a later registration in the same slot.
    pub(crate) gen: u32,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) device: Device,
}

impl MrHandle {
    /// The domain group the memory is registered with.
    pub fn group(&self) -> usize {
        self.group as usize
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The engine-internal key: slot id and generation.
    pub(crate) fn key(&self) -> u64 {
        crate::wrid::mr_key(self.id, self.gen)
    }

    /// Bounds check of `[offset, offset + len)`; `what` names the range in
    /// the error and is only formatted on failure (hot path: one check per
    /// page of a paged submit).
    pub(crate) fn check(
        &self,
        what: impl std::fmt::Display,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        crate::error::check_range(what, offset, len, self.len)
    }
}

/// A zeroed, page-aligned heap buffer the engine registers with NICs. It is
/// only ever accessed through raw pointers (NICs write into it), never
/// through long-lived Rust references.
#[derive(Debug)]
pub(crate) struct RawBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `RawBuf` owns its allocation exclusively; all accesses go through
// raw pointers whose synchronisation is handled by the engine's protocol
// (a slot or buffer is owned by exactly one party at a time).
unsafe impl Send for RawBuf {}
// SAFETY: see `Send`; `&RawBuf` only exposes the pointer and length.
unsafe impl Sync for RawBuf {}

const BUF_ALIGN: usize = 4096;

impl RawBuf {
    pub(crate) fn new(len: usize) -> Result<Self, EngineError> {
        let size = len.max(1);
        let layout =
            Layout::from_size_align(size, BUF_ALIGN).map_err(|_| EngineError::InvalidArgument {
                what: format!("buffer of {len} bytes"),
            })?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| EngineError::InvalidArgument {
            what: format!("allocation of {len} bytes failed"),
        })?;
        Ok(Self { ptr, len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn region(&self) -> MemRegion {
        // SAFETY: the buffer is valid for reads and writes for its whole
        // length until `self` is dropped, and the engine drops it only
        // after deregistering it (domains are closed first).
        unsafe { MemRegion::new(self.ptr, self.len.max(1), Device::Host) }
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        if let Ok(layout) = Layout::from_size_align(self.len.max(1), BUF_ALIGN) {
            // SAFETY: allocated in `new` with exactly this layout.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Fixed-size send slots on NIC 0 of a group. Submitters pop a free slot,
/// copy the frame in (its header, then the message: see [`crate::frame`]),
/// and hand the slot index to the worker; the worker pushes it back when
/// the SEND completes.
#[derive(Debug)]
pub(crate) struct SendPool {
    pub(crate) buf: RawBuf,
    pub(crate) slot_len: u64,
    pub(crate) free: ArrayQueue<u32>,
}

impl SendPool {
    pub(crate) fn new(slots: u32, slot_len: u64) -> Result<Self, EngineError> {
        let slots = slots.max(1);
        let total = slot_len
            .checked_mul(u64::from(slots))
            .and_then(|t| usize::try_from(t).ok())
            .ok_or_else(|| EngineError::InvalidArgument {
                what: "send pool size overflows".into(),
            })?;
        let buf = RawBuf::new(total)?;
        let free = ArrayQueue::new(slots as usize);
        for i in 0..slots {
            let _ = free.push(i);
        }
        Ok(Self {
            buf,
            slot_len,
            free,
        })
    }

    pub(crate) fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_len
    }

    /// Copies `msg` (a whole frame) into a free slot; `None` if none is
    /// free or it does not fit.
    pub(crate) fn try_fill(&self, msg: &[u8]) -> Option<u32> {
        self.try_fill_parts(&[], msg)
    }

    /// Copies `head` then `msg` into a free slot; `None` if none is free
    /// or they do not fit.
    pub(crate) fn try_fill_parts(&self, head: &[u8], msg: &[u8]) -> Option<u32> {
        let total = head.len().checked_add(msg.len())?;
        if total as u64 > self.slot_len {
            return None;
        }
        let slot = self.free.pop()?;
        let Some(off) = usize::try_from(self.slot_offset(slot)).ok() else {
            let _ = self.free.push(slot);
            return None;
        };
        // SAFETY: `slot` was popped from the free list, so this thread owns
        // the slot's bytes exclusively until it hands the slot to the worker;
        // `off + head.len() + msg.len() <= buf.len()` because their sum is at
        // most `slot_len` and the buffer holds `slots * slot_len` bytes.
        unsafe {
            let dst = self.buf.ptr().add(off);
            std::ptr::copy_nonoverlapping(head.as_ptr(), dst, head.len());
            std::ptr::copy_nonoverlapping(msg.as_ptr(), dst.add(head.len()), msg.len());
        }
        Some(slot)
    }
}

/// A frame (header and message, see [`crate::frame`]) handed to the
/// worker for a SEND.
#[derive(Debug)]
pub(crate) enum SendPayload {
    /// Already copied into this send slot, `len` bytes.
    Slot { slot: u32, len: u64 },
    /// Not in a slot (pool empty or message larger than a slot).
    Owned(Vec<u8>),
}

/// Why [`RecvPool::copy_out`] returned no message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotCopied {
    /// The buffer index or length is out of the pool's range (a backend
    /// bug: reported to the callback as an error).
    OutOfRange,
    /// The frame was dropped (see [`crate::frame::accept`]).
    Rejected(Rejected),
}

/// Receive callback: the filled bytes, or why the buffer came back empty.
pub type RecvCallback = Box<dyn FnMut(Result<&[u8], EngineError>) + Send + 'static>;

/// Receive callback told the sender as well: the filled bytes and who sent
/// them (`None` where the NIC does not say; see
/// [`MessageSender`](crate::MessageSender)), or why the buffer came back
/// empty.
pub type RecvFromCallback =
    Box<dyn FnMut(Result<(&[u8], Option<&crate::MessageSender>), EngineError>) + Send + 'static>;

/// Where a receive pool's messages go.
pub(crate) enum RecvSink {
    /// To a callback on the callback thread (`submit_recvs`).
    Callback(parking_lot::Mutex<RecvCallback>),
    /// To a callback given the sender too (`submit_recvs_from`).
    CallbackFrom(parking_lot::Mutex<RecvFromCallback>),
    /// Into a queue the caller polls (`recv_queue`).
    Queue(Box<QueueSink>),
}

/// A rotating pool of receive buffers on NIC 0 of a group. Each buffer
/// holds one frame: a header ([`HEADER_LEN`] bytes) and a message of up to
/// `len` bytes; only accepted frames' messages reach the callback.
///
/// The worker copies each filled buffer out into an owned message and
/// re-posts the buffer at once, so receive buffers never wait for the
/// user's callback (a callback that blocks, e.g. on a full request queue,
/// cannot stop this engine from receiving, and so cannot stall a peer's
/// SENDs). The owned messages are recycled through `spare`: after the
/// callback returns, its message goes back for the next receive, so a
/// steady stream allocates nothing. Copied-out messages are bounded
/// (`max_out`, from `EngineConfig::recv_backlog_bytes`): past the bound the
/// worker holds finished buffers back until callbacks return messages.
pub(crate) struct RecvPool {
    pub(crate) id: u16,
    pub(crate) buf: RawBuf,
    /// Bytes per buffer: the largest message it holds plus the frame
    /// header.
    pub(crate) stride: u64,
    pub(crate) count: u32,
    pub(crate) sink: RecvSink,
    /// Owned message buffers whose callbacks have returned.
    spare: ArrayQueue<Vec<u8>>,
    /// Messages copied out whose callback has not returned yet.
    out: AtomicU32,
    /// `out` from which the worker holds finished buffers back.
    max_out: u32,
    /// The group whose worker re-posts held buffers: woken when `out`
    /// falls below `max_out` (it may sleep with buffers held).
    group: Arc<dyn PoolGroup>,
}

/// What a [`RecvPool`] needs of the domain group it belongs to (the
/// driver's shared group state implements it).
pub(crate) trait PoolGroup: Send + Sync {
    /// Whether the group is shutting down.
    fn closing(&self) -> bool;
    /// Wakes the group's worker if it sleeps.
    fn wake(&self);
}

impl RecvPool {
    /// Bytes of the buffer a pool of `count` messages of up to `len` bytes
    /// needs (`None` on overflow).
    pub(crate) fn buffer_len(len: u64, count: u32) -> Option<usize> {
        len.checked_add(HEADER_LEN as u64)?
            .checked_mul(u64::from(count))
            .and_then(|t| usize::try_from(t).ok())
    }

    /// A pool of `count` buffers for messages of up to `len` bytes each, in
    /// `buf` ([`RecvPool::buffer_len`] bytes), holding buffers back once
    /// `backlog_bytes` of messages are copied out (at least one message);
    /// `group` is woken when they may be re-posted.
    pub(crate) fn new(
        id: u16,
        buf: RawBuf,
        len: u64,
        count: u32,
        sink: RecvSink,
        backlog_bytes: u64,
        group: Arc<dyn PoolGroup>,
    ) -> Self {
        let max_out = (backlog_bytes / len.max(1)).clamp(1, u64::from(u32::MAX));
        Self {
            id,
            buf,
            stride: len.saturating_add(HEADER_LEN as u64),
            count,
            sink,
            spare: ArrayQueue::new(count.max(1) as usize),
            out: AtomicU32::new(0),
            max_out: u32::try_from(max_out).unwrap_or(u32::MAX),
            group,
        }
    }

    /// The queue of a polled pool (`None`: a callback pool).
    pub(crate) fn queue(&self) -> Option<&QueueSink> {
        match &self.sink {
            RecvSink::Queue(q) => Some(q),
            RecvSink::Callback(_) | RecvSink::CallbackFrom(_) => None,
        }
    }

    /// Whether the pool's group is shutting down.
    pub(crate) fn group_closing(&self) -> bool {
        self.group.closing()
    }

    /// The largest message a buffer holds, in bytes.
    pub(crate) fn max_message(&self) -> u64 {
        self.stride.saturating_sub(HEADER_LEN as u64)
    }

    /// Counts a message just copied out; whether the pool is now at its
    /// backlog bound (the worker then holds the buffer back).
    pub(crate) fn took_out(&self) -> bool {
        self.out.fetch_add(1, Ordering::SeqCst).saturating_add(1) >= self.max_out
    }

    /// Whether copied-out messages are at the backlog bound.
    pub(crate) fn backlogged(&self) -> bool {
        self.out.load(Ordering::SeqCst) >= self.max_out
    }

    /// The message of the frame in the first `n` bytes of buffer `idx`,
    /// copied into an owned message (a recycled one when there is one),
    /// with the incarnation the frame names as its sender's, if
    /// a receiver of incarnation `own` accepts the frame
    /// ([`crate::frame::accept`]).
    ///
    /// # Safety
    /// Buffer `idx` must not be posted (no NIC may write it) during the
    /// call: the worker calls this on a buffer whose receive just completed,
    /// before re-posting it.
    pub(crate) unsafe fn copy_out(
        &self,
        idx: u32,
        n: u64,
        own: Incarnation,
    ) -> Result<(Vec<u8>, Incarnation), NotCopied> {
        if idx >= self.count || n > self.stride {
            return Err(NotCopied::OutOfRange);
        }
        let off = u64::from(idx)
            .checked_mul(self.stride)
            .and_then(|o| usize::try_from(o).ok())
            .ok_or(NotCopied::OutOfRange)?;
        let n = usize::try_from(n).map_err(|_| NotCopied::OutOfRange)?;
        // SAFETY: in bounds (idx < count, n <= stride, the buffer is
        // count*stride bytes); the caller guarantees no concurrent writer.
        let bytes = unsafe { std::slice::from_raw_parts(self.buf.ptr().add(off), n) };
        let body = frame::accept(bytes, own).map_err(NotCopied::Rejected)?;
        let mut msg = self.spare.pop().unwrap_or_default();
        msg.clear();
        msg.extend_from_slice(body);
        Ok((msg, frame::sender(bytes)))
    }

    /// Returns a message whose callback has returned, for reuse; wakes the
    /// worker when this brings the pool below its backlog bound. (The
    /// decrement and the worker's `sleeping` flag pair as every waker's
    /// store and the worker's re-check do: the group's `wake`.)
    pub(crate) fn recycle(&self, msg: Vec<u8>) {
        let _ = self.spare.push(msg);
        if self.out.fetch_sub(1, Ordering::SeqCst) == self.max_out {
            self.group.wake();
        }
    }
}
