//! Bounded waits for threaded tests.

use std::time::{Duration, Instant};

/// Polls `cond` until it holds; panics with `hang: <what> ...` once
/// `timeout` has passed without it.
///
/// The timeout only catches hangs: pick it generously (tens of seconds), it
/// is not a speed assertion. Polling spins briefly, then yields, then sleeps
/// 200 µs between polls, so a long wait does not burn a core.
pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    let mut polls = 0u32;
    while !cond() {
        assert!(
            start.elapsed() < timeout,
            "hang: {what} did not happen within {timeout:?}"
        );
        polls = polls.saturating_add(1);
        if polls < 64 {
            std::hint::spin_loop();
        } else if polls < 128 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Whether `fd` becomes readable within `ms` milliseconds (`poll(2)`;
/// 0: right now). For tests of wait fds and doorbells.
#[allow(unsafe_code)]
pub fn fd_readable(fd: std::os::fd::RawFd, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, exclusively borrowed for the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0 && p.revents & libc::POLLIN != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn returns_once_the_condition_holds() {
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        let t = std::thread::spawn(move || f.store(true, Ordering::Release));
        wait_until("flag", Duration::from_secs(60), || {
            flag.load(Ordering::Acquire)
        });
        t.join().unwrap();
    }

    #[test]
    #[should_panic(expected = "hang: never did not happen")]
    fn panics_on_hang() {
        wait_until("never", Duration::from_millis(1), || false);
    }
}
