"""Processes of the weight-transfer tests: vLLM workers (a toy model with a
vLLM-style ``load_weights`` behind the ``"weft"`` engine vLLM's factory
creates) and trainer ranks (DTensors over a gloo device mesh, vLLM's
``ModuleSource``, the trainer factory)."""

from __future__ import annotations

import os
import traceback
import types
from typing import Any, Optional

import torch

# Trainer parameters: name -> (shape, placement over the 1-D trainer mesh:
# an int shards that dim, None replicates, "plain" is not a DTensor).
PARAMS: dict[str, tuple[tuple[int, ...], Any]] = {
    "layers.0.q_proj.weight": ((8, 16), 0),
    "layers.0.k_proj.weight": ((4, 16), 0),
    "layers.0.v_proj.weight": ((4, 16), 1),
    "layers.0.gate_proj.weight": ((8, 16), 0),
    "layers.0.up_proj.weight": ((8, 16), 1),
    "layers.0.o_proj.weight": ((16, 8), 1),
    "layers.0.norm.weight": ((16,), None),
    "layers.0.bias": ((16,), "plain"),
    "layers.0.w8": ((8, 12), 0),
    "embed.weight": ((10, 16), 0),
}
#: The worker's fused parameters and their checkpoint parts, in order.
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
FP8 = ["layers.0.w8"]
BLOCK = 4


def weights(version: int) -> dict[str, torch.Tensor]:
    """The full bf16 tensors of `version` (every process computes them alike)."""
    g = torch.Generator().manual_seed(1000 + version)
    return {n: (torch.randn(s, generator=g) * 2).to(torch.bfloat16) for n, (s, _) in PARAMS.items()}


def ref_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one f32 scale per block x block tile: scale = amax / 448."""
    x = x.float()
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-rows // block), -(-cols // block), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            t = x[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = t.abs().max()
            # IEEE division (a Python-float divisor may become a multiply
            # by its reciprocal).
            scale = amax / torch.tensor(448.0) if amax > 0 else torch.tensor(1.0)
            s[i, j] = scale
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (t / scale).to(torch.float8_e4m3fn)
    return q, s


def vllm_owner(cls: type, **attrs: Any) -> Any:
    """A vLLM layer of class `cls` with just the attributes its loader
    reads (no process group needed)."""
    o = cls.__new__(cls)
    for k, v in attrs.items():
        object.__setattr__(o, k, v)
    return o


class _Layer(torch.nn.Module):
    def __init__(self, tp: int, rank: int) -> None:
        super().__init__()
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.bias = z(16)
        self.w8 = torch.nn.Parameter(torch.zeros(8, 12, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w8_scale_inv = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        for m in ("qkv_proj", "gate_up_proj", "o_proj", "norm"):
            self.add_module(m, torch.nn.Module())
        self.qkv_proj.weight = z(16 // tp, 16)
        self.gate_up_proj.weight = z(16 // tp, 16)
        self.o_proj.weight = z(16, 8 // tp)
        self.norm.weight = z(16)
        if tp > 1:
            # vLLM's own loaders, bound to layers of TP rank `rank`: fused
            # q/k/v (4 heads of 2, 2 key/value heads), fused gate/up, a
            # row-parallel o_proj, a norm.
            from vllm.model_executor.layers.linear import (
                MergedColumnParallelLinear,
                QKVParallelLinear,
                RowParallelLinear,
            )
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            tp_attrs = dict(tp_rank=rank, tp_size=tp)
            qkv = vllm_owner(
                QKVParallelLinear,
                num_heads=4 // tp,
                num_kv_heads=2 // tp,
                num_kv_head_replicas=1,
                head_size=2,
                v_head_size=2,
                total_num_heads=4,
                total_num_kv_heads=2,
                **tp_attrs,
            )
            merged = vllm_owner(MergedColumnParallelLinear, output_sizes=[8, 8], **tp_attrs)
            row = vllm_owner(RowParallelLinear, **tp_attrs)
            for m, owner, cls in [(self.qkv_proj, qkv, QKVParallelLinear), (self.gate_up_proj, merged, MergedColumnParallelLinear)]:
                m.weight.output_dim = 0
                m.weight.weight_loader = types.MethodType(cls.weight_loader, owner)
            self.o_proj.weight.input_dim = 1
            self.o_proj.weight.weight_loader = types.MethodType(RowParallelLinear.weight_loader, row)
            self.norm.weight.weight_loader = default_weight_loader


class ToyModel(torch.nn.Module):
    """The worker's model: q/k/v fused into qkv_proj and gate/up into
    gate_up_proj as vLLM does, w8 stored as fp8 with its scales, a
    10-token embedding; with ``tp`` 2, the fused projections, o_proj, the
    norm and the embedding (5 rows of each rank's 8, the rest padding)
    carry vLLM's loaders of TP rank ``rank``."""

    packed_modules_mapping = FUSED

    def __init__(self, tp: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(tp, rank)])
        self.embed = torch.nn.Module()
        # Not zeros: the padding rows must be cleared as vLLM's loader does.
        self.embed.weight = torch.nn.Parameter(torch.ones(10 if tp == 1 else 8, 16, dtype=torch.bfloat16), requires_grad=False)
        if tp > 1:
            from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

            idx = types.SimpleNamespace(org_vocab_start_index=5 * rank, org_vocab_end_index=5 * rank + 5)
            owner = vllm_owner(VocabParallelEmbedding, shard_indices=idx, org_vocab_size=10)
            self.embed.weight.output_dim = 0
            self.embed.weight.weight_loader = types.MethodType(VocabParallelEmbedding.weight_loader, owner)

    def load_weights(self, weights) -> set[str]:
        rows = {}
        for fused, parts in FUSED.items():
            at = 0
            for part in parts:
                n = PARAMS[f"layers.0.{part}.weight"][0][0]
                rows[f"layers.0.{part}.weight"] = (f"layers.0.{fused}.weight", at, at + n)
                at += n
        loaded = set()
        for name, t in weights:
            with torch.no_grad():
                if name in rows:
                    fused, a, b = rows[name]
                    self.get_parameter(fused)[a:b].copy_(t)
                else:
                    self.get_parameter(name).copy_(t)
            loaded.add(name)
        return loaded

    def matches(self, version: int) -> list[str]:
        """Names that differ from `version` (empty: all bytes right). A
        parameter with a vLLM loader must hold what that loader makes of
        the whole checkpoint tensors."""
        w = weights(version)
        want = {"layers.0.bias": w["layers.0.bias"]}
        parts = {f"layers.0.{f}.weight": [f"layers.0.{p}.weight" for p in ps] for f, ps in FUSED.items()}
        for name in [*parts, "layers.0.o_proj.weight", "layers.0.norm.weight", "embed.weight"]:
            p = self.get_parameter(name)
            fulls = [w[n] for n in parts.get(name, [name])]
            if not hasattr(p, "weight_loader"):
                want[name] = torch.cat(fulls)
                continue
            ref = torch.nn.Parameter(torch.zeros_like(p), requires_grad=False)
            for attr in ("input_dim", "output_dim"):
                if hasattr(p, attr):
                    setattr(ref, attr, getattr(p, attr))
            if name in parts:
                ids = ["q", "k", "v"] if "qkv" in name else list(range(len(fulls)))
                for shard_id, full in zip(ids, fulls):
                    p.weight_loader(ref, full, shard_id)
            else:
                p.weight_loader(ref, fulls[0])
            want[name] = ref.data
        layer = self.layers[0]
        q, s = ref_fp8(w["layers.0.w8"], BLOCK)
        bad = [n for n, t in want.items() if not torch.equal(self.get_parameter(n).view(torch.int16), t.view(torch.int16))]
        if not torch.equal(layer.w8.view(torch.uint8), q.view(torch.uint8)):
            bad.append("w8")
        if not torch.equal(layer.w8_scale_inv, s):
            bad.append("w8_scale_inv")
        return bad


def serve_worker(ctl, rpc, root: str, rank: int, tp: int = 1) -> None:
    """A vLLM worker: answers the trainer sender's RPCs on `rpc`; reports
    after each finished update whether its model holds that version, and
    at the end which parameters it took straight into the model."""
    try:
        import weft.vllm_weights  # noqa: F401  (registers "weft")
        from vllm.config import DeviceConfig, ModelConfig, VllmConfig
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
        from pathlib import Path

        import vllm_fixtures as F

        mc = ModelConfig(model=F.model_dir(Path(root)), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=256)
        vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))
        vc.parallel_config.rank = rank
        model = ToyModel(tp, rank)
        eng = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="weft"), vc, torch.device("cpu"), model
        )
        ctl.send(("ready", type(eng).__name__))
        versions = []
        while True:
            try:
                method, arg = rpc.recv()
            except EOFError:
                break
            try:
                if method == "init_weight_transfer_engine":
                    eng.init_transfer_engine(eng.parse_init_info(arg))
                elif method == "start_weight_update":
                    eng.start_weight_update()
                elif method == "update_weights":
                    # update_weights would synchronize an accelerator this
                    # CPU machine lacks; vLLM's base does exactly this first.
                    eng.receive_weights(eng.parse_update_info(arg))
                elif method == "finish_weight_update":
                    eng.finish_weight_update()
                    versions.append((int(arg), model.matches(int(arg))))
                elif method == "check":
                    rpc.send(("ok", model.matches(int(arg))))
                    continue
                rpc.send(("ok", None))
            except Exception:  # noqa: BLE001 - reported to the caller
                rpc.send(("error", traceback.format_exc()))
        direct = eng.direct
        eng.shutdown()
        ctl.send(("done", versions, direct))
    except Exception:  # noqa: BLE001
        ctl.send(("error", traceback.format_exc()))


class PipeClient:
    """VLLMWeightSyncClient over pipes to every worker: each call goes to
    all workers at once and returns when all answered."""

    def __init__(self, conns) -> None:
        self.conns = conns

    def _all(self, method: str, arg: Any = None) -> None:
        for c in self.conns:
            c.send((method, arg))
        errs = [r[1] for r in (c.recv() for c in self.conns) if r[0] != "ok"]
        if errs:
            raise RuntimeError("worker: " + errs[0])

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version=None) -> None:
        self._all("finish_weight_update", weight_version)

    def check(self, version: int) -> list:
        """Per worker: the names that differ from `version` (test only)."""
        for c in self.conns:
            c.send(("check", version))
        return [c.recv()[1] for c in self.conns]


def serve_trainer(
    ctl,
    rank: int,
    world: int,
    port: int,
    conns,
    store: str,
    provider: str,
    versions: int,
    die_at: Optional[int] = None,
    timeout: float = 30.0,
) -> None:
    """A trainer rank: DTensor shards over a gloo mesh, `versions` pushes.
    With `die_at`, rank 1 exits hard just before pushing that version and
    rank 0 reports how its push failed and what the workers then hold."""
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from vllm.distributed.weight_transfer.base import ModuleSource, VLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from weft.vllm_weights import WeftTrainerInitInfo

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        module = torch.nn.Module()
        w0 = weights(0)
        for name, (_, pl) in PARAMS.items():
            t = w0[name]
            if pl != "plain":
                t = distribute_tensor(t, mesh, [Replicate() if pl is None else Shard(pl)])
            module.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t, requires_grad=False))
        source = ModuleSource(_Named(module))
        client = PipeClient(conns) if rank == 0 else PipeClient([])
        assert isinstance(client, VLLMWeightSyncClient)
        info = WeftTrainerInitInfo(
            store=store,
            namespace="rl-test",
            provider=provider,
            inference_ranks=2,
            trainers=world,
            fp8=FP8,
            plan={"block": BLOCK, "unit_bytes": 64, "align": 16, "min_direct_bytes": 16},
            timeout=timeout,
            layerwise_reload=False,
            rank=rank,
        )
        eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        for v in range(versions):
            w = weights(v)
            with torch.no_grad():
                for name, p in module.named_parameters():
                    full = w[_unname(name)]
                    if hasattr(p, "to_local"):
                        p.to_local().copy_(distribute_tensor(full, mesh, p.placements).to_local())
                    else:
                        p.copy_(full)
            if v == die_at and rank == 1:
                os._exit(1)
            if v == die_at:
                try:
                    eng.send_weights()
                except Exception as e:  # noqa: BLE001 - reported to the test
                    held = client.check(v - 1)
                    ctl.send(("failed", (type(e).__name__, getattr(e, "kind", None), eng.version, held)))
                    os._exit(0)  # the gloo group lost a rank: no orderly teardown
                ctl.send(("error", f"version {v} succeeded without trainer 1"))
                os._exit(0)
            eng.send_weights()
        dist.barrier()
        eng.shutdown()
        dist.destroy_process_group()
        ctl.send(("done", eng.version))
    except Exception:  # noqa: BLE001
        ctl.send(("error", traceback.format_exc()))


def _unname(n: str) -> str:
    return {k.replace(".", "_"): k for k in PARAMS}[n]


class _Named(torch.nn.Module):
    """Presents the parameters under their dotted names."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def named_parameters(self, *a, **k):  # type: ignore[override]
        for n, p in self.inner.named_parameters():
            yield _unname(n), p
