//! weft-cuda's whole GPU test set (and the watcher latency bench) on a
//! machine with an NVIDIA GPU (driver >= 580 / CUDA 13.0, NVRTC).
//!
//! - `gpu-build [DIR]` (build machine, no GPU or toolkit needed): builds the
//!   test binaries and the `watcher_latency` example with `--features cuda`
//!   in release, and copies them, stripped, with this `xtask` binary into
//!   DIR (default `gpu-bin/`, git-ignored).
//! - `gpu-run --prebuilt DIR` (device machine, no cargo): runs them, as
//!   `DIR/xtask gpu-run --prebuilt DIR`.
//! - `gpu-run` (cargo on the GPU machine): builds and runs everything.
//!
//! GPU tests skip themselves without a GPU; the run sets
//! `WEFT_CUDA_REQUIRE_GPU=1` so that on the GPU machine a missing driver or
//! NVRTC fails instead of skipping (and a `SKIP` line fails the run).
//! Output and the bench's JSON go to `$OUT` (default `./gpu-out`).

use crate::proc::{self, fail, io, Error, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The bench example copied next to the test binaries.
const BENCH: &str = "watcher_latency";
/// The cross-process copy bandwidth example, copied and run with the bench.
const IPC_BENCH: &str = "ipc_bandwidth";
/// The engine-over-CUDA-shm bandwidth example, copied (run by hand with a
/// CUDA-enabled libfabric: `WEFT_LIBFABRIC_PATH`).
const SHM_BENCH: &str = "shm_hmem_bandwidth";
/// The same-host backend's bandwidth and latency examples, copied and run
/// with the bench (the latency one also over the CUDA shm when carried).
const NVLINK_BENCHES: [&str; 2] = ["nvlink_bandwidth", "nvlink_latency"];

/// `cargo <sub> --release -p weft-cuda --features cuda`.
fn cargo_cuda(sub: &str) -> Command {
    let mut c = proc::cargo();
    c.args([sub, "--release", "-p", "weft-cuda", "--features", "cuda"]);
    c
}

/// `cargo <sub> --release -p weft --features cuda`: the facade's GPU
/// examples (the cross-process benches).
fn cargo_facade_cuda(sub: &str) -> Command {
    let mut c = proc::cargo();
    c.args([sub, "--release", "-p", "weft", "--features", "cuda"]);
    c
}

/// Builds the GPU test and bench binaries into `dir`.
pub fn build(root: &Path, dir: &Path) -> Result {
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    for e in std::fs::read_dir(dir)
        .map_err(io("reading", dir))?
        .flatten()
    {
        if e.path().is_file() {
            std::fs::remove_file(e.path()).map_err(io("removing", &e.path()))?;
        }
    }
    let mut tests = cargo_cuda("test");
    tests.arg("--no-run").current_dir(root);
    let mut exes = proc::executables(&mut tests, true)?;
    let mut examples = cargo_cuda("build");
    examples.arg("--examples").current_dir(root);
    let mut facade = cargo_facade_cuda("build");
    facade.arg("--examples").current_dir(root);
    let mut built = proc::executables(&mut examples, false)?;
    built.extend(proc::executables(&mut facade, false)?);
    exes.extend(built.into_iter().filter(|p| {
        p.file_name().is_some_and(|n| {
            n == BENCH || n == IPC_BENCH || n == SHM_BENCH || NVLINK_BENCHES.iter().any(|b| n == *b)
        })
    }));
    if !exes
        .iter()
        .any(|p| p.file_name().is_some_and(|n| n == BENCH))
    {
        return fail(format!("gpu-build: no {BENCH} example built"));
    }
    // This binary runs them on the device machine (`xtask gpu-run`).
    let me = std::env::current_exe().map_err(|e| Error(format!("locating xtask: {e}")))?;
    let mut copied = Vec::new();
    for exe in exes.iter().chain([&me]) {
        let name = if *exe == me {
            "xtask".into()
        } else {
            exe.file_name().unwrap_or_default().to_owned()
        };
        let to = dir.join(name);
        std::fs::copy(exe, &to).map_err(io("copying to", &to))?;
        copied.push(to);
    }
    // Best effort, as before: an unstripped binary still runs.
    let _ = Command::new("strip").args(&copied).status();
    for p in &copied {
        let size = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        println!("{size:>12}  {}", p.display());
    }
    Ok(())
}

/// What `gpu-run` runs.
#[derive(Debug, Clone)]
pub struct RunArgs {
    /// Binaries from `gpu-build`; `None`: build and run with cargo.
    pub prebuilt: Option<PathBuf>,
    /// Also run the watcher latency bench with this many events.
    pub bench: Option<u64>,
}

/// The environment of the GPU runs: NVRTC on the loader path (the toolkit's
/// lib64 or a pip wheel's copy, whichever exists), GPUs required, backtraces.
fn gpu_env() -> Vec<(String, String)> {
    let mut ld = std::env::var("LD_LIBRARY_PATH")
        .ok()
        .filter(|s| !s.is_empty());
    let prepend = |ld: &mut Option<String>, d: &str| {
        *ld = Some(match ld.take() {
            Some(old) => format!("{d}:{old}"),
            None => d.to_string(),
        });
    };
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
    ] {
        if Path::new(d).exists() {
            prepend(&mut ld, d);
        }
    }
    let in_ldconfig = Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("libnvrtc.so"));
    let in_toolkit = std::fs::read_dir("/usr/local/cuda/lib64").is_ok_and(|d| {
        d.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("libnvrtc.so"))
    });
    if !in_ldconfig && !in_toolkit {
        let found = Command::new("find")
            .args(["/", "-xdev", "-name", "libnvrtc.so*", "-path", "*nvidia*"])
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .map(str::to_string)
            });
        if let Some(parent) = found.as_deref().map(Path::new).and_then(Path::parent) {
            prepend(&mut ld, &parent.display().to_string());
        }
    }
    let mut env = Vec::new();
    if let Some(ld) = ld {
        env.push(("LD_LIBRARY_PATH".to_string(), ld));
    }
    env.push(("WEFT_CUDA_REQUIRE_GPU".into(), "1".into()));
    env.push(("RUST_BACKTRACE".into(), "1".into()));
    env
}

/// Runs the GPU tests (and the bench), from the workspace root `root`.
pub fn run(root: &Path, args: &RunArgs) -> Result {
    let out = std::env::var_os("OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("./gpu-out"));
    std::fs::create_dir_all(&out).map_err(io("creating", &out))?;
    let env = gpu_env();
    let _ = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader",
        ])
        .envs(env.clone())
        .status();

    // A CUDA-enabled libfabric (scripts/libfabric-cuda.sh) next to the
    // binaries: the tests load it and must register CUDA memory on shm.
    let lf_dir = args
        .prebuilt
        .clone()
        .unwrap_or_else(|| root.join("gpu-bin"))
        .join("libfabric-cuda");
    let lf_cuda = lf_dir.join("libfabric.so.1");
    let lf_env: Vec<(String, String)> = if lf_cuda.is_file() {
        let abs = std::fs::canonicalize(&lf_cuda).map_err(io("resolving", &lf_cuda))?;
        vec![
            ("WEFT_LIBFABRIC_PATH".into(), abs.display().to_string()),
            ("WEFT_REQUIRE_CUDA_LIBFABRIC".into(), "1".into()),
        ]
    } else {
        println!(
            "no {}: the GPU-to-GPU libfabric tests will skip (and fail the run); build it with \
             scripts/libfabric-cuda.sh",
            lf_cuda.display()
        );
        Vec::new()
    };
    let log_path = out.join("gpu-tests.log");
    let mut log = File::create(&log_path).map_err(io("creating", &log_path))?;
    let mut ok = true;
    match &args.prebuilt {
        None => {
            let mut c = cargo_cuda("test");
            // One test at a time: see crates/weft-cuda/tests/cuda/main.rs.
            c.args(["--", "--test-threads=1"])
                .current_dir(root)
                .envs(env.clone())
                .envs(lf_env.clone());
            ok &= proc::run_tee(&mut c, &mut log)?;
        }
        Some(dir) => {
            let mut bins: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(io("reading", dir))?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .filter(|p| {
                    p.file_name().is_some_and(|n| {
                        ![BENCH, IPC_BENCH, SHM_BENCH, "xtask"].contains(&n.to_str().unwrap_or(""))
                    })
                })
                .collect();
            bins.sort();
            for t in bins {
                let name = t.file_name().unwrap_or_default().to_string_lossy();
                proc::tee_line(&format!("== {name}"), &mut log)?;
                let mut c = Command::new(&t);
                c.arg("--test-threads=1")
                    .envs(env.clone())
                    .envs(lf_env.clone());
                ok &= proc::run_tee(&mut c, &mut log)?;
                if !lf_env.is_empty() && name.starts_with("cuda-") {
                    // The distro libfabric's typed refusal, without the CUDA build.
                    proc::tee_line(
                        &format!("== {name} gpu_libfabric (system libfabric)"),
                        &mut log,
                    )?;
                    let mut c = Command::new(&t);
                    c.args(["gpu_libfabric", "--test-threads=1"])
                        .envs(env.clone());
                    ok &= proc::run_tee(&mut c, &mut log)?;
                }
            }
        }
    }
    drop(log);
    let text = std::fs::read_to_string(&log_path).map_err(io("reading", &log_path))?;
    if text.lines().any(|l| l.starts_with("SKIP")) {
        ok = false;
    }
    println!("GPU tests: {}", if ok { "PASSED" } else { "FAILED" });

    if let Some(events) = args.bench {
        let mut c = match &args.prebuilt {
            None => {
                let mut c = cargo_cuda("run");
                c.args(["--example", BENCH, "--"]).current_dir(root);
                c
            }
            Some(dir) => Command::new(dir.join(BENCH)),
        };
        c.arg(events.to_string())
            .arg("--json")
            .arg(out.join("watcher-latency.json"))
            .envs(env);
        let txt = out.join("watcher-latency.txt");
        let mut txt_log = File::create(&txt).map_err(io("creating", &txt))?;
        ok &= proc::run_tee(&mut c, &mut txt_log)?;
        // Device-to-device copies into another process's memory against the
        // same copies in this process, for both kinds of shared memory.
        let txt = out.join("ipc-bandwidth.txt");
        let mut txt_log = File::create(&txt).map_err(io("creating", &txt))?;
        for vmm in [false, true] {
            let mut c = match &args.prebuilt {
                None => {
                    let mut c = cargo_facade_cuda("run");
                    c.args(["--example", IPC_BENCH, "--"]).current_dir(root);
                    c
                }
                Some(dir) => Command::new(dir.join(IPC_BENCH)),
            };
            c.args(vmm.then_some("--vmm")).envs(gpu_env());
            ok &= proc::run_tee(&mut c, &mut txt_log)?;
        }
        // Engine WRITEs GPU to GPU across processes over nvlink: bandwidth
        // and small-WRITE latency, each against its raw baseline; latency
        // over the CUDA shm too when it is carried.
        for (bench, shm) in [
            (NVLINK_BENCHES[0], false),
            (NVLINK_BENCHES[1], false),
            (NVLINK_BENCHES[1], true),
        ] {
            if shm && lf_env.is_empty() {
                continue;
            }
            let name = format!(
                "{}{}.txt",
                bench.replace('_', "-"),
                if shm { "-shm" } else { "" }
            );
            let txt = out.join(name);
            let mut txt_log = File::create(&txt).map_err(io("creating", &txt))?;
            let mut c = match &args.prebuilt {
                None => {
                    let mut c = cargo_facade_cuda("run");
                    c.args(["--example", bench, "--"]).current_dir(root);
                    c
                }
                Some(dir) => Command::new(dir.join(bench)),
            };
            c.args(["--reps", "5"])
                .args(shm.then_some("--shm"))
                .envs(gpu_env())
                .envs(lf_env.clone());
            ok &= proc::run_tee(&mut c, &mut txt_log)?;
        }
        // Engine WRITEs GPU to GPU across processes over the CUDA shm.
        if !lf_env.is_empty() {
            let txt = out.join("shm-hmem-bandwidth.txt");
            let mut txt_log = File::create(&txt).map_err(io("creating", &txt))?;
            // Staged through host memory, then with CUDA IPC.
            for ipc in [false, true] {
                let mut c = match &args.prebuilt {
                    None => {
                        let mut c = cargo_facade_cuda("run");
                        c.args(["--example", SHM_BENCH, "--"]).current_dir(root);
                        c
                    }
                    Some(dir) => Command::new(dir.join(SHM_BENCH)),
                };
                c.args(ipc.then_some("--ipc"))
                    .args(["--reps", "3"])
                    .envs(gpu_env())
                    .envs(lf_env.clone());
                ok &= proc::run_tee(&mut c, &mut txt_log)?;
            }
        }
    }
    if ok {
        Ok(())
    } else {
        fail("GPU run failed")
    }
}
