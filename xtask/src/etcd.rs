//! etcd for the rendezvous tests: they run inside the workspace's test run
//! (`weft-rendezvous`'s `etcd` and `etcd_restart` modules, and the
//! KvCache rendezvous tests) with `WEFT_REQUIRE_ETCD=1`, so a missing `etcd`
//! binary fails the run instead of skipping. Each test starts its own etcd
//! on 127.0.0.1 with free ports and a temporary data directory
//! (`weft_testkit::etcd`); no system etcd service is needed or used.
//! `scripts/setup.sh` installs Debian's `etcd-server`.

use crate::proc::{self, fail, Result};
use std::process::Command;

/// The variable that makes the etcd tests fail instead of skipping.
pub const REQUIRE: (&str, &str) = ("WEFT_REQUIRE_ETCD", "1");

/// Fails when `etcd` is not installed (nor `WEFT_ETCD` set).
pub fn check() -> Result {
    let found = std::env::var_os("WEFT_ETCD").is_some()
        || proc::quietly_succeeds(Command::new("etcd").arg("--version"));
    if !found {
        return fail("etcd not found: install etcd-server (scripts/setup.sh) or set WEFT_ETCD");
    }
    Ok(())
}
