//! Signals stay the application's: libfabric and the libraries it loads
//! install handlers of their own. Debian's build links `libinfinipath`
//! (PSM), whose constructor replaces the SIGINT, SIGTERM, SIGSEGV, SIGBUS,
//! SIGABRT and SIGILL handlers with a backtrace printer that exits with
//! status 1 (and drops a `.btr` file), so Ctrl-C no longer raises Python's
//! `KeyboardInterrupt` and an application's SIGTERM handler never runs;
//! the `shm` provider installs its own on its first endpoint.
//!
//! Every libfabric call that can install one (loading the library,
//! `fi_getinfo`, opening fabrics, domains and endpoints) runs inside
//! [`keep_signals`]: the dispositions of [`KEPT`] are read before and every
//! one that changed is put back after. The windows are serialized, so two
//! threads opening endpoints at once cannot save each other's changes. A
//! handler the application installs from another thread during such a
//! window (microseconds to milliseconds, at start-up) would be undone as
//! well: install handlers before opening weft, or after.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};

/// The signals whose dispositions weft keeps for the application while
/// libfabric opens (see the module docs).
pub const KEPT: [c_int; 12] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGQUIT,
    libc::SIGHUP,
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGABRT,
    libc::SIGILL,
    libc::SIGFPE,
    libc::SIGPIPE,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// Linux's `SA_RESTORER` (not exported by the `libc` crate on every
/// target): the C library sets it on every action it installs.
pub const SA_RESTORER: c_int = 0x0400_0000;

/// Serializes the windows.
static WINDOW: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Dispositions put back since the process started.
static RESTORED: AtomicU64 = AtomicU64::new(0);

/// How many signal dispositions libfabric (or a library it loaded) changed
/// and weft put back, in this process.
pub fn restored_dispositions() -> u64 {
    RESTORED.load(Ordering::Relaxed)
}

fn current(sig: c_int) -> Option<libc::sigaction> {
    // SAFETY: an all-zero `sigaction` is a valid out-parameter.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: querying only (no new action); `old` is a valid out-pointer.
    let rc = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
    (rc == 0).then_some(old)
}

/// Whether two dispositions act the same. `SA_RESTORER` is left out: the
/// C library adds it to every action it installs, so a disposition put
/// back differs from the kernel's initial one in that bit only.
fn same(a: &libc::sigaction, b: &libc::sigaction) -> bool {
    let flags = |x: &libc::sigaction| x.sa_flags & !SA_RESTORER;
    a.sa_sigaction == b.sa_sigaction && flags(a) == flags(b) && mask_eq(a, b)
}

fn mask_eq(a: &libc::sigaction, b: &libc::sigaction) -> bool {
    KEPT.iter().all(|&s| {
        // SAFETY: sigismember only reads the set; `s` is a valid signal.
        unsafe { libc::sigismember(&a.sa_mask, s) == libc::sigismember(&b.sa_mask, s) }
    })
}

/// Runs `f` (a libfabric call) and puts back every disposition of [`KEPT`]
/// it changed.
pub(crate) fn keep_signals<T>(f: impl FnOnce() -> T) -> T {
    let _window = WINDOW
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let saved: Vec<(c_int, libc::sigaction)> = KEPT
        .iter()
        .filter_map(|&s| current(s).map(|a| (s, a)))
        .collect();
    let out = f();
    for (sig, was) in &saved {
        let Some(now) = current(*sig) else {
            continue;
        };
        if same(&now, was) {
            continue;
        }
        // SAFETY: `was` is the disposition the kernel reported for `sig`
        // before the call: setting it back installs nothing new.
        let rc = unsafe { libc::sigaction(*sig, was, std::ptr::null_mut()) };
        if rc == 0 {
            RESTORED.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                signal = sig,
                "libfabric changed a signal disposition: put back"
            );
        } else {
            tracing::warn!(
                signal = sig,
                error = %std::io::Error::last_os_error(),
                "could not put back a signal disposition libfabric changed"
            );
        }
    }
    out
}
