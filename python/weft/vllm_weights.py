"""weft as a vLLM weight-transfer backend (``"weft"``): RL trainers push
new weights into vLLM workers with one-sided WRITEs, every trainer rank
from the shards it holds (FSDP/TP DTensors included: no gather to a rank
0), into double-buffered host memory on each worker that becomes live only
when every byte landed. A parameter whose checkpoint name is a vLLM
parameter with a plain loader (replicated, column- or row-parallel; not
fused, packed, quantised or under pipeline parallelism) arrives as this
worker's own tensor-parallel shard and is copied straight into the model;
every other one arrives whole and goes through the model's own
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
    """The plan every rank builds alike: per inference rank, each parameter
    as the box it takes (its shard, or the whole tensor)."""
    params = rl.params_from_metas(table, trainers)
    fp8 = set(fp8)
    inference = [
        [(name, [(name, r0, r1, c0, c1)], "fp8" if name in fp8 else "none") for name, r0, r1, c0, c1, _ in rank]
        for rank in targets
    ]
    return rl.RlPlan(trainers, params, inference, **knobs)


#: Record kind of the workers' targets in the rendezvous store.
_TARGETS = "vllm-weights-targets"


def _tp_shard(param: Any) -> tuple[int, int, int] | None:
    """``(dim, tp_rank, tp_size)`` of a parameter whose loader only copies
    this rank's slice of one dimension (``dim`` -1: the whole tensor), or
    ``None`` for anything else: a missing, wrapped or unknown loader (a
    model's ``load_weights`` may transform what reaches it), packing,
    transposition, pre-sharded storage."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(param, "weight_loader", None)
    if loader is None or isinstance(loader, partial):
        return None
    for attr in ("packed_dim", "packed_factor", "marlin_tile_size"):
        if getattr(param, attr, None) is not None:
            return None
    for attr in ("needs_scalar_to_array", "is_sharded_weight", "is_transposed"):
        if getattr(param, attr, False):
            return None
    fn = loader.__func__ if inspect.ismethod(loader) else loader
    if fn in (default_weight_loader, ReplicatedLinear.weight_loader):
        return (-1, 0, 1)
    column = fn in (ColumnParallelLinear.weight_loader, ColumnParallelLinear.weight_loader_v2)
    row = fn in (RowParallelLinear.weight_loader, RowParallelLinear.weight_loader_v2)
    owner = loader.__self__ if inspect.ismethod(loader) else None
    if not (column or row) or owner is None:
        return None
    dim = getattr(param, "output_dim" if column else "input_dim", None)
    size, rank = getattr(owner, "tp_size", None), getattr(owner, "tp_rank", None)
    if not all(isinstance(x, int) for x in (dim, size, rank)) or not 0 <= rank < size:
        return None
    return (dim, rank, size)


def _targets(model: torch.nn.Module, table: list, fp8: list, direct: bool, whole_modules: bool) -> list:
    """This worker's targets: per parameter of ``table``, ``[name, r0, r1,
    c0, c1, direct]`` (rows and columns of the planner's 2-D view). With
    ``whole_modules`` (vLLM's layerwise reload), a module with a parameter
    that goes through ``load_weights`` takes all of its parameters that
    way."""
    params = dict(model.named_parameters()) if direct else {}
    fp8 = set(fp8)
    out = []
    for name, dtype, shape, *_ in table:
        rows, cols = rl.as_2d(shape)
        box = [name, 0, rows, 0, cols, False]
        p = params.get(name)
        shard = None
        if p is not None and name not in fp8 and str(p.dtype) == dtype and p.data.is_contiguous():
            shard = _tp_shard(p)
        if shard is not None:
            dim, rank, size = shard
            local = tuple(p.shape)
            if dim == -1 and local == tuple(shape):
                box[5] = True
            elif 0 <= dim < len(shape) and len(local) == len(shape) and (dim == 0 or len(shape) == 2):
                want = tuple(d // size if k == dim else d for k, d in enumerate(shape))
                if local == want and shape[dim] == local[dim] * size:
                    n = local[dim]
                    if dim == 0:
                        box[1:3] = [rank * n, (rank + 1) * n]
                    else:
                        box[3:5] = [rank * n, (rank + 1) * n]
                    box[5] = True
        out.append(box)
    if whole_modules:
        mixed = {b[0].rpartition(".")[0] for b in out if not b[5] and b[0] in params}
        for b in out:
            if b[5] and b[0].rpartition(".")[0] in mixed:
                rows, cols = rl.as_2d(next(t[2] for t in table if t[0] == b[0]))
                b[1:6] = [0, rows, 0, cols, False]
    return out


def _check_targets(table: list, rank: int, got: Any) -> list:
    """Worker ``rank``'s targets as read from the store (untrusted): one
    ``[name, r0, r1, c0, c1, direct]`` per parameter, in ``table``'s order,
    inside the parameter."""
    bad = rl._err("layout", f"weft: inference rank {rank} published malformed targets")
    if not isinstance(got, list) or len(got) != len(table):
        raise bad
    for t, entry in zip(table, got):
        rows, cols = rl.as_2d(t[2])
        if not (isinstance(entry, list) and len(entry) == 6 and entry[0] == t[0]):
            raise bad
        r0, r1, c0, c1, direct = entry[1:]
        if not all(type(x) is int for x in (r0, r1, c0, c1)) or type(direct) is not bool:
            raise bad
        if not (0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols):
            raise bad
    return got


class _Rendezvous:
    """This rank's records in the store and the directory of every rank."""

    def __init__(self, store: str, namespace: str) -> None:
        self.store = rendezvous.open_store(store)
        self.session = rendezvous.Session(self.store, ttl=30)
        self.ns = rendezvous.Namespace(self.store, namespace)
        self.directory: rl.RlDirectory | None = None

    def publish(self, me: str, endpoint: tuple) -> None:
        self.ns.publish_mr(self.session, me, "a", endpoint[0])
        self.ns.publish_mr(self.session, me, "b", endpoint[1])

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

            def get(who: str) -> tuple:
                return (self.ns.wait_mr(who, "a", timeout=timeout), self.ns.wait_mr(who, "b", timeout=timeout))

            self.directory = rl.RlDirectory(
                plan,
                [get(f"trainer-{r}") for r in range(plan.trainers)],
                [get(f"inference-{r}") for r in range(plan.inference_ranks)],
            )
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
        rv.publish(f"inference-{rank}", self._inf.endpoint())
        params = dict(self.model.named_parameters())
        self._direct = {t[0]: params[t[0]].data for t in mine if t[5]}
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
        return info.layerwise_reload and len(self._direct) < len(self._shapes)

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
                with torch.no_grad():
                    dst.copy_(rl.read_tensor(inf, i, tuple(dst.shape)))
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
        self._rv.publish(f"trainer-{info.rank}", self._trainer.endpoint())
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
