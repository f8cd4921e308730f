#!/usr/bin/env python3
"""Baseline for weft-moe's GPU kernels: a straightforward torch dispatch and
combine of the same DeepSeek-V3 decode shape on the same GPU (one process,
all EP ranks' data on one GPU, so no network): 7392-byte tokens (7168 fp8 +
56 f32 scales), top-8 of 256 experts, 128 tokens per rank, bf16 outputs of
7168, EP8 (8 x 128 tokens).

dispatch: stable argsort of the expert ids of all (rank, t, k) pairs (gives
          the expert-major, source-major, (t, k) layout weft produces),
          scatter_add counts for the expert offsets, index_select of the token rows;
combine:  scatter the expert outputs back to pair order (index_copy), then
          the weighted sum over k in f32 and a cast to bf16.

Timed with CUDA events, p50/p99 over ITERS iterations after warm-up, eager
and CUDA-graph-captured. Usage: torch_baseline.py [ITERS] (default 300).
"""
import sys

import torch

N, T, R, E, TB, H = 8, 128, 8, 256, 7168 + 56 * 4, 7168
iters = int(sys.argv[1]) if len(sys.argv) > 1 else 300
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(1)

tokens = torch.randint(0, 256, (N * T, TB), dtype=torch.uint8, device=dev, generator=g)
ids = torch.rand(N * T, E, device=dev, generator=g).topk(R, dim=1).indices.to(torch.int32)
weights = torch.rand(N * T, R, device=dev, generator=g)
pair_token = torch.arange(N * T, device=dev).repeat_interleave(R)
y = torch.randn(N * T * R, H, device=dev, generator=g).to(torch.bfloat16)
ones = torch.ones(N * T * R, dtype=torch.int64, device=dev)
out_pairs = torch.empty(N * T * R, H, dtype=torch.bfloat16, device=dev)
state = {}


def dispatch():
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat.long(), ones)
    state["order"] = order
    return tokens.index_select(0, pair_token.index_select(0, order)), counts


def combine():
    out_pairs.index_copy_(0, state["order"], y)
    yp = out_pairs.view(N * T, R, H).float()
    return (yp * weights.unsqueeze(-1)).sum(1).to(torch.bfloat16)


def timeit(fn, n):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    v = []
    for i in range(n + 20):
        s.record()
        fn()
        e.record()
        e.synchronize()
        if i >= 20:
            v.append(s.elapsed_time(e) * 1e3)
    v.sort()
    return v[len(v) // 2], v[min(len(v) - 1, round((len(v) - 1) * 0.99))]


def graphed(fn):
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(st)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    return gr.replay


print(f"# torch {torch.__version__} baseline on {torch.cuda.get_device_name(0)}: EP{N} on one GPU, "
      f"{T} tokens/rank, top-{R}/{E}, {TB} B tokens, bf16 out {H}")
print("\n| baseline (all 8 ranks' data) | p50 µs | p99 µs |\n|---|---|---|")
dispatch()
for name, fn in [("torch dispatch, eager", dispatch), ("torch combine, eager", combine)]:
    p50, p99 = timeit(fn, iters)
    print(f"| {name} | {p50:.1f} | {p99:.1f} |")
for name, fn in [("torch dispatch, CUDA graph", dispatch), ("torch combine, CUDA graph", combine)]:
    try:
        p50, p99 = timeit(graphed(fn), iters)
        print(f"| {name} | {p50:.1f} | {p99:.1f} |")
    except Exception as ex:  # capture unsupported for an op: say so
        print(f"| {name} | n/a ({type(ex).__name__}: {ex}) | |")
