//! The key table of an `shm` domain: which remote keys it has registered
//! now, in a small file under `/dev/shm` that its shm peers map and check
//! before they post a WRITE.
//!
//! libfabric 1.17's shm provider checks a WRITE's key at the target, and
//! when the key is unknown (deregistered, never registered, out of
//! bounds) it drops the command without answering: the writer's operation
//! never completes and, since the writer's responses are consumed in order,
//! neither does any later operation on that endpoint. A descriptor that went
//! stale would wedge the path to a healthy peer until the hung-peer timeout
//! declared it dead. With the table, a writer rejects such a WRITE before it
//! reaches the provider.
//!
//! Layout (all little-endian integers, naturally aligned):
//! - header (64 bytes): magic `u64`, version `u32`, slot count `u32`, lane
//!   count `u32`, owner pid `i32`, overflow count `u64`, the owner's
//!   sleeping flag `u32` (its worker sleeps on its doorbell, `ffi::Bell`:
//!   a writer that posts to it rings);
//! - `LANES` writer lanes of 8 bytes: pid `i32`, posting flag `u32`;
//! - `SLOTS` key slots of 32 bytes: sequence `u32` (odd while the owner
//!   changes the slot), state `u32` (empty, live, revoked), key, base and
//!   length `u64` each.
//!
//! Only the owner writes slots; a writer writes only its lane. The posting
//! flag closes the race with deregistration: a writer raises it before it
//! checks a key and lowers it once the provider took the command; the owner
//! revokes a key, then waits until no live writer's flag is up, then
//! progresses its endpoint so commands already queued run against the still
//! registered memory, and only then closes the registration. Both sides use
//! sequentially consistent accesses for the flag and the state (a store
//! then a load on each side: one of them sees the other).
//!
//! The table is advice from the peer about itself: a forged table can make
//! a writer refuse writes to that peer, nothing more. Every read is bounded
//! (probes, retries), so a table left half-written by a dead owner is
//! harmless.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const MAGIC: u64 = u64::from_le_bytes(*b"weftkeys");
const VERSION: u32 = 2;
/// Key slots: registrations live at once in one domain that the table can
/// describe; past that, unknown keys are let through (see `overflow`).
pub(crate) const SLOTS: usize = 16384;
/// Writer lanes: domains writing to this one that can be checked; later
/// writers go unchecked.
pub(crate) const LANES: usize = 256;
const HEADER: usize = 64;
const LANE: usize = 8;
const SLOT: usize = 32;
const LANES_AT: usize = HEADER;
const SLOTS_AT: usize = LANES_AT + LANES * LANE;
/// The file's size.
pub(crate) const SIZE: usize = SLOTS_AT + SLOTS * SLOT;

const EMPTY: u32 = 0;
const LIVE: u32 = 1;
const REVOKED: u32 = 2;

/// Retries of one slot read while the owner changes it.
const READ_RETRIES: u32 = 64;

/// The prefix of a key table's file name; the rest is the owner's region
/// name.
pub(crate) const PREFIX: &str = "weft-keys.";

/// The file of the domain whose shm region is `region`.
pub(crate) fn path_of(region: &str) -> PathBuf {
    Path::new("/dev/shm").join(format!("{PREFIX}{region}"))
}

/// A mapped key table, as its owner or as a writer.
pub(crate) struct KeyTable {
    base: *mut u8,
    /// The owner unlinks its file when dropped.
    owned: Option<PathBuf>,
}

// SAFETY: the mapping is plain shared memory accessed only through
// atomics; the pointer is owned by this value and unmapped once.
unsafe impl Send for KeyTable {}

/// What the table says about a WRITE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The key is registered and the range lies inside it.
    Valid,
    /// The key is registered but the range is outside it.
    OutOfBounds { base: u64, len: u64 },
    /// The key is not registered now.
    UnknownKey,
    /// The table cannot tell (full, or being changed by a dead owner).
    Unsure,
}

impl KeyTable {
    /// Creates the table of the domain whose region is `region` (replacing
    /// a file of that name left by a dead process), empty.
    pub(crate) fn create(region: &str) -> std::io::Result<KeyTable> {
        let path = path_of(region);
        let _ = std::fs::remove_file(&path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let made = file.set_len(SIZE as u64).and_then(|_| map(&file));
        let base = match made {
            Ok(b) => b,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        let t = KeyTable {
            base,
            owned: Some(path),
        };
        t.u32_at(8).store(VERSION, Ordering::Relaxed);
        t.u32_at(12).store(SLOTS as u32, Ordering::Relaxed);
        t.u32_at(16).store(LANES as u32, Ordering::Relaxed);
        t.i32_at(20)
            .store(std::process::id() as i32, Ordering::Relaxed);
        // The magic last: a writer that sees it sees a whole header.
        t.u64_at(0).store(MAGIC, Ordering::Release);
        Ok(t)
    }

    /// Maps the table of the peer whose region is `region`, if it has one
    /// of this version and size.
    pub(crate) fn open(region: &str) -> std::io::Result<KeyTable> {
        let path = path_of(region);
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        if file.metadata()?.len() != SIZE as u64 {
            return Err(std::io::Error::other("key table of another size"));
        }
        let t = KeyTable {
            base: map(&file)?,
            owned: None,
        };
        let ok = t.u64_at(0).load(Ordering::Acquire) == MAGIC
            && t.u32_at(8).load(Ordering::Relaxed) == VERSION
            && t.u32_at(12).load(Ordering::Relaxed) == SLOTS as u32
            && t.u32_at(16).load(Ordering::Relaxed) == LANES as u32;
        if !ok {
            return Err(std::io::Error::other("not a key table of this version"));
        }
        Ok(t)
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= SIZE && off.is_multiple_of(8));
        // SAFETY: `off` is inside the `SIZE`-byte mapping (all offsets come
        // from the layout constants) and 8-aligned (the mapping is page
        // aligned); the memory lives as long as `self` and is only ever
        // accessed atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= SIZE && off.is_multiple_of(4));
        // SAFETY: as in `u64_at`, 4-aligned.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn i32_at(&self, off: usize) -> &AtomicI32 {
        debug_assert!(off + 4 <= SIZE && off.is_multiple_of(4));
        // SAFETY: as in `u64_at`, 4-aligned.
        unsafe { &*(self.base.add(off) as *const AtomicI32) }
    }

    fn slot(k: usize) -> usize {
        SLOTS_AT + (k % SLOTS) * SLOT
    }

    fn home(key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % SLOTS
    }

    /// Owner: `key` is registered for remote writes over `[base, base+len)`.
    /// Returns false when the table is full (unknown keys are then let
    /// through, see [`Verdict::Unsure`]).
    pub(crate) fn publish(&self, key: u64, base: u64, len: u64) -> bool {
        let h = Self::home(key);
        for i in 0..SLOTS {
            let s = Self::slot(h + i);
            if self.u32_at(s + 4).load(Ordering::Relaxed) == LIVE {
                continue;
            }
            let seq = self.u32_at(s);
            let v = seq.load(Ordering::Relaxed);
            seq.store(v.wrapping_add(1) | 1, Ordering::Relaxed);
            fence(Ordering::Release);
            self.u64_at(s + 8).store(key, Ordering::Relaxed);
            self.u64_at(s + 16).store(base, Ordering::Relaxed);
            self.u64_at(s + 24).store(len, Ordering::Relaxed);
            self.u32_at(s + 4).store(LIVE, Ordering::SeqCst);
            seq.store((v | 1).wrapping_add(1), Ordering::Release);
            return true;
        }
        self.u64_at(24).fetch_add(1, Ordering::SeqCst);
        false
    }

    /// Owner: `key` is no longer registered. Returns whether it was in the
    /// table. Call [`KeyTable::quiesce`] before closing the registration.
    pub(crate) fn revoke(&self, key: u64) -> bool {
        let h = Self::home(key);
        for i in 0..SLOTS {
            let s = Self::slot(h + i);
            match self.u32_at(s + 4).load(Ordering::Relaxed) {
                EMPTY => break,
                LIVE if self.u64_at(s + 8).load(Ordering::Relaxed) == key => {
                    let seq = self.u32_at(s);
                    let v = seq.load(Ordering::Relaxed);
                    seq.store(v.wrapping_add(1) | 1, Ordering::Relaxed);
                    fence(Ordering::Release);
                    self.u32_at(s + 4).store(REVOKED, Ordering::SeqCst);
                    seq.store((v | 1).wrapping_add(1), Ordering::Release);
                    return true;
                }
                _ => {}
            }
        }
        false
    }

    /// Owner, after [`KeyTable::revoke`]: waits (at most `bound`) until no
    /// writer of a running process is between its check and its post.
    /// Returns the lanes still posting when the bound ran out.
    pub(crate) fn quiesce(&self, bound: Duration, alive: impl Fn(i32) -> bool) -> usize {
        fence(Ordering::SeqCst);
        let deadline = Instant::now() + bound;
        loop {
            let busy = (0..LANES)
                .filter(|&l| {
                    let at = LANES_AT + l * LANE;
                    self.u32_at(at + 4).load(Ordering::SeqCst) != 0 && {
                        let pid = self.i32_at(at).load(Ordering::Relaxed);
                        pid != 0 && alive(pid)
                    }
                })
                .count();
            if busy == 0 || Instant::now() >= deadline {
                return busy;
            }
            std::thread::yield_now();
        }
    }

    /// Writer: takes a free lane (or one of a process that is gone) for
    /// this process.
    pub(crate) fn claim_lane(&self, alive: impl Fn(i32) -> bool) -> Option<usize> {
        let me = std::process::id() as i32;
        for l in 0..LANES {
            let at = LANES_AT + l * LANE;
            let pid = self.i32_at(at);
            let cur = pid.load(Ordering::Relaxed);
            if (cur == 0 || (cur != me && !alive(cur)))
                && pid
                    .compare_exchange(cur, me, Ordering::SeqCst, Ordering::Relaxed)
                    .is_ok()
            {
                self.u32_at(at + 4).store(0, Ordering::SeqCst);
                return Some(l);
            }
        }
        None
    }

    /// Writer: gives lane `l` back.
    pub(crate) fn release_lane(&self, l: usize) {
        let at = LANES_AT + (l % LANES) * LANE;
        self.u32_at(at + 4).store(0, Ordering::SeqCst);
        self.i32_at(at).store(0, Ordering::SeqCst);
    }

    /// Writer: raises (`true`) or lowers lane `l`'s posting flag. Raise it
    /// before [`KeyTable::check`] and lower it once the provider has taken
    /// (or refused) the WRITE.
    pub(crate) fn posting(&self, l: usize, on: bool) {
        let at = LANES_AT + (l % LANES) * LANE;
        self.u32_at(at + 4).store(u32::from(on), Ordering::SeqCst);
    }

    /// Owner: whether its worker is about to sleep on its doorbell (peers
    /// that post to it then ring). Sequentially consistent: the owner sets
    /// it, then looks for work; a writer posts, then reads it.
    pub(crate) fn set_sleeping(&self, on: bool) {
        self.u32_at(32).store(u32::from(on), Ordering::SeqCst);
    }

    /// Writer (or owner): whether the owner sleeps on its doorbell.
    pub(crate) fn sleeping(&self) -> bool {
        fence(Ordering::SeqCst);
        self.u32_at(32).load(Ordering::SeqCst) != 0
    }

    /// Writer: whether a WRITE of `len` bytes at remote address `addr` with
    /// `key` may be posted.
    pub(crate) fn check(&self, key: u64, addr: u64, len: u64) -> Verdict {
        let h = Self::home(key);
        for i in 0..SLOTS {
            let s = Self::slot(h + i);
            let Some((state, k, base, blen)) = self.read_slot(s) else {
                return Verdict::Unsure;
            };
            match state {
                EMPTY => break,
                LIVE if k == key => {
                    let inside = addr
                        .checked_sub(base)
                        .and_then(|off| off.checked_add(len))
                        .is_some_and(|end| end <= blen);
                    return if inside {
                        Verdict::Valid
                    } else {
                        Verdict::OutOfBounds { base, len: blen }
                    };
                }
                _ => {}
            }
        }
        if self.u64_at(24).load(Ordering::SeqCst) > 0 {
            Verdict::Unsure
        } else {
            Verdict::UnknownKey
        }
    }

    /// One consistent read of slot `s`: (state, key, base, len); `None` when
    /// the owner kept changing it (or died doing so).
    fn read_slot(&self, s: usize) -> Option<(u32, u64, u64, u64)> {
        let seq = self.u32_at(s);
        for _ in 0..READ_RETRIES {
            let a = seq.load(Ordering::Acquire);
            if a & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let state = self.u32_at(s + 4).load(Ordering::SeqCst);
            let k = self.u64_at(s + 8).load(Ordering::Relaxed);
            let base = self.u64_at(s + 16).load(Ordering::Relaxed);
            let len = self.u64_at(s + 24).load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == a {
                return Some((state, k, base, len));
            }
        }
        None
    }
}

impl Drop for KeyTable {
    fn drop(&mut self) {
        // SAFETY: `base` is the `SIZE`-byte mapping made by `map`, unmapped
        // once, here; no reference into it outlives `self`.
        unsafe { libc::munmap(self.base.cast(), SIZE) };
        if let Some(p) = self.owned.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Maps `SIZE` bytes of `file` shared, read-write.
fn map(file: &std::fs::File) -> std::io::Result<*mut u8> {
    // SAFETY: maps `SIZE` bytes of a regular file opened read-write and at
    // least that long; the result is checked against MAP_FAILED; the fd
    // may be closed afterwards (the mapping keeps the file).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p.cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(tag: &str) -> String {
        format!("weft-test-{}-{tag}", std::process::id())
    }

    #[test]
    fn publish_check_revoke() {
        let name = region("pcr");
        let owner = KeyTable::create(&name).unwrap();
        let writer = KeyTable::open(&name).unwrap();
        assert_eq!(writer.check(7, 100, 1), Verdict::UnknownKey);
        assert!(owner.publish(7, 100, 50));
        assert_eq!(writer.check(7, 100, 50), Verdict::Valid);
        assert_eq!(writer.check(7, 149, 1), Verdict::Valid);
        assert_eq!(
            writer.check(7, 149, 2),
            Verdict::OutOfBounds { base: 100, len: 50 }
        );
        assert_eq!(
            writer.check(7, 99, 1),
            Verdict::OutOfBounds { base: 100, len: 50 }
        );
        assert_eq!(
            writer.check(7, u64::MAX, 2),
            Verdict::OutOfBounds { base: 100, len: 50 }
        );
        assert_eq!(writer.check(8, 100, 1), Verdict::UnknownKey);
        assert!(owner.revoke(7));
        assert!(!owner.revoke(7));
        assert_eq!(writer.check(7, 100, 1), Verdict::UnknownKey);
        // The slot is reused; keys that collide stay findable.
        for k in 0..1000u64 {
            assert!(owner.publish(1000 + k, k * 10, 10));
        }
        for k in (0..1000u64).step_by(2) {
            assert!(owner.revoke(1000 + k));
        }
        for k in 0..1000u64 {
            let want = if k % 2 == 0 {
                Verdict::UnknownKey
            } else {
                Verdict::Valid
            };
            assert_eq!(writer.check(1000 + k, k * 10, 10), want, "key {k}");
        }
        let path = path_of(&name);
        drop(writer);
        assert!(path.exists());
        drop(owner);
        assert!(!path.exists(), "the owner removes its table");
    }

    #[test]
    fn full_table_lets_unknown_keys_through() {
        let name = region("full");
        let owner = KeyTable::create(&name).unwrap();
        for k in 0..SLOTS as u64 {
            assert!(owner.publish(k + 1, 0, 1));
        }
        assert!(!owner.publish(u64::MAX, 0, 1));
        assert_eq!(owner.check(u64::MAX, 0, 1), Verdict::Unsure);
        assert_eq!(owner.check(5, 0, 1), Verdict::Valid);
    }

    #[test]
    fn lanes_and_quiesce() {
        let name = region("lanes");
        let owner = KeyTable::create(&name).unwrap();
        let writer = KeyTable::open(&name).unwrap();
        let l = writer.claim_lane(|_| true).unwrap();
        let l2 = writer.claim_lane(|_| true).unwrap();
        assert_ne!(l, l2);
        writer.posting(l, true);
        assert_eq!(owner.quiesce(Duration::from_millis(20), |_| true), 1);
        // A lane of a process that is gone does not hold the owner up.
        assert_eq!(owner.quiesce(Duration::from_secs(5), |_| false), 0);
        writer.posting(l, false);
        assert_eq!(owner.quiesce(Duration::from_secs(5), |_| true), 0);
        writer.release_lane(l);
        writer.release_lane(l2);
        let all: Vec<_> = (0..LANES)
            .map(|_| writer.claim_lane(|_| true).unwrap())
            .collect();
        assert_eq!(all.len(), LANES);
        assert_eq!(writer.claim_lane(|_| true), None);
        // Lanes of dead processes are taken over.
        writer.i32_at(LANES_AT).store(i32::MAX, Ordering::SeqCst);
        assert_eq!(writer.claim_lane(|p| p != i32::MAX), Some(0));
    }

    #[test]
    fn garbage_is_not_a_table() {
        let name = region("garbage");
        let path = path_of(&name);
        std::fs::write(&path, vec![0xa5u8; SIZE]).unwrap();
        assert!(KeyTable::open(&name).is_err());
        std::fs::write(&path, b"short").unwrap();
        assert!(KeyTable::open(&name).is_err());
        let _ = std::fs::remove_file(&path);
        assert!(KeyTable::open(&name).is_err(), "no file");
    }
}
