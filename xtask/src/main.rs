//! `cargo run -p xtask -- <task>`: project automation.
#![forbid(unsafe_code)]

use std::process::{Command, ExitCode};

fn run(cmd: &mut Command) -> bool {
    eprintln!("xtask: running {cmd:?}");
    match cmd.status() {
        Ok(s) => s.success(),
        Err(e) => {
            eprintln!("xtask: cannot start {cmd:?}: {e}");
            false
        }
    }
}

fn main() -> ExitCode {
    let task = std::env::args().nth(1).unwrap_or_default();
    let ok = match task.as_str() {
        "ci" => {
            run(Command::new("cargo").args(["fmt", "--all", "--", "--check"]))
                && run(Command::new("cargo").args([
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--",
                    "-D",
                    "warnings",
                ]))
                && run(Command::new("cargo").args(["test", "--workspace"]))
        }
        _ => {
            eprintln!("usage: cargo run -p xtask -- ci");
            false
        }
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
