//! CI step of `apps/weft-rl` (its tests already run in `cargo test
//! --workspace`): the CLI end to end — the scale table at the paper's
//! scale, and a real multi-process update over libfabric tcp with a killed
//! trainer (P2P and Rank0 checked bit-exact), and the refusal of numbers
//! out of range. It runs the `weft-rl` binary
//! the workspace's test run built (`target/debug`, the test profile), so
//! nothing is compiled again.

use std::path::Path;
use std::process::Command;

use crate::proc::{self, fail, Result};

/// Runs `weft-rl simulate`, `plan`/`simulate` of Hugging Face configs, the
/// refusals, and `weft-rl run --provider libfabric:tcp --kill`.
pub fn run(root: &Path, env: &[(&str, &str)]) -> Result {
    let bin = root.join("target/debug/weft-rl");
    if !bin.is_file() {
        return fail(format!(
            "{} is missing: it is built by `cargo test --workspace`",
            bin.display()
        ));
    }
    proc::run(
        Command::new(&bin)
            .arg("simulate")
            .current_dir(root)
            .envs(env.iter().copied()),
    )?;
    // Numbers out of range are refused with the option named, not run.
    for (args, names) in [
        (&["simulate", "--nic-gbps", "0"][..], "nic_gbps"),
        (&["simulate", "--nics", "0"][..], "nics"),
        (&["plan", "--unit-mib", "0"][..], "--unit-mib"),
    ] {
        let out = Command::new(&bin)
            .args(args)
            .current_dir(root)
            .output()
            .map_err(|e| crate::proc::Error(format!("running weft-rl {args:?}: {e}")))?;
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !err.contains(names) {
            return fail(format!(
                "weft-rl {args:?} must fail naming {names}: status {}, stderr {err:?}",
                out.status
            ));
        }
    }
    // A model the repo does not build in, from its config.json and a
    // layout file (apps/weft-rl/configs): planned, and simulated.
    let configs = root.join("apps/weft-rl/configs");
    for (cmd, config, layout, name) in [
        (
            "plan",
            "llama-3.1-405b.config.json",
            Some("fsdp64-pp2-to-tp8.layout.json"),
            "llama-3.1-405b",
        ),
        (
            "simulate",
            "tiny-qwen3-moe.config.json",
            Some("tiny.layout.json"),
            "tiny-qwen3-moe",
        ),
    ] {
        let mut c = Command::new(&bin);
        c.arg(cmd).arg("--config").arg(configs.join(config));
        if let Some(l) = layout {
            c.arg("--layout").arg(configs.join(l));
        }
        let out = c
            .current_dir(root)
            .envs(env.iter().copied())
            .output()
            .map_err(|e| {
                crate::proc::Error(format!("running weft-rl {cmd} --config {config}: {e}"))
            })?;
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        if !out.status.success() || !text.contains(name) {
            return fail(format!(
                "weft-rl {cmd} --config {config}: status {}, stderr {:?}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    proc::run(
        Command::new(&bin)
            .args([
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
