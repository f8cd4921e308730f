"""weft.rl.bootstrap: four trainer and two inference processes in one
``torch.distributed`` gloo group (ranks in a shuffled order) build their
directory with one collective and push two versions over libfabric tcp,
checked bit for bit by the inference processes (the tables and the
reference are those of python/tests/test_rl.py)."""

from __future__ import annotations

import os
import sys

import pytest

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)
from procs import run_ranks  # noqa: E402  (python/tests/procs.py)

pytest.importorskip("torch")

RANK = r"""
import sys, time
import numpy as np, torch.distributed as dist, weft, weft.rl as rl
sys.path.insert(0, sys.argv[3])
import test_rl as T
g, tmp = int(sys.argv[1]), sys.argv[2]
# Group rank g plays a shuffled role: the plan's ranks need not follow the group's.
role, rank = [("inference", 1), ("trainer", 2), ("trainer", 0), ("inference", 0), ("trainer", 3), ("trainer", 1)][g]
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=g, world_size=6)
plan = rl.RlPlan(4, T.params(), T.targets(True), block=4, unit_bytes=48, align=8, min_direct_bytes=16)
eng = weft.TransferEngine("libfabric:tcp", domain="same-machine")
me = rl.RlTrainer(eng, plan, rank) if role == "trainer" else rl.RlInference(eng, plan, rank)
d = rl.bootstrap(me)
for version in range(2):
    w = T.weights(700 + version)
    if role == "trainer":
        for k, (name, r, c) in enumerate(plan.pieces(rank)):
            me.load_piece(k, np.ascontiguousarray(T.box(w[name], r, c)))
    me.step(version, d)
    if role == "inference":
        T.check_live(me, w, T.targets(True)[rank])
dist.barrier()
print("ok", flush=True)
eng.shutdown()
"""


def test_bootstrap_over_a_gloo_group(tmp_path):
    import weft

    status = {p.spec: p for p in weft.providers()}["libfabric:tcp"]
    if not status.available:
        pytest.skip(f"libfabric:tcp: {status.reason}")
    argvs = [[str(g), str(tmp_path), TESTS] for g in range(6)]
    outs = run_ranks(RANK, argvs, env=dict(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"), timeout=180)
    assert outs == ["ok"] * 6
