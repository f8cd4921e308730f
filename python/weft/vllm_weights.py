"""weft as a vLLM weight-transfer backend (``"weft"``): RL trainers push
new weights into vLLM workers with one-sided WRITEs, every trainer rank
from the shards it holds (FSDP/TP DTensors included: no gather to a rank
0), into double-buffered host memory on each worker that becomes live only
when every byte landed. A vLLM parameter filled by a plain loader
(replicated, column- or row-parallel, a vocabulary-parallel embedding or
LM head) or a fused one (q/k/v, gate/up)
arrives as this worker's own tensor-parallel shard, assembled from the
checkpoint parts, and is copied straight into the model; every other
parameter arrives whole and goes through the model's own
``load_weights`` (checkpoint format: vLLM slices and fuses as it does for a
checkpoint). Workers publish which they take in the rendezvous store, and
every rank plans from all of them. See :mod:`weft.rl` for the transfer
itself.

Worker side (vLLM resolves it by name once registered)::

    import weft.vllm_weights                      # registers "weft" on import
    llm = LLM(model, weight_transfer_config=WeightTransferConfig(backend="weft"))

Trainer side, on every trainer rank (rank 0 drives the workers' RPCs)::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from weft.vllm_weights import WeftTrainerInitInfo

    info = WeftTrainerInitInfo(
        store="etcd:http://10.0.0.5:2379", namespace="job-7", provider="libfabric:efa",
        trainers=world_size, inference_ranks=num_vllm_workers, rank=rank)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    eng.send_weights()                            # every step, every rank

Ranks find each other through a weft rendezvous store (``store``: ``dir:``
for one host, ``etcd:`` across hosts) under ``namespace`` (use a fresh one
per job). A vLLM worker's inference rank is ``data_parallel_rank *
world_size + rank`` of its parallel config. ``layerwise_reload`` (default
on) runs vLLM's layerwise reload around each update, as vLLM's own
checkpoint-format engines do; it needs a model vLLM loaded itself.
Parameters named in ``fp8`` arrive as e4m3 with per-``block`` tile f32
scales, loaded as ``<name>`` and ``<name>_scale_inv`` (the DeepSeek-V3
checkpoint names).
"""

from __future__ import annotations

import inspect
import json
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from . import rendezvous, rl
from ._weft import TransferEngine

BACKEND = "weft"

__all__ = [
    "BACKEND",
    "WeftInitInfo",
    "WeftTrainerEngine",
    "WeftTrainerInitInfo",
    "WeftUpdateInfo",
    "WeftWeightTransferEngine",
    "register",
]


@dataclass
class WeftInitInfo(WeightTransferInitInfo):
    """What the trainer sender hands every worker at the init handshake."""

    store: str
    namespace: str
    provider: str
    trainers: int
    inference_ranks: int
    params: list
    """``[name, dtype, shape, owners, mesh_shape, placements]`` per
    parameter (placements: ``None`` or the tensor dimension per mesh
    dimension), in the trainers' metadata order."""
    fp8: list = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    timeout: float = 60.0
    layerwise_reload: bool = True


@dataclass
class WeftUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version the trainers push (buffer ``version % 2``)."""

    version: int


@dataclass
class WeftTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings (the same on every trainer rank but ``rank``).

    ``plan``: :class:`weft.rl.RlPlan` knobs (``block``, ``unit_bytes``,
    ``align``, ``watermark``, ``min_direct_bytes``)."""

    backend: ClassVar[str] = BACKEND
    store: str
    namespace: str
    provider: str
    inference_ranks: int
    trainers: int = 1
    fp8: list = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    timeout: float = 60.0
    layerwise_reload: bool = True


def _placement(p: Any) -> int | None:
    dim = getattr(p, "dim", None)
    return None if dim is None else int(dim)


def _table(metas: list) -> list:
    """ParamMeta records as plain lists (the init handshake is a dict)."""
    out = []
    for m in metas:
        placements = None if m.placements is None else [_placement(p) for p in m.placements]
        out.append(
            [
                m.name,
                str(m.dtype),
                list(m.shape),
                None if m.owners is None else list(m.owners),
                None if m.mesh_shape is None else list(m.mesh_shape),
                placements,
            ]
        )
    return out


def _plan(table: list, trainers: int, targets: list, fp8: list, knobs: dict) -> rl.RlPlan:
    """The plan every rank builds alike from every worker's targets
    (:func:`_targets`)."""
    params = rl.params_from_metas(table, trainers)
    fp8 = set(fp8)
    inference = [
        [(name, [tuple(seg) for seg in segs], "fp8" if name in fp8 else "none") for name, segs, _ in rank]
        for rank in targets
    ]
    return rl.RlPlan(trainers, params, inference, **knobs)


#: Record kind of the workers' targets in the rendezvous store.
_TARGETS = "vllm-weights-targets"

#: Attributes of a parameter whose loader packs, transposes or expects
#: pre-sharded storage: such a parameter goes through ``load_weights``.
_PACKED = ("packed_dim", "packed_factor", "marlin_tile_size")
_FLAGS = ("needs_scalar_to_array", "is_sharded_weight", "is_transposed")


def _loader(param: Any) -> tuple[Any, Any] | None:
    """``(function, owner)`` of a parameter's plain weight loader, or
    ``None`` (missing or wrapped: a model's ``load_weights`` may transform
    what reaches it; packed or flagged storage)."""
    loader = getattr(param, "weight_loader", None)
    if loader is None or isinstance(loader, partial):
        return None
    if any(getattr(param, a, None) is not None for a in _PACKED) or any(getattr(param, a, False) for a in _FLAGS):
        return None
    if inspect.ismethod(loader):
        return loader.__func__, loader.__self__
    return loader, None


def _ints(*xs: Any) -> bool:
    return all(type(x) is int for x in xs)


def _shard(param: Any, shape: tuple) -> list | None:
    """The box ``[r0, r1, c0, c1]`` of a checkpoint tensor of ``shape`` that
    ``param``'s loader copies (vLLM's default, replicated, column- or
    row-parallel loader; a vocabulary-parallel embedding or LM head, whose
    rows past the box are padding), or ``None``."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    got = _loader(param)
    if got is None:
        return None
    fn, owner = got
    rows, cols = rl.as_2d(shape)
    local = tuple(param.shape)
    if fn in (default_weight_loader, ReplicatedLinear.weight_loader):
        return [0, rows, 0, cols] if local == tuple(shape) else None
    if fn is VocabParallelEmbedding.weight_loader:
        idx = getattr(owner, "shard_indices", None)
        r0, r1 = getattr(idx, "org_vocab_start_index", None), getattr(idx, "org_vocab_end_index", None)
        ok = getattr(param, "output_dim", None) == 0 and getattr(owner, "org_vocab_size", None) == rows
        if not (ok and _ints(r0, r1) and len(local) == len(shape) == 2 and 0 <= r0 < r1 <= rows):
            return None
        return [r0, r1, 0, cols] if local[1] == cols and r1 - r0 <= local[0] else None
    column = fn in (ColumnParallelLinear.weight_loader, ColumnParallelLinear.weight_loader_v2)
    row = fn in (RowParallelLinear.weight_loader, RowParallelLinear.weight_loader_v2)
    if not (column or row) or owner is None:
        return None
    dim = getattr(param, "output_dim" if column else "input_dim", None)
    size, rank = getattr(owner, "tp_size", None), getattr(owner, "tp_rank", None)
    if not _ints(dim, size, rank) or not 0 <= rank < size or len(local) != len(shape):
        return None
    if not (dim == 0 or (dim == 1 and len(shape) == 2)):
        return None
    if local != tuple(d // size if k == dim else d for k, d in enumerate(shape)) or shape[dim] != local[dim] * size:
        return None
    n = local[dim]
    return [rank * n, (rank + 1) * n, 0, cols] if dim == 0 else [0, rows, rank * n, (rank + 1) * n]


def _fused(param: Any, parts: list, shapes: dict) -> list | None:
    """The segments ``[[part, r0, r1, 0, cols], ...]`` a fused vLLM
    parameter (``QKVParallelLinear``: q, k, v; ``MergedColumnParallelLinear``:
    gate, up, ...) takes from its checkpoint ``parts``, stacked as its loader
    stacks them for this TP rank, or ``None``."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    got = _loader(param)
    if got is None or got[1] is None or getattr(param, "output_dim", None) != 0:
        return None
    fn, o = got
    size, rank = getattr(o, "tp_size", None), getattr(o, "tp_rank", None)
    if not _ints(size, rank) or not 0 <= rank < size:
        return None
    if fn is QKVParallelLinear.weight_loader and len(parts) == 3:
        hq, hk, hv = (getattr(o, a, None) for a in ("num_heads", "num_kv_heads", "num_kv_head_replicas"))
        d, dv = getattr(o, "head_size", None), getattr(o, "v_head_size", None)
        if not _ints(hq, hk, hv, d, dv) or hv < 1:
            return None
        # (rows this rank takes, its shard index, rows in the checkpoint)
        cuts = [(hq * d, rank, hq * d * size), (hk * d, rank // hv, hk * d * size // hv)]
        cuts.append((hk * dv, rank // hv, hk * dv * size // hv))
    elif fn is MergedColumnParallelLinear.weight_loader:
        sizes = getattr(o, "output_sizes", None)
        if not isinstance(sizes, list) or len(sizes) != len(parts) or not _ints(*sizes):
            return None
        if any(n % size for n in sizes):
            return None
        cuts = [(n // size, rank, n) for n in sizes]
    else:
        return None
    cols = {rl.as_2d(shapes[p])[1] for p in parts}
    local_rows, local_cols = rl.as_2d(tuple(param.shape))
    if len(cols) != 1 or cols != {local_cols} or sum(c[0] for c in cuts) != local_rows:
        return None
    segs = []
    for part, (n, k, total) in zip(parts, cuts):
        if rl.as_2d(shapes[part])[0] != total or (k + 1) * n > total:
            return None
        segs.append([part, k * n, (k + 1) * n, 0, local_cols])
    return segs


def _targets(model: torch.nn.Module, table: list, fp8: list, direct: bool, whole_modules: bool) -> list:
    """This worker's targets, ``[name, segments, direct]`` each, segments
    ``[param, r0, r1, c0, c1]`` of the planner's 2-D view: a vLLM parameter
    its plain or fused loader fills (named after it, ``direct``: copied
    straight into the model), and every other parameter of ``table`` whole
    (named after itself, through ``load_weights``). With ``whole_modules``
    (vLLM's layerwise reload), a module with a parameter that goes through
    ``load_weights`` takes all of its parameters that way."""
    shapes = {t[0]: tuple(t[2]) for t in table}
    dtypes = {t[0]: t[1] for t in table}
    fp8 = set(fp8)
    params = dict(model.named_parameters()) if direct else {}
    packed = getattr(model, "packed_modules_mapping", None) or {}

    def plain(p: Any, names: list) -> bool:
        ok = p.dim() > 0 and p.data.is_contiguous()
        return ok and all(n not in fp8 and dtypes.get(n) == str(p.dtype) for n in names)

    def whole(n: str) -> list:
        rows, cols = rl.as_2d(shapes[n])
        return [n, [[n, 0, rows, 0, cols]], False]

    out, taken = [], set()
    for name, p in params.items():
        module, _, attr = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        parts = packed.get(leaf)
        if name in shapes and plain(p, [name]):
            box = _shard(p, shapes[name])
            if box is not None:
                out.append([name, [[name, *box]], True])
                taken.add(name)
        elif isinstance(parts, (list, tuple)) and parts:
            names = [".".join(x for x in (prefix, part, attr) if x) for part in parts]
            if all(n in shapes and n not in taken for n in names) and plain(p, names):
                segs = _fused(p, names, shapes)
                if segs is not None:
                    out.append([name, segs, True])
                    taken.update(names)
    if whole_modules:
        mixed = {n.rpartition(".")[0] for n in shapes if n in params and n not in taken}
        for t in [t for t in out if t[0].rpartition(".")[0] in mixed]:
            out.remove(t)
            taken.difference_update(seg[0] for seg in t[1])
    out.extend(whole(n) for n, *_ in table if n not in taken)
    return out


def _check_targets(table: list, rank: int, got: Any) -> list:
    """Worker ``rank``'s targets as read from the store (untrusted): entries
    ``[name, segments, direct]`` with distinct names; segments of known
    parameters inside them; a parameter through ``load_weights`` whole."""
    bad = rl._err("layout", f"weft: inference rank {rank} published malformed targets")
    shapes = {t[0]: rl.as_2d(t[2]) for t in table}
    if not isinstance(got, list):
        raise bad
    names = set()
    for entry in got:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise bad
        name, segs, direct = entry
        if name in names or type(direct) is not bool or not isinstance(segs, list) or not segs:
            raise bad
        names.add(name)
        for seg in segs:
            if not (isinstance(seg, list) and len(seg) == 5 and seg[0] in shapes and _ints(*seg[1:])):
                raise bad
            rows, cols = shapes[seg[0]]
            r0, r1, c0, c1 = seg[1:]
            if not (0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols):
                raise bad
        if not direct and segs != [[name, 0, shapes.get(name, (0, 0))[0], 0, shapes.get(name, (0, 0))[1]]]:
            raise bad
    return got


class _Rendezvous:
    """This rank's records in the store and the directory of every rank."""

    def __init__(self, store: str, namespace: str) -> None:
        self.store = rendezvous.open_store(store)
        self.session = rendezvous.Session(self.store, ttl=30)
        self.ns = rendezvous.Namespace(self.store, namespace)
        self.directory: rl.RlDirectory | None = None

    def publish(self, me: Any) -> None:
        rl.publish_endpoint(self.ns, self.session, me)

    def publish_targets(self, rank: int, targets: list) -> None:
        self.ns.publish_record(self.session, _TARGETS, f"inference-{rank}", json.dumps(targets).encode())

    def targets(self, table: list, inference_ranks: int, timeout: float) -> list:
        """Every worker's targets, in inference rank order."""
        out = []
        for r in range(inference_ranks):
            raw = self.ns.wait_record(_TARGETS, f"inference-{r}", timeout=timeout)
            try:
                got = json.loads(raw)
            except ValueError:
                got = None
            out.append(_check_targets(table, r, got))
        return out

    def wait(self, plan: rl.RlPlan, timeout: float) -> rl.RlDirectory:
        if self.directory is None:
            self.directory = rl.wait_directory(self.ns, plan, timeout)
        return self.directory

    def close(self) -> None:
        self.session.close()


class WeftWeightTransferEngine(WeightTransferEngine[WeftInitInfo, WeftUpdateInfo]):
    """The vLLM worker side of backend ``"weft"``."""

    init_info_cls = WeftInitInfo
    update_info_cls = WeftUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._info: WeftInitInfo | None = None
        self._engine: TransferEngine | None = None
        self._inf: rl.RlInference | None = None
        self._rv: _Rendezvous | None = None
        self._shapes: dict[str, tuple] = {}
        self._direct: dict[str, torch.Tensor] = {}
        self._loads = True

    def rank(self) -> int:
        """This worker's inference rank."""
        pc = self.parallel_config
        return int(pc.data_parallel_rank) * int(pc.world_size) + int(pc.rank)

    @property
    def direct(self) -> list[str]:
        """The parameters this worker receives as its own shard, copied
        straight into the model (the rest go through ``load_weights``)."""
        return sorted(self._direct)

    def init_transfer_engine(self, init_info: WeftInitInfo) -> None:
        info = init_info
        rank = self.rank()
        if not 0 <= rank < info.inference_ranks:
            raise rl.RlError(f"inference rank {rank} outside the {info.inference_ranks} the trainers expect")
        # Straight copies need the checkpoint's shapes split over TP alone:
        # pipeline parallelism and quantised models go through load_weights.
        quantised = getattr(self.model_config, "quantization", None) is not None
        pp = int(getattr(self.parallel_config, "pipeline_parallel_size", 1))
        mine = _targets(self.model, info.params, info.fp8, not quantised and pp == 1, info.layerwise_reload)
        rv = _Rendezvous(info.store, info.namespace)
        self._rv = rv
        rv.publish_targets(rank, mine)
        targets = rv.targets(info.params, info.inference_ranks, info.timeout)
        plan = _plan(info.params, info.trainers, targets, info.fp8, info.plan)
        self._engine = TransferEngine(info.provider)
        self._inf = rl.RlInference(self._engine, plan, rank, timeout=info.timeout)
        rv.publish(self._inf)
        params = dict(self.model.named_parameters())
        self._direct = {t[0]: params[t[0]].data for t in mine if t[2]}
        self._loads = any(not t[2] for t in mine)
        self._shapes = {p[0]: tuple(p[2]) for p in info.params}
        self._info = info

    def _ready(self) -> tuple[WeftInitInfo, rl.RlInference, _Rendezvous]:
        if self._info is None or self._inf is None or self._rv is None:
            raise RuntimeError("weft: init_transfer_engine was not called")
        return self._info, self._inf, self._rv

    def _reloads(self) -> bool:
        """Whether vLLM's layerwise reload runs around an update: asked
        for, and some parameter goes through ``load_weights``."""
        info, _, _ = self._ready()
        return info.layerwise_reload and self._loads

    def start_weight_update(self) -> None:
        if self._reloads():
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        if self._reloads():
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: WeftUpdateInfo) -> None:
        """Waits for version ``update_info.version`` (every byte of it),
        copies this worker's shards into the model and loads the rest
        through ``model.load_weights``. A failed transfer raises
        :class:`weft.RlError` and leaves the model as it was."""
        info, inf, rv = self._ready()
        version = int(update_info.version)
        directory = rv.wait(inf.plan, info.timeout)
        try:
            inf.step(version, directory)
        except rl.RlError:
            inf.recover()
            raise
        weights = []
        for i, (name, rows, cols, quant, _) in enumerate(inf.plan.tensors(inf.rank)):
            dst = self._direct.get(name)
            if dst is not None:
                # A vocabulary shard fills the leading rows; the rest is
                # padding, zeroed as vLLM's loader does.
                shape = (rows, *dst.shape[1:]) if rows < dst.shape[0] else tuple(dst.shape)
                with torch.no_grad():
                    dst[: shape[0]].copy_(rl.read_tensor(inf, i, shape))
                    dst[shape[0] :].zero_()
            elif quant == "fp8":
                q, s = rl.read_tensor(inf, i)
                block = int(info.plan.get("block", 128))
                weights.append((name, q.reshape(self._shapes[name]).to(self.device)))
                scales = s.reshape(-(-rows // block), -(-cols // block))
                weights.append((f"{name}_scale_inv", scales.to(self.device)))
            else:
                weights.append((name, rl.read_tensor(inf, i, self._shapes[name]).to(self.device)))
        if weights:
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        if self._rv is not None:
            self._rv.close()
            self._rv = None
        self._inf = None
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


class WeftTrainerEngine(TrainerWeightTransferEngine[WeftTrainerInitInfo]):
    """The trainer side of backend ``"weft"``: every rank writes its own
    shards; rank 0 (the sender) also drives the workers' RPCs."""

    init_info_cls = WeftTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: WeftTrainerInitInfo, *, client: Any, source: Any = None) -> "WeftTrainerEngine":
        if source is None:
            raise ValueError("weft: trainer_init needs a WeightSource")
        self = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        info = init_info
        table = _table(source.metadata)
        self._info = info
        self._rv = _Rendezvous(info.store, info.namespace)
        self._version = 0
        if self.is_sender:
            # The workers publish which part of each parameter they take
            # while they initialise; the plan needs them all.
            client.init_weight_transfer_engine(
                {
                    "store": info.store,
                    "namespace": info.namespace,
                    "provider": info.provider,
                    "trainers": info.trainers,
                    "inference_ranks": info.inference_ranks,
                    "params": table,
                    "fp8": list(info.fp8),
                    "plan": dict(info.plan),
                    "timeout": info.timeout,
                    "layerwise_reload": info.layerwise_reload,
                }
            )
        targets = self._rv.targets(table, info.inference_ranks, info.timeout)
        self._plan = _plan(table, info.trainers, targets, info.fp8, info.plan)
        self._engine = TransferEngine(info.provider)
        self._trainer = rl.RlTrainer(self._engine, self._plan, info.rank, timeout=info.timeout)
        self._rv.publish(self._trainer)
        return self

    @property
    def version(self) -> int:
        """The version the next ``send_weights`` pushes."""
        return self._version

    def send_weights(self) -> None:
        """Pushes the source's weights as the next version; returns when
        every worker loaded it. On a failure every rank raises
        :class:`weft.RlError` (the workers keep the previous weights) and
        the next call retries the same version."""
        src = self.source
        named = src.iter_local() if src.implements_iter_local() else src.iter_full()
        rl.load_local(self._trainer, named)
        directory = self._rv.wait(self._plan, self._info.timeout)
        version = self._version
        rpc: list[BaseException] = []
        thread = None
        if self.is_sender:
            self.client.start_weight_update()

            def update() -> None:
                try:
                    self.client.update_weights({"version": version})
                except BaseException as e:  # noqa: BLE001 - re-raised on this thread
                    rpc.append(e)

            thread = threading.Thread(target=update, name="weft-update-weights")
            thread.start()
        try:
            self._trainer.step(version, directory)
        except rl.RlError:
            self._trainer.recover()
            if thread is not None:
                thread.join()
            raise
        if thread is not None:
            thread.join()
            if rpc:
                raise rpc[0]
            self.client.finish_weight_update(str(version))
        self._version += 1

    def shutdown(self) -> None:
        self._rv.close()
        self._engine.shutdown()


def register() -> None:
    """Registers backend ``"weft"`` with vLLM's worker and trainer
    factories (done on import; a second call is a no-op)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, WeftWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, WeftTrainerEngine)


register()
