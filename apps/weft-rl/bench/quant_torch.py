#!/usr/bin/env python3
"""A straightforward torch reference of weft-rl's GPU stages, side by side
with the NVRTC kernels (apps/weft-rl/examples/gpu_quant_bench.rs).

For every shape of the Rust bench (read from its --out TSV, so both run the
same shapes and the same FSDP split) it times
  quant: bf16 [R, C] -> pad to 128x128 tiles, view as tiles, amax over each
         tile, scale = amax / 448 (1 where amax == 0), q = x / scale,
         clamp to +-448, .to(torch.float8_e4m3fn) (timed as written, with
         torch's default scalar division);
  chain: torch.cat of each part's FSDP Shard(0) chunks (unshard), torch.cat
         of the parts (fuse), then quant;
with CUDA events, and prints GB/s of bf16 input and ours / torch.

With --dump DIR (written by gpu_quant_bench --dump) it also quantises the
dumped inputs with the torch reference and compares fp8 bytes and scales
with ours, bit for bit, against the reference with IEEE division of the
scale (weft-rl's convention); the plain reference's difference from it is
printed too.

usage: quant_torch.py --ours results.tsv [--dump DIR] [--iters N] [--fsdp N]
"""
import argparse
import sys

import torch

BLOCK = 128
E4M3_MAX = 448.0


def quant(x: torch.Tensor, block: int = BLOCK, ieee: bool = False):
    """The straightforward reference. `amax / 448` with a Python scalar
    divisor is computed by torch on CUDA as `amax * (1 / 448)` (its
    scalar-divisor fast path), which differs from IEEE division in the last
    bit of about half the scales; `ieee=True` divides by a tensor instead,
    which is true IEEE division, weft-rl's convention (src/fp8.rs)."""
    rows, cols = x.shape
    pr, pc = (-rows) % block, (-cols) % block
    xp = torch.nn.functional.pad(x, (0, pc, 0, pr)) if pr or pc else x
    br, bc = xp.shape[0] // block, xp.shape[1] // block
    t = xp.view(br, block, bc, block)
    amax = t.abs().amax(dim=(1, 3)).float()
    div = torch.full_like(amax, E4M3_MAX) if ieee else E4M3_MAX
    scale = torch.where(amax > 0, amax / div, torch.ones_like(amax))
    q = (t.float() / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.to(torch.float8_e4m3fn).view(xp.shape)[:rows, :cols].contiguous()
    return q, scale


def tile_amax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per-tile amax (f32), as `quant` computes it."""
    rows, cols = x.shape
    pr, pc = (-rows) % block, (-cols) % block
    xp = torch.nn.functional.pad(x, (0, pc, 0, pr)) if pr or pc else x
    t = xp.view(xp.shape[0] // block, block, xp.shape[1] // block, block)
    return t.abs().amax(dim=(1, 3)).float()


def chunks(ext: int, n: int):
    c = -(-ext // n)
    return [min(c, max(ext - i * c, 0)) for i in range(n) if ext - i * c > 0]


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def check(dump: str) -> bool:
    ok = True
    try:
        index = [l.split("\t") for l in open(f"{dump}/index.tsv").read().split("\n") if l]
    except FileNotFoundError:
        print(f"no {dump}/index.tsv: bit-exactness not checked")
        return False
    for si, rows, cols in index:
        rows, cols = int(rows), int(cols)
        raw = open(f"{dump}/{si}.in.bf16", "rb").read()
        x = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(rows, cols).cuda()
        # The plain reference, for information: how far torch's default
        # scalar division lands from IEEE division, and whether it is
        # exactly amax * f32(1/448) (the scalar fast path).
        pq, ps = quant(x)
        q, scale = quant(x, ieee=True)
        amax = tile_amax(x)
        nz = amax > 0
        recip = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32, device=amax.device)
        is_recip = bool(torch.equal(ps[nz], amax[nz] * recip))
        plain_s = int((ps != scale).sum())
        plain_q = int((pq.view(torch.uint8) != q.view(torch.uint8)).sum())
        print(f"  plain torch (amax / 448.0) vs IEEE division: scales differing "
              f"{plain_s} / {scale.numel()}, fp8 bytes differing {plain_q} / {q.numel()}; "
              f"plain scales == amax * f32(1/448): {is_recip}")
        ours_q = torch.frombuffer(bytearray(open(f"{dump}/{si}.q.bin", "rb").read()), dtype=torch.uint8)
        ours_s = torch.frombuffer(bytearray(open(f"{dump}/{si}.scales.f32", "rb").read()), dtype=torch.int32)
        tq = q.view(torch.uint8).flatten().cpu()
        ts = scale.contiguous().view(torch.int32).flatten().cpu()
        dq = int((tq != ours_q).sum())
        ds = int((ts != ours_s).sum())
        verdict = "bit-exact" if dq == 0 and ds == 0 else "DIFFERENT"
        print(f"check {rows}x{cols}: fp8 bytes differing {dq} / {tq.numel()}, "
              f"scales differing {ds} / {ts.numel()}: {verdict}")
        if dq or ds:
            ok = False
            i = int((tq != ours_q).nonzero()[0]) if dq else None
            if i is not None:
                print(f"  first fp8 difference at {i}: bf16 {x.flatten()[i].item()!r} "
                      f"torch {int(tq[i]):#04x} ours {int(ours_q[i]):#04x}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, help="gpu_quant_bench --out TSV")
    ap.add_argument("--dump", help="gpu_quant_bench --dump DIR")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--fsdp", type=int, default=16)
    ap.add_argument("--out", help="write the side-by-side table (TSV) here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch without CUDA: nothing to compare")
        return 1
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name(0)}, "
          f"{a.iters} iterations, FSDP {a.fsdp} Shard(0)")
    lines = [l.split("\t") for l in open(a.ours).read().split("\n")[1:] if l]
    rows_out = ["shape\tquant_gbps_ours\tquant_gbps_torch\tquant_ratio"
                "\tchain_gbps_ours\tchain_gbps_torch\tchain_ratio"]
    print(f"{'shape':<36} {'quant GB/s':>22} {'ratio':>6} {'chain GB/s':>22} {'ratio':>6}")
    print(f"{'':<36} {'ours':>10} {'torch':>11} {'':>6} {'ours':>10} {'torch':>11}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, parts, rows, cols, nbytes, _qms, qg, _cms, cg in lines:
        parts = [int(p) for p in parts.split(",")]
        rows, cols, nbytes = int(rows), int(cols), int(nbytes)
        x = (torch.randn(rows, cols, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        tq = timed(lambda: quant(x), a.iters)
        # Shards of each part (views would make torch.cat a plain copy of
        # one tensor; real shards are separate tensors).
        shards, at = [], 0
        for pr in parts:
            mine, r0 = [], 0
            for c in chunks(pr, a.fsdp):
                mine.append(x[at + r0: at + r0 + c].clone())
                r0 += c
            shards.append(mine)
            at += pr
        tc = timed(lambda: quant(torch.cat([torch.cat(s, 0) for s in shards], 0)), a.iters)
        gb = nbytes / 1e9
        tqg, tcg = gb / (tq / 1e3), gb / (tc / 1e3)
        qg, cg = float(qg), float(cg)
        print(f"{name:<36} {qg:>10.1f} {tqg:>11.1f} {qg / tqg:>6.2f} {cg:>10.1f} {tcg:>11.1f} {cg / tcg:>6.2f}")
        rows_out.append(f"{name}\t{qg:.2f}\t{tqg:.2f}\t{qg / tqg:.3f}\t{cg:.2f}\t{tcg:.2f}\t{cg / tcg:.3f}")
        del x, shards
        torch.cuda.empty_cache()
    if a.out:
        open(a.out, "w").write("\n".join(rows_out) + "\n")
    ok = check(a.dump) if a.dump else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
