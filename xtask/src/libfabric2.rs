//! `cargo xtask libfabric2`: the in-process libfabric tests (smoke,
//! conformance over tcp and shm, engine over tcp) against libfabric 2.x:
//! Debian 13 (trixie)'s libfabric1 package and the libraries it needs,
//! unpacked under target/libfabric2 and loaded through trixie's own dynamic
//! loader. Nothing is installed system-wide. The cross-process tests are not
//! run here (their peers re-exec the test binary without this loader).
//!
//! The packages come from the Debian archive this machine's apt is already
//! configured with (its mirror, suite `trixie`). Skips (success, with a
//! message) when they cannot be fetched; fails when a test fails or the
//! loaded library is not 2.x.

use crate::apt;
use crate::proc::{self, fail, io, Result};
use std::path::Path;
use std::process::Command;

/// The suite libfabric 2.x comes from.
const SUITE: &str = "trixie";

/// trixie's packages that the tests load (libfabric and its dependencies,
/// down to the C library, since trixie's loader runs them).
const PKGS: [&str; 12] = [
    "libfabric1",
    "libc6",
    "libibverbs1",
    "ibverbs-providers",
    "librdmacm1t64",
    "libpsm2-2",
    "libnl-3-200",
    "libnl-route-3-200",
    "libatomic1",
    "libgcc-s1",
    "libnuma1",
    "libuuid1",
];

/// The in-process test modules of weft-libfabric's test binary run against
/// 2.x (libtest filters: `smoke::` selects the `smoke` module).
const TESTS: [&str; 5] = [
    "smoke::",
    "conformance_tcp::",
    "conformance_shm::",
    "engine_tcp::",
    "engine_shm::",
];

/// Runs the task from the workspace root `root`, with `env` set for the
/// build and the tests.
pub fn run(root: &Path, env: &[(&str, &str)]) -> Result {
    let dir = root.join("target/libfabric2");
    let sysroot = dir.join("root");
    let cache = dir.join("cache");
    for d in [
        dir.join("lists/partial"),
        cache.join("archives/partial"),
        sysroot.clone(),
    ] {
        std::fs::create_dir_all(&d).map_err(io("creating", &d))?;
    }
    if !sysroot.join(".done").exists() && !fetch(&dir, &sysroot)? {
        return Ok(());
    }
    let lib = sysroot.join("usr/lib/x86_64-linux-gnu");
    let loader = lib.join("ld-linux-x86-64.so.2");
    let libpath = format!(
        "{}:{}",
        lib.display(),
        sysroot.join("lib/x86_64-linux-gnu").display()
    );
    let mut debs: Vec<String> = std::fs::read_dir(&cache)
        .map_err(io("reading", &cache))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("libfabric1_") && n.ends_with(".deb"))
        .collect();
    debs.sort();
    println!("libfabric2: {}", debs.join(" "));

    // The workspace's test build (already done by the workspace run: this
    // only lists it); the libfabric crate's test binary is `libfabric-*`.
    let mut build = proc::cargo();
    build.args(["test", "--workspace"]);
    build
        .arg("--no-run")
        .current_dir(root)
        .envs(env.iter().copied());
    let bins: Vec<_> = proc::executables(&mut build, true)?
        .into_iter()
        .filter(|b| {
            b.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.rsplit_once('-'))
                .is_some_and(|(stem, _)| stem == "libfabric")
        })
        .collect();
    if bins.is_empty() {
        return fail("libfabric2: no test binaries built");
    }
    for b in bins {
        let name = b.file_name().unwrap_or_default().to_string_lossy();
        println!("libfabric2: {name} against libfabric 2.x");
        proc::run(
            Command::new(&loader)
                .arg("--library-path")
                .arg(&libpath)
                .arg(&b)
                .args(TESTS)
                .envs(env.iter().copied())
                .env("WEFT_EXPECT_LIBFABRIC_MAJOR", "2"),
        )?;
    }
    Ok(())
}

/// Downloads trixie's packages and unpacks them under `sysroot`; false
/// (after printing why) when they cannot be fetched.
fn fetch(dir: &Path, sysroot: &Path) -> Result<bool> {
    let sources = apt::configured();
    let codename = apt::codename();
    let Some(archive) = apt::debian_archive(&sources, codename.as_deref()) else {
        println!("libfabric2: SKIP: no Debian archive among the configured apt sources");
        return Ok(false);
    };
    let list = dir.join("trixie.sources");
    std::fs::write(&list, apt::sources_file(archive, SUITE)).map_err(io("writing", &list))?;
    let cache = dir.join("cache");
    let apt_get = || {
        let mut c = Command::new("apt-get");
        c.arg("-o")
            .arg(format!("Dir::Etc::SourceList={}", list.display()))
            .args(["-o", "Dir::Etc::SourceParts=/dev/null", "-o"])
            .arg(format!("Dir::State::Lists={}", dir.join("lists").display()))
            .arg("-o")
            .arg(format!("Dir::Cache={}", cache.display()))
            .args(["-o", "APT::Sandbox::User=root", "-qq"]);
        c
    };
    if !proc::quietly_succeeds(apt_get().arg("update")) {
        println!("libfabric2: SKIP: cannot fetch Debian {SUITE} package lists");
        return Ok(false);
    }
    for p in PKGS {
        let mut dl = apt_get();
        dl.arg("download")
            .arg(format!("{p}/{SUITE}"))
            .current_dir(&cache);
        if !proc::quietly_succeeds(&mut dl) {
            println!("libfabric2: SKIP: cannot download {p} from {SUITE}");
            return Ok(false);
        }
    }
    let mut debs: Vec<_> = std::fs::read_dir(&cache)
        .map_err(io("reading", &cache))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .collect();
    debs.sort();
    for d in debs {
        proc::run(Command::new("dpkg").arg("-x").arg(&d).arg(sysroot))?;
    }
    let done = sysroot.join(".done");
    std::fs::write(&done, "").map_err(io("writing", &done))?;
    Ok(true)
}
