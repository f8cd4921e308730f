#!/usr/bin/env bash
# weft-rl's GPU path on a machine with an NVIDIA GPU (driver >= 580 /
# CUDA 13.0, NVRTC; torch with CUDA for the side-by-side reference): the
# bit-exact GPU tests and the quantisation bench against torch.
#
#   apps/weft-rl/run-gpu.sh --build [DIR]
#       build machine (no GPU or toolkit needed): release builds of the test
#       binary `gpu_rl` and the example `gpu_quant_bench`, stripped, into
#       DIR (default gpu-bin/rl, git-ignored) with this script and
#       bench/quant_torch.py.
#   apps/weft-rl/run-gpu.sh --prebuilt [DIR] [--tests-only|--bench-only] [--iters N]
#       device machine: run them. GPU tests are required to run
#       (WEFT_REQUIRE_GPU=1: a missing driver or NVRTC fails, and a SKIP
#       line fails the run). Output goes to ${OUT:-./gpu-out}/rl/.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=$(pwd)

mode= what=all
case "${1:-}" in
  --build) mode=build; shift ;;
  --prebuilt) mode=prebuilt; shift ;;
  *) echo "usage: $0 --build [DIR] | --prebuilt [DIR] [--tests-only|--bench-only] [--iters N]" >&2; exit 2 ;;
esac
dir=gpu-bin/rl
case "${1:-}" in
  ''|--*) ;;
  *) dir="$1"; shift ;;
esac
case "${1:-}" in
  --tests-only) what=tests; shift ;;
  --bench-only) what=bench; shift ;;
esac
iters=20
if [ "${1:-}" = --iters ]; then iters="$2"; shift 2; fi

if [ "$mode" = build ]; then
  export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-1}"
  mkdir -p "$dir"
  rm -f "$dir/gpu_rl" "$dir/gpu_quant_bench"
  exe=$(cargo test --release -p weft-rl --features cuda --test rl --no-run \
          --message-format=json 2>/dev/null |
        grep -o '"executable":"[^"]*"' | grep "/rl-" | tail -n1 | cut -d'"' -f4)
  [ -n "$exe" ] || { echo "gpu_rl test binary not found" >&2; exit 1; }
  cp "$exe" "$dir/gpu_rl"
  cargo build --release -p weft-rl --features cuda --example gpu_quant_bench
  cp target/release/examples/gpu_quant_bench "$dir/gpu_quant_bench"
  cp apps/weft-rl/run-gpu.sh "$dir/run-gpu.sh"
  cp apps/weft-rl/bench/quant_torch.py "$dir/quant_torch.py"
  strip "$dir/gpu_rl" "$dir/gpu_quant_bench" 2>/dev/null || true
  ls -l "$dir"
  du -sh "$dir"
  exit 0
fi

case "$dir" in /*) ;; *) dir="$here/$dir" ;; esac
out="${OUT:-./gpu-out}/rl"
mkdir -p "$out"
# NVRTC on the loader path.
. "$here/scripts/nvrtc-path.sh"
export LD_LIBRARY_PATH WEFT_REQUIRE_GPU=1 WEFT_CUDA_REQUIRE_GPU=1 RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt" || true

rc=0
if [ "$what" != bench ]; then
  "$dir/gpu_rl" gpu_rl:: gpu_xproc:: --test-threads=1 --nocapture 2>&1 | tee "$out/tests.txt" || rc=1
  if grep -q 'SKIP ' "$out/tests.txt"; then echo "a GPU test skipped on the GPU machine" >&2; rc=1; fi
fi
if [ "$what" != tests ]; then
  rm -rf "$out/dump"
  "$dir/gpu_quant_bench" --iters "$iters" --out "$out/ours.tsv" --dump "$out/dump" 2>&1 |
    tee "$out/bench.txt" || rc=1
  if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    python3 "$dir/quant_torch.py" --ours "$out/ours.tsv" --dump "$out/dump" --iters "$iters" \
      --out "$out/side_by_side.tsv" 2>&1 | tee "$out/torch.txt" || rc=1
  else
    echo "torch with CUDA not available: reference not run" | tee "$out/torch.txt"
    rc=1
  fi
  rm -rf "$out/dump"
fi
exit $rc
