//! Child processes for cross-process tests: the current test binary,
//! re-executed to run one test in a role.
//!
//! The parent calls [`spawn_role`] naming an *entry test* (a `#[test]` in the
//! same binary) and a role. The child runs only that test, which starts by
//! calling [`role`]: `Some(role)` in a child (it then does the role's work,
//! reports with [`send_line`] and usually ends with `std::process::exit`),
//! `None` when the test harness runs the entry test normally (it should then
//! return at once, or do a self-test).
//!
//! The child's stdout is a pipe to the parent. libtest writes its own lines
//! there too, so [`send_line`] prefixes the handshake lines with
//! [`LINE_PREFIX`] and [`ChildProcess::recv_line`] skips every other line.
//! The child's stderr is inherited, so its panics show in the test output.
//!
//! ```no_run
//! use weft_testkit::child;
//!
//! #[test]
//! fn peer_entry() {
//!     let Some(role) = child::role() else { return };
//!     child::send_line(&format!("ready {role}")).unwrap();
//!     std::process::exit(0);
//! }
//!
//! #[test]
//! fn two_processes() {
//!     let mut c = child::spawn_role("peer_entry", "server", &[]).unwrap();
//!     assert_eq!(c.recv_line().unwrap().as_deref(), Some("ready server"));
//!     assert!(c.wait().unwrap().success());
//! }
//! ```

use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};

/// The environment variable carrying the child's role.
pub const ROLE_ENV: &str = "WEFT_TESTKIT_ROLE";

/// The prefix of handshake lines on the child's stdout.
pub const LINE_PREFIX: &str = "weft-testkit> ";

/// The role of this process: `Some` in a child started by [`spawn_role`].
pub fn role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// Child side: sends one handshake line (no newline inside) to the parent.
pub fn send_line(line: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    writeln!(out, "{LINE_PREFIX}{line}")?;
    out.flush()
}

/// Re-executes the current test binary to run only `entry_test` (its full
/// path in the binary, e.g. `peer_entry` or `module::peer_entry`), with
/// [`ROLE_ENV`] set to `role` and the extra `envs`.
pub fn spawn_role(
    entry_test: &str,
    role: &str,
    envs: &[(&str, &OsStr)],
) -> io::Result<ChildProcess> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args([entry_test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().map(BufReader::new);
    Ok(ChildProcess { child, stdout })
}

/// A child started by [`spawn_role`]. Dropping it kills and reaps the child
/// if it still runs.
#[derive(Debug)]
pub struct ChildProcess {
    child: Child,
    stdout: Option<BufReader<ChildStdout>>,
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
        let Some(r) = self.stdout.as_mut() else {
            return Ok(None);
        };
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                return Ok(None);
            }
            if let Some(l) = line.strip_prefix(LINE_PREFIX) {
                return Ok(Some(l.trim_end_matches(['\r', '\n']).to_string()));
            }
        }
    }

    /// The exit status, if the child has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Waits for the child to exit.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        self.stdout = None;
        self.child.wait()
    }

    /// Kills the child (SIGKILL on Unix) and reaps it.
    pub fn kill(&mut self) -> io::Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        self.child.kill()?;
        self.child.wait()
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
