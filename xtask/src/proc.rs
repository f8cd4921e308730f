//! Running commands: checking their status, collecting the executables
//! cargo builds (from its JSON messages) and copying a command's output to
//! the terminal and a log at once.

use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Why a task failed (what `xtask` prints before exiting non-zero).
#[derive(Debug)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// The result of a task or a step of one.
pub type Result<T = ()> = std::result::Result<T, Error>;

/// `Err(Error)` from anything printable.
pub fn fail<T>(msg: impl fmt::Display) -> Result<T> {
    Err(Error(msg.to_string()))
}

/// Maps an I/O error on `path` to an [`Error`] saying `what` failed.
pub fn io<'a>(what: &str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    let what = what.to_string();
    move |e| Error(format!("{what} {}: {e}", path.display()))
}

/// A `cargo` command: the cargo that runs `cargo xtask` (`$CARGO`), or the
/// one on `PATH`.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// `program arg...` for messages.
pub fn show(cmd: &Command) -> String {
    let prog = Command::get_program(cmd).to_string_lossy();
    let prog = prog.rsplit('/').next().unwrap_or_default().to_string();
    std::iter::once(prog)
        .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` (output to the terminal) and fails unless it succeeds.
pub fn run(cmd: &mut Command) -> Result {
    match cmd.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => fail(format!("`{}` failed ({s})", show(cmd))),
        Err(e) => fail(format!("cannot start `{}`: {e}", show(cmd))),
    }
}

/// Runs `cmd` with its output discarded; whether it succeeded.
pub fn quietly_succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs a cargo build command (`build`, `test --no-run`) with
/// `--message-format=json` and returns the executables it produced, in
/// build order; with `tests_only`, only test harness binaries.
pub fn executables(cmd: &mut Command, tests_only: bool) -> Result<Vec<PathBuf>> {
    cmd.arg("--message-format=json").stdout(Stdio::piped());
    let out = cmd
        .output()
        .map_err(|e| Error(format!("cannot start `{}`: {e}", show(cmd))))?;
    if !out.status.success() {
        return fail(format!("`{}` failed ({})", show(cmd), out.status));
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(m) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if m["reason"] != "compiler-artifact" {
            continue;
        }
        if tests_only && m["profile"]["test"] != true {
            continue;
        }
        if let Some(exe) = m["executable"].as_str() {
            exes.push(PathBuf::from(exe));
        }
    }
    Ok(exes)
}

/// Runs `cmd` with stdout and stderr merged (`2>&1`) and copied to this
/// process's stdout and to `log` (`| tee -a log`); whether it succeeded.
pub fn run_tee(cmd: &mut Command, log: &mut File) -> Result<bool> {
    let (mut reader, writer) =
        std::io::pipe().map_err(|e| Error(format!("cannot create a pipe: {e}")))?;
    let writer2 = writer
        .try_clone()
        .map_err(|e| Error(format!("cannot duplicate a pipe: {e}")))?;
    cmd.stdout(writer).stderr(writer2);
    let mut child = cmd
        .spawn()
        .map_err(|e| Error(format!("cannot start `{}`: {e}", show(cmd))))?;
    // Close our copies of the write end, or the read below never ends.
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    copy_tee(&mut reader, log)?;
    let status = child
        .wait()
        .map_err(|e| Error(format!("waiting for `{}`: {e}", show(cmd))))?;
    Ok(status.success())
}

fn copy_tee(from: &mut impl Read, log: &mut File) -> Result {
    let mut buf = [0u8; 8192];
    let mut stdout = std::io::stdout();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return fail(format!("reading command output: {e}")),
        };
        let _ = stdout.write_all(&buf[..n]);
        let _ = stdout.flush();
        log.write_all(&buf[..n])
            .map_err(|e| Error(format!("writing the log: {e}")))?;
    }
}

/// Writes `line` (plus a newline) to stdout and to `log` (`echo | tee -a`).
pub fn tee_line(line: &str, log: &mut File) -> Result {
    println!("{line}");
    writeln!(log, "{line}").map_err(|e| Error(format!("writing the log: {e}")))
}
