//! Re-executing the running test binary as a child process that runs one
//! named `#[test]` (the child's entry point), and signalling it.

use std::process::{Child, Command, Stdio};

/// How to start a child: the entry test to run, its environment, and
/// whether its stdin/stdout are pipes (else `/dev/null`). stderr is
/// inherited so the child's diagnostics reach the test log.
#[derive(Debug, Clone, Default)]
pub struct SpawnSpec {
    /// Name of the `#[test]` the child runs (`--exact`).
    pub entry: String,
    /// Environment variables telling the child its role.
    pub env: Vec<(String, String)>,
    /// Pipe stdin and stdout (for line protocols).
    pub piped: bool,
}

/// Starts this test binary again, running only `spec.entry`.
pub fn spawn_self(spec: &SpawnSpec) -> std::io::Result<Child> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args([
        spec.entry.as_str(),
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ]);
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    let io = || {
        if spec.piped {
            Stdio::piped()
        } else {
            Stdio::null()
        }
    };
    cmd.stdin(io()).stdout(io()).stderr(Stdio::inherit());
    cmd.spawn()
}

/// Sends `sig` to process `pid` (a child not yet reaped).
pub fn signal(pid: u32, sig: i32) -> std::io::Result<()> {
    let pid = i32::try_from(pid).map_err(|_| std::io::Error::other("pid out of range"))?;
    // SAFETY: plain kill(2); no memory is passed.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
