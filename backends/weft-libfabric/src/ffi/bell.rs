//! The doorbell of an `shm` domain: a FIFO under `/dev/shm` whose read end
//! is the domain's wait fd. libfabric's shm provider has no wait object, so
//! an idle engine on it could only keep polling (a core per engine); with
//! the bell its worker sleeps in `poll(2)` like on tcp, and a peer that
//! posts to it while it sleeps (its key table says so) writes one byte.
//!
//! The owner keeps a write end open itself, so the read end never reports
//! a hang-up when no peer holds one.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The prefix of a doorbell's file name; the rest is the owner's region
/// name.
pub(crate) const PREFIX: &str = "weft-bell.";

/// The doorbell file of the domain whose shm region is `region`.
fn path_of(region: &str) -> PathBuf {
    Path::new("/dev/shm").join(format!("{PREFIX}{region}"))
}

/// The owner's side: the read end (the wait fd) and a write end that keeps
/// it from hanging up; the file is removed when dropped.
#[derive(Debug)]
pub(crate) struct Bell {
    rd: File,
    _keep: File,
    path: PathBuf,
}

impl Bell {
    /// Creates the doorbell of the domain whose region is `region`
    /// (replacing a file of that name left by a dead process).
    pub(crate) fn create(region: &str) -> std::io::Result<Bell> {
        let path = path_of(region);
        let _ = std::fs::remove_file(&path);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| std::io::Error::other("doorbell path with a NUL byte"))?;
        // SAFETY: `c` is a NUL-terminated path that lives across the call.
        if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let opened = (|| {
            let rd = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(&path)?;
            let keep = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(&path)?;
            Ok::<_, std::io::Error>((rd, keep))
        })();
        match opened {
            Ok((rd, keep)) => Ok(Bell {
                rd,
                _keep: keep,
                path,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// The fd that becomes readable when a peer rings.
    pub(crate) fn fd(&self) -> RawFd {
        self.rd.as_raw_fd()
    }

    /// Empties the FIFO (the fd is unreadable afterwards until the next
    /// ring). Returns whether anything was there.
    pub(crate) fn drain(&self) -> bool {
        let mut buf = [0u8; 64];
        let mut any = false;
        loop {
            match (&self.rd).read(&mut buf) {
                Ok(0) => return any,
                Ok(_) => any = true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return any,
            }
        }
    }
}

impl Drop for Bell {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A peer's side: the write end of another domain's doorbell.
#[derive(Debug)]
pub(crate) struct Ringer(File);

impl Ringer {
    /// Opens the doorbell of the domain whose region is `region`; fails
    /// when it has none (another library, an older weft) or its owner is
    /// gone (no reader: `ENXIO`).
    pub(crate) fn open(region: &str) -> std::io::Result<Ringer> {
        let f = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path_of(region))?;
        Ok(Ringer(f))
    }

    /// Wakes the owner (a full FIFO already wakes it; a closed one has no
    /// one left to wake).
    pub(crate) fn ring(&self) {
        let _ = (&self.0).write(&[1u8]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_testkit::wait::fd_readable as readable;

    #[test]
    fn a_ring_wakes_and_a_drain_resets() {
        let name = format!("weft-test-{}-bell", std::process::id());
        let bell = Bell::create(&name).unwrap();
        assert!(
            !readable(bell.fd(), 0),
            "quiet at first (no hang-up without peers)"
        );
        let r = Ringer::open(&name).unwrap();
        r.ring();
        r.ring();
        assert!(readable(bell.fd(), 1000));
        assert!(bell.drain());
        assert!(!readable(bell.fd(), 0));
        // Many rings never block the ringer (the FIFO fills, writes fail).
        for _ in 0..200_000 {
            r.ring();
        }
        assert!(readable(bell.fd(), 0));
        assert!(bell.drain());
        drop(r);
        assert!(!readable(bell.fd(), 0), "a peer closing its end is no ring");
        let path = path_of(&name);
        drop(bell);
        assert!(!path.exists());
        assert!(Ringer::open(&name).is_err(), "no doorbell any more");
    }
}
