"""weft.moe.MoeRank: MoE dispatch/combine from Python, checked against a
numpy reference written here — in one process on the simulated fabric
(ranks on threads: every call releases the GIL) and as processes over
libfabric tcp; ids of -1 (no expert), weights given with combine, typed
refusals of bad shapes, ids and garbled peer infos, a dead rank."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import weft
import weft.moe as moe
from procs import run_ranks

N, E, K, T, TB, H = 4, 8, 3, 5, 24, 6


def inputs(seed: int, n: int = N, t: int = T, none_share: float = 0.25):
    """Per rank: token rows (uint8 [t, TB]), ids (int64 [t, K], -1 some),
    weights (f32, multiples of 1/8 so every sum is exact in f32)."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n):
        tr = t if r != n - 1 else max(t - 2, 0)  # the last rank sends fewer
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(tr)]).astype(np.int64).reshape(tr, K)
        ids[rng.random((tr, K)) < none_share] = -1
        toks = rng.integers(0, 256, (tr, TB), dtype=np.uint8)
        w = (rng.integers(-8, 9, (tr, K)) / 8.0).astype(np.float32)
        out.append((toks, ids, w))
    return out


def ref_dispatch(ins, rank: int, n: int = N):
    """Rows of `rank`'s local experts: expert ascending, then source rank,
    then the source's (t, k) order; with offsets, source ranks and pair
    indices t·K + k at the source."""
    loc = E // n
    rows, offs, src, pair = [], [0], [], []
    for e in range(rank * loc, (rank + 1) * loc):
        for s, (toks, ids, _) in enumerate(ins):
            for t, k in zip(*np.nonzero(ids == e)):
                rows.append(toks[t])
                src.append(s)
                pair.append(int(t) * ids.shape[1] + int(k))
        offs.append(len(rows))
    data = np.stack(rows).tobytes() if rows else b""
    return data, offs, src, pair


def expert(rows: np.ndarray, e: int) -> np.ndarray:
    """The test expert: f32 outputs, exact small values."""
    return ((rows[:, :H].astype(np.float32) - 128.0) * (e + 1) / 4.0).astype(np.float32)


def ref_combine(ins, outs_by_rank, n: int = N, weights=None):
    """Per source rank: sum over k with an expert of w[t,k]·y(t,k), f32."""
    loc = E // n
    where = {}
    for d in range(n):
        row = 0
        for e in range(d * loc, (d + 1) * loc):
            for s, (_, ids, _) in enumerate(ins):
                for t, k in zip(*np.nonzero(ids == e)):
                    where[(s, t, k)] = (d, row)
                    row += 1
    res = []
    for s, (toks, ids, w) in enumerate(ins):
        w = w if weights is None else weights[s]
        y = np.zeros((ids.shape[0], H), np.float32)
        for t in range(ids.shape[0]):
            for k in range(K):
                if ids[t, k] >= 0:
                    d, row = where[(s, t, k)]
                    y[t] += w[t, k] * outs_by_rank[d][row]
        res.append(y)
    return res


def outputs_of(data: bytes, offs, rank: int, n: int = N) -> np.ndarray:
    rows = np.frombuffer(data, np.uint8).reshape(-1, TB) if data else np.zeros((0, TB), np.uint8)
    loc = E // n
    parts = [expert(rows[offs[i] : offs[i + 1]], rank * loc + i) for i in range(loc)]
    return np.concatenate(parts) if parts else np.zeros((0, H), np.float32)


def ranks_on(engines, n: int = N, **kw):
    rs = [moe.MoeRank(engines[r], r, n, E, K, T, TB, H, out_dtype="f32", **kw) for r in range(n)]
    infos = [r.info() for r in rs]
    for r in rs:
        r.connect(infos)
    return rs


def on_threads(fns):
    res, errs = [None] * len(fns), []

    def run(i, f):
        try:
            res[i] = f()
        except BaseException as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errs:
        raise errs[0]
    return res


@pytest.fixture
def engines():
    backend = weft.provider("loopback", profile="adversarial", seed=3)
    es = [weft.TransferEngine(backend) for _ in range(N)]
    yield es
    for e in es:
        e.shutdown()


def test_steps_match_the_reference_with_no_expert_ids_and_late_weights(engines):
    rs = ranks_on(engines)
    for step in range(4):
        ins = inputs(100 + step)
        got = on_threads([lambda r=r: r.dispatch(*ins[r.rank]) for r in rs])
        outs = []
        for r, (data, offs, src, pair, layout) in zip(rs, got):
            want = ref_dispatch(ins, r.rank)
            assert (data, offs, src, pair) == want, f"step {step} rank {r.rank}"
            outs.append(outputs_of(data, offs, r.rank))
        # Odd steps: the combine's weights differ from the dispatch's.
        late = [(-w + 0.5).astype(np.float32) for _, _, w in ins] if step % 2 else None
        ys = on_threads(
            [
                lambda r=r, g=g: r.combine(outs[r.rank], g[4], None if late is None else late[r.rank])
                for r, g in zip(rs, got)
            ]
        )
        want = ref_combine(ins, outs, weights=late)
        for r, y in zip(rs, ys):
            assert np.array_equal(np.frombuffer(y, np.float32).reshape(-1, H), want[r.rank]), f"step {step}"
    for r in rs:
        r.shutdown()


def test_refusals_are_typed(engines):
    rs = ranks_on(engines)
    r0 = rs[0]
    toks, ids, w = inputs(1)[0]
    with pytest.raises(moe.MoeError) as e:
        r0.dispatch(np.zeros((T + 1, TB), np.uint8), np.zeros((T + 1, K), np.int64))
    assert e.value.kind == "too_many_tokens"
    bad = ids.copy()
    bad[0, 0] = E
    with pytest.raises(moe.MoeError) as e:
        r0.dispatch(toks, bad, w)
    assert e.value.kind == "expert_out_of_range"
    bad[0, 0] = -2
    with pytest.raises(weft.InvalidArgumentError):
        r0.dispatch(toks, bad, w)
    with pytest.raises(weft.InvalidArgumentError):
        r0.dispatch(toks, ids.astype(np.float64), w)
    with pytest.raises(moe.MoeError) as e:
        r0.dispatch(np.ascontiguousarray(toks[:, :-1]), ids, w)
    assert e.value.kind == "shape"
    # Garbled or foreign infos never connect a fresh rank.
    fresh = moe.MoeRank(engines[0], 0, N, E, K, T, TB, H, instance=1)
    infos = [r.info() for r in rs]
    with pytest.raises(moe.MoeError) as e:
        fresh.connect(infos[:2] + [b"\x07garbage"] + infos[3:])
    assert e.value.kind == "peer_info"
    with pytest.raises(moe.MoeError) as e:
        fresh.connect(infos[:3])
    assert e.value.kind == "shape"
    other = moe.MoeRank(engines[1], 1, N, E, K, T + 1, TB, H, instance=1)
    with pytest.raises(moe.MoeError) as e:
        fresh.connect([fresh.info(), other.info()] + infos[2:])
    assert e.value.kind == "peer_info"
    with pytest.raises(moe.MoeError) as e:
        moe.MoeRank(engines[0], 0, N, E + 1, K, T, TB, H, instance=2)
    assert e.value.kind == "config"
    with pytest.raises(moe.MoeError) as e:
        fresh.dispatch(toks, ids, w)
    assert e.value.kind == "not_connected"
    assert moe.MoeRank.buffer_bytes(N, E, K, T, TB, H) > 0
    for r in rs + [fresh, other]:
        r.shutdown()


def test_a_masked_rank_drops_its_pairs_and_the_others_match_the_reference(engines):
    """Rank 2 masked: the others run as a group of three; pairs for rank
    2's experts are dropped, the other ids renumbered (here, by hand), and
    source ranks stay whole-group numbers."""
    active, loc = [0, 1, 3], E // N
    rs = [moe.MoeRank(engines[g], g, N, E, K, T, TB, H, out_dtype="f32", masked=[2]) for g in active]
    infos = [r.info() for r in rs]
    for r in rs:
        r.connect(infos)
    assert [r.rank for r in rs] == active
    assert rs[0].shape[:2] == (N, E)
    for step in range(3):
        ins = inputs(300 + step)
        act = []
        for g in active:
            toks, ids, w = ins[g]
            owner = np.where(ids >= 0, ids // loc, -1)
            mapped = np.where(owner == 2, -1, np.where(owner > 2, ids - loc, ids))
            act.append((toks, mapped, w))
        got = on_threads([lambda r=r, g=g: r.dispatch(*ins[g]) for r, g in zip(rs, active)])
        outs = []
        for a, (data, offs, src, pair, _) in enumerate(got):
            wd, wo, ws, wp = ref_dispatch(act, a, n=3)
            assert (data, offs, pair) == (wd, wo, wp), f"step {step} rank {active[a]}"
            assert src == [active[s] for s in ws]
            outs.append(outputs_of(data, offs, a, n=3))
        ys = on_threads([lambda i=i, r=r: r.combine(outs[i], got[i][4]) for i, r in enumerate(rs)])
        want = ref_combine(act, outs, n=3)
        for a, y in enumerate(ys):
            assert np.array_equal(np.frombuffer(y, np.float32).reshape(-1, H), want[a]), f"step {step}"
    with pytest.raises(moe.MoeError) as e:
        moe.MoeRank(engines[2], 2, N, E, K, T, TB, H, masked=[2])
    assert e.value.kind == "masked"
    with pytest.raises(moe.MoeError) as e:
        moe.MoeRank(engines[2], 0, N, E, K, T, TB, H, masked=[5])
    assert e.value.kind == "config"
    for r in rs:
        r.shutdown()


def test_combine_refuses_missing_weights_wrong_output_types_and_a_second_connect(engines):
    rs = ranks_on(engines)
    ins = inputs(3)
    got = on_threads([lambda r=r: r.dispatch(ins[r.rank][0], ins[r.rank][1]) for r in rs])
    outs = [outputs_of(g[0], g[1], r.rank) for r, g in zip(rs, got)]
    with pytest.raises(weft.InvalidArgumentError):
        rs[0].combine(outs[0], got[0][4])  # weights neither at dispatch nor here
    with pytest.raises(weft.InvalidArgumentError) as e:
        rs[0].combine(outs[0].view(np.float64), got[0][4], ins[0][2])  # right size, wrong type
    assert e.value.kind == "unsupported_dtype"
    with pytest.raises(moe.MoeError) as e:
        rs[0].connect([r.info() for r in rs])
    assert e.value.kind == "out_of_order"
    # None of that disturbed the step.
    ys = on_threads([lambda r=r, g=g: r.combine(outs[r.rank], g[4], ins[r.rank][2]) for r, g in zip(rs, got)])
    want = ref_combine(ins, outs)
    for r, y in zip(rs, ys):
        assert np.array_equal(np.frombuffer(y, np.float32).reshape(-1, H), want[r.rank])
    for r in rs:
        r.shutdown()


def test_a_dead_rank_times_out_the_others(engines):
    """Rank 3 never dispatches: the others raise MoeError (timeout) within
    their timeout and are poisoned afterwards."""
    rs = ranks_on(engines, timeout=1.0)
    ins = inputs(7)
    t0 = time.monotonic()
    errs = []

    def one(r):
        try:
            r.dispatch(*ins[r.rank])
        except moe.MoeError as e:
            errs.append(e.kind)

    on_threads([lambda r=r: one(r) for r in rs[:3]])
    assert errs == ["timeout"] * 3
    assert time.monotonic() - t0 < 30
    with pytest.raises(moe.MoeError) as e:
        rs[0].dispatch(*ins[0])
    assert e.value.kind == "poisoned"


RANK = r"""
import os, sys, time
import numpy as np, weft, weft.moe as moe
sys.path.insert(0, sys.argv[3])
import test_moe as T
rank, d = int(sys.argv[1]), sys.argv[2]
eng = weft.TransferEngine("libfabric:tcp", domain="same-machine")
r = moe.MoeRank(eng, rank, T.N, T.E, T.K, T.T, T.TB, T.H, out_dtype="f32", timeout=30.0)
with open(os.path.join(d, f"{rank}.tmp"), "wb") as f:
    f.write(r.info())
os.rename(os.path.join(d, f"{rank}.tmp"), os.path.join(d, f"{rank}.info"))
paths = [os.path.join(d, f"{x}.info") for x in range(T.N)]
while not all(os.path.exists(p) for p in paths):
    time.sleep(0.05)
r.connect([open(p, "rb").read() for p in paths])
for step in range(3):
    ins = T.inputs(900 + step)
    data, offs, src, pair, layout = r.dispatch(*ins[rank])
    assert (data, offs, src, pair) == T.ref_dispatch(ins, rank), step
    outs = [T.outputs_of(*T.ref_dispatch(ins, x)[:2], x) for x in range(T.N)]
    y = np.frombuffer(r.combine(outs[rank], layout), np.float32).reshape(-1, T.H)
    assert np.array_equal(y, T.ref_combine(ins, outs)[rank]), step
r.shutdown()
print("ok", flush=True)
time.sleep(0.5)
eng.shutdown()
"""


@pytest.mark.fabric
def test_ranks_as_processes_over_tcp(tmp_path):
    status = {p.spec: p for p in weft.providers()}["libfabric:tcp"]
    if not status.available:
        pytest.skip(f"libfabric:tcp: {status.reason}")
    here = os.path.dirname(__file__)
    outs = run_ranks(RANK, [[str(r), str(tmp_path), here] for r in range(N)], timeout=120)
    assert outs == ["ok"] * N


def test_deep_ep_module_imports_without_torch():
    import weft.deep_ep as deep_ep

    assert deep_ep.Buffer is moe.Buffer
    with pytest.raises(NotImplementedError, match="Config"):
        deep_ep.Config(20)
    deep_ep.install()
    import deep_ep as alias  # noqa: F401

    assert alias.Buffer is moe.Buffer
    del sys.modules["deep_ep"]
