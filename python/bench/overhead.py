"""Python-side overhead of weft's binding, next to the same operations in
Rust measured in the same run (python/examples/overhead_rs.rs on the same
kind of engine: loopback-null, 1 NIC, 64-byte writes).

Rows:
  submit_single_write        the submit call alone (batches of 1000, drained between)
  submit_to_callback         submit → first line of the completion callback, one in flight
  watcher_store_to_callback  host store into a UVM watcher word → callback entry
  watcher_gpu_to_callback    (--gpu) torch CUDA kernel bumping a pinned word → callback
                             entry, t0 taken before the launch (includes launch cost)

Usage (from the repo root, after `pip install ./python` and
`cargo build --release --example overhead_rs --manifest-path python/Cargo.toml`):
  python python/bench/overhead.py [--iters N] [--rust-bin PATH] [--gpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

import weft

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUST_BIN = os.path.join(ROOT, "target", "python", "release", "examples", "overhead_rs")


def summary(op: str, us: list, lang: str = "python") -> dict:
    a = np.asarray(us)
    return {
        "op": op,
        "lang": lang,
        "n": len(us),
        "p50_us": round(float(np.percentile(a, 50)), 3),
        "p99_us": round(float(np.percentile(a, 99)), 3),
        "p999_us": round(float(np.percentile(a, 99.9)), 3),
    }


def bench_submit(a, s, desc, iters: int) -> list:
    out = []
    now = time.perf_counter_ns
    while len(out) < iters:
        ts = []
        for _ in range(min(1000, iters - len(out))):
            t0 = now()
            t = a.submit_single_write(64, s, desc)
            out.append((now() - t0) / 1e3)
            ts.append(t)
        for t in ts:
            t.wait(timeout=10)
    return out


def bench_callback(a, s, desc, iters: int) -> list:
    now = time.perf_counter_ns
    stamp = [0]
    ev = threading.Event()

    def cb(_t):
        stamp[0] = now()
        ev.set()

    out = []
    for _ in range(iters):
        ev.clear()
        t0 = now()
        a.submit_single_write(64, s, desc, callback=cb)
        if not ev.wait(10):
            raise RuntimeError("callback never ran")
        out.append((stamp[0] - t0) / 1e3)
    return out


def bench_watcher(a, iters: int) -> list:
    now = time.perf_counter_ns
    stamp = [0]
    ev = threading.Event()

    def cb(_old, _new):
        stamp[0] = now()
        ev.set()

    w = a.alloc_uvm_watcher(cb)
    out = []
    for i in range(1, iters + 1):
        ev.clear()
        t0 = now()
        w.store(i)
        if not ev.wait(10):
            raise RuntimeError("watcher callback never ran")
        out.append((stamp[0] - t0) / 1e3)
    w.close()
    return out


def bench_watcher_gpu(a, iters: int) -> list:
    import torch

    now = time.perf_counter_ns
    stamp = [0]
    ev = threading.Event()

    def cb(_old, _new):
        stamp[0] = now()
        ev.set()

    word = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    w = a.alloc_uvm_watcher(cb, word=word)
    g = torch.as_tensor(w, device="cuda")
    g.add_(0)
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        ev.clear()
        t0 = now()
        g.add_(1)
        if not ev.wait(10):
            raise RuntimeError("watcher callback never ran")
        out.append((stamp[0] - t0) / 1e3)
    torch.cuda.synchronize()
    w.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rust-bin", default=RUST_BIN)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()

    rows = []
    if os.path.exists(args.rust_bin):
        r = subprocess.run([args.rust_bin, str(args.iters)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        rows += [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    else:
        print(f"note: no Rust twin at {args.rust_bin}: Python rows only", file=sys.stderr)

    backend = weft.provider("loopback-null")
    with weft.TransferEngine(backend) as a, weft.TransferEngine(backend) as b:
        src, dst = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        s, d = a.reg_mr(src), b.reg_mr(dst)
        desc = d.desc
        rows.append(summary("submit_single_write", bench_submit(a, s, desc, args.iters)))
        rows.append(summary("submit_to_callback", bench_callback(a, s, desc, args.iters)))
        rows.append(summary("watcher_store_to_callback", bench_watcher(a, args.iters)))
        if args.gpu:
            rows.append(summary("watcher_gpu_to_callback", bench_watcher_gpu(a, min(args.iters, 20000))))

    print(f"{'operation':28} {'lang':7} {'n':>7} {'p50 us':>9} {'p99 us':>9} {'p99.9 us':>9}")
    for op in dict.fromkeys(r["op"] for r in rows):
        for r in (x for x in rows if x["op"] == op):
            print(f"{op:28} {r['lang']:7} {r['n']:>7} {r['p50_us']:>9.3f} {r['p99_us']:>9.3f} {r['p999_us']:>9.3f}")
        py = next((x for x in rows if x["op"] == op and x["lang"] == "python"), None)
        rs = next((x for x in rows if x["op"] == op and x["lang"] == "rust"), None)
        if py and rs:
            print(f"{'':28} {'added':7} {'':>7} {py['p50_us'] - rs['p50_us']:>9.3f} {py['p99_us'] - rs['p99_us']:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
