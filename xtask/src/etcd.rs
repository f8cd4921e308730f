//! The rendezvous tests that need etcd (`weft-rendezvous`'s `etcd` and
//! `etcd_restart` targets), run with `WEFT_REQUIRE_ETCD=1` so a missing
//! `etcd` binary fails the run instead of skipping. Each test starts its own
//! etcd on 127.0.0.1 with free ports and a temporary data directory
//! (`weft_testkit::etcd`); no system etcd service is needed or used.
//! `scripts/setup.sh` installs Debian's `etcd-server`.

use crate::proc::{self, fail, Result};
use std::path::Path;
use std::process::Command;

/// Runs the etcd-backed rendezvous tests; fails when `etcd` is not installed.
pub fn run(root: &Path, env: &[(&str, &str)]) -> Result {
    let found = std::env::var_os("WEFT_ETCD").is_some()
        || proc::quietly_succeeds(Command::new("etcd").arg("--version"));
    if !found {
        return fail("etcd not found: install etcd-server (scripts/setup.sh) or set WEFT_ETCD");
    }
    proc::run(
        proc::cargo()
            .args([
                "test",
                "-p",
                "weft-rendezvous",
                "--test",
                "rendezvous",
                // The `etcd` and `etcd_restart` modules of the one binary.
                "etcd",
            ])
            .current_dir(root)
            .envs(env.iter().copied())
            .env("WEFT_REQUIRE_ETCD", "1"),
    )
}
