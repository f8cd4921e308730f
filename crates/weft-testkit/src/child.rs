//! Child processes for cross-process tests: the current test binary,
//! re-executed to run one test in a role.
//!
//! The parent calls [`spawn_role`] naming an *entry test* (a `#[test]` in the
//! same binary) and a role. The child runs only that test, which starts by
//! calling [`role`]: `Some(role)` in a child (it then does the role's work,
//! talks to the parent in lines and usually ends with
//! `std::process::exit`), `None` when the test harness runs the entry test
//! normally (it should then return at once, or do a self-test).
//!
//! Parent and child talk in lines (no newline inside a line):
//!
//! - child to parent: the child's stdout is a pipe. libtest writes its own
//!   output there too, so [`send_line`] prefixes the handshake lines with
//!   [`LINE_PREFIX`] and the parent ([`ChildProcess::recv_line`],
//!   [`ChildProcess::recv_line_timeout`]) skips everything else, including
//!   text libtest printed before the prefix on the same line (`test x ... `).
//!   A thread of the parent drains the pipe all the time, so a child that
//!   prints a lot never blocks on it.
//! - parent to child: the child's stdin is a pipe too.
//!   [`ChildProcess::send_line`] writes a line, the child reads it with
//!   [`recv_line`]; `None` there means the parent closed the pipe
//!   ([`ChildProcess::close_stdin`]) or went away, so a child that serves
//!   its parent's lines exits on its own when the parent dies.
//!
//! The child's stderr is inherited, so its panics show in the test output.
//! On Unix, [`ChildProcess::signal`] sends the child a signal (to stop and
//! continue it, say); [`ChildProcess::kill`] kills and reaps it.
//!
//! ```no_run
//! use weft_testkit::child;
//!
//! #[test]
//! fn peer_entry() {
//!     let Some(role) = child::role() else { return };
//!     child::send_line(&format!("ready {role}")).unwrap();
//!     while let Some(req) = child::recv_line().unwrap() {
//!         child::send_line(&format!("echo {req}")).unwrap();
//!     }
//!     std::process::exit(0);
//! }
//!
//! #[test]
//! fn two_processes() {
//!     let mut c = child::spawn_role("peer_entry", "server", &[]).unwrap();
//!     assert_eq!(c.recv_line().unwrap().as_deref(), Some("ready server"));
//!     c.send_line("hi").unwrap();
//!     assert_eq!(c.recv_line().unwrap().as_deref(), Some("echo hi"));
//!     assert!(c.wait().unwrap().success()); // closes its stdin first
//! }
//! ```

use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::Duration;

/// The environment variable carrying the child's role.
pub const ROLE_ENV: &str = "WEFT_TESTKIT_ROLE";

/// The prefix of handshake lines on the child's stdout.
pub const LINE_PREFIX: &str = "weft-testkit> ";

/// The role of this process: `Some` in a child started by [`spawn_role`].
pub fn role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// Child side: sends one handshake line (no newline inside) to the parent.
/// Lines sent from several threads do not interleave.
pub fn send_line(line: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    writeln!(out, "{LINE_PREFIX}{line}")?;
    out.flush()
}

/// Child side: the next line the parent sent with
/// [`ChildProcess::send_line`] (without the newline); `None` once the parent
/// closed the child's stdin or exited. Blocks until a line or the end comes.
pub fn recv_line() -> io::Result<Option<String>> {
    let mut line = String::new();
    if io::stdin().lock().read_line(&mut line)? == 0 {
        return Ok(None);
    }
    Ok(Some(line.trim_end_matches(['\r', '\n']).to_string()))
}

/// The full path in this test binary of the test `entry_test` names: the
/// name itself when a test has exactly that path, else the one test whose
/// path ends in `::entry_test` (a crate's integration tests are modules of
/// one binary, so `peer_entry` is `xproc::peer_entry` there). The binary's
/// test list is read once (`--list`).
fn resolve_entry(exe: &std::path::Path, entry_test: &str) -> io::Result<String> {
    static LIST: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let list = match LIST.get() {
        Some(l) => l,
        None => {
            let out = Command::new(exe)
                .args(["--list", "--format", "terse"])
                .env_remove(ROLE_ENV)
                .stdin(Stdio::null())
                .stderr(Stdio::inherit())
                .output()?;
            let names = String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| l.strip_suffix(": test"))
                .map(str::to_string)
                .collect();
            LIST.get_or_init(|| names)
        }
    };
    if list.iter().any(|n| n == entry_test) {
        return Ok(entry_test.to_string());
    }
    let suffix = format!("::{entry_test}");
    let found: Vec<&String> = list.iter().filter(|n| n.ends_with(&suffix)).collect();
    match found.as_slice() {
        [one] => Ok((*one).clone()),
        [] => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no test named {entry_test} in this binary"),
        )),
        many => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{entry_test} names several tests: {many:?}; give its module path"),
        )),
    }
}

/// Re-executes the current test binary to run only `entry_test` (a test's
/// full path in the binary, e.g. `xproc::peer_entry`, or just its name when
/// that is unique, e.g. `peer_entry`), with [`ROLE_ENV`] set to `role` and
/// the extra `envs`.
pub fn spawn_role(
    entry_test: &str,
    role: &str,
    envs: &[(&str, &OsStr)],
) -> io::Result<ChildProcess> {
    let exe = std::env::current_exe()?;
    let entry = resolve_entry(&exe, entry_test)?;
    let mut cmd = Command::new(exe);
    cmd.args([entry.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn()?;
    let stdin = child.stdin.take();
    let lines = match child.stdout.take() {
        Some(out) => match read_lines(out, child.id()) {
            Ok(rx) => Some(rx),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        },
        None => None,
    };
    Ok(ChildProcess {
        child,
        stdin,
        lines,
    })
}

/// Starts the thread that reads the child's stdout and forwards the
/// handshake lines (what follows [`LINE_PREFIX`]) until the end or an error.
fn read_lines(out: ChildStdout, pid: u32) -> io::Result<Receiver<io::Result<String>>> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(format!("child {pid} stdout"))
        .spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = String::new();
            loop {
                line.clear();
                let sent = match r.read_line(&mut line) {
                    Ok(0) => return,
                    // Text before the prefix is libtest's (`test x ... `
                    // without a newline); other lines are not ours.
                    Ok(_) => match line.find(LINE_PREFIX) {
                        Some(at) => tx.send(Ok(line[at + LINE_PREFIX.len()..]
                            .trim_end_matches(['\r', '\n'])
                            .to_string())),
                        None => Ok(()),
                    },
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                if sent.is_err() {
                    // Nobody listens any more; keep draining so the child
                    // never blocks on a full pipe.
                    let _ = io::copy(&mut r, &mut io::sink());
                    return;
                }
            }
        })?;
    Ok(rx)
}

/// A child started by [`spawn_role`]. Dropping it kills and reaps the child
/// if it still runs.
#[derive(Debug)]
pub struct ChildProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Option<Receiver<io::Result<String>>>,
}

impl ChildProcess {
    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The next handshake line the child sent with [`send_line`] (without
    /// the prefix and newline); `None` once the child closed its stdout
    /// (exited). Blocks until a line or the end comes.
    pub fn recv_line(&mut self) -> io::Result<Option<String>> {
        let Some(rx) = self.lines.as_ref() else {
            return Ok(None);
        };
        match rx.recv() {
            Ok(line) => line.map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Like [`Self::recv_line`], but gives up after `timeout` with an error
    /// of kind [`io::ErrorKind::TimedOut`] (a zero timeout only takes a line
    /// that already came).
    pub fn recv_line_timeout(&mut self, timeout: Duration) -> io::Result<Option<String>> {
        let Some(rx) = self.lines.as_ref() else {
            return Ok(None);
        };
        match rx.recv_timeout(timeout) {
            Ok(line) => line.map(Some),
            Err(RecvTimeoutError::Disconnected) => Ok(None),
            Err(RecvTimeoutError::Timeout) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no line from child {} within {timeout:?}", self.id()),
            )),
        }
    }

    /// Sends one line (no newline inside) to the child, which reads it with
    /// [`recv_line`]. Fails once the stdin pipe is closed (by
    /// [`Self::close_stdin`], or by the child exiting).
    pub fn send_line(&mut self, line: &str) -> io::Result<()> {
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                format!("stdin of child {} is closed", self.child.id()),
            ));
        };
        writeln!(stdin, "{line}")?;
        stdin.flush()
    }

    /// Closes the child's stdin: its [`recv_line`] then returns `None`.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// The exit status, if the child has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Closes the child's stdin, then waits for the child to exit. Lines it
    /// sent before stay readable.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        self.close_stdin();
        self.child.wait()
    }

    /// Kills the child (SIGKILL on Unix) and reaps it; the status of its
    /// exit if it had already exited.
    pub fn kill(&mut self) -> io::Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        self.child.kill()?;
        self.child.wait()
    }

    /// Sends signal `sig` (e.g. `libc::SIGSTOP`, `libc::SIGCONT`) to the
    /// child. Fails, sending nothing, once the child has exited (its pid
    /// may belong to another process by then).
    #[cfg(unix)]
    pub fn signal(&mut self, sig: i32) -> io::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            return Err(io::Error::other(format!(
                "child {} already exited ({status})",
                self.child.id()
            )));
        }
        // Not reaped (only `self` reaps it), so the pid is still the child's.
        sys::kill(self.child.id(), sig)
    }
}

/// `kill(2)`.
#[cfg(unix)]
#[allow(unsafe_code)]
mod sys {
    use std::io;

    /// Sends `sig` to process `pid`.
    pub(super) fn kill(pid: u32, sig: i32) -> io::Result<()> {
        let pid = libc::pid_t::try_from(pid)
            .map_err(|_| io::Error::other(format!("pid {pid} out of range")))?;
        // SAFETY: plain kill(2); no memory is passed.
        if unsafe { libc::kill(pid, sig) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
