//! The one place weft touches an `shm` provider region itself: freeing the
//! region lock a dead process left held.
//!
//! libfabric 1.17's shm provider guards each endpoint's region (a file
//! under `/dev/shm`, mapped by every process that talks to it) with a
//! `pthread_spinlock_t` that both the owner (progressing its queue) and
//! every writer (posting a command) take. A process killed while it holds
//! its own lock leaves it held for good, and the next write to it spins
//! inside `fi_writemsg` forever, taking the writer's whole engine with it.
//! Once the owner is dead nobody can own the lock legitimately except a
//! writer posting into a queue no one will read, so putting the lock back
//! to "unlocked" is safe: a spinning writer then gets it, posts into the
//! dead region, returns, and the dead peer's work fails as usual.
//!
//! The region header is checked before anything is written: the region
//! format version 1.17 writes (4) and the owner's pid, both at fixed
//! offsets of `struct smr_region` (`include/ofi_shm.h`, v1.17): `version`
//! (u8) at 0, `pid` (i32) at 4, `lock` at 24. Any other version is left
//! alone (libfabric 2.x lays the region out differently).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

/// `SMR_VERSION` of libfabric 1.17's shm regions.
const V117: u8 = 4;
/// Offsets in `struct smr_region` (1.17, x86-64).
const PID_AT: usize = 4;
const LOCK_AT: usize = 24;
/// Bytes of the header mapped.
const HEADER: usize = 32;

/// The value of an unlocked `pthread_spinlock_t` in this C library (1 with
/// glibc's x86-64 implementation, 0 with its generic one), read from a
/// lock it initialised.
fn unlocked_value() -> i32 {
    static VALUE: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *VALUE.get_or_init(|| {
        let mut l: libc::pthread_spinlock_t = -1;
        // SAFETY: `l` is a valid, writable spinlock object.
        let rc = unsafe { libc::pthread_spin_init(&mut l, libc::PTHREAD_PROCESS_SHARED) };
        if rc != 0 {
            return 0;
        }
        let v = l;
        // SAFETY: initialised above, not locked, destroyed once.
        unsafe { libc::pthread_spin_destroy(&mut l) };
        v
    })
}

/// What [`free_dead_owner_lock`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockState {
    /// The lock was held: put back to unlocked.
    Freed,
    /// The lock was not held.
    Free,
    /// Not a 1.17 region of `pid` (another version, another owner, too
    /// short, gone): nothing done.
    Foreign,
}

/// For the region file `path` of the process `pid`, which the caller has
/// found dead: puts its region lock back to unlocked if it is held.
pub(crate) fn free_dead_owner_lock(path: &Path, pid: i32) -> std::io::Result<LockState> {
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    if file.metadata()?.len() < HEADER as u64 {
        return Ok(LockState::Foreign);
    }
    // SAFETY: maps the first `HEADER` bytes of a regular file we opened
    // read-write, shared (the provider's own mappings see our store);
    // the mapping is unmapped below before returning.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            HEADER,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let base = p.cast::<u8>();
    // SAFETY: `base..base + HEADER` is mapped; the reads are of plain
    // integers at their C offsets (aligned: the mapping is page-aligned).
    let (version, owner) = unsafe {
        (
            std::ptr::read_volatile(base),
            std::ptr::read_volatile(base.add(PID_AT).cast::<i32>()),
        )
    };
    let state = if version != V117 || owner != pid {
        LockState::Foreign
    } else {
        // SAFETY: the lock word is a 4-byte aligned i32 inside the mapping;
        // other processes access it only atomically (spin lock operations).
        let lock = unsafe { &*base.add(LOCK_AT).cast::<AtomicI32>() };
        let unlocked = unlocked_value();
        if lock.load(Ordering::Acquire) == unlocked {
            LockState::Free
        } else {
            lock.store(unlocked, Ordering::Release);
            LockState::Freed
        }
    };
    // SAFETY: unmaps exactly the mapping made above.
    unsafe { libc::munmap(p, HEADER) };
    Ok(state)
}
