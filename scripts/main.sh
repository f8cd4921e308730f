#!/usr/bin/env bash
# The main job: demos and benchmarks over the built-in loopback backend
# (`cargo xtask bench`; results in bench-out/, WEFT_BENCH_ARGS replaces the
# default --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo xtask bench
