"""weft.rl from Python: trainers holding DTensor-style shards (FSDP x TP
grids, HSDP replicas, replicated vectors) push versions into inference
ranks' double-buffered memory; every byte checked against the global
tensors, fp8 targets against an independent numpy reference of the e4m3
block quantisation. Loopback engines in one process, and trainer and
inference processes over libfabric tcp finding each other through a
``dir:`` rendezvous store."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import weft
import weft.rl as rl
from procs import run_ranks

# name -> (shape, layout); four trainers as a 2 x 2 mesh.
PARAMS = {
    # FSDP (rows) x TP (cols): a grid of boxes.
    "w": ((10, 6), ("mesh", [2, 2], [0, 1, 2, 3], [0, 1])),
    # HSDP: rows sharded over the inner dimension, replicated over the outer.
    "e": ((9, 6), ("mesh", [2, 2], [0, 1, 2, 3], [None, 0])),
    # A norm replicated everywhere.
    "n": ((7,), ("replicate", [0, 1, 2, 3])),
    # Nested shards of one dimension (outer first, torch.chunk sizes).
    "u": ((11, 3), ("mesh", [2, 2], [3, 2, 1, 0], [0, 0])),
}


def params():
    return [(n, *rl.as_2d(s), l) for n, (s, l) in PARAMS.items()]


def targets(fp8: bool = False):
    q = "fp8" if fp8 else "none"
    return [
        # rank 0: everything whole, plus a fused tensor (w over e).
        [
            ("w", [("w", 0, 10, 0, 6)], "none"),
            ("e", [("e", 0, 9, 0, 6)], "none"),
            ("n", [("n", 0, 7, 0, 1)], "none"),
            ("u", [("u", 0, 11, 0, 3)], "none"),
            ("we", [("w", 0, 8, 0, 6), ("e", 2, 9, 0, 6)], q),
        ],
        # rank 1: a TP-style slice of columns and a row slice.
        [
            ("w.cols", [("w", 0, 10, 2, 5)], "none"),
            ("u.rows", [("u", 3, 9, 0, 3)], q),
        ],
    ]


def weights(seed: int) -> dict[str, np.ndarray]:
    """Global bf16 tensors (as uint16 bit patterns), finite values."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, _) in PARAMS.items():
        f = rng.standard_normal(shape).astype(np.float32) * 3
        out[name] = (f.view(np.uint32) >> 16).astype(np.uint16)
    return out


def box(w: np.ndarray, r: tuple[int, int], c: tuple[int, int]) -> np.ndarray:
    rows, cols = rl.as_2d(w.shape)
    return w.reshape(rows, cols)[r[0] : r[1], c[0] : c[1]]


def expected(w: dict[str, np.ndarray], segments) -> np.ndarray:
    return np.concatenate([box(w[p], (r0, r1), (c0, c1)) for p, r0, r1, c0, c1 in segments])


# --- an independent e4m3 reference: nearest representable value, ties to
# the even code, saturating at 448 (every finite e4m3fn value enumerated).
_CODES = np.arange(0x7F, dtype=np.uint8)  # 0x00..0x7E: the non-negative finite values


def _e4m3_value(code: np.ndarray) -> np.ndarray:
    e = (code >> 3).astype(np.int32) & 0xF
    m = (code & 7).astype(np.float64)
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))


_VALUES = _e4m3_value(_CODES)


def ref_e4m3(x: np.ndarray) -> np.ndarray:
    a = np.abs(x.astype(np.float64)).ravel()
    hi = np.clip(np.searchsorted(_VALUES, a), 1, len(_VALUES) - 1)
    lo = hi - 1
    dlo, dhi = a - _VALUES[lo], _VALUES[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= 448, 0x7E, pick).astype(np.uint8)
    return (pick | np.where(np.signbit(x.ravel()), 0x80, 0).astype(np.uint8)).reshape(x.shape)


def ref_fp8(bits: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    x = (bits.astype(np.uint32) << 16).view(np.float32)
    rows, cols = x.shape
    q = np.zeros((rows, cols), np.uint8)
    br, bc = -(-rows // block), -(-cols // block)
    scales = np.zeros((br, bc), np.float32)
    for i in range(br):
        for j in range(bc):
            t = x[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = np.float32(np.abs(t).max())
            s = np.float32(amax / np.float32(448.0)) if amax > 0 else np.float32(1.0)
            scales[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = ref_e4m3(t / s)
    return q, scales


def check_live(inf, w, tgt, block: int = 4) -> None:
    """Inference rank `inf`'s live tensors (targets `tgt`) against the
    reference of weights `w`: bf16 bytes, or fp8 bytes and scales."""
    for k, (name, segs, quant) in enumerate(tgt):
        want = expected(w, segs)
        got = np.frombuffer(inf.read(k), np.uint8)
        if quant == "none":
            assert np.array_equal(got.view(np.uint16).reshape(want.shape), want), name
        else:
            q, s = ref_fp8(want, block)
            assert np.array_equal(got.reshape(want.shape), q), name
            assert np.array_equal(np.frombuffer(inf.read_scales(k), np.float32).reshape(s.shape), s), name


def run_all(fns):
    """Runs every callable on its own thread; returns results or raises the first error."""
    out, errs = [None] * len(fns), []

    def go(i, f):
        try:
            out[i] = f()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=go, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    if errs:
        raise errs[0]
    return out


class Cluster:
    def __init__(self, engines, plan, timeout=10.0):
        self.plan = plan
        self.trainers = [rl.RlTrainer(engines[r], plan, r, timeout=timeout) for r in range(4)]
        self.inference = [rl.RlInference(engines[4 + i], plan, i, timeout=timeout) for i in range(2)]
        self.dir = rl.RlDirectory(
            plan, [t.endpoint() for t in self.trainers], [i.endpoint() for i in self.inference]
        )

    def load(self, w):
        for t in self.trainers:
            for k, (name, r, c) in enumerate(self.plan.pieces(t.rank)):
                t.load_piece(k, np.ascontiguousarray(box(w[name], r, c)))

    def step(self, version, trainers=None):
        trainers = self.trainers if trainers is None else trainers
        return run_all(
            [lambda t=t: t.step(version, self.dir) for t in trainers]
            + [lambda i=i: i.step(version, self.dir) for i in self.inference]
        )

    def check(self, w, fp8=False, block=4):
        for i, inf in enumerate(self.inference):
            for k, (name, segs, quant) in enumerate(targets(fp8)[i]):
                n, rows, cols, q, _ = self.plan.tensors(i)[k]
                assert (n, q) == (name, quant)
                want = expected(w, segs)
                assert (rows, cols) == want.shape
                got = np.frombuffer(inf.read(k), np.uint8)
                if quant == "none":
                    assert np.array_equal(got.view(np.uint16).reshape(rows, cols), want), name
                else:
                    rq, rs = ref_fp8(want, block)
                    assert np.array_equal(got.reshape(rows, cols), rq), name
                    s = np.frombuffer(inf.read_scales(k), np.float32).reshape(rs.shape)
                    assert np.array_equal(s, rs), name


@pytest.fixture
def engines():
    backend = weft.provider("loopback", seed=3)
    es = [weft.TransferEngine(backend) for _ in range(6)]
    yield es
    for e in es:
        e.shutdown()


@pytest.mark.parametrize("fp8", [False, True])
def test_mesh_layouts_update_bit_exact(engines, fp8):
    plan = rl.RlPlan(4, params(), targets(fp8), block=4, unit_bytes=48, align=8, min_direct_bytes=16)
    assert plan.trainers == 4 and plan.inference_ranks == 2
    # Every rank of the mesh holds its DTensor box: w's grid of four.
    assert [p for p in plan.pieces(1) if p[0] == "w"] == [("w", (0, 5), (3, 6))]
    c = Cluster(engines, plan)
    for version in range(3):
        w = weights(100 + version)
        c.load(w)
        stats = c.step(version)
        assert all(s["waves"] > 0 for s in stats[:4])
        assert sum(s["bytes"] for s in stats[:4]) > 0
        assert all(i.live == version for i in c.inference)
        c.check(w, fp8=fp8)
    s = plan.summary()
    assert s["units"] > 0 and len(s["trainer_bytes"]) == 4


def test_a_trainer_that_never_writes_fails_the_step_and_old_weights_stay(engines):
    plan = rl.RlPlan(4, params(), targets(), block=4, unit_bytes=48, align=8, min_direct_bytes=16)
    c = Cluster(engines, plan, timeout=1.0)
    w0 = weights(1)
    c.load(w0)
    c.step(0)
    c.load(weights(2))
    # Trainer 3 is absent: the others and the inference ranks time out.
    with pytest.raises(rl.RlError) as e:
        c.step(1, trainers=c.trainers[:3])
    assert e.value.kind in ("timeout", "engine")
    assert all(i.live == 0 for i in c.inference)
    c.check(w0)
    for x in c.trainers + c.inference:
        x.recover()
    w1 = weights(3)
    c.load(w1)
    c.step(1)
    assert all(i.live == 1 for i in c.inference)
    c.check(w1)


def test_refusals_are_typed(engines):
    with pytest.raises(rl.RlError) as e:
        rl.RlPlan(4, [("w", 4, 4, ("mesh", [3], [0, 1], [0]))], [[]])
    assert e.value.kind == "layout"
    with pytest.raises(rl.RlError):
        rl.RlPlan(4, [("w", 4, 4, ("grid", [0]))], [[]])
    with pytest.raises(rl.RlError):
        rl.RlPlan(4, params(), [[("x", [("nope", 0, 1, 0, 1)], "none")]])
    with pytest.raises(rl.RlError):
        rl.RlPlan(4, params(), [[("x", [("w", 0, 1, 0, 1)], "int4")]])
    with pytest.raises(rl.RlError) as e:
        rl.RlPlan(4, params(), targets(), block=0)
    assert e.value.kind == "config"
    with pytest.raises(rl.RlError) as e:
        rl.layout_of("x", (2, 3, 4), [0, 1], [2], [1])
    assert e.value.kind == "layout"
    plan = rl.RlPlan(4, params(), targets(), block=4, align=8)
    t = rl.RlTrainer(engines[0], plan, 0)
    with pytest.raises(weft.WeftError):
        t.load_piece(0, np.zeros(3, np.uint8))  # wrong size
    with pytest.raises(weft.WeftError):
        t.load("nope", np.zeros(3, np.uint8))
    with pytest.raises(rl.RlError) as e:
        rl.RlTrainer(engines[1], plan, 9)
    assert e.value.kind == "unknown_rank"
    i = rl.RlInference(engines[4], plan, 0)
    with pytest.raises(weft.WeftError):
        i.read(0)  # nothing live yet
    with pytest.raises(weft.WeftError):
        rl.RlDirectory(plan, [t.endpoint()], [i.endpoint()])  # counts


def test_layout_of_maps_placements():
    class Shard:
        def __init__(self, dim):
            self.dim = dim

    class Replicate:
        pass

    assert rl.layout_of("w", (8, 4), [0, 1, 2, 3], [2, 2], [Shard(0), Shard(1)]) == (
        "mesh",
        [2, 2],
        [0, 1, 2, 3],
        [0, 1],
    )
    assert rl.layout_of("e", (4, 2, 3), [5, 6], None, [Replicate()]) == ("mesh", [2], [5, 6], [None])
    assert rl.layout_of("b", (5,), [0, 1], None, [Shard(-1)]) == ("mesh", [2], [0, 1], [0])
    assert rl.layout_of("r", (5,), [0, 1]) == ("replicate", [0, 1])
    assert rl.as_2d((4, 2, 3)) == (4, 6) and rl.as_2d((7,)) == (7, 1) and rl.as_2d(()) == (1, 1)
    t = rl.whole_targets(params(), 2, fp8=["w"])
    assert len(t) == 2 and t[0][0] == ("w", [("w", 0, 10, 0, 6)], "fp8")


RANK = r"""
import sys, time
import numpy as np, weft, weft.rl as rl
sys.path.insert(0, sys.argv[4])
import test_rl as T

role, rank, store_path, device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[5]
if device == "cuda":  # torch CUDA tensors in and out (the GPU machine)
    import torch
plan = rl.RlPlan(4, T.params(), T.targets(True), block=4, unit_bytes=48, align=8, min_direct_bytes=16)
eng = weft.TransferEngine("libfabric:tcp", domain="same-machine")
me = rl.RlTrainer(eng, plan, rank) if role == "trainer" else rl.RlInference(eng, plan, rank)
store = weft.rendezvous.open_store("dir:" + store_path)
session = weft.rendezvous.Session(store, ttl=30)
ns = weft.rendezvous.Namespace(store, "rl")
rl.publish_endpoint(ns, session, me)
d = rl.wait_directory(ns, plan, timeout=60)
for version in range(2):
    w = T.weights(500 + version)
    if role == "trainer" and device == "cuda":
        # whole parameters as CUDA bf16 tensors: load_local cuts the pieces
        full = {n: torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16).cuda() for n, a in w.items()}
        assert rl.load_local(me, full.items()) == len(plan.pieces(rank))
        me.step(version, d)
    elif role == "trainer":
        for k, (name, r, c) in enumerate(plan.pieces(rank)):
            me.load_piece(k, np.ascontiguousarray(T.box(w[name], r, c)))
        me.step(version, d)
    else:
        me.step(version, d)
        if device == "cuda":
            got = rl.read_tensors(me)
            for name, segs, quant in T.targets(True)[rank]:
                if quant == "none":
                    want = torch.from_numpy(T.expected(w, segs).astype(np.int16)).cuda()
                    assert torch.equal(got[name].cuda().view(torch.int16), want), name
        T.check_live(me, w, T.targets(True)[rank])
print(role, rank, "ok", flush=True)
time.sleep(1.0)  # the last acks reach the trainers before the engine goes
session.close()
eng.shutdown()
"""


def run_rl_ranks(tmp_path, device: str = "cpu") -> None:
    """Four trainer and two inference processes over libfabric tcp, finding
    each other through a dir: store; two versions, fp8 targets included."""
    status = {p.spec: p for p in weft.providers()}["libfabric:tcp"]
    if not status.available:
        pytest.skip(f"libfabric:tcp: {status.reason}")
    here = os.path.dirname(__file__)
    roles = [("trainer", r) for r in range(4)] + [("inference", r) for r in range(2)]
    argvs = [[role, str(r), str(tmp_path / "store"), here, device] for role, r in roles]
    outs = run_ranks(RANK, argvs, cwd=str(tmp_path), timeout=180)
    assert outs == [f"{role} {r} ok" for role, r in roles]


@pytest.mark.fabric
def test_trainer_and_inference_processes_over_tcp(tmp_path):
    run_rl_ranks(tmp_path)


def test_f32_sources_and_the_explicit_fp8_fallback(engines):
    """An f32 parameter arrives as f32; fp8 targets that cannot be quantised
    as given (a fused segment of 5 rows with 4-row tiles; an f32 source)
    are refused, or with fp8_fallback=True kept in the trainers' dtype and
    listed."""
    ps = params() + [("f", 6, 3, ("mesh", [2], [1, 2], [0]), 0, "f32")]
    tgt = [
        [
            ("f", [("f", 0, 6, 0, 3)], "none"),
            ("bad", [("w", 0, 5, 0, 6), ("e", 0, 9, 0, 6)], "fp8"),
            ("f8", [("f", 1, 5, 0, 3)], "fp8"),
            ("ok", [("w", 0, 8, 0, 6), ("e", 2, 9, 0, 6)], "fp8"),
        ],
        [("n", [("n", 0, 7, 0, 1)], "none")],
    ]
    kw = dict(block=4, unit_bytes=48, align=8, min_direct_bytes=16)
    with pytest.raises(rl.RlError) as e:
        rl.RlPlan(4, ps, tgt, **kw)
    assert e.value.kind == "layout"
    plan = rl.RlPlan(4, ps, tgt, fp8_fallback=True, **kw)
    assert [(r, t) for r, t, _ in plan.fallbacks()] == [(0, "bad"), (0, "f8")]
    assert [t[3:] for t in plan.tensors(0)] == [("none", "f32"), ("none", "bf16"), ("none", "f32"), ("fp8", "fp8")]
    trainers = [rl.RlTrainer(engines[r], plan, r) for r in range(4)]
    inference = [rl.RlInference(engines[4 + i], plan, i) for i in range(2)]
    d = rl.RlDirectory(plan, [t.endpoint() for t in trainers], [i.endpoint() for i in inference])
    w = weights(77)
    f = np.random.default_rng(5).standard_normal((6, 3)).astype(np.float32)
    for t in trainers:
        for k, (name, r, c) in enumerate(plan.pieces(t.rank)):
            src = f if name == "f" else w[name]
            t.load_piece(k, np.ascontiguousarray(box(src, r, c)))
    run_all([lambda t=t: t.step(0, d) for t in trainers] + [lambda i=i: i.step(0, d) for i in inference])
    got = lambda k: np.frombuffer(inference[0].read(k), np.uint8)  # noqa: E731
    assert np.array_equal(got(0).view(np.float32).reshape(6, 3), f)
    assert np.array_equal(got(1).view(np.uint16).reshape(14, 6), expected(w, tgt[0][1][1]))
    assert np.array_equal(got(2).view(np.float32).reshape(4, 3), f[1:5])
    q, s = ref_fp8(expected(w, tgt[0][3][1]), 4)
    assert np.array_equal(got(3).reshape(q.shape), q)


def test_a_directory_naming_the_wrong_memory_fails_the_step(engines):
    """Descriptors arrive from other processes: a directory that names a
    trainer's arena where an inference rank's weights should be (too small,
    another role's memory) fails the step with a typed error; nothing
    panics, and nothing lands outside the named regions."""
    plan = rl.RlPlan(4, params(), targets(), block=4, unit_bytes=48, align=8, min_direct_bytes=16)
    c = Cluster(engines, plan, timeout=2.0)
    c.load(weights(1))
    t0 = c.trainers[0].endpoint()
    bad = rl.RlDirectory(plan, [t.endpoint() for t in c.trainers], [t0, c.inference[1].endpoint()])
    with pytest.raises(rl.RlError) as e:
        run_all([lambda t=t: t.step(0, bad) for t in c.trainers])
    assert e.value.kind in ("engine", "timeout")
    assert all(i.live is None for i in c.inference)


def test_directory_through_a_rendezvous_store(engines, tmp_path):
    """`publish_endpoint` / `wait_directory`: every rank's endpoint as a
    record of a rendezvous namespace builds the directory; a record holding
    another rank's endpoint (forged or misfiled) is a typed ``bootstrap``
    error, and a missing one times out."""
    plan = rl.RlPlan(4, params(), targets(), block=4, unit_bytes=48, align=8, min_direct_bytes=16)
    c = Cluster(engines, plan)
    store = weft.rendezvous.open_store(f"dir:{tmp_path}/s")
    session = weft.rendezvous.Session(store, ttl=30)
    ns = weft.rendezvous.Namespace(store, "rl")
    for x in c.trainers + c.inference:
        rl.publish_endpoint(ns, session, x)
    c.dir = rl.wait_directory(ns, plan, timeout=5)
    w = weights(37)
    c.load(w)
    c.step(0)
    c.check(w)
    forged = weft.rendezvous.Namespace(store, "forged")
    for x in c.trainers + c.inference:
        rl.publish_endpoint(forged, session, x)
    # inference-1's record now holds trainer 0's endpoint.
    forged.publish_record(session, rl.ENDPOINT_RECORD, "inference-1", rl.encode_endpoint(c.trainers[0]))
    with pytest.raises(rl.RlError) as e:
        rl.wait_directory(forged, plan, timeout=5)
    assert e.value.kind == "bootstrap"
    with pytest.raises(weft.RendezvousTimeoutError) as e:
        rl.wait_directory(weft.rendezvous.Namespace(store, "empty"), plan, timeout=0.2)
    assert "trainer-0" in str(e.value)
    session.close()


def test_directory_from_endpoint_bytes_in_any_order(engines):
    """What `bootstrap` all-gathers: every rank's `encode_endpoint` bytes,
    in any order, build the directory; garbled, duplicated, missing or
    foreign payloads raise typed errors (never anything else)."""
    plan = rl.RlPlan(4, params(), targets(), block=4, unit_bytes=48, align=8, min_direct_bytes=16)
    c = Cluster(engines, plan)
    payloads = [rl.encode_endpoint(x) for x in c.trainers + c.inference]
    assert rl.decode_endpoint(payloads[4])[:2] == ("inference", 0)
    c.dir = rl.directory_of(plan, list(reversed(payloads)))
    w = weights(31)
    c.load(w)
    c.step(0)
    c.check(w)
    for bad in [payloads[:-1], payloads + payloads[:1], payloads[:5] + [payloads[0]]]:
        with pytest.raises(rl.RlError) as e:
            rl.directory_of(plan, bad)
        assert e.value.kind == "bootstrap"
    p = payloads[2]
    for junk in [b"", b"wrl1", b"wrl1x" + p[5:], p[:-1], p + b"\0"]:
        with pytest.raises(rl.RlError) as e:
            rl.decode_endpoint(junk)
        assert e.value.kind == "bootstrap"
    for i in range(len(p)):
        flipped = p[:i] + bytes([p[i] ^ 0x5A]) + p[i + 1 :]
        try:
            rl.decode_endpoint(flipped)
        except (rl.RlError, weft.DescriptorError):
            pass


def test_a_target_with_its_own_fp8_block(engines):
    """"fp8:<n>" gives one tensor its own n x n tiles (the plan's block is
    4; "we" uses 2, with its fused segment boundary at row 8, whole tiles
    of either): data and scales match the reference at each block; a bad
    block is a typed layout error."""
    tgt = targets(True)
    tgt[0][4] = ("we", tgt[0][4][1], "fp8:2")
    kw = dict(block=4, unit_bytes=48, align=8, min_direct_bytes=16)
    plan = rl.RlPlan(4, params(), tgt, **kw)
    c = Cluster(engines, plan)
    w = weights(55)
    c.load(w)
    c.step(0)
    for i, (name, segs, quant, block) in [(0, (*tgt[0][4], 2)), (1, (*tgt[1][1], 4))]:
        k = [t[0] for t in tgt[i]].index(name)
        want = expected(w, segs)
        q, s = ref_fp8(want, block)
        got = np.frombuffer(c.inference[i].read(k), np.uint8).reshape(want.shape)
        assert np.array_equal(got, q), name
        sc = np.frombuffer(c.inference[i].read_scales(k), np.float32).reshape(s.shape)
        assert np.array_equal(sc, s), name
    for bad in ["fp8:0", "fp8:x", "fp8:9999", "int4"]:
        t2 = targets(True)
        t2[0][4] = ("we", t2[0][4][1], bad)
        with pytest.raises(rl.RlError) as e:
            rl.RlPlan(4, params(), t2, **kw)
        assert e.value.kind == "layout", bad


def test_targets_joined_side_by_side(engines):
    """A target's segments joined along columns ("cols", torch.cat(dim=1)):
    w's columns 0..4 beside u's rows 0..10 (4 and 3 wide), bf16 and fp8
    (4-wide tiles: the first segment is whole tiles), against numpy's
    concatenation and the e4m3 reference; an unknown concat is a typed
    layout error."""
    segs = [("w", 0, 10, 0, 4), ("u", 0, 10, 0, 3)]
    tgt = [[("side", segs, "none", "cols"), ("side.fp8", segs, "fp8", "cols")], [("n", [("n", 0, 7, 0, 1)], "none")]]
    kw = dict(block=4, unit_bytes=48, align=8, min_direct_bytes=16)
    plan = rl.RlPlan(4, params(), tgt, **kw)
    c = Cluster(engines, plan)
    w = weights(91)
    c.load(w)
    c.step(0)
    want = np.concatenate([box(w[p], (r0, r1), (c0, c1)) for p, r0, r1, c0, c1 in segs], axis=1)
    got = np.frombuffer(c.inference[0].read(0), np.uint16).reshape(want.shape)
    assert np.array_equal(got, want)
    q, s = ref_fp8(want, 4)
    assert np.array_equal(np.frombuffer(c.inference[0].read(1), np.uint8).reshape(q.shape), q)
    assert np.array_equal(np.frombuffer(c.inference[0].read_scales(1), np.float32).reshape(s.shape), s)
    with pytest.raises(rl.RlError) as e:
        rl.RlPlan(4, params(), [[("side", segs, "none", "diagonal")], []], **kw)
    assert e.value.kind == "layout"
    assert "diagonal" in str(e.value)
    with pytest.raises(rl.RlError) as e:
        rl.RlPlan(4, params(), [[("side", segs, "none", 7)], []], **kw)
    assert e.value.kind == "layout" and "concat 7 " in str(e.value)
    with pytest.raises(rl.RlError) as e:
        rl.RlPlan(4, params(), tgt, ramp=17, **kw)
    assert e.value.kind == "config"
