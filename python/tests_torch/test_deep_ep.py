"""weft's DeepEP shim (``weft.deep_ep``, imported as ``deep_ep``): N rank
processes in a ``torch.distributed`` gloo group, each with its own engine
over libfabric tcp, call ``low_latency_dispatch`` / ``low_latency_combine``
as DeepEP code does; every rank checks what it received and what it
combined against a reference of the documented semantics written here:

- dispatch: expert ``e``'s first ``recv_count[e]`` rows are the tokens that
  name it, by source rank then source token, quantised with the fp8 rule
  (per token and 128 columns: ``scale = max(|x|, 1e-4) / 448``, rounded up
  to a power of two with ``round_scale``; ``e4m3(clamp(x / scale))``) or
  as bf16; ``src_info`` the source token, ``layout_range[e, s] = begin <<
  32 | count``;
- combine: ``Σ_k w[t,k]·y(t,k)`` over the ``k`` with an expert, then bf16.
  The test's expert outputs and weights are small dyadic numbers, so every
  sum is exact in f32 and the comparison is bit for bit.

Cases: random routings at EP 2 and 4, ``-1`` ids, all tokens to one
expert, a rank with no tokens, exactly ``num_max_dispatch_tokens_per_rank``
tokens and one over (a typed error on every rank, nothing sent), fp8 with
and without ``round_scale`` and bf16, ``out=`` written in place, the async
event and the receive hook, the calls the shim refuses by name, and a rank
that dies before a dispatch (the others raise ``MoeError`` of kind
``timeout`` within their timeout). With a GPU the same runs on CUDA
tensors (the shim's data path stays the host's).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from procs import run_ranks  # noqa: E402  (python/tests/procs.py)

torch = pytest.importorskip("torch")

E, K, H, TM = 8, 4, 256, 6


def make(seed: int, n: int, routing: str):
    """Every rank's (x bf16 [T, H], topk_idx int64 [T, K], weights f32)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        t = TM
        if routing == "ragged":
            t = int(torch.randint(0, TM + 1, (1,), generator=g))
        if routing == "empty_rank" and r == 0:
            t = 0
        x = (torch.randn(t, H, generator=g) * 3).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K, dtype=torch.int64)
        if routing == "none_ids":
            idx[torch.rand(t, K, generator=g) < 0.3] = -1
            if t:
                idx[0] = -1
        if routing == "one_expert":
            idx[:] = -1
            idx[:, 0] = E - 1
        w = (torch.randint(-8, 9, (t, K), generator=g) / 8.0).to(torch.float32)
        out.append((x, idx.to(torch.int64), w))
    return out


def ref_quant(x, round_scale: bool):
    """DeepEP's rule: scale_inv = amax · f32(1/448), x · (448 / amax); or a
    power-of-two scale_inv and x / scale_inv."""
    t = x.shape[0]
    xf = x.float().view(t, H // 128, 128)
    amax = xf.abs().amax(-1).clamp(min=1e-4)
    inv = amax * torch.tensor(1 / 448.0, dtype=torch.float32)
    if round_scale:
        inv = torch.exp2(torch.ceil(torch.log2(inv)))
        y = xf / inv[..., None]
    else:
        # A tensor division: torch's `448.0 / amax` is a reciprocal times
        # 448, which can differ from the quotient in the last bit.
        y = xf * (torch.full_like(amax, 448.0) / amax)[..., None]
    q = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(t, H), inv


def expert(rows, scales, e: int):
    """The test's expert: a multiple of 1/4 in [-32, 32] per element."""
    deq = rows.float() if scales is None else rows.float() * scales.repeat_interleave(128, dim=-1)
    return (torch.round(deq * (e + 1)) / 4).clamp(-32, 32).to(torch.bfloat16)


def check_dispatch(rank, n, ins, recv_x, recv_count, handle, fp8, round_scale):
    loc = E // n
    src_info, layout_range, tmax, h, ne = handle  # DeepEP's five entries
    assert (tmax, h, ne) == (TM, H, E)
    if fp8:
        rx, rs = recv_x
        assert rx.shape == (loc, TM * n, H) and rx.dtype == torch.float8_e4m3fn
        assert rs.shape == (loc, TM * n, H // 128) and rs.stride(1) == 1  # column-major, as DeepEP
    else:
        rx, rs = recv_x, None
        assert rx.shape == (loc, TM * n, H) and rx.dtype == torch.bfloat16
    quant = [ref_quant(x, round_scale) if fp8 else (x, None) for x, _, _ in ins]
    for le in range(loc):
        e = rank * loc + le
        rows, scales, toks, per = [], [], [], [0] * n
        for s, (_, idx, _) in enumerate(ins):
            for t in range(idx.shape[0]):
                if bool((idx[t] == e).any()):
                    rows.append(quant[s][0][t])
                    if fp8:
                        scales.append(quant[s][1][t])
                    toks.append(t)
                    per[s] += 1
        c = int(recv_count[le])
        assert c == len(rows), f"expert {e}: {c} rows, want {len(rows)}"
        if c:
            got = rx[le, :c].cpu()
            want = torch.stack(rows)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"expert {e}: rows"
            if fp8:
                assert torch.equal(rs[le, :c].cpu(), torch.stack(scales)), f"expert {e}: scales"
            assert src_info[le, :c].cpu().tolist() == toks
        begin = 0
        for s in range(n):
            assert int(layout_range[le, s]) == (begin << 32) | per[s], f"expert {e} source {s}"
            begin += per[s]


def ref_combine(rank, n, ins, fp8, round_scale):
    x, idx, w = ins[rank]
    q = ref_quant(x, round_scale) if fp8 else (x, None)
    y = torch.zeros(idx.shape[0], H, dtype=torch.float32)
    for t in range(idx.shape[0]):
        for k in range(K):
            e = int(idx[t, k])
            if e >= 0:
                s = None if q[1] is None else q[1][t : t + 1]
                y[t] += w[t, k] * expert(q[0][t : t + 1], s, e)[0].float()
    return y.to(torch.bfloat16)


def outputs(rank, n, recv_x, fp8):
    loc = E // n
    rx, rs = recv_x if fp8 else (recv_x, None)
    ys = [expert(rx[le].cpu(), None if rs is None else rs[le].cpu(), rank * loc + le) for le in range(loc)]
    return torch.stack(ys)


RANK = r"""
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[5])
import test_deep_ep as T
rank, n, tmp, case, _, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=n)
import weft.deep_ep
weft.deep_ep.install()
import deep_ep
dev = torch.device(device)
if dev.type == "cuda":
    # CUDA contexts of several processes on one GPU take seconds to make:
    # every rank makes its own before the first step's 3 s rounds start.
    torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    dist.barrier()
hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T.TM, T.H, n, T.E)
buf = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True,
                     provider="libfabric:tcp", domain="same-machine", timeout=3.0)
if case == "dies":
    ins = T.make(5, n, "random")
    x, idx, w = ins[rank]
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), T.TM, T.E)
    buf.low_latency_combine(T.outputs(rank, n, recv_x, True).to(dev), idx.to(dev), w.to(dev), handle)
    dist.barrier()  # every combine write has landed
    if rank == n - 1:
        os._exit(0)  # dies before the next step
    t0 = time.monotonic()
    try:
        buf.low_latency_dispatch(x.to(dev), idx.to(dev), T.TM, T.E)
    except __import__("weft").MoeError as e:
        print("raised", e.kind, round(time.monotonic() - t0, 1), end=" ", flush=True)
    # The survivors mask the dead rank and go on without it: pairs naming
    # its experts are dropped, exactly as ids of -1 in the reference, and
    # it sends nothing (all its ids -1 there).
    buf.low_latency_update_mask_buffer(n - 1, True)
    status = torch.zeros(n, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * (n - 1) + [1], status
    for call in [lambda: buf.low_latency_update_mask_buffer(n - 1, False), buf.low_latency_clean_mask_buffer]:
        try:
            call()
            raise SystemExit("unmasking not refused")
        except NotImplementedError:
            pass
    buf.low_latency_update_mask_buffer(0 if rank else 1, False)  # not masked: nothing to do
    loc = T.E // n
    for step, seed in enumerate([6, 7]):
        ins = T.make(seed, n, "random")
        dropped = [(xx, torch.where((ii // loc == n - 1) | (s == n - 1), -1, ii), ww)
                   for s, (xx, ii, ww) in enumerate(ins)]
        x, idx, w = ins[rank]
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), T.TM, T.E)
        T.check_dispatch(rank, n, dropped, recv_x, recv_count, handle, True, False)
        comb, _, _ = buf.low_latency_combine(T.outputs(rank, n, recv_x, True).to(dev), idx.to(dev), w.to(dev), handle)
        assert torch.equal(comb.cpu(), T.ref_combine(rank, n, dropped, True, False)), step
    print("masked-ok", flush=True)
    sys.exit(0)
seed = 10
for routing in ["random", "none_ids", "one_expert", "empty_rank", "ragged"]:
    for fp8, rnd in [(True, False), (True, True), (False, False)]:
        seed += 1
        ins = T.make(seed, n, routing)
        x, idx, w = ins[rank]
        stats = torch.zeros(T.E // n, dtype=torch.int32)
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            x.to(dev), idx.to(dev), T.TM, T.E, cumulative_local_expert_recv_stats=stats,
            use_fp8=fp8, round_scale=rnd, async_finish=True, return_recv_hook=True)
        hook()
        event.current_stream_wait()
        T.check_dispatch(rank, n, ins, recv_x, recv_count, handle, fp8, rnd)
        assert torch.equal(stats, recv_count.cpu())
        y = T.outputs(rank, n, recv_x, fp8).to(dev)
        out = torch.empty(x.shape[0], T.H, dtype=torch.bfloat16, device=dev)
        comb, ev, hk = buf.low_latency_combine(y, idx.to(dev), w.to(dev), handle, out=out)
        assert comb is out and hk is None
        want = T.ref_combine(rank, n, ins, fp8, rnd)
        assert torch.equal(out.cpu(), want), (routing, fp8, rnd)
# One token over the limit: a typed error on every rank, nothing sent.
x = torch.zeros(T.TM + 1, T.H, dtype=torch.bfloat16, device=dev)
idx = torch.zeros(T.TM + 1, T.K, dtype=torch.int64, device=dev)
idx[:, 1:] = -1
try:
    buf.low_latency_dispatch(x, idx, T.TM, T.E)
    raise SystemExit("no error for one token over the limit")
except __import__("weft").MoeError as e:
    assert e.kind == "too_many_tokens", e.kind
# One rank alone over the limit: it is refused, the others time out; the
# next step (every rank) rebuilds the shape's rank and works.
ins = T.make(98, n, "random")
x1, idx1, w1 = ins[rank]
try:
    if rank == 0:
        buf.low_latency_dispatch(x, idx, T.TM, T.E)
    else:
        buf.low_latency_dispatch(x1.to(dev), idx1.to(dev), T.TM, T.E)
    raise SystemExit("a step with one refusing rank went through")
except __import__("weft").MoeError as e:
    assert e.kind == ("too_many_tokens" if rank == 0 else "timeout"), e.kind
for call in [lambda: buf.low_latency_dispatch(x[:1], idx[:1], T.TM, T.E, use_ue8m0=True),
             lambda: buf.get_next_low_latency_combine_buffer(None),
             lambda: buf.get_dispatch_layout(idx, T.E)]:
    try:
        call()
        raise SystemExit("not refused")
    except NotImplementedError:
        pass
# And the group still works after the refusals, once every rank has seen
# its own (rank 0 was refused at once, the others wait out their timeout).
dist.barrier()
ins = T.make(99, n, "random")
x, idx, w = ins[rank]
t0 = time.monotonic()
print(f"rank {rank}: recovery step at {time.time():.3f}", file=sys.stderr, flush=True)
try:
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), T.TM, T.E)
finally:
    print(f"rank {rank}: recovery dispatch {time.monotonic() - t0:.3f} s", file=sys.stderr, flush=True)
T.check_dispatch(rank, n, ins, recv_x, recv_count, handle, True, False)
comb, _, _ = buf.low_latency_combine(T.outputs(rank, n, recv_x, True).to(dev), idx.to(dev), w.to(dev), handle)
assert torch.equal(comb.cpu(), T.ref_combine(rank, n, ins, True, False))
assert comb.device == dev
dist.barrier()
buf.destroy()
print("ok", flush=True)
"""


def run(tmp_path, n: int, case: str, device: str = "cpu"):
    import weft

    status = {p.spec: p for p in weft.providers()}["libfabric:tcp"]
    if not status.available:
        pytest.skip(f"libfabric:tcp: {status.reason}")
    here = os.path.dirname(__file__)
    argvs = [[str(r), str(n), str(tmp_path), case, here, device] for r in range(n)]
    return run_ranks(RANK, argvs, env=dict(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"), timeout=240)


@pytest.mark.parametrize("n", [2, 4])
def test_dispatch_combine_match_the_reference(tmp_path, n):
    assert run(tmp_path, n, "steps") == ["ok"] * n


def test_a_dead_rank_raises_timeout_on_the_others_who_then_mask_it(tmp_path):
    outs = run(tmp_path, 4, "dies")
    assert outs[3] == ""
    for line in outs[:3]:
        kind, secs = line.split()[1], float(line.split()[2])
        # A dead peer is a round that never completes, or a failed WRITE.
        assert kind in ("timeout", "engine") and secs < 30, line
        # Then the survivors masked it and went on, checked per step.
        assert line.split()[3] == "masked-ok", line


@pytest.mark.gpu
def test_cuda_tensors(tmp_path):
    if not torch.cuda.is_available():
        if os.environ.get("WEFT_REQUIRE_GPU") == "1":
            pytest.fail("WEFT_REQUIRE_GPU=1 but torch sees no GPU")
        pytest.skip("no CUDA GPU")
    assert run(tmp_path, 4, "steps", "cuda:0") == ["ok"] * 4
