#!/bin/bash
# Copies this machine's `perf` with every library it links and the dynamic
# loader into DIR, so it runs on a host without perf (the H200 machine):
#   DIR/lib/ld-linux-x86-64.so.2 --library-path DIR/lib DIR/perf record ...
# Pair it with scripts/perf-roles.py (which aggregates its samples by thread
# role). Usage: scripts/perf-bundle.sh DIR
set -euo pipefail
dir=${1:?usage: $0 DIR}
perf=$(command -v perf) || { echo "perf is not installed here" >&2; exit 1; }
mkdir -p "$dir/lib"
cp -L "$perf" "$dir/perf"
for l in $(ldd "$perf" | grep -o '/[^ ]*'); do
  cp -L "$l" "$dir/lib/"
done
echo "$dir: $(du -sh "$dir" | cut -f1)"
