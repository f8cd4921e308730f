"""weft as vLLM's weight-transfer backend, against the real vLLM package:
vLLM's factories create the ``"weft"`` worker engine (in two worker
processes, each with a model behind a vLLM-style ``load_weights``) and the
trainer engine (two trainer processes holding DTensor shards over a gloo
mesh, read through vLLM's ``ModuleSource``); the trainer sender drives the
workers through a ``VLLMWeightSyncClient``. Every byte of every version is
checked on the workers, fp8 values and scales against torch's own e4m3."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch
from vllm.distributed.weight_transfer.base import ModuleSource

import rl_ranks
import weft
import weft.rl as rl
import weft.vllm_weights as vw


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recv(conn, what: str, timeout: float = 240):
    if not conn.poll(timeout):
        raise TimeoutError(f"{what}: no answer in {timeout} s")
    r = conn.recv()
    if r[0] == "error":
        raise AssertionError(f"{what} failed:\n{r[1]}")
    return r


def _require(provider: str) -> None:
    status = {p.spec: p for p in weft.providers()}[provider]
    if not status.available:
        pytest.skip(f"{provider}: {status.reason}")


def _workers(ctx, tmp_path, procs: list) -> tuple[list, list]:
    """Two vLLM worker processes, ready: their control pipes and the
    client ends of their RPC pipes (for trainer 0's client)."""
    ctls, client_ends = [], []
    for r in range(2):
        ctl, ctl_child = ctx.Pipe()
        rpc, rpc_child = ctx.Pipe()
        p = ctx.Process(target=rl_ranks.serve_worker, args=(ctl_child, rpc_child, str(tmp_path), r), daemon=True)
        p.start()
        procs.append(p)
        ctls.append(ctl)
        client_ends.append(rpc)
    for r, c in enumerate(ctls):
        assert _recv(c, f"worker {r}")[1] == "WeftWeightTransferEngine"
    return ctls, client_ends


def _trainers(ctx, tmp_path, procs: list, client_ends: list, provider: str, versions: int, **kw) -> list:
    """Two trainer processes on a fresh gloo port and store: (process,
    control pipe) each; trainer 0 drives the workers."""
    port, store = _port(), f"dir:{tmp_path / 'store'}"
    out = []
    for r in range(2):
        ctl, ctl_child = ctx.Pipe()
        p = ctx.Process(
            target=rl_ranks.serve_trainer,
            args=(ctl_child, r, 2, port, client_ends if r == 0 else [], store, provider, versions),
            kwargs=kw,
            daemon=True,
        )
        p.start()
        procs.append(p)
        out.append((p, ctl))
    return out


@pytest.mark.parametrize("provider", ["libfabric:tcp", "libfabric:shm"])
def test_trainers_push_versions_into_vllm_workers(provider, tmp_path):
    _require(provider)
    ctx = mp.get_context("spawn")
    procs: list = []
    try:
        workers, client_ends = _workers(ctx, tmp_path, procs)
        trainers = _trainers(ctx, tmp_path, procs, client_ends, provider, 3)
        for r, (_, c) in enumerate(trainers):
            assert _recv(c, f"trainer {r}") == ("done", 3)
        for c in client_ends:
            c.close()
        for r, c in enumerate(workers):
            _, versions = _recv(c, f"worker {r}")
            assert versions == [(v, []) for v in range(3)], f"worker {r}: {versions}"
    finally:
        for p in procs:
            p.kill()


def test_a_trainer_dying_fails_the_update_and_workers_keep_the_last_version(tmp_path):
    """Trainer 1 exits hard before version 1: trainer 0's send_weights and
    the workers' receive_weights fail with weft.RlError within the step
    timeout (no hang), and both workers still hold version 0 byte for
    byte."""
    provider = "libfabric:tcp"
    _require(provider)
    ctx = mp.get_context("spawn")
    procs: list = []
    try:
        _, client_ends = _workers(ctx, tmp_path, procs)
        trainers = _trainers(ctx, tmp_path, procs, client_ends, provider, 2, die_at=1, timeout=3.0)
        kind, rl_kind, version, held = _recv(trainers[0][1], "trainer 0", timeout=120)[1]
        assert kind == "RlError" and rl_kind in ("timeout", "engine"), (kind, rl_kind)
        assert version == 1, "the failed version is retried next"
        assert held == [[], []], f"workers no longer hold version 0: {held}"
        trainers[1][0].join(30)
        assert trainers[1][0].exitcode == 1
    finally:
        for p in procs:
            p.kill()


def test_module_source_metadata_maps_to_the_plan():
    """vLLM's ModuleSource of plain tensors: every trainer holds each one
    whole; the plan gives every worker every parameter; fp16 is a typed
    refusal."""
    m = torch.nn.Module()
    m.register_parameter("a", torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16)))
    m.register_parameter("b", torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16)))
    table = vw._table(ModuleSource(m).metadata)
    assert table[0][:3] == ["a", "torch.bfloat16", [4, 6]]
    plan = vw._plan(table, 3, 2, ["a"], {"block": 4})
    assert plan.params() == [("a", 4, 6, "bf16"), ("b", 5, 1, "bf16")]
    assert [t[0] for t in plan.tensors(1)] == ["a", "b"] and plan.tensors(1)[0][3] == "fp8"
    assert {p[0] for p in plan.pieces(2)} == {"a", "b"}
    m.register_parameter("c", torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)))
    with pytest.raises(rl.RlError) as e:
        vw._plan(vw._table(ModuleSource(m).metadata), 3, 2, [], {})
    assert e.value.kind == "layout"


def test_backend_is_registered_with_both_factories():
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    assert WeightTransferEngineFactory._registry["weft"]() is vw.WeftWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["weft"]() is vw.WeftTrainerEngine
    vw.register()  # idempotent
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("weft_weight_transfer") == "weft.vllm_weights:register"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
