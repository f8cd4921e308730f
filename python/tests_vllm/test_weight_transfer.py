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


def _workers(ctx, tmp_path, procs: list, tp: int = 1) -> tuple[list, list]:
    """Two vLLM worker processes (with ``tp`` 2: the two TP ranks of one
    model), ready: their control pipes and the client ends of their RPC
    pipes (for trainer 0's client)."""
    ctls, client_ends = [], []
    for r in range(2):
        ctl, ctl_child = ctx.Pipe()
        rpc, rpc_child = ctx.Pipe()
        p = ctx.Process(target=rl_ranks.serve_worker, args=(ctl_child, rpc_child, str(tmp_path), r, tp), daemon=True)
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


def _push_three_versions(tmp_path, provider: str, tp: int) -> list:
    """Two trainers push three versions into two workers (``tp`` 2: the TP
    ranks of one model); every worker holds each version byte for byte.
    Returns what each worker took straight into its model."""
    _require(provider)
    ctx = mp.get_context("spawn")
    procs: list = []
    try:
        workers, client_ends = _workers(ctx, tmp_path, procs, tp=tp)
        trainers = _trainers(ctx, tmp_path, procs, client_ends, provider, 3)
        for r, (_, c) in enumerate(trainers):
            assert _recv(c, f"trainer {r}") == ("done", 3)
        for c in client_ends:
            c.close()
        out = []
        for r, c in enumerate(workers):
            _, versions, direct = _recv(c, f"worker {r}")
            assert versions == [(v, []) for v in range(3)], f"worker {r}: {versions}"
            out.append(direct)
        return out
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("provider", ["libfabric:tcp", "libfabric:shm"])
def test_trainers_push_versions_into_vllm_workers(provider, tmp_path):
    direct = _push_three_versions(tmp_path, provider, tp=1)
    assert direct == [[], []], "no vLLM loaders: every parameter through load_weights"


def test_tp_workers_take_their_shards_straight_into_the_model(tmp_path):
    """Two workers as the TP ranks of one model whose fused qkv_proj and
    gate_up_proj, o_proj, norm and embedding carry vLLM's QKV,
    merged-column, row-parallel, default and vocabulary-parallel loaders:
    each worker receives only its own
    shards (its heads of q, k and v stacked, its halves of gate and up, half
    of o_proj's columns, its 5 of the embedding's 10 rows into 8 padded
    ones) and copies them into the parameters, holding
    exactly what vLLM's loaders make of the whole checkpoint tensors; the
    fp8 tensor and the loader-less bias still go through load_weights.
    Three versions over tcp."""
    direct = _push_three_versions(tmp_path, "libfabric:tcp", tp=2)
    want = ["embed.weight"] + [f"layers.0.{m}.weight" for m in ["gate_up_proj", "norm", "o_proj", "qkv_proj"]]
    assert direct == [want, want], direct


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
    whole = vw._targets(m, table, ["a"], True, False)
    assert whole == [["a", [["a", 0, 4, 0, 6]], False], ["b", [["b", 0, 5, 0, 1]], False]], "no loaders: whole"
    plan = vw._plan(table, 3, [whole, whole], ["a"], {"block": 4})
    assert plan.params() == [("a", 4, 6, "bf16"), ("b", 5, 1, "bf16")]
    assert [t[0] for t in plan.tensors(1)] == ["a", "b"] and plan.tensors(1)[0][3] == "fp8"
    assert {p[0] for p in plan.pieces(2)} == {"a", "b"}
    m.register_parameter("c", torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)))
    with pytest.raises(rl.RlError) as e:
        t = vw._table(ModuleSource(m).metadata)
        vw._plan(t, 3, [vw._targets(m, t, [], True, False)] * 2, [], {})
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


def test_targets_follow_vllm_loaders_and_refuse_the_rest():
    """Which part of each parameter a worker takes: its TP shard for vLLM's
    row- and column-parallel loaders (columns of a 2-D weight, rows of a
    1-D bias), its heads of q, k and v for a fused QKV loader (key/value
    heads replicated over 4 ranks: rank 3 takes head 1), its parts of a
    merged gate/up, its vocabulary rows of an embedding, the whole tensor
    for the default loader; anything else
    arrives whole for load_weights (no loader, a wrapped loader, packed, a
    shape that is not the checkpoint's split, an fp8 name, a fused part
    missing). With whole modules, a module with one parameter through
    load_weights takes all through it. Records read back from the store
    are checked: wrong names, lengths, types or ranges are typed layout
    errors."""
    import functools
    import types

    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from rl_ranks import vllm_owner

    tp = dict(tp_rank=1, tp_size=2)
    z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731

    def put(m, path, t, cls=None, owner=None, **attrs):
        mod = m
        for part in path.split(".")[:-1]:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        setattr(mod, path.split(".")[-1], t)
        for k, v in attrs.items():
            setattr(t, k, v)
        if cls is not None:
            t.weight_loader = types.MethodType(cls.weight_loader, owner or vllm_owner(cls, **tp))

    m = torch.nn.Module()
    m.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    put(m, "row.weight", z(6, 4), RowParallelLinear, input_dim=1)
    put(m, "row.bias", z(6))
    put(m, "col.weight", z(3, 8), ColumnParallelLinear, output_dim=0)
    put(m, "col.bias", z(3), ColumnParallelLinear, output_dim=0)
    put(m, "norm.weight", z(8))
    m.norm.weight.weight_loader = default_weight_loader
    put(m, "plain.weight", z(4, 4))
    put(m, "wrapped.weight", z(3, 8), output_dim=0)
    m.wrapped.weight.weight_loader = functools.partial(ColumnParallelLinear.weight_loader, vllm_owner(ColumnParallelLinear, **tp))
    put(m, "packed.weight", z(3, 8), ColumnParallelLinear, output_dim=0, packed_dim=0)
    put(m, "odd.weight", z(4, 8), ColumnParallelLinear, output_dim=0)
    put(m, "f8.weight", z(3, 8), ColumnParallelLinear, output_dim=0)
    # q: 4 heads of 2 over TP 4 (1 each); k, v: 2 heads over TP 4 (replicated twice).
    qkv = vllm_owner(
        QKVParallelLinear, num_heads=1, num_kv_heads=1, num_kv_head_replicas=2, head_size=2, v_head_size=2, tp_rank=3, tp_size=4
    )
    put(m, "attn.qkv_proj.weight", z(6, 8), QKVParallelLinear, qkv, output_dim=0)
    put(m, "mlp.gate_up_proj.weight", z(6, 8), MergedColumnParallelLinear, vllm_owner(MergedColumnParallelLinear, output_sizes=[6, 6], **tp), output_dim=0)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    idx = types.SimpleNamespace(org_vocab_start_index=5, org_vocab_end_index=10)
    put(m, "embed.weight", z(8, 4), VocabParallelEmbedding, vllm_owner(VocabParallelEmbedding, shard_indices=idx, org_vocab_size=10), output_dim=0)
    # A fused parameter whose parts are not all in the checkpoint.
    put(m, "lone.gate_up_proj.weight", z(6, 8), MergedColumnParallelLinear, vllm_owner(MergedColumnParallelLinear, output_sizes=[6, 6], **tp), output_dim=0)
    full = {
        "row.weight": (6, 8),
        "row.bias": (6,),
        "col.weight": (6, 8),
        "col.bias": (6,),
        "norm.weight": (8,),
        "plain.weight": (4, 4),
        "wrapped.weight": (6, 8),
        "packed.weight": (6, 8),
        "odd.weight": (6, 8),
        "f8.weight": (6, 8),
        "attn.q_proj.weight": (8, 8),
        "attn.k_proj.weight": (4, 8),
        "attn.v_proj.weight": (4, 8),
        "mlp.gate_proj.weight": (6, 8),
        "mlp.up_proj.weight": (6, 8),
        "lone.gate_proj.weight": (6, 8),
        "embed.weight": (10, 4),
    }
    table = [[n, "torch.bfloat16", list(s), None, None, None] for n, s in full.items()]
    got = {t[0]: (t[1], t[2]) for t in vw._targets(m, table, ["f8.weight"], True, False)}
    whole = lambda n: ([[n, 0, *rl.as_2d(full[n])[:1], 0, rl.as_2d(full[n])[1]]], False)  # noqa: E731
    assert got == {
        "row.weight": ([["row.weight", 0, 6, 4, 8]], True),
        "col.weight": ([["col.weight", 3, 6, 0, 8]], True),
        "col.bias": ([["col.bias", 3, 6, 0, 1]], True),
        "norm.weight": ([["norm.weight", 0, 8, 0, 1]], True),
        "attn.qkv_proj.weight": (
            [["attn.q_proj.weight", 6, 8, 0, 8], ["attn.k_proj.weight", 2, 4, 0, 8], ["attn.v_proj.weight", 2, 4, 0, 8]],
            True,
        ),
        "mlp.gate_up_proj.weight": ([["mlp.gate_proj.weight", 3, 6, 0, 8], ["mlp.up_proj.weight", 3, 6, 0, 8]], True),
        "embed.weight": ([["embed.weight", 5, 10, 0, 4]], True),
        **{
            n: whole(n)
            for n in [
                "row.bias",
                "plain.weight",
                "wrapped.weight",
                "packed.weight",
                "odd.weight",
                "f8.weight",
                "lone.gate_proj.weight",
            ]
        },
    }
    # Whole modules: row.bias goes through load_weights, so row.weight does.
    got = {t[0]: t[2] for t in vw._targets(m, table, ["f8.weight"], True, True)}
    assert got["row.weight"] is False and got["col.weight"] and got["attn.qkv_proj.weight"]
    # No straight copies asked for (quantised, PP): everything whole.
    assert not any(t[2] for t in vw._targets(m, table, [], False, False))
    good = vw._targets(m, table, [], True, False)
    assert vw._check_targets(table, 0, good) == good
    first = good[0]
    bad = [
        None,
        [["x", [["x", 0, 1, 0, 1]], True]],
        [[first[0], [[first[1][0][0], 0, 99, 0, 1]], True]],
        [[first[0], [[first[1][0][0], 0.0, 1, 0, 1]], True]],
        [[first[0], [[first[1][0][0], 0, 1, 0, 1]], 1]],
        [[first[0], [[first[1][0][0], False, 1, 0, 1]], True]],
        [[first[0], [], True]],
        [first, first],
        [["plain.weight", [["plain.weight", 0, 2, 0, 4]], False]],
    ]
    for b in bad:
        with pytest.raises(rl.RlError) as e:
            vw._check_targets(table, 3, b)
        assert e.value.kind == "layout", b
