//! Sleeping in file descriptors: a group's wake-up eventfd ([`WakeFd`],
//! written by submitters, control requests, arms and shutdown) and a
//! worker's [`Blocker`], which sleeps in `poll(2)` on its NICs' wait fds
//! ([`weft_transport::Domain::wait_fd`]) and the wake-up fd at once. The
//! only OS calls of the engine's idle path live here.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// A non-blocking eventfd: [`WakeFd::signal`] makes it readable until the
/// sleeper [`WakeFd::drain`]s it.
#[derive(Debug)]
pub(crate) struct WakeFd(File);

impl WakeFd {
    /// A new eventfd, or `None` where the OS refuses one (the group then
    /// never sleeps in fds; it parks as before).
    pub(crate) fn new() -> Option<WakeFd> {
        // SAFETY: eventfd takes no pointers; a non-negative return is a new
        // fd nobody else owns, handed to `OwnedFd` at once.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "eventfd failed: workers will not sleep in wait fds"
            );
            return None;
        }
        // SAFETY: `fd` is a freshly created, open descriptor owned by no one
        // else (checked non-negative above).
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        Some(WakeFd(File::from(owned)))
    }

    /// Makes the fd readable (wakes a sleeper). A full counter (EAGAIN)
    /// already is readable.
    pub(crate) fn signal(&self) {
        let _ = (&self.0).write(&1u64.to_ne_bytes());
    }

    /// Resets the fd to unreadable.
    fn drain(&self) {
        let mut buf = [0u8; 8];
        loop {
            match (&self.0).read(&mut buf) {
                Ok(8) => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                _ => break,
            }
        }
    }

    fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// The fds one worker sleeps on: every NIC's wait fd, then its group's
/// [`WakeFd`].
pub(crate) struct Blocker {
    fds: Vec<libc::pollfd>,
}

impl Blocker {
    /// A blocker over `nic_fds` and `wake`; `None` if a NIC has no wait fd
    /// (`nic_fds` then is `None`) or there is no wake fd.
    pub(crate) fn new(nic_fds: Option<Vec<RawFd>>, wake: Option<&WakeFd>) -> Option<Blocker> {
        let mut fds: Vec<libc::pollfd> = nic_fds?
            .into_iter()
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        fds.push(libc::pollfd {
            fd: wake?.raw(),
            events: libc::POLLIN,
            revents: 0,
        });
        Some(Blocker { fds })
    }

    /// Sleeps until a NIC fd or the wake fd is readable, or `timeout`
    /// passes; then drains the wake fd. Returns whether a NIC fd woke it.
    /// Errors of `poll(2)` (EINTR) end the sleep early, which costs one
    /// more round of polling.
    pub(crate) fn sleep(&mut self, wake: &WakeFd, timeout: Duration) -> bool {
        let ms = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        for p in &mut self.fds {
            p.revents = 0;
        }
        // SAFETY: `fds` is a live, exclusively borrowed array of
        // `fds.len()` pollfd structs; poll only writes their `revents`.
        let n = unsafe { libc::poll(self.fds.as_mut_ptr(), self.fds.len() as libc::nfds_t, ms) };
        wake.drain();
        let nics = self.fds.len() - 1;
        n > 0 && self.fds[..nics].iter().any(|p| p.revents != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_signal_ends_the_sleep_and_is_drained() {
        let wake = WakeFd::new().expect("eventfd");
        let mut b = Blocker::new(Some(Vec::new()), Some(&wake)).expect("blocker");
        wake.signal();
        wake.signal();
        let t = Instant::now();
        assert!(
            !b.sleep(&wake, Duration::from_secs(30)),
            "no NIC fd to wake it"
        );
        assert!(t.elapsed() < Duration::from_secs(30), "signal did not wake");
        // Drained: the next sleep runs to its timeout.
        let t = Instant::now();
        assert!(!b.sleep(&wake, Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(19), "fd left readable");
    }

    #[test]
    fn a_readable_nic_fd_is_reported() {
        let wake = WakeFd::new().expect("eventfd");
        let nic = WakeFd::new().expect("eventfd");
        let mut b = Blocker::new(Some(vec![nic.raw()]), Some(&wake)).expect("blocker");
        nic.signal();
        assert!(
            b.sleep(&wake, Duration::from_secs(30)),
            "NIC fd not reported"
        );
    }

    #[test]
    fn no_blocker_without_every_fd() {
        let wake = WakeFd::new().expect("eventfd");
        assert!(Blocker::new(None, Some(&wake)).is_none());
        assert!(Blocker::new(Some(vec![0]), None).is_none());
    }
}
