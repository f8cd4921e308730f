"""Python-side cost of weft.moe's MoeRank against the same steps in Rust,
measured in the same run (python/examples/moe_overhead_rs.rs): N ranks on
threads of one process, each with its own engine on the simulated fabric
(``loopback``, ideal profile), each step a dispatch and a combine per rank
after a barrier, each call timed alone. The inputs follow the same rule on
both sides (token t's k-th expert is (7t + 13r + k·E/K) mod E), the shape
defaults to DeepSeek-V3 decode (128 tokens, hidden 7168 as 7392-byte fp8 +
scale rows, top-8 of 256 experts, bf16 outputs, 8 ranks).

Prints, per call, p50 and p99 over every rank's steps for Python and Rust
and their ratio, min / median / max over ``--rounds`` alternating rounds.

Usage (from the repo root, after installing the wheel and
`cargo build --release --example moe_overhead_rs --manifest-path python/Cargo.toml`):
  python python/bench/moe_overhead.py [--ranks 8] [--steps 200] [--rounds 3] [--rust-bin PATH]
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
import weft.moe as moe

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_BIN = os.path.join(HERE, "..", "target", "release", "examples", "moe_overhead_rs")
WARM = 10


def ids_of(r: int, t: int, e: int, k: int) -> np.ndarray:
    tt = np.arange(t)[:, None]
    kk = np.arange(k)[None, :]
    return ((7 * tt + 13 * r + kk * (e // k)) % e).astype(np.int64)


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(round((len(v) - 1) * p)))]


def python_round(n, steps, t, h, tb, e, k):
    backend = weft.provider("loopback")
    engines = [weft.TransferEngine(backend) for _ in range(n)]
    ranks = [moe.MoeRank(engines[r], r, n, e, k, t, tb, h, timeout=60.0) for r in range(n)]
    infos = [r.info() for r in ranks]
    for r in ranks:
        r.connect(infos)
    barrier = threading.Barrier(n)
    times = [([], []) for _ in range(n)]
    errors = []

    def run(r):
        try:
            toks = ((np.arange(t * tb) * 31 + r) % 256).astype(np.uint8).reshape(t, tb)
            ids = ids_of(r, t, e, k)
            w = np.full((t, k), 0.125, np.float32)
            for s in range(steps + WARM):
                barrier.wait()
                t0 = time.perf_counter()
                _rows, offs, _src, _pair, layout = ranks[r].dispatch(toks, ids, w)
                dt = time.perf_counter() - t0
                y = np.zeros((offs[-1], h), np.uint16)
                barrier.wait()
                t0 = time.perf_counter()
                out = ranks[r].combine(y, layout)
                ct = time.perf_counter() - t0
                assert len(out) == t * h * 2
                if s >= WARM:
                    times[r][0].append(dt * 1e6)
                    times[r][1].append(ct * 1e6)
        except Exception as ex:  # noqa: BLE001 - reported below
            errors.append(ex)
            barrier.abort()

    th = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    for r in ranks:
        r.shutdown()
    for e_ in engines:
        e_.shutdown()
    if errors:
        raise errors[0]
    d = [v for a, _ in times for v in a]
    c = [v for _, b in times for v in b]
    return {"moe_dispatch": (pct(d, 0.5), pct(d, 0.99)), "moe_combine": (pct(c, 0.5), pct(c, 0.99))}


def rust_round(binary, n, steps, t, h, tb, e, k):
    r = subprocess.run(
        [binary, *(str(x) for x in (n, steps, t, h, tb, e, k))],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{binary} failed: {r.stderr.strip()}")
    out = {}
    for line in r.stdout.splitlines():
        j = json.loads(line)
        out[j["op"]] = (j["p50_us"], j["p99_us"])
    return out


def mmm(v):
    v = sorted(v)
    return f"{v[0]:.2f} / {v[len(v) // 2]:.2f} / {v[-1]:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--token-bytes", type=int, default=7168 + 56 * 4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--rust-bin", default=DEFAULT_BIN)
    a = ap.parse_args()
    if not os.path.exists(a.rust_bin):
        print(f"no Rust twin at {a.rust_bin}: build it first", file=sys.stderr)
        return 2
    shape = (a.ranks, a.steps, a.tokens, a.hidden, a.token_bytes, a.experts, a.topk)
    py, rs = [], []
    for _ in range(a.rounds):
        rs.append(rust_round(a.rust_bin, *shape))
        py.append(python_round(*shape))
    print(
        f"EP{a.ranks}, T {a.tokens}, hidden {a.hidden} ({a.token_bytes}-byte rows), top-{a.topk} of "
        f"{a.experts}, {a.steps} steps x {a.rounds} rounds, loopback; µs, min / median / max over rounds"
    )
    print("| call | Python p50 | Rust p50 | ratio p50 | Python p99 | Rust p99 |")
    print("|---|---|---|---|---|---|")
    for op in ("moe_dispatch", "moe_combine"):
        p50 = [p[op][0] for p in py]
        r50 = [r[op][0] for r in rs]
        ratio = [p[op][0] / r[op][0] for p, r in zip(py, rs)]
        print(
            f"| {op} | {mmm(p50)} | {mmm(r50)} | {mmm(ratio)} | "
            f"{mmm([p[op][1] for p in py])} | {mmm([r[op][1] for r in rs])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
