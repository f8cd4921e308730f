#!/bin/bash
# The paged case (null) and the proxy scatter (null) on the device machine,
# twice each in one call, then the per-target summary of
# scripts/bench-targets.py. Results go to $OUT/bench.tgz (a call brings back
# at most 8 files, so everything is in one tarball, rewritten after each
# step).
#
# Prepare here (the device has no cargo), in a git-ignored folder:
#   cargo build --release -p weft-bench
#   mkdir -p gpu-bin/bench && cp target/release/weft-bench gpu-bin/bench/ && strip gpu-bin/bench/weft-bench
# and run there with carry ["gpu-bin/bench"]:
#   bash scripts/device-bench.sh gpu-bin/bench
# About 60 s on the 16-core H200 host; every step has its own time limit.
set -uo pipefail
bin=$(cd "${1:?usage: $0 DIR-with-weft-bench}" && pwd)/weft-bench
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-./gpu-out}/bench
mkdir -p "$out"
nproc > "$out/nproc"
lscpu > "$out/lscpu" 2>&1
pack() { (cd "$out/.." && tar czf bench.tgz bench); }
for i in 1 2; do
  timeout 120 "$bin" p2p --cases paged --rounds 3 --backend loopback-null \
    --no-progress --csv "$out/paged$i.csv" > "$out/paged$i.txt" 2>&1
  echo "paged$i rc=$?" >> "$out/log"
  timeout 60 "$bin" proxy --rounds 3 --backend loopback-null \
    --no-progress --csv "$out/proxy$i.csv" > "$out/proxy$i.txt" 2>&1
  echo "proxy$i rc=$?" >> "$out/log"
  python3 "$here/bench-targets.py" "$out/paged$i.csv" "$out/proxy$i.csv" > "$out/targets$i.txt" 2>&1
  echo "targets$i rc=$?" >> "$out/log"
  pack
done
cat "$out/log" "$out"/targets*.txt
