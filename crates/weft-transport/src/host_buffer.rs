//! [`HostBuffer`]: page-aligned host memory to register with a domain or an
//! engine.
//!
//! RDMA memory is written behind Rust's back: once registered, NICs (and
//! peers holding the rkey) write into it while the program runs. A
//! `HostBuffer` owns such memory and hands out the [`MemRegion`] describing
//! it, so that the one `unsafe` promise of [`MemRegion::new`] is made here,
//! once, instead of by every user.
//!
//! See [`HostBuffer`] for the lifetime contract and how to access the bytes.

use crate::{Device, MemRegion};
use std::io;
use std::ptr::NonNull;
use thiserror::Error;

/// Why a [`HostBuffer`] could not be created.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum HostBufferError {
    /// The operating system refused to map the memory.
    #[error("mapping {len} bytes of host memory failed: {source}")]
    Map {
        /// Requested length in bytes.
        len: usize,
        /// The error (its `raw_os_error` is the errno).
        #[source]
        source: io::Error,
    },
    /// Huge pages were asked for and none could be had: none reserved
    /// (`/proc/sys/vm/nr_hugepages`), too few free, or not supported here.
    /// There is no silent fallback: build again without
    /// [`HostBufferBuilder::huge_pages`] to use ordinary pages.
    #[error("no huge pages for {len} bytes (huge page size {page_size}): {source}")]
    HugePages {
        /// Requested length in bytes.
        len: usize,
        /// The huge page size the mapping was rounded to.
        page_size: usize,
        /// The error (its `raw_os_error` is the errno).
        #[source]
        source: io::Error,
    },
    /// `mlock` failed, typically `ENOMEM`/`EPERM` for a `RLIMIT_MEMLOCK`
    /// (`ulimit -l`) smaller than the buffer.
    #[error("mlock of {len} bytes failed: {source} (check RLIMIT_MEMLOCK, `ulimit -l`)")]
    Mlock {
        /// Length in bytes that was to be locked.
        len: usize,
        /// The error (its `raw_os_error` is the errno).
        #[source]
        source: io::Error,
    },
    /// The length, rounded up to whole pages, overflows `usize`.
    #[error("host buffer of {len} bytes is too large")]
    TooLarge {
        /// Requested length in bytes.
        len: usize,
    },
}

/// Options for a [`HostBuffer`]; see [`HostBuffer::builder`].
#[derive(Debug, Clone, Copy)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct HostBufferBuilder {
    len: usize,
    huge_pages: bool,
    mlock: bool,
}

impl HostBufferBuilder {
    /// Backs the buffer with huge pages (`MAP_HUGETLB`, the system's default
    /// huge page size; the mapping is rounded up to whole huge pages). Fails
    /// with [`HostBufferError::HugePages`] when none are available; it does
    /// not fall back to ordinary pages. Linux only: elsewhere building fails
    /// with that error.
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// Locks the buffer into RAM (`mlock`) so that it is resident and never
    /// swapped. Fails with [`HostBufferError::Mlock`] when the lock limit is
    /// too small.
    pub fn mlock(mut self, on: bool) -> Self {
        self.mlock = on;
        self
    }

    /// Maps the buffer, zero-initialised.
    pub fn build(self) -> Result<HostBuffer, HostBufferError> {
        HostBuffer::map(self)
    }
}

/// Page-aligned, zero-initialised host memory to register with a domain or
/// an engine.
///
/// # Lifetime contract
///
/// The buffer keeps its memory mapped for as long as it lives. A registration
/// made from [`HostBuffer::region`] does not borrow the buffer, so **every
/// registration of the region must be released (deregistered, or its domain
/// or engine shut down) before the buffer is dropped**. Declaring the buffer
/// before the domain or engine that registers it (locals drop in reverse
/// order), or holding it in an `Arc` that the owner of the registration also
/// keeps, are the usual ways to honour this.
///
/// # Accessing the bytes
///
/// [`HostBuffer::read`] and [`HostBuffer::write`] copy through raw pointers
/// and never create a Rust reference into the memory, so they may be used
/// while the region is registered (through a shared `&self`, e.g. from an
/// `Arc`). Bytes a remote WRITE is still landing in are unspecified: read them
/// only after the completion or immediate that says they are final.
/// [`HostBuffer::as_slice`] and [`HostBuffer::as_mut_slice`] hand out
/// references, so they take `&mut self` (no [`HostBuffer::write`] can run
/// concurrently) and must only be used while no remote write can land: before
/// registering with remote-write access, or after the transfers into the
/// buffer have completed.
///
/// ```
/// use weft_transport::HostBuffer;
/// let buf = HostBuffer::builder(1 << 20).build().unwrap();
/// assert!(buf.write(0, b"hello"));
/// assert_eq!(buf.read(0, 5).unwrap(), b"hello");
/// let region = buf.region(); // register it; release it before `buf` drops
/// assert_eq!(region.len(), 1 << 20);
/// ```
pub struct HostBuffer {
    ptr: NonNull<u8>,
    /// Requested length (what `len` and `region` report).
    len: usize,
    /// Mapped length (whole pages, at least one).
    map_len: usize,
    huge: bool,
    locked: bool,
}

// SAFETY: the buffer exclusively owns its mapping (like a `Box<[u8]>`); it is
// only accessed through raw-pointer copies from `&self` or references
// borrowed from `&mut self`, so it may move between threads.
#[allow(unsafe_code)]
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only ever copies through raw pointers (`read`,
// `write`); references into the memory need `&mut self`. Concurrent raw copies
// from several threads race like the NIC's writes do, which is the documented
// contract of registered memory (bytes being written are unspecified).
#[allow(unsafe_code)]
unsafe impl Sync for HostBuffer {}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("huge", &self.huge)
            .field("locked", &self.locked)
            .finish()
    }
}

impl HostBuffer {
    /// `len` zero bytes on ordinary pages, neither huge nor locked.
    pub fn new(len: usize) -> Result<Self, HostBufferError> {
        Self::builder(len).build()
    }

    /// A builder for a buffer of `len` bytes, to choose huge pages or `mlock`.
    pub fn builder(len: usize) -> HostBufferBuilder {
        HostBufferBuilder {
            len,
            huge_pages: false,
            mlock: false,
        }
    }

    /// Length in bytes (as requested; the mapping behind it is whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the buffer is backed by huge pages.
    pub fn is_huge(&self) -> bool {
        self.huge
    }

    /// Whether the buffer is locked into RAM.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// The region to register: all `len` bytes, [`Device::Host`].
    ///
    /// The memory stays valid while `self` lives; every registration of the
    /// region must be released before `self` is dropped (see the lifetime
    /// contract on [`HostBuffer`]).
    pub fn region(&self) -> MemRegion {
        // SAFETY: `ptr..ptr+len` lies inside the mapping this buffer owns,
        // valid for reads and writes until `drop` unmaps it; the buffer never
        // hands out references while shared (`as_slice`/`as_mut_slice` need
        // `&mut self`). Releasing registrations before the drop is the
        // documented contract of this type.
        #[allow(unsafe_code)]
        unsafe {
            MemRegion::new(self.ptr, self.len, Device::Host)
        }
    }

    /// The region of the bytes `range` of the buffer (to register part of
    /// it), or `None` when the range is reversed or out of bounds. The same
    /// lifetime contract as [`Self::region`] applies.
    pub fn sub_region(&self, range: std::ops::Range<usize>) -> Option<MemRegion> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        // SAFETY: `range.start <= len` (checked above), so the pointer stays
        // inside the mapping (or one past the requested bytes, which the
        // mapping of at least one page also covers).
        #[allow(unsafe_code)]
        let ptr = unsafe { self.ptr.add(range.start) };
        // SAFETY: `ptr..ptr+(end-start)` lies inside the mapping this buffer
        // owns; otherwise as in `region`.
        #[allow(unsafe_code)]
        unsafe {
            Some(MemRegion::new(ptr, range.end - range.start, Device::Host))
        }
    }

    /// A copy of the `len` bytes at `offset`, or `None` when out of bounds.
    /// Copies through a raw pointer: safe to call while registered, but bytes
    /// a remote write is still landing in are unspecified.
    pub fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: `offset..offset+len` is inside the mapping (checked above);
        // `out` is a fresh vector, so the spans do not overlap; no reference
        // into the buffer is created.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), len)
        };
        Some(out)
    }

    /// Copies `data` in at `offset`; returns `false` (writing nothing) when it
    /// does not fit. Copies through a raw pointer, so it may be called through
    /// `&self` while the region is registered (e.g. to produce data a NIC
    /// sends).
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        let fits = offset
            .checked_add(data.len())
            .is_some_and(|end| end <= self.len);
        if fits {
            // SAFETY: in bounds (checked above); `data` is a Rust slice and
            // cannot alias the buffer, which never hands out references
            // through `&self`.
            #[allow(unsafe_code)]
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    self.ptr.as_ptr().add(offset),
                    data.len(),
                )
            };
        }
        fits
    }

    /// The bytes as a slice. Takes `&mut self` so that no [`Self::write`]
    /// runs concurrently; use it only while no remote write can land in the
    /// buffer (before registering it for remote writes, or after the
    /// transfers into it completed).
    pub fn as_slice(&mut self) -> &[u8] {
        // SAFETY: the mapping is valid for `len` bytes (zero-initialised, so
        // initialised) while `self` lives; `&mut self` excludes Rust-side
        // writes for the borrow; remote writes are excluded by the documented
        // contract above.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr(), self.len)
        }
    }

    /// The bytes as a mutable slice; the same rules as [`Self::as_slice`].
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the borrow exclusive.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len)
        }
    }

    fn map(b: HostBufferBuilder) -> Result<Self, HostBufferError> {
        let len = b.len;
        let page = if b.huge_pages {
            sys::huge_page_size()
        } else {
            sys::page_size()
        };
        let map_len = len
            .max(1)
            .checked_next_multiple_of(page)
            .ok_or(HostBufferError::TooLarge { len })?;
        let ptr = sys::map(map_len, b.huge_pages).map_err(|source| {
            if b.huge_pages {
                HostBufferError::HugePages {
                    len,
                    page_size: page,
                    source,
                }
            } else {
                HostBufferError::Map { len, source }
            }
        })?;
        let mut buf = HostBuffer {
            ptr,
            len,
            map_len,
            huge: b.huge_pages,
            locked: false,
        };
        if b.mlock {
            // `buf` unmaps on the error path when it drops.
            sys::lock(buf.ptr, buf.map_len).map_err(|source| HostBufferError::Mlock {
                len: buf.map_len,
                source,
            })?;
            buf.locked = true;
        }
        Ok(buf)
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        sys::unmap(self.ptr, self.map_len, self.locked);
    }
}

/// The operating-system calls behind [`HostBuffer`].
#[cfg(unix)]
#[allow(unsafe_code)]
mod sys {
    use std::io;
    use std::ptr::NonNull;

    /// The base page size.
    pub(super) fn page_size() -> usize {
        // SAFETY: `sysconf` has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
    }

    /// The default huge page size (`Hugepagesize` in `/proc/meminfo`, else
    /// 2 MiB).
    pub(super) fn huge_page_size() -> usize {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Hugepagesize:"))
                    .and_then(|v| v.trim().strip_suffix("kB"))
                    .and_then(|kb| kb.trim().parse::<usize>().ok())
            })
            .and_then(|kb| kb.checked_mul(1024))
            .unwrap_or(2 << 20)
    }

    /// Maps `len` (> 0, whole pages) zeroed, private, anonymous bytes.
    pub(super) fn map(len: usize, huge: bool) -> io::Result<NonNull<u8>> {
        #[cfg(target_os = "linux")]
        let flags =
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if huge { libc::MAP_HUGETLB } else { 0 };
        #[cfg(not(target_os = "linux"))]
        let flags = if huge {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "huge pages are supported on Linux only",
            ));
        } else {
            libc::MAP_PRIVATE | libc::MAP_ANON
        };
        // SAFETY: an anonymous private mapping at an address of the kernel's
        // choosing touches no existing memory; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))
    }

    /// Locks `len` bytes at `ptr` (a mapping of ours) into RAM.
    pub(super) fn lock(ptr: NonNull<u8>, len: usize) -> io::Result<()> {
        // SAFETY: `ptr..ptr+len` is a mapping made by `map`; `mlock` only
        // changes its residency.
        if unsafe { libc::mlock(ptr.as_ptr().cast(), len) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Unmaps a mapping made by `map` (unlocking it first if locked).
    pub(super) fn unmap(ptr: NonNull<u8>, len: usize, locked: bool) {
        // SAFETY: `ptr..ptr+len` is a mapping made by `map` and owned by the
        // dropping `HostBuffer`; nothing uses it after this call (the type's
        // contract: registrations are released before the drop). Failures
        // leave at worst a leaked mapping, so the results are ignored.
        unsafe {
            if locked {
                libc::munlock(ptr.as_ptr().cast(), len);
            }
            libc::munmap(ptr.as_ptr().cast(), len);
        }
    }
}

/// Portable fallback: the global allocator, page-aligned; neither huge pages
/// nor `mlock`.
#[cfg(not(unix))]
#[allow(unsafe_code)]
mod sys {
    use std::alloc::Layout;
    use std::io;
    use std::ptr::NonNull;

    const PAGE: usize = 4096;

    pub(super) fn page_size() -> usize {
        PAGE
    }

    pub(super) fn huge_page_size() -> usize {
        2 << 20
    }

    pub(super) fn map(len: usize, huge: bool) -> io::Result<NonNull<u8>> {
        if huge {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "huge pages are not supported on this platform",
            ));
        }
        let layout = Layout::from_size_align(len, PAGE).map_err(io::Error::other)?;
        // SAFETY: `len > 0` (the caller maps at least one page).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(p).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))
    }

    pub(super) fn lock(_ptr: NonNull<u8>, _len: usize) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "mlock is not supported on this platform",
        ))
    }

    pub(super) fn unmap(ptr: NonNull<u8>, len: usize, _locked: bool) {
        if let Ok(layout) = Layout::from_size_align(len, PAGE) {
            // SAFETY: allocated by `map` with this layout, freed once.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_page_aligned_and_sized() {
        let mut b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.len(), 10_000);
        assert!(!b.is_empty());
        assert_eq!(b.region().addr() % sys::page_size() as u64, 0);
        assert_eq!(b.region().len(), 10_000);
        assert_eq!(b.region().device(), Device::Host);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        assert!(!b.is_huge() && !b.is_locked());
    }

    #[test]
    fn empty_buffer_is_valid() {
        let mut b = HostBuffer::new(0).unwrap();
        assert!(b.is_empty());
        assert_eq!(b.region().len(), 0);
        assert!(b.as_slice().is_empty());
        assert_eq!(b.read(0, 0), Some(Vec::new()));
        assert!(b.write(0, &[]));
        assert!(!b.write(0, &[1]));
    }

    #[test]
    fn sub_regions_are_checked() {
        let b = HostBuffer::new(100).unwrap();
        let r = b.sub_region(10..30).unwrap();
        assert_eq!(r.addr(), b.region().addr() + 10);
        assert_eq!(r.len(), 20);
        assert_eq!(b.sub_region(100..100).unwrap().len(), 0);
        assert!(b.sub_region(90..101).is_none());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 30..10;
        assert!(b.sub_region(reversed).is_none());
    }

    #[test]
    fn read_write_bounds() {
        let b = HostBuffer::new(100).unwrap();
        assert!(b.write(90, &[7; 10]));
        assert!(!b.write(91, &[7; 10]));
        assert!(!b.write(usize::MAX, &[7]));
        assert_eq!(b.read(90, 10).unwrap(), vec![7; 10]);
        assert_eq!(b.read(89, 1).unwrap(), vec![0]);
        assert!(b.read(91, 10).is_none());
        assert!(b.read(usize::MAX, 2).is_none());
    }

    #[test]
    fn slices_see_raw_writes() {
        let mut b = HostBuffer::new(4096).unwrap();
        b.as_mut_slice()[..3].copy_from_slice(&[1, 2, 3]);
        assert_eq!(b.read(0, 4).unwrap(), vec![1, 2, 3, 0]);
        assert!(b.write(4093, &[9, 9, 9]));
        assert_eq!(&b.as_slice()[4093..], &[9, 9, 9]);
    }

    #[test]
    fn shared_across_threads() {
        let b = std::sync::Arc::new(HostBuffer::new(64).unwrap());
        let b2 = b.clone();
        std::thread::spawn(move || assert!(b2.write(0, &[5; 64])))
            .join()
            .unwrap();
        assert_eq!(b.read(0, 64).unwrap(), vec![5; 64]);
    }

    #[test]
    fn too_large_is_a_typed_error() {
        let e = HostBuffer::new(usize::MAX).unwrap_err();
        assert!(matches!(e, HostBufferError::TooLarge { len: usize::MAX }));
    }

    #[test]
    fn huge_pages_map_or_report_why_not() {
        // Hosts without reserved huge pages are the common case; both
        // outcomes are valid, but a failure must be the typed error.
        match HostBuffer::builder(1).huge_pages(true).build() {
            Ok(mut b) => {
                assert!(b.is_huge());
                assert_eq!(b.region().addr() % sys::huge_page_size() as u64, 0);
                assert!(b.write(0, &[1]));
                assert_eq!(b.as_slice(), &[1]);
            }
            Err(HostBufferError::HugePages { len, source, .. }) => {
                assert_eq!(len, 1);
                assert!(source.raw_os_error().is_some() || cfg!(not(target_os = "linux")));
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    #[test]
    fn mlock_locks_or_reports_errno() {
        match HostBuffer::builder(8192).mlock(true).build() {
            Ok(b) => {
                assert!(b.is_locked());
                assert_eq!(b.read(8191, 1).unwrap(), vec![0]);
            }
            Err(HostBufferError::Mlock { len, source }) => {
                assert!(len >= 8192);
                assert!(source.raw_os_error().is_some() || cfg!(not(unix)));
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}
