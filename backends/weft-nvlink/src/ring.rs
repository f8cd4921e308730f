//! A single-producer single-consumer ring of frames in memory two
//! processes share. The producer owns `tail`, the consumer `head`; both
//! count bytes from the ring's creation (never wrapped), so `tail - head`
//! is the fill. A frame never wraps: one that does not fit before the end
//! is preceded by a padding frame. The other side is untrusted: every
//! header and counter it wrote is checked before use, and a bad one is a
//! [`RingError`] (the caller drops the connection), never a wild access.
//!
//! Frame: `len: u32` (these 8 bytes, header and payload; the frame takes
//! it rounded up to 8), `kind: u16`, `hlen: u16` (header bytes after these
//! 8), header, payload.

#![allow(unsafe_code)]

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Bytes of ring control words before the data.
pub(crate) const CONTROL: usize = 192;
const PAD: u16 = 0;
/// Largest header a frame may carry.
pub(crate) const MAX_HDR: usize = 56;

/// A broken promise of the other side: the connection is unusable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RingError(pub(crate) String);

/// One side's view of a ring at `base` (control words, then `cap` data
/// bytes) inside a shared mapping that outlives it.
pub(crate) struct Ring {
    base: *mut u8,
    cap: u64,
    /// Producer: last head seen. Consumer: our head.
    cached: u64,
}

// SAFETY: the ring refers to a shared mapping owned by the same connection
// object; it is moved between threads with it, never shared.
unsafe impl Send for Ring {}

/// A frame at the head of a ring (valid until [`Ring::consume`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Frame {
    pub(crate) kind: u16,
    pub(crate) hdr: [u8; MAX_HDR],
    pub(crate) hlen: usize,
    /// Start of the payload in the shared mapping.
    pub(crate) payload: *const u8,
    pub(crate) payload_len: usize,
    total: u64,
}

impl Ring {
    /// The ring at `base`, `cap` data bytes (a power of two, ≥ 4 KiB).
    ///
    /// # Safety
    /// `base .. base + CONTROL + cap` lies in a shared mapping (8-aligned)
    /// that outlives the ring, and only one producer and one consumer use
    /// it.
    pub(crate) unsafe fn new(base: *mut u8, cap: usize) -> Ring {
        debug_assert!(cap.is_power_of_two() && (base as usize).is_multiple_of(64));
        Ring {
            base,
            cap: cap as u64,
            cached: 0,
        }
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is one of the 8-aligned control offsets, inside the
        // mapping (see `new`); atomics are how both sides touch them.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn tail(&self) -> &AtomicU64 {
        self.word(0)
    }

    fn head(&self) -> &AtomicU64 {
        self.word(64)
    }

    /// Set by a consumer about to sleep; see [`Ring::arm`].
    fn waiting(&self) -> &AtomicU32 {
        // SAFETY: as `word`, a 4-aligned control word.
        unsafe { &*(self.base.add(128) as *const AtomicU32) }
    }

    fn data(&self, at: u64) -> *mut u8 {
        // SAFETY: `at % cap < cap`, inside the data area.
        unsafe { self.base.add(CONTROL + (at % self.cap) as usize) }
    }

    /// Largest frame payload with a header of `hlen` bytes.
    pub(crate) fn max_payload(&self, hlen: usize) -> usize {
        (self.cap / 4) as usize - 8 - hlen
    }

    // ----- producer -----

    /// Appends a frame whose payload `fill` writes (exactly `payload`
    /// bytes) when it fits; `false` when the ring is full now. Whether the
    /// consumer waits for a doorbell is [`Ring::wants_bell`].
    pub(crate) fn push(
        &mut self,
        kind: u16,
        hdr: &[u8],
        payload: usize,
        fill: impl FnOnce(*mut u8),
    ) -> bool {
        debug_assert!(kind != PAD && hdr.len() <= MAX_HDR);
        debug_assert!(payload <= self.max_payload(hdr.len()));
        let exact = (8 + hdr.len() + payload) as u64;
        let len = exact.next_multiple_of(8);
        let tail = self.tail().load(Ordering::Relaxed);
        let to_end = self.cap - tail % self.cap;
        let need = if len > to_end { len + to_end } else { len };
        if tail + need - self.cached > self.cap {
            self.cached = self.head().load(Ordering::Acquire);
            if tail + need - self.cached > self.cap {
                return false;
            }
        }
        let mut at = tail;
        if len > to_end {
            self.put_header(at, to_end as u32, PAD, 0);
            at += to_end;
        }
        self.put_header(at, exact as u32, kind, hdr.len() as u16);
        let p = self.data(at);
        // SAFETY: the frame's bytes `[at, at+len)` are free (checked above)
        // and contiguous (the padding moved `at` to the start if needed).
        unsafe {
            std::ptr::copy_nonoverlapping(hdr.as_ptr(), p.add(8), hdr.len());
            fill(p.add(8 + hdr.len()));
        }
        self.tail().store(at + len, Ordering::Release);
        true
    }

    fn put_header(&self, at: u64, len: u32, kind: u16, hlen: u16) {
        let v = len as u64 | (kind as u64) << 32 | (hlen as u64) << 48;
        // SAFETY: `at` is 8-aligned inside the data area; the slot is free.
        unsafe { std::ptr::write_volatile(self.data(at) as *mut u64, v) };
    }

    /// After pushing: whether the consumer said it sleeps (it is then
    /// woken by the caller through its doorbell). Clears the flag.
    pub(crate) fn wants_bell(&self) -> bool {
        fence(Ordering::SeqCst);
        self.waiting().load(Ordering::Relaxed) != 0 && self.waiting().swap(0, Ordering::AcqRel) != 0
    }

    // ----- consumer -----

    /// The frame at the head, if any.
    pub(crate) fn peek(&mut self) -> Result<Option<Frame>, RingError> {
        loop {
            let tail = self.tail().load(Ordering::Acquire);
            let head = self.cached;
            if tail == head {
                return Ok(None);
            }
            if tail < head || tail - head > self.cap {
                return Err(RingError(format!("ring counters head {head} tail {tail}")));
            }
            // SAFETY: `head` is 8-aligned inside the data area; the peer
            // may change the word concurrently, so it is read once.
            let v = unsafe { std::ptr::read_volatile(self.data(head) as *const u64) };
            let (exact, kind, hlen) = (v as u32 as u64, (v >> 32) as u16, (v >> 48) as usize);
            let len = exact.next_multiple_of(8);
            let to_end = self.cap - head % self.cap;
            if exact < 8 || len > to_end || head + len > tail {
                return Err(RingError(format!("frame of {len} bytes at {head}")));
            }
            if kind == PAD {
                self.advance(head + len);
                continue;
            }
            if hlen > MAX_HDR || 8 + hlen as u64 > exact {
                return Err(RingError(format!("frame header of {hlen} bytes in {len}")));
            }
            let mut hdr = [0u8; MAX_HDR];
            let p = self.data(head);
            // SAFETY: `[head+8, head+8+hlen)` lies inside the frame (checked).
            unsafe { std::ptr::copy_nonoverlapping(p.add(8), hdr.as_mut_ptr(), hlen) };
            return Ok(Some(Frame {
                kind,
                hdr,
                hlen,
                // SAFETY: inside the frame (checked above).
                payload: unsafe { p.add(8 + hlen) },
                payload_len: (exact as usize) - 8 - hlen,
                total: len,
            }));
        }
    }

    /// Drops the frame [`Ring::peek`] returned.
    pub(crate) fn consume(&mut self, f: &Frame) {
        let h = self.cached + f.total;
        self.advance(h);
    }

    fn advance(&mut self, h: u64) {
        self.cached = h;
        self.head().store(h, Ordering::Release);
    }

    /// Announces that the consumer is about to sleep; `true` when the ring
    /// is still empty afterwards (sleeping is safe: the next push rings
    /// the doorbell), `false` when a frame arrived (the flag is cleared).
    pub(crate) fn arm(&self) -> bool {
        self.waiting().store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.tail().load(Ordering::SeqCst) != self.cached {
            self.waiting().store(0, Ordering::Relaxed);
            return false;
        }
        true
    }
}

impl Frame {
    pub(crate) fn u64_at(&self, i: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.hdr[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(align(64))]
    struct Mem([u8; CONTROL + 4096]);

    fn pair(m: &mut Mem) -> (Ring, Ring) {
        let p = m.0.as_mut_ptr();
        // SAFETY: `m` outlives both rings inside the test.
        unsafe { (Ring::new(p, 4096), Ring::new(p, 4096)) }
    }

    #[test]
    fn frames_wrap_with_padding_and_come_out_in_order() {
        let mut m = Mem([0; CONTROL + 4096]);
        let (mut tx, mut rx) = pair(&mut m);
        let mut next = 0u64;
        for round in 0..200u64 {
            let n = (round * 37 % 900) as usize;
            let hdr = round.to_le_bytes();
            // SAFETY: `fill` writes exactly `n` bytes.
            let ok = tx.push(1, &hdr, n, |p| unsafe {
                std::ptr::write_bytes(p, round as u8, n)
            });
            if !ok {
                while let Some(f) = rx.peek().unwrap() {
                    assert_eq!(f.u64_at(0), next);
                    next += 1;
                    rx.consume(&f);
                }
                // SAFETY: `fill` writes exactly `n` bytes.
                assert!(tx.push(1, &hdr, n, |p| unsafe {
                    std::ptr::write_bytes(p, round as u8, n)
                }));
            }
        }
        while let Some(f) = rx.peek().unwrap() {
            assert_eq!(f.u64_at(0), next);
            // SAFETY: the payload is inside the frame.
            let b = unsafe { std::slice::from_raw_parts(f.payload, f.payload_len) };
            assert!(
                b.iter().all(|&x| x == next as u8),
                "frame {next}: {} bytes, first {:?}",
                b.len(),
                &b[..b.len().min(8)]
            );
            next += 1;
            rx.consume(&f);
        }
        assert_eq!(next, 200);
    }

    #[test]
    fn garbage_counters_and_headers_are_errors() {
        let mut m = Mem([0; CONTROL + 4096]);
        let (tx, mut rx) = pair(&mut m);
        tx.tail().store(1 << 40, Ordering::Relaxed);
        assert!(rx.peek().is_err());
        tx.tail().store(16, Ordering::Relaxed);
        tx.put_header(0, 4, 1, 0);
        assert!(rx.peek().is_err(), "a frame shorter than its header");
        tx.put_header(0, 16, 1, 40);
        assert!(rx.peek().is_err(), "a header longer than the frame");
        tx.put_header(0, 24, 1, 0);
        assert!(rx.peek().is_err(), "a frame past the tail");
    }

    #[test]
    fn arm_refuses_sleep_when_data_is_there() {
        let mut m = Mem([0; CONTROL + 4096]);
        let (mut tx, rx) = pair(&mut m);
        assert!(rx.arm());
        assert!(tx.push(1, &[], 0, |_| {}));
        assert!(tx.wants_bell());
        assert!(!tx.wants_bell(), "the flag is cleared by the first bell");
        assert!(!rx.arm());
    }
}
