//! Polled receive pools: [`RecvQueue`], the receive path without a
//! callback thread.
//!
//! A pool made by [`TransferEngine::recv_queue`](crate::TransferEngine::recv_queue)
//! works like one made by `submit_recvs` (the worker copies every accepted
//! frame out and re-posts its buffer at once, bounded by
//! `EngineConfig::recv_backlog_bytes`), but its messages go into a queue the
//! caller drains from its own thread instead of to a callback on the
//! engine's callback thread. A serving loop that already polls each step
//! takes messages with [`RecvQueue::try_recv`] and pays no thread wake-up
//! per message; [`RecvQueue::recv_timeout`] spins briefly and then sleeps
//! until the worker delivers.

use crate::error::EngineError;
use crate::mem::RecvPool;
use crate::request::GroupAddress;
use crossbeam_queue::SegQueue;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_transport::{Incarnation, NetAddr};

/// How long [`RecvQueue::recv_timeout`] polls before it sleeps.
const SPIN: Duration = Duration::from_micros(50);
/// The longest single sleep of a waiting receiver: it re-checks the
/// engine's shutdown between sleeps.
const NAP: Duration = Duration::from_millis(10);

/// A queued message and its sender, or a receive error.
type Queued = Result<(Vec<u8>, Option<MessageSender>), EngineError>;

/// The queue side of a polled receive pool: what the worker delivers and
/// the receiver takes. Owned by the pool ([`RecvPool`]).
#[derive(Default)]
pub(crate) struct QueueSink {
    q: SegQueue<Queued>,
    /// Receivers sleeping (or about to) in `recv_timeout`.
    waiters: AtomicU32,
    lock: parking_lot::Mutex<()>,
    cv: parking_lot::Condvar,
    /// The [`RecvQueue`] was dropped: later messages are discarded.
    closed: AtomicBool,
}

impl QueueSink {
    /// Called by the worker: queues `result` (or discards it once the
    /// queue is gone, returning the message's buffer to `pool`) and wakes a
    /// sleeping receiver.
    pub(crate) fn deliver(
        &self,
        pool: &RecvPool,
        result: Result<Vec<u8>, EngineError>,
        from: Option<MessageSender>,
    ) {
        if self.closed.load(Ordering::SeqCst) {
            if let Ok(m) = result {
                pool.recycle(m);
            }
            return;
        }
        self.q.push(result.map(|m| (m, from)));
        // Pairs with the receiver raising `waiters` under `lock` before its
        // last look at the queue: either it sees this message, or this
        // sees it waiting and notifies under the lock it waits with. The
        // fence orders the push before the load (the queue's own stores
        // are release stores only); a receiver that still missed it would
        // only sleep until its next nap ends.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock();
            self.cv.notify_all();
        }
    }

    /// Discards what is queued and everything that arrives later, and
    /// wakes sleeping receivers.
    fn close(&self, pool: &RecvPool) {
        self.closed.store(true, Ordering::SeqCst);
        while let Some(r) = self.q.pop() {
            if let Ok((m, _)) = r {
                pool.recycle(m);
            }
        }
        let _g = self.lock.lock();
        self.cv.notify_all();
    }
}

/// A receive pool whose messages the caller takes by polling, made by
/// [`TransferEngine::recv_queue`](crate::TransferEngine::recv_queue).
///
/// Messages come out in the order the worker accepted them; a receive error
/// comes out in its place among them. Each message is a [`RecvMsg`] that
/// holds one of the pool's copied-out buffers until it is dropped: while
/// `EngineConfig::recv_backlog_bytes` worth of messages are held (queued or
/// not yet dropped), the pool stops re-posting buffers and peers' SENDs
/// wait. Dropping the queue discards its queued messages and every later
/// one (the buffers stay posted, so peers' SENDs still complete). Share it
/// between threads by reference: every method takes `&self`.
pub struct RecvQueue {
    pub(crate) pool: Arc<RecvPool>,
}

impl std::fmt::Debug for RecvQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvQueue")
            .field("pool", &self.pool.id)
            .field("queued", &self.len())
            .finish()
    }
}

impl RecvQueue {
    fn sink(&self) -> &QueueSink {
        self.pool
            .queue()
            .expect("a RecvQueue's pool always has a queue sink")
    }

    /// The next message or receive error, without waiting (`None`: nothing
    /// arrived yet).
    pub fn try_recv(&self) -> Option<Result<RecvMsg, EngineError>> {
        self.sink().q.pop().map(|r| {
            r.map(|(bytes, from)| RecvMsg {
                bytes,
                from,
                pool: Arc::clone(&self.pool),
            })
        })
    }

    /// The next message or receive error, waiting up to `timeout`: polls
    /// for a few tens of microseconds, then sleeps until the worker
    /// delivers. `None` when nothing arrived in time or the queue is
    /// closed; `Err(ShutDown)` once the engine is shut down and nothing is
    /// left.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<Result<RecvMsg, EngineError>> {
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        loop {
            if let Some(r) = self.try_recv() {
                return Some(r);
            }
            if self.is_closed() {
                return None;
            }
            if self.pool.group_closing() {
                return Some(Err(EngineError::ShutDown));
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            if now.duration_since(start) < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let nap = deadline.map_or(NAP, |d| d.duration_since(now).min(NAP));
            let s = self.sink();
            let mut g = s.lock.lock();
            s.waiters.fetch_add(1, Ordering::SeqCst);
            if s.q.is_empty() && !s.closed.load(Ordering::SeqCst) {
                s.cv.wait_for(&mut g, nap);
            }
            s.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Discards what is queued and every later message (as dropping the
    /// queue does), and wakes receivers waiting in
    /// [`recv_timeout`](Self::recv_timeout), which then return `None`.
    /// Idempotent.
    pub fn close(&self) {
        self.sink().close(&self.pool);
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.sink().closed.load(Ordering::SeqCst)
    }

    /// Messages and errors queued now.
    pub fn len(&self) -> usize {
        self.sink().q.len()
    }

    /// Whether nothing is queued now.
    pub fn is_empty(&self) -> bool {
        self.sink().q.is_empty()
    }

    /// The largest message the pool's buffers hold, in bytes.
    pub fn max_message(&self) -> u64 {
        self.pool.max_message()
    }
}

impl Drop for RecvQueue {
    fn drop(&mut self) {
        self.sink().close(&self.pool);
    }
}

/// One received message: its bytes (`Deref<Target = [u8]>`), held in one
/// of its pool's copied-out buffers until dropped (see [`RecvQueue`] for
/// why holding many stalls peers).
pub struct RecvMsg {
    bytes: Vec<u8>,
    from: Option<MessageSender>,
    pool: Arc<RecvPool>,
}

impl RecvMsg {
    /// Who sent the message, when the NIC it arrived on says (every
    /// backend in this repository does); see [`MessageSender`] for how far
    /// that can be trusted.
    pub fn sender(&self) -> Option<&MessageSender> {
        self.from.as_ref()
    }

    /// Whether the message came from `peer`: one of its NICs, and (when
    /// `peer` names one) its incarnation. `false` when the sender is not
    /// known.
    pub fn is_from(&self, peer: &GroupAddress) -> bool {
        self.from.as_ref().is_some_and(|s| s.is(peer))
    }
}

/// Who sent a received message.
///
/// `nic` is the sending NIC's address as the receiving NIC's fabric
/// attributes the message: on verbs (RC) and nvlink the connection it came
/// over, on the loopback fabric the sending endpoint, on libfabric the
/// endpoint its message layer answers (the sender names itself in the
/// layer's header; a sender naming another endpoint never gets its answer,
/// so its SEND fails, but the message is delivered). `incarnation` is the
/// one the sender's frame names as its own, as written by the sender.
/// Use it to tell peers apart and to route replies, not as
/// authentication against a hostile peer on a shared libfabric endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageSender {
    /// Address of the NIC the message came from.
    pub nic: NetAddr,
    /// The sending engine's incarnation, as its frame names it.
    pub incarnation: Incarnation,
}

impl MessageSender {
    /// Whether this is `peer`: its NIC is one of `peer`'s, and its
    /// incarnation matches `peer`'s unless `peer` names none (0).
    pub fn is(&self, peer: &GroupAddress) -> bool {
        peer.nics.contains(&self.nic)
            && (peer.incarnation == Incarnation(0) || peer.incarnation == self.incarnation)
    }
}

impl Deref for RecvMsg {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl AsRef<[u8]> for RecvMsg {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl std::fmt::Debug for RecvMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvMsg")
            .field("len", &self.bytes.len())
            .finish()
    }
}

impl Drop for RecvMsg {
    fn drop(&mut self) {
        self.pool.recycle(std::mem::take(&mut self.bytes));
    }
}
