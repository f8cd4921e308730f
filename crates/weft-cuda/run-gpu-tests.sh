#!/usr/bin/env bash
# Runs weft-cuda's whole GPU test set (and the watcher latency bench) in one
# call on a machine with an NVIDIA GPU (driver >= 580 / CUDA 13.0, NVRTC).
# A wrapper over `cargo xtask gpu-build` / `gpu-run` (xtask/src/gpu.rs).
#
#   crates/weft-cuda/run-gpu-tests.sh [--bench [EVENTS]]
#       cargo is available: build with --features cuda and run everything.
#   crates/weft-cuda/run-gpu-tests.sh --build DIR
#       on a build machine (no GPU or toolkit needed): build the test and
#       bench binaries (release) and copy them, with the xtask binary that
#       runs them, into DIR.
#   crates/weft-cuda/run-gpu-tests.sh --prebuilt DIR [--bench [EVENTS]]
#       run binaries from DIR (e.g. on a device machine without cargo).
#
# GPU tests skip themselves without a GPU; the run sets
# WEFT_CUDA_REQUIRE_GPU=1 so that on the GPU machine a missing driver or
# NVRTC fails instead of skipping. Output and the bench's JSON go to
# ${OUT:-./gpu-out}.
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=cargo dir= bench=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) mode=build; dir="$2"; shift 2 ;;
    --prebuilt) mode=prebuilt; dir="$2"; shift 2 ;;
    --bench) bench=(--bench); shift
             if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then bench=(--bench "$1"); shift; fi ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

case "$mode" in
  build) exec cargo xtask gpu-build "$dir" ;;
  prebuilt) exec "$dir/xtask" gpu-run --prebuilt "$dir" "${bench[@]}" ;;
  *) exec cargo xtask gpu-run "${bench[@]}" ;;
esac
