//! The Python package (`python/`, distribution `weft-rdma`, import name
//! `weft`): build its wheel, install it into the environment of the
//! interpreter the user runs, and run its pytest suite; lint its own cargo
//! workspace.
//!
//! The interpreter is `$WEFT_PYTHON`, else the active virtualenv's
//! (`$VIRTUAL_ENV`), else `python3` on `PATH` — unless that one is
//! externally managed (PEP 668, as Debian's `/usr/bin/python3`): then a
//! `.venv` at the repository root is created and used (activate it to
//! `import weft`). After `cargo xtask test`, `python -c "import weft"` works
//! in that environment.

use crate::proc::{self, fail, io, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The cargo target dir of the Python workspace: the root workspace's, so
/// the dependencies both compile alike (same versions, features and
/// profile) are compiled once. Artifacts differing in features coexist
/// there; neither build invalidates the other.
const TARGET: &str = "target";

/// Where the built wheel is put (the tests list its files).
const WHEELS: &str = "target/python-wheels";

/// pytest's exit status when it collected no tests.
const NO_TESTS: i32 = 5;

fn python_cmd(py: &Path, root: &Path) -> Command {
    let mut c = Command::new(py);
    c.current_dir(root)
        .env("CARGO_TARGET_DIR", root.join(TARGET))
        .env("RUST_BACKTRACE", "1");
    c
}

/// What `py -c code` prints (trimmed).
fn query(py: &Path, root: &Path, code: &str) -> Result<String> {
    let out = python_cmd(py, root)
        .args(["-c", code])
        .output()
        .map_err(|e| proc::Error(format!("cannot run {}: {e}", py.display())))?;
    if !out.status.success() {
        return fail(format!(
            "{} does not run: {}",
            py.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether `py` refuses pip installs (PEP 668's `EXTERNALLY-MANAGED`
/// marker in its stdlib, and not inside a virtualenv).
fn externally_managed(py: &Path, root: &Path) -> Result<bool> {
    let v = query(
        py,
        root,
        "import os, sys, sysconfig; print(sys.prefix == sys.base_prefix and \
         os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))",
    )?;
    Ok(v == "True")
}

/// The interpreter whose environment gets `weft` (see the module docs).
fn interpreter(root: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("WEFT_PYTHON").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    if let Some(v) = std::env::var_os("VIRTUAL_ENV").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(v).join("bin/python"));
    }
    let py = PathBuf::from("python3");
    if !externally_managed(&py, root)? {
        return Ok(py);
    }
    let venv = root.join(".venv");
    if !venv.join("bin/python").exists() {
        println!("python3 is externally managed: creating {}", venv.display());
        proc::run(python_cmd(&py, root).args(["-m", "venv"]).arg(&venv))?;
    }
    println!("weft is installed into .venv: run `. .venv/bin/activate` to use it");
    Ok(venv.join("bin/python"))
}

/// Builds the wheel from `python/` (release), installs it, runs pytest
/// (GPU tests deselected; `no tests collected` is a failure).
pub fn test(root: &Path) -> Result {
    let py = interpreter(root)?;
    proc::run(python_cmd(&py, root).args([
        "-m",
        "pip",
        "install",
        "-q",
        "-U",
        "maturin>=1.9,<2",
        "pytest",
        "numpy",
    ]))?;
    // The build backend runs `maturin` from the interpreter's scripts folder
    // (not on PATH for a virtualenv that is not activated).
    let scripts = query(
        &py,
        root,
        "import sysconfig; print(sysconfig.get_path('scripts'))",
    )?;
    let path = std::env::join_paths(std::iter::once(PathBuf::from(scripts)).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .map_err(|e| proc::Error(format!("PATH: {e}")))?;
    let wheels = root.join(WHEELS);
    if wheels.exists() {
        std::fs::remove_dir_all(&wheels).map_err(io("emptying", &wheels))?;
    }
    // `pip wheel ./python` + installing that wheel is `pip install
    // ./python`, keeping the wheel so the tests can list its files.
    proc::run(
        python_cmd(&py, root)
            .env("PATH", &path)
            .args([
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-w",
            ])
            .arg(&wheels)
            .arg("./python"),
    )?;
    let wheel = std::fs::read_dir(&wheels)
        .map_err(io("reading", &wheels))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| proc::Error(format!("no wheel in {}", wheels.display())))?;
    proc::run(
        python_cmd(&py, root)
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(&wheel),
    )?;
    let mut pytest = python_cmd(&py, root);
    pytest
        .args([
            "-m",
            "pytest",
            "python/tests",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "not gpu",
        ])
        .env("WEFT_WHEEL", &wheel)
        // The etcd-backed tests must not skip in this run (setup.sh
        // installs etcd-server).
        .env(crate::etcd::REQUIRE.0, crate::etcd::REQUIRE.1);
    match pytest.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) if s.code() == Some(NO_TESTS) => {
            fail("pytest collected no tests from python/tests (broken collection or wrong path)")
        }
        Ok(s) => fail(format!("`{}` failed ({s})", proc::show(&pytest))),
        Err(e) => fail(format!("cannot start `{}`: {e}", proc::show(&pytest))),
    }
}

/// `cargo fmt --check` and clippy (warnings denied) on the Python
/// workspace, which the root workspace's lint does not cover.
pub fn lint(root: &Path) -> Result {
    let manifest = root.join("python/Cargo.toml");
    proc::run(
        proc::cargo()
            .args(["fmt", "--manifest-path"])
            .arg(&manifest)
            .args(["--", "--check"])
            .current_dir(root),
    )?;
    proc::run(
        proc::cargo()
            .args(["clippy", "--manifest-path"])
            .arg(&manifest)
            .args(["--all-targets", "--", "-D", "warnings"])
            .env("CARGO_TARGET_DIR", root.join(TARGET))
            .env("PYO3_BUILD_EXTENSION_MODULE", "1")
            .current_dir(root),
    )
}
