"""RL weight transfer: trainer processes write new weights straight into
inference processes' memory with one-sided RDMA WRITEs, every trainer
from the shards it holds (no gather to a rank 0), following one routing
table every rank computes alike from the same description.

The description is two tables. *Parameters*: what the trainers hold, each
``(name, rows, cols, layout[, mesh_group[, dtype]])`` with tensors seen as
2-D (``[d0, d1 * ...]``), ``dtype`` ``"bf16"`` (default) or ``"f32"``,
and ``layout`` one of ``("replicate", ranks)``, ``("shard", dim, ranks,
sizes)`` or ``("mesh", mesh_shape, ranks, placements)`` — a torch DTensor's
device mesh with one placement per mesh dimension: ``None`` (Replicate) or
the tensor dimension it shards (``Shard(d)``, ``torch.chunk`` sizes, outer
mesh dimension first). *Targets*: per inference rank, the tensors it holds,
each ``(name, segments, quant[, concat])``: boxes ``(param, r0, r1, c0,
c1)`` of parameters stacked along rows (``concat`` ``"rows"``, the default:
q/k/v into a fused qkv) or side by side (``"cols"``), ``quant`` ``"none"``
(bf16 as trained), ``"fp8"`` (e4m3 with one f32 scale per ``block x
block`` tile, quantised by the trainers) or ``"fp8:<n>"`` (the same with
this tensor's own ``n x n`` tiles)::

    import weft, weft.rl as rl

    params = rl.params_from_module(model, trainers=world)   # DTensors or plain
    targets = rl.whole_targets(params, inference_ranks=2)   # or your own tables
    plan = rl.RlPlan(world, params, targets)
    # trainer process `rank`
    t = rl.RlTrainer(weft.TransferEngine("libfabric:tcp"), plan, rank)
    # inference process `rank`
    i = rl.RlInference(weft.TransferEngine("libfabric:tcp"), plan, rank)
    # everyone: exchange endpoint() descriptors, then
    d = rl.RlDirectory(plan, trainer_endpoints, inference_endpoints)
    # (or, all ranks in one torch.distributed group: d = rl.bootstrap(me))
    rl.load_local(t, model.named_parameters())   # each step, trainers
    t.step(version, d)                           # trainers, all at once
    i.step(version, d)                           # inference ranks, at once
    w = rl.read_tensors(i, plan, rank)           # {name: tensor}

Inference memory is double-buffered: version ``v`` lands in buffer ``v % 2``
and becomes live only when every byte of it landed, so the live weights are
never written and a failed step (a dead trainer: ``RlError``, kind
``timeout`` or ``engine``) leaves them as they were; call ``recover()`` on
every rank before retrying. Trainers hold bf16. For vLLM's pluggable weight
transfer see :mod:`weft.vllm_weights`.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Iterable, Optional, Sequence, Union

from ._errors import RlError
from ._weft import MrDesc, RlDirectory, RlInference, RlPlan, RlTrainer

__all__ = [
    "RlDirectory",
    "RlError",
    "RlInference",
    "RlPlan",
    "RlTrainer",
    "as_2d",
    "bootstrap",
    "decode_endpoint",
    "directory_of",
    "encode_endpoint",
    "layout_of",
    "load_local",
    "param_of",
    "params_from_metas",
    "params_from_module",
    "publish_endpoint",
    "read_tensor",
    "read_tensors",
    "wait_directory",
    "whole_targets",
]


def _err(kind: str, message: str) -> RlError:
    e = RlError(message)
    e.kind = kind
    return e


def as_2d(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of a tensor of ``shape`` as the planner sees it:
    ``[d0, d1 * d2 * ...]`` (a vector ``[n]`` is ``[n, 1]``)."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def layout_of(
    name: str,
    shape: Sequence[int],
    owners: Sequence[int],
    mesh_shape: Sequence[int] | None = None,
    placements: Sequence[Any] | None = None,
) -> tuple:
    """The layout tuple of a parameter held by ``owners`` (row-major over
    ``mesh_shape``, default 1-D) with one placement per mesh dimension:
    ``None`` or an object with a ``dim`` (torch's or vLLM's ``Shard``) or an
    int for Shard, anything else without ``dim`` (``Replicate``) for
    replicated. ``placements=None``: every owner holds the whole tensor."""
    owners = [int(r) for r in owners]
    if placements is None:
        return ("replicate", owners)
    mesh_shape = [len(owners)] if mesh_shape is None else [int(d) for d in mesh_shape]
    ndim = len(tuple(shape))
    out: list[int | None] = []
    for p in placements:
        dim = p if isinstance(p, int) else getattr(p, "dim", None)
        if dim is None:
            out.append(None)
            continue
        dim = int(dim)
        if dim < 0:
            dim += ndim
        if dim == 0 or (dim == 1 and ndim == 2):
            out.append(dim)
        else:
            raise _err(
                "layout",
                f"{name}: Shard({dim}) of a {ndim}-D tensor is not a box of its 2-D view "
                f"[d0, d1*...] (only Shard(0), or Shard(1) of a 2-D tensor)",
            )
    return ("mesh", mesh_shape, owners, out)


def _dtensor_layout(t: Any) -> tuple[list[int], list[int], list[Any]] | None:
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return None
    grid = mesh.mesh
    placements = []
    for p in t.placements:
        kind = type(p).__name__
        if kind == "Shard":
            placements.append(int(p.dim))
        elif kind == "Replicate":
            placements.append(None)
        else:
            raise _err("layout", f"placement {p!r} (only Shard and Replicate)")
    return [int(r) for r in grid.flatten().tolist()], list(grid.shape), placements


def _dtype(name: str, dtype: Any) -> str:
    """``"bf16"`` or ``"f32"`` for a torch/numpy dtype or its name."""
    d = str(dtype)
    if "bfloat16" in d:
        return "bf16"
    if "float32" in d:
        return "f32"
    raise _err("layout", f"{name}: trainers hold bf16 or f32, not {d}")


def param_of(name: str, t: Any, trainers: int, mesh_group: int = 0) -> tuple:
    """The parameter entry of tensor ``t`` (a torch DTensor: its mesh and
    placements; a plain tensor: held whole by every one of ``trainers``).
    Trainers hold bf16 or f32: anything else raises ``RlError`` (kind
    ``layout``)."""
    dtype = _dtype(name, getattr(t, "dtype", type(t).__name__))
    shape = tuple(t.shape)
    rows, cols = as_2d(shape)
    d = _dtensor_layout(t)
    if d is None:
        layout = ("replicate", list(range(trainers)))
    else:
        owners, mesh_shape, placements = d
        layout = layout_of(name, shape, owners, mesh_shape, placements)
    return (name, rows, cols, layout, mesh_group, dtype)


def params_from_module(module: Any, trainers: int) -> list[tuple]:
    """Parameter entries of ``module.named_parameters()`` (see
    :func:`param_of`), in its order."""
    return [param_of(n, p, trainers) for n, p in module.named_parameters()]


def whole_targets(
    params: Sequence[tuple], inference_ranks: int, fp8: Iterable[str] = ()
) -> list[list[tuple]]:
    """Targets where every inference rank receives every parameter whole
    (the checkpoint format a serving stack's own loader slices and fuses),
    the names in ``fp8`` quantised."""
    fp8 = set(fp8)
    one = [
        (p[0], [(p[0], 0, int(p[1]), 0, int(p[2]))], "fp8" if p[0] in fp8 else "none")
        for p in params
    ]
    return [list(one) for _ in range(int(inference_ranks))]


def _bytes_of(t: Any) -> Any:
    """The bytes of a bf16 tensor (torch, on any device) or array (numpy),
    as a C-contiguous uint8 numpy array of its shape with the last
    dimension in bytes; other buffers as they are."""
    if hasattr(t, "full_tensor") and hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "detach"):  # torch
        import torch

        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.contiguous().view(torch.uint8).numpy()
    if hasattr(t, "__array_interface__"):
        import numpy as np

        a = np.ascontiguousarray(t)
        return a.view(np.uint8).reshape(*a.shape[:-1], -1) if a.ndim else a.view(np.uint8)
    return t


def load_local(trainer: RlTrainer, named: Iterable[tuple[str, Any]]) -> int:
    """Copies each ``(name, tensor)`` this trainer holds a piece of into its
    shard memory: a DTensor's local shard, a tensor of exactly the piece's
    size, or the whole parameter (the piece is cut out of it). Names it
    holds nothing of are skipped. Returns the pieces loaded."""
    pieces: dict[str, list[tuple[int, tuple, tuple]]] = {}
    for k, (name, r, c) in enumerate(trainer_pieces(trainer)):
        pieces.setdefault(name, []).append((k, r, c))
    full = {n: (r, c, 4 if d == "f32" else 2) for n, r, c, d in trainer.plan.params()}
    n = 0
    for name, t in named:
        mine = pieces.get(name)
        if not mine:
            continue
        whole = _bytes_of(t)  # once per tensor (a CUDA tensor: one copy to host)
        rows, cols, e = full[name]
        for k, (r0, r1), (c0, c1) in mine:
            data = whole
            size = (r1 - r0) * (c1 - c0) * e
            nbytes = getattr(data, "nbytes", None)
            if nbytes is not None and nbytes != size and nbytes == rows * cols * e:
                data = data.reshape(rows, cols * e)[r0:r1, e * c0 : e * c1]
                data = data.copy(order="C")
            trainer.load_piece(k, data)
            n += 1
    return n


def params_from_metas(metas: Iterable[Any], trainers: int) -> list[tuple]:
    """Parameter entries from vLLM-style ``ParamMeta`` records (``name``,
    ``dtype``, ``shape``, ``owners``, ``mesh_shape``, ``placements``; or
    lists in that order): owners ``None`` means every trainer, placements
    ``None`` replicated over the owners."""
    out = []
    for m in metas:
        if isinstance(m, (list, tuple)):
            name, dtype, shape, owners, mesh_shape, placements = m
        else:
            name, dtype, shape = m.name, m.dtype, m.shape
            owners, mesh_shape, placements = m.owners, m.mesh_shape, m.placements
        dt = _dtype(name, dtype)
        rows, cols = as_2d(shape)
        owners = list(range(trainers)) if owners is None else owners
        out.append((name, rows, cols, layout_of(name, shape, owners, mesh_shape, placements), 0, dt))
    return out


def trainer_pieces(trainer: RlTrainer) -> list[tuple]:
    """``(param, rows, cols)`` of the pieces ``trainer`` holds."""
    return trainer.plan.pieces(trainer.rank)


def read_tensor(inf: RlInference, index: int, shape: Sequence[int] | None = None) -> Any:
    """Tensor ``index`` of the live version as torch tensors: bf16 (shaped
    ``shape``, default ``[rows, cols]``; f32 for f32 sources), or for an fp8 target the pair
    ``(float8_e4m3fn [rows, cols], float32 scales)``."""
    import torch

    name, rows, cols, quant, dtype = inf.plan.tensors(inf.rank)[index]
    if quant == "fp8":
        q = torch.frombuffer(bytearray(inf.read(index)), dtype=torch.uint8)
        s = torch.frombuffer(bytearray(inf.read_scales(index)), dtype=torch.float32)
        return q.view(torch.float8_e4m3fn).reshape(rows, cols), s
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    t = torch.frombuffer(bytearray(inf.read(index)), dtype=tdt)
    return t.reshape(tuple(shape) if shape is not None else (rows, cols))


def read_tensors(inf: RlInference, shapes: dict[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """Every tensor of the live version by name (see :func:`read_tensor`)."""
    shapes = shapes or {}
    out = {}
    for i, (name, *_) in enumerate(inf.plan.tensors(inf.rank)):
        out[name] = read_tensor(inf, i, shapes.get(name))
    return out


_EP_MAGIC = b"wrl1"
_ROLES = {b"t": "trainer", b"i": "inference"}


def encode_endpoint(me: Union[RlTrainer, RlInference]) -> bytes:
    """`me`'s role, rank and ``endpoint()`` descriptors as bytes (for any
    channel; `bootstrap` all-gathers them)."""
    role = b"t" if isinstance(me, RlTrainer) else b"i"
    a, b = me.endpoint()
    da, db = a.to_bytes(), b.to_bytes()
    return _EP_MAGIC + role + struct.pack("<III", me.rank, len(da), len(db)) + da + db


def decode_endpoint(data: bytes) -> tuple:
    """Parses `encode_endpoint`'s bytes (untrusted: anything else raises
    ``RlError`` of kind ``bootstrap``, or ``DescriptorError`` from the
    descriptors' own checks). Returns ``(role, rank, (desc_a, desc_b))``."""
    head = 4 + 1 + 12
    if len(data) < head or data[:4] != _EP_MAGIC or data[4:5] not in _ROLES:
        raise _err("bootstrap", "not an RL endpoint")
    rank, la, lb = struct.unpack_from("<III", data, 5)
    if head + la + lb != len(data):
        raise _err("bootstrap", f"an RL endpoint of {len(data)} bytes announces {head + la + lb}")
    a = MrDesc.from_bytes(data[head : head + la])
    b = MrDesc.from_bytes(data[head + la :])
    return _ROLES[data[4:5]], rank, (a, b)


def directory_of(plan: RlPlan, payloads: Iterable[bytes]) -> RlDirectory:
    """The directory from every rank's `encode_endpoint` bytes: each
    trainer ``0..plan.trainers`` and inference rank exactly once."""
    return _directory(plan, (decode_endpoint(data) for data in payloads))


def _directory(plan: RlPlan, endpoints: Iterable[tuple]) -> RlDirectory:
    """`directory_of` from decoded ``(role, rank, descs)`` endpoints."""
    seen: dict = {}
    for role, rank, descs in endpoints:
        if (role, rank) in seen:
            raise _err("bootstrap", f"{role} {rank} announced twice")
        seen[(role, rank)] = descs
    want = [("trainer", r) for r in range(plan.trainers)] + [
        ("inference", r) for r in range(plan.inference_ranks)
    ]
    missing = [w for w in want if w not in seen]
    extra = [k for k in seen if k not in set(want)]
    if missing or extra:
        raise _err("bootstrap", f"the plan's ranks do not match the group: missing {missing}, unknown {extra}")
    return RlDirectory(
        plan,
        [seen[("trainer", r)] for r in range(plan.trainers)],
        [seen[("inference", r)] for r in range(plan.inference_ranks)],
    )


#: Record kind under which `publish_endpoint` stores a rank's endpoint.
ENDPOINT_RECORD = "rl-endpoint"


def _who(role: str, rank: int) -> str:
    return f"{role}-{rank}"


def publish_endpoint(ns: Any, session: Any, me: Union[RlTrainer, RlInference]) -> None:
    """Publishes `me`'s `encode_endpoint` bytes in rendezvous namespace `ns`
    (a :class:`weft.rendezvous.Namespace`), as record ``rl-endpoint`` /
    ``trainer-<rank>`` or ``inference-<rank>``, owned by `session` (gone
    when it ends). `wait_directory` on every rank reads them back."""
    role = "trainer" if isinstance(me, RlTrainer) else "inference"
    ns.publish_record(session, ENDPOINT_RECORD, _who(role, me.rank), encode_endpoint(me))


def wait_directory(ns: Any, plan: RlPlan, timeout: float = 60.0) -> RlDirectory:
    """Waits up to `timeout` seconds per rank for every trainer's and
    inference rank's `publish_endpoint` record in `ns` and builds the
    directory from them. The records are untrusted: `directory_of` checks
    them (a record under another rank's name is refused as ``bootstrap``)."""
    keys = [_who("trainer", r) for r in range(plan.trainers)]
    keys += [_who("inference", r) for r in range(plan.inference_ranks)]
    endpoints = []
    for k in keys:
        role, rank, descs = decode_endpoint(ns.wait_record(ENDPOINT_RECORD, k, timeout=timeout))
        if _who(role, rank) != k:
            raise _err("bootstrap", f"record {k!r} holds the endpoint of {role} {rank}")
        endpoints.append((role, rank, descs))
    return _directory(plan, endpoints)


def bootstrap(me: Union[RlTrainer, RlInference], group: Optional[Any] = None) -> RlDirectory:
    """Builds the `RlDirectory` over the ``torch.distributed`` process
    group `group` (default: the world) whose members are exactly the plan's
    trainers and inference ranks, in any order: all-gathers every rank's
    `encode_endpoint`. A collective."""
    from .dist import all_gather_bytes

    return directory_of(me.plan, all_gather_bytes(encode_endpoint(me), group=group))
