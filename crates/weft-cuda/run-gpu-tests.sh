#!/usr/bin/env bash
# Runs weft-cuda's whole GPU test set (and the watcher latency bench) in one
# call on a machine with an NVIDIA GPU (driver >= 580 / CUDA 13.0, NVRTC).
#
#   crates/weft-cuda/run-gpu-tests.sh [--bench [EVENTS]]
#       cargo is available: build with --features cuda and run everything.
#   crates/weft-cuda/run-gpu-tests.sh --build DIR
#       on a build machine (no GPU or toolkit needed): build the test and
#       bench binaries (release) and copy them into DIR.
#   crates/weft-cuda/run-gpu-tests.sh --prebuilt DIR [--bench [EVENTS]]
#       run binaries from DIR (e.g. on a device machine without cargo).
#
# GPU tests skip themselves without a GPU; this script sets
# WEFT_CUDA_REQUIRE_GPU=1 so that on the GPU machine a missing driver or
# NVRTC fails instead of skipping. Output and the bench's JSON go to
# ${OUT:-./gpu-out}.
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=cargo dir= bench=0 events=100000
while [ $# -gt 0 ]; do
  case "$1" in
    --build) mode=build; dir="$2"; shift 2 ;;
    --prebuilt) mode=prebuilt; dir="$2"; shift 2 ;;
    --bench) bench=1; shift
             if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then events="$1"; shift; fi ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

# Test binaries of weft-cuda and of the crates whose GPU tests live here.
cargo_tests() {
  cargo test --release -p weft-cuda --features cuda "$@"
}

if [ "$mode" = build ]; then
  mkdir -p "$dir"
  rm -f "$dir"/*
  cargo_tests --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except Exception: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m.get("profile",{}).get("test"):
        print(m["executable"])' \
    | while read -r exe; do cp "$exe" "$dir/"; done
  cargo build --release -p weft-cuda --features cuda --examples
  tdir="${CARGO_TARGET_DIR:-target}/release/examples"
  cp "$tdir/watcher_latency" "$dir/"
  strip "$dir"/* 2>/dev/null || true
  ls -la "$dir"
  exit 0
fi

out="${OUT:-./gpu-out}"
mkdir -p "$out"
# NVRTC: the toolkit's lib64 or a pip wheel's copy, whichever exists.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -e "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so' && ! ls /usr/local/cuda/lib64/libnvrtc.so* >/dev/null 2>&1; then
  nv=$(find / -xdev -name 'libnvrtc.so*' -path '*nvidia*' 2>/dev/null | head -1 || true)
  [ -n "$nv" ] && export LD_LIBRARY_PATH="$(dirname "$nv"):${LD_LIBRARY_PATH:-}"
fi
export WEFT_CUDA_REQUIRE_GPU=1 RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

status=0
if [ "$mode" = cargo ]; then
  cargo_tests -- --test-threads=4 2>&1 | tee "$out/gpu-tests.log" || status=1
  bench_bin() { cargo run --release -p weft-cuda --features cuda --example watcher_latency -- "$@"; }
else
  : > "$out/gpu-tests.log"
  for t in "$dir"/*; do
    [ "$(basename "$t")" = watcher_latency ] && continue
    echo "== $(basename "$t")" | tee -a "$out/gpu-tests.log"
    "$t" --test-threads=4 2>&1 | tee -a "$out/gpu-tests.log" || status=1
  done
  bench_bin() { "$dir/watcher_latency" "$@"; }
fi
if grep -q '^SKIP' "$out/gpu-tests.log"; then status=1; fi
echo "GPU tests: $([ $status = 0 ] && echo PASSED || echo FAILED)"

if [ "$bench" = 1 ]; then
  bench_bin "$events" --json "$out/watcher-latency.json" 2>&1 | tee "$out/watcher-latency.txt" || status=1
fi
exit $status
