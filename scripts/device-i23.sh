#!/bin/bash
# Issue #23's open measurements on the device machine, in one call: the
# paged case (null) and the proxy scatter (null) twice each, then the
# per-target summary. Results go to $OUT/i23.tgz (a call brings back at most
# 8 files, so everything is in one tarball, rewritten after each step).
#
# Prepare here (the device has no cargo), in a git-ignored folder:
#   cargo build --release -p weft-bench
#   mkdir -p gpu-bin/i23 && cp target/release/weft-bench gpu-bin/i23/ && strip gpu-bin/i23/weft-bench
# and run there with carry ["gpu-bin/i23"]:
#   bash scripts/device-i23.sh gpu-bin/i23
# About 60 s on the 16-core H200 host; every step has its own time limit.
set -uo pipefail
bin=$(cd "${1:?usage: $0 DIR-with-weft-bench}" && pwd)/weft-bench
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-./gpu-out}/i23
mkdir -p "$out"
nproc > "$out/nproc"
lscpu > "$out/lscpu" 2>&1
pack() { (cd "$out/.." && tar czf i23.tgz i23); }
for i in 1 2; do
  timeout 120 "$bin" p2p --cases paged --rounds 3 --backend loopback-null \
    --no-progress --csv "$out/paged$i.csv" > "$out/paged$i.txt" 2>&1
  echo "paged$i rc=$?" >> "$out/log"
  timeout 60 "$bin" proxy --rounds 3 --backend loopback-null \
    --no-progress --csv "$out/proxy$i.csv" > "$out/proxy$i.txt" 2>&1
  echo "proxy$i rc=$?" >> "$out/log"
  python3 "$here/i23-targets.py" "$out/paged$i.csv" "$out/proxy$i.csv" > "$out/targets$i.txt" 2>&1
  echo "targets$i rc=$?" >> "$out/log"
  pack
done
cat "$out/log" "$out"/targets*.txt
