//! The KvCache benchmark step of `cargo xtask bench`: `weft-bench kvcache`
//! (Qwen3-235B-like and DeepSeek-V3 MLA shapes vs raw paged writes) on
//! loopback and libfabric tcp/shm (a backend missing here is reported as
//! unavailable in the table, not failed). `WEFT_BENCH_ARGS` replaces the
//! default `--quick` as for the other benches.

use crate::proc;
use std::path::Path;
use std::process::Command;

/// Runs the step if `weft-bench` was built into `release`.
pub fn bench(root: &Path, release: &Path) -> proc::Result {
    let weft_bench = release.join("weft-bench");
    if !weft_bench.is_file() {
        return Ok(());
    }
    let args = std::env::var("WEFT_BENCH_ARGS")
        .ok()
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| "--quick".into());
    proc::run(
        Command::new(&weft_bench)
            .args([
                "kvcache",
                "--backend",
                "loopback,libfabric:tcp,libfabric:shm",
            ])
            .args(args.split_whitespace())
            .args(["--json", "bench-out/kvcache.json"])
            .args(["--csv", "bench-out/kvcache.csv"])
            .current_dir(root),
    )
}
