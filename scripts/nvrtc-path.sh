# Sourced by apps/*/run-gpu.sh on the GPU machine: puts NVRTC on the loader
# path (the CUDA toolkit's lib64, or the copy a pip wheel ships) and exports
# LD_LIBRARY_PATH. The same search as `cargo xtask gpu-run` (xtask/src/gpu.rs,
# `gpu_env`).
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
if ! ldconfig -p 2>/dev/null | grep -q libnvrtc.so && ! ls /usr/local/cuda/lib64/libnvrtc.so* >/dev/null 2>&1; then
  f=$(find / -xdev -name 'libnvrtc.so*' -path '*nvidia*' 2>/dev/null | head -n1 || true)
  [ -n "$f" ] && LD_LIBRARY_PATH="$(dirname "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export LD_LIBRARY_PATH
