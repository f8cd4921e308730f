#!/usr/bin/env bash
# The main job: demos and benchmarks over the built-in loopback backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --workspace --bins
mkdir -p bench-out
for demo in target/release/weft-demo; do
  [ -x "$demo" ] && "$demo"
done
if [ -x target/release/weft-bench ]; then
  target/release/weft-bench all --backend loopback-null ${WEFT_BENCH_ARGS:---quick} \
    --json bench-out/bench.json --csv bench-out/bench.csv --plot bench-out/bandwidth.svg
fi
