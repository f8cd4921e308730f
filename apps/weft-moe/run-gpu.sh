#!/usr/bin/env bash
# weft-moe's GPU path on a machine with an NVIDIA GPU (driver >= 580 /
# CUDA 13.0, NVRTC): the bit-exact tests (ranks as threads of one process
# and as one process per rank) and the DeepSeek-V3 decode benches (in one
# process, and one process per rank).
#
#   apps/weft-moe/run-gpu.sh --build DIR
#       build machine (no GPU or toolkit needed): release builds of the test
#       binary `gpu_moe` and the examples `gpu_bench` and `gpu_procs`,
#       stripped, into DIR
#       with this script and bench/torch_baseline.py (the torch baseline)
#       (use a git-ignored folder such as gpu-bin/moe).
#   apps/weft-moe/run-gpu.sh --prebuilt DIR [--tests-only|--bench-only] [BENCH ARGS...]
#       device machine: run them. GPU tests are required to run
#       (WEFT_CUDA_REQUIRE_GPU=1: a missing driver or NVRTC fails, and a
#       SKIP line fails the run). Output goes to ${OUT:-./gpu-out}/moe/.
set -euo pipefail
cd "$(dirname "$0")/../.."

mode= dir= what=all
case "${1:-}" in
  --build) mode=build; dir="$2"; shift 2 ;;
  --prebuilt) mode=prebuilt; dir="$2"; shift 2 ;;
  *) echo "usage: $0 --build DIR | --prebuilt DIR [--tests-only|--bench-only] [BENCH ARGS]" >&2; exit 2 ;;
esac
case "${1:-}" in
  --tests-only) what=tests; shift ;;
  --bench-only) what=bench; shift ;;
esac

if [ "$mode" = build ]; then
  mkdir -p "$dir"
  rm -f "$dir/gpu_moe" "$dir/gpu_bench" "$dir/gpu_procs"
  exe=$(cargo test --release -p weft-moe --features cuda --test moe --no-run \
          --message-format=json 2>/dev/null |
        grep -o '"executable":"[^"]*"' | grep "/moe-" | tail -n1 | cut -d'"' -f4)
  [ -n "$exe" ] || { echo "gpu_moe test binary not found" >&2; exit 1; }
  cp "$exe" "$dir/gpu_moe"
  cargo build --release -p weft-moe --features cuda --example gpu_bench --example gpu_procs
  cp target/release/examples/gpu_bench target/release/examples/gpu_procs "$dir/"
  cp "$0" "$dir/run-gpu.sh"
  cp apps/weft-moe/bench/torch_baseline.py "$dir/torch_baseline.py"
  strip "$dir/gpu_moe" "$dir/gpu_bench" "$dir/gpu_procs" 2>/dev/null || true
  ls -l "$dir"
  exit 0
fi

out="${OUT:-./gpu-out}/moe"
mkdir -p "$out"
# NVRTC on the loader path.
. scripts/nvrtc-path.sh
export LD_LIBRARY_PATH WEFT_CUDA_REQUIRE_GPU=1 RUST_BACKTRACE=1 CUDA_DEVICE_MAX_CONNECTIONS=32
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt" || true

rc=0
if [ "$what" != bench ]; then
  "$dir/gpu_moe" --test-threads=1 --nocapture 2>&1 | tee "$out/tests.txt" || rc=1
  if grep -q '^SKIP' "$out/tests.txt"; then echo "a GPU test skipped on the GPU machine" >&2; rc=1; fi
fi
if [ "$what" != tests ]; then
  "$dir/gpu_bench" "$@" 2>&1 | tee "$out/bench.txt" || rc=1
  # One process per rank, over nvlink and (with a CUDA-enabled libfabric
  # loaded through WEFT_LIBFABRIC_PATH) libfabric shm with FI_HMEM.
  "$dir/gpu_procs" --iters "${1:-300}" 2>&1 | tee "$out/procs.txt" || rc=1
  if [ -n "${WEFT_LIBFABRIC_PATH:-}" ]; then
    "$dir/gpu_procs" --iters "${1:-300}" --provider libfabric:shm 2>&1 | tee "$out/procs_shm.txt" || rc=1
  fi
  if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    python3 "$dir/torch_baseline.py" "$@" 2>&1 | tee "$out/torch_baseline.txt" || rc=1
  else
    echo "torch with CUDA not available: baseline not run" | tee "$out/torch_baseline.txt"
  fi
fi
exit $rc
