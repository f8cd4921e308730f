//! `cargo xtask <task>` (alias in `.cargo/config.toml`): the project's
//! automation. The shell scripts under `scripts/` install system packages
//! (`scripts/setup.sh`) and call these tasks.
//!
//! - `ci`: `lint`, then `test` (what `.ci/run` does, after setup).
//! - `lint`: `cargo fmt --check` and clippy with warnings denied.
//! - `test`: every test of the workspace (`bash scripts/test.sh`).
//! - `bench`: demos and benchmarks on the loopback backend
//!   (`bash scripts/main.sh`), results in `bench-out/`.
//! - `libfabric2`: the in-process libfabric tests against libfabric 2.x.
//! - `gpu-build`, `gpu-run`: weft-cuda's GPU tests, built here and run on a
//!   GPU machine (see `gpu.rs`).

#![deny(unsafe_code)]

mod apt;
mod etcd;
mod gpu;
mod kvcache;
mod libfabric2;
mod proc;
mod python;
mod rl;
mod vllm;

use clap::{Parser, Subcommand};
use proc::Result;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

#[derive(Parser, Debug)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "weft's project automation"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand, Debug)]
enum Task {
    /// Formatting and lints, then every test (`lint`, then `test`).
    Ci,
    /// `cargo fmt --check` and `cargo clippy --workspace --all-targets -D warnings`.
    Lint,
    /// Every test: the workspace's tests, the libfabric 2.x run, the loom models.
    Test,
    /// The Python package alone (part of `test`): build the wheel, install it
    /// into the current interpreter's environment, run pytest.
    Python,
    /// The vLLM connector's tests alone (part of `test`; needs the wheel the
    /// Python step built): vLLM installed into target/venv-vllm, pytest.
    Vllm,
    /// Demos and benchmarks over the built-in loopback backend (release build);
    /// results in bench-out/. `WEFT_BENCH_ARGS` replaces the default `--quick`.
    Bench,
    /// The in-process libfabric tests against libfabric 2.x (Debian trixie's,
    /// fetched from this machine's configured Debian mirror; skipped when it
    /// cannot be fetched).
    Libfabric2,
    /// Build weft-cuda's GPU test binaries and the watcher latency bench
    /// (release, `--features cuda`, stripped) into DIR for a GPU machine
    /// without cargo, with this xtask binary to run them.
    GpuBuild {
        /// Output folder (emptied first).
        #[arg(default_value = "gpu-bin")]
        dir: PathBuf,
    },
    /// Run weft-cuda's GPU tests (GPU required; output in $OUT or ./gpu-out).
    GpuRun {
        /// Run the binaries `gpu-build` put in DIR instead of building with cargo.
        #[arg(long, value_name = "DIR")]
        prebuilt: Option<PathBuf>,
        /// Also run the watcher latency bench (EVENTS events, default 100000).
        #[arg(long, value_name = "EVENTS", num_args = 0..=1, default_missing_value = "100000")]
        bench: Option<u64>,
    },
}

/// The workspace root (xtask's parent folder, or the current folder where
/// this binary runs away from its source tree, e.g. on a device machine).
fn root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).parent();
    match built {
        Some(r) if r.join("Cargo.toml").exists() => r.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn lint(root: &Path) -> Result {
    proc::run(
        proc::cargo()
            .args(["fmt", "--all", "--", "--check"])
            .current_dir(root),
    )?;
    proc::run(
        proc::cargo()
            .args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ])
            .current_dir(root),
    )?;
    python::lint(root)
}

/// The test harness arguments of a full run: every test, the slow ones
/// included, except known provider failures and manual probes.
pub const ALL_TESTS: [&str; 5] = [
    "--include-ignored",
    "--skip",
    "known_failures::",
    "--skip",
    "manual::",
];

fn test(root: &Path) -> Result {
    // Every step runs with backtraces on.
    let env = [("RUST_BACKTRACE", "1")];
    // The etcd-backed tests run in the workspace run below and must not
    // skip.
    etcd::check()?;
    // Unit, integration, property and conformance tests of every crate
    // (loopback conformance runs 50+ seeds; libfabric runs over tcp and
    // shm; rendezvous on a real etcd). One invocation for the whole
    // workspace: every later step reuses what it built (`-p` would unify
    // features differently and rebuild).
    // Slow cross-process and soak tests are `#[ignore = "slow: ..."]`, so a
    // plain `cargo test` stays quick; CI runs them too. Cases a provider
    // cannot satisfy (`known_failures::`) and probes run by hand
    // (`manual::`) stay out. Doc tests run on their own: their `ignore`
    // blocks are illustrations, not tests to include.
    proc::run(
        proc::cargo()
            .args([
                "test",
                "--workspace",
                "--lib",
                "--bins",
                "--tests",
                "--examples",
                "--",
            ])
            .args(ALL_TESTS)
            .current_dir(root)
            .envs(env)
            .env(etcd::REQUIRE.0, etcd::REQUIRE.1),
    )?;
    proc::run(
        proc::cargo()
            .args(["test", "--workspace", "--doc"])
            .current_dir(root)
            .envs(env),
    )?;
    // The in-process libfabric tests again, against libfabric 2.x (Debian
    // 13's package, unpacked under target/; skipped when it cannot be
    // fetched).
    libfabric2::run(root, &env)?;
    // The Python package: wheel built, installed, pytest (python.rs).
    python::test(root)?;
    // The vLLM connector against the real vLLM package (its own venv).
    vllm::test(root)?;
    rl::run(root, &env)?;
    // Model-checked lock-free parts (the ImmCounter and the shutdown gate,
    // with loom: every `loom_model` module of the engine), in their
    // own target dir so the cfg(loom) build does not invalidate the normal
    // one.
    proc::run(
        proc::cargo()
            .args([
                "test",
                "-p",
                "weft-engine",
                "--lib",
                "--release",
                "loom_model",
            ])
            .current_dir(root)
            .envs(env)
            .env("RUSTFLAGS", "--cfg loom")
            .env("CARGO_TARGET_DIR", "target/loom"),
    )
}

fn bench(root: &Path) -> Result {
    proc::run(
        proc::cargo()
            .args(["build", "--release", "--workspace", "--bins"])
            .current_dir(root),
    )?;
    let out = root.join("bench-out");
    std::fs::create_dir_all(&out).map_err(proc::io("creating", &out))?;
    let release = root.join("target/release");
    let demo = release.join("weft-demo");
    if demo.is_file() {
        proc::run(Command::new(&demo).current_dir(root))?;
    }
    let weft_bench = release.join("weft-bench");
    if weft_bench.is_file() {
        let args = std::env::var("WEFT_BENCH_ARGS")
            .ok()
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| "--quick".into());
        proc::run(
            Command::new(&weft_bench)
                .args(["all", "--backend", "loopback-null"])
                .args(args.split_whitespace())
                .args(["--json", "bench-out/bench.json"])
                .args(["--csv", "bench-out/bench.csv"])
                .args(["--plot", "bench-out/bandwidth.svg"])
                .current_dir(root),
        )?;
    }
    kvcache::bench(root, &release)?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let root = root();
    let res = match cli.task {
        Task::Ci => lint(&root).and_then(|()| test(&root)),
        Task::Lint => lint(&root),
        Task::Test => test(&root),
        Task::Bench => bench(&root),
        Task::Python => python::test(&root),
        Task::Vllm => vllm::test(&root),
        Task::Libfabric2 => libfabric2::run(&root, &[]),
        Task::GpuBuild { dir } => gpu::build(&root, &dir),
        Task::GpuRun { prebuilt, bench } => gpu::run(&root, &gpu::RunArgs { prebuilt, bench }),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
