//! CI step of `apps/weft-rl` (its tests already run in `cargo test
//! --workspace`): the CLI end to end — the scale table at the paper's
//! scale, and a real multi-process update over libfabric tcp with a killed
//! trainer (P2P and Rank0 checked bit-exact).

use std::path::Path;

use crate::proc::{self, Result};

/// Runs `weft-rl simulate` and `weft-rl run --provider libfabric:tcp --kill`.
pub fn run(root: &Path, env: &[(&str, &str)]) -> Result {
    proc::run(
        proc::cargo()
            .args(["run", "--release", "-p", "weft-rl", "--", "simulate"])
            .current_dir(root)
            .envs(env.iter().copied()),
    )?;
    proc::run(
        proc::cargo()
            .args([
                "run",
                "--release",
                "-p",
                "weft-rl",
                "--",
                "run",
                "--provider",
                "libfabric:tcp",
                "--steps",
                "2",
                "--kill",
            ])
            .current_dir(root)
            .envs(env.iter().copied()),
    )
}
