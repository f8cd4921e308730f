//! The vLLM connector's tests (`python/tests_vllm`) against the real vLLM
//! package, and the tests that need torch (`python/tests_torch`: the DeepEP
//! shim), in a virtualenv of their own (`target/venv-vllm`, or
//! `$WEFT_VLLM_VENV`): vLLM pinned to the release the connector is written
//! for, pytest, and the weft wheel `python::test` built. vLLM is a large
//! install (about 4.4 GB downloaded, 9.5 GB installed, a few minutes);
//! pip skips it when the pinned version is already there.

use crate::proc::{self, fail, io, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The vLLM release the connector is tested against.
pub const VLLM: &str = "vllm==0.33.0";

/// Where the built wheel is (`python::test` put it there).
const WHEELS: &str = "target/python-wheels";

fn venv(root: &Path) -> PathBuf {
    match std::env::var_os("WEFT_VLLM_VENV").filter(|v| !v.is_empty()) {
        Some(v) => PathBuf::from(v),
        None => root.join("target/venv-vllm"),
    }
}

/// Creates the virtualenv (if needed), installs vLLM, pytest and the
/// wheel, runs the tests; prints how long each part took.
pub fn test(root: &Path) -> Result {
    let t0 = Instant::now();
    let venv = venv(root);
    let py = venv.join("bin/python");
    if !py.exists() {
        proc::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    let pip = |args: &[&str]| {
        let mut c = Command::new(&py);
        c.args(["-m", "pip", "install", "-q", "--no-cache-dir"])
            .args(args)
            .current_dir(root);
        c
    };
    proc::run(&mut pip(&[VLLM, "pytest"]))?;
    let wheels = root.join(WHEELS);
    let wheel = std::fs::read_dir(&wheels)
        .map_err(io("reading", &wheels))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            proc::Error(format!(
                "no wheel in {} (run the Python tests first)",
                wheels.display()
            ))
        })?;
    let wheel = wheel.to_string_lossy().into_owned();
    proc::run(&mut pip(&["--force-reinstall", "--no-deps", &wheel]))?;
    let installed = t0.elapsed();
    let t1 = Instant::now();
    let mut pytest = Command::new(&py);
    pytest
        .args([
            "-m",
            "pytest",
            "python/tests_vllm",
            // The DeepEP shim's tests need torch, which this venv has.
            "python/tests_torch",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
        ])
        .current_dir(root)
        .env_remove("VLLM_TARGET_DEVICE")
        .env("RUST_BACKTRACE", "1");
    let r = match pytest.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => fail(format!("`{}` failed ({s})", proc::show(&pytest))),
        Err(e) => fail(format!("cannot start `{}`: {e}", proc::show(&pytest))),
    };
    println!(
        "vllm tests: install {:.0} s, tests {:.0} s ({})",
        installed.as_secs_f64(),
        t1.elapsed().as_secs_f64(),
        VLLM
    );
    r
}
