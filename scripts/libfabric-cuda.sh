#!/bin/bash
# Builds libfabric with CUDA support (FI_HMEM_CUDA, CUDA loaded at run time
# with dlopen) for the GPU machine, whose distro libfabric has none: its shm
# provider then moves GPU memory between processes with CUDA IPC.
#
#   bash scripts/libfabric-cuda.sh SRC [OUT]
#
# SRC: a libfabric source tree (a git checkout or release tarball of
# ofiwg/libfabric, e.g. v1.17.1; this machine needs no network for it).
# OUT: where libfabric.so.1 goes (default gpu-bin/libfabric-cuda, which
# `cargo xtask gpu-build` leaves alone and `gpu-run --prebuilt gpu-bin`
# uses). The CUDA headers come from the CUDA runtime and nvcc wheels (pip
# download, no install); only tcp, rxm and shm are built.
set -euo pipefail
src=$(cd "${1:?usage: $0 LIBFABRIC-SRC [OUT]}" && pwd)
out=$(mkdir -p "${2:-gpu-bin/libfabric-cuda}" && cd "${2:-gpu-bin/libfabric-cuda}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for t in autoconf automake libtoolize make gcc; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install autoconf automake libtool build-essential)"; exit 1; }
done
python3 -m pip download -q --no-deps -d "$work/wheels" nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12
mkdir -p "$work/cuda/include"
python3 - "$work" <<'PY'
import os, sys, zipfile
work = sys.argv[1]
for w in os.listdir(f"{work}/wheels"):
    z = zipfile.ZipFile(f"{work}/wheels/{w}")
    for n in z.namelist():
        if "/include/" in n and not n.endswith("/"):
            rel = n.split("/include/", 1)[1]
            dst = f"{work}/cuda/include/{rel}"
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.exists(dst):
                with open(dst, "wb") as f:
                    f.write(z.read(n))
PY
cp -r "$src" "$work/src"
cd "$work/src"
[ -x configure ] || ./autogen.sh > "$work/autogen.log" 2>&1
no="psm psm2 psm3 sockets verbs efa usnic udp mrail rxd perf hook_debug hook_hmem dmabuf_peer_mem opx net"
./configure --prefix="$work/prefix" --with-cuda="$work/cuda" --enable-cuda-dlopen \
  --enable-shm=yes --enable-tcp=yes --enable-rxm=yes $(for p in $no; do echo "--enable-$p=no"; done) \
  --disable-static > "$work/configure.log" 2>&1 || { tail -20 "$work/configure.log"; exit 1; }
grep -q "define HAVE_CUDA 1" config.h || { echo "configure did not enable CUDA"; exit 1; }
make -j"$(nproc)" > "$work/make.log" 2>&1 || { tail -20 "$work/make.log"; exit 1; }
make install > "$work/install.log" 2>&1
cp -L "$work/prefix/lib/libfabric.so.1" "$out/libfabric.so.1"
strip "$out/libfabric.so.1" 2>/dev/null || true
# libfabric's own ping-pong, the baseline of `weft-bench pingpong --fi-pingpong`.
[ -x "$work/prefix/bin/fi_pingpong" ] && cp "$work/prefix/bin/fi_pingpong" "$out/" && strip "$out/fi_pingpong" 2>/dev/null || true
LD_LIBRARY_PATH="$work/prefix/lib" "$work/prefix/bin/fi_info" --version | tee "$out/VERSION"
ls -la "$out"
