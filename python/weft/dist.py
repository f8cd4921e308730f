"""Bootstrap from ``torch.distributed``: every rank of a process group
learns every other rank's engine address and descriptors in one collective.

    import torch.distributed as dist, weft, weft.dist
    dist.init_process_group("gloo")                 # or the job's own group
    engine = weft.TransferEngine("libfabric:efa")
    reg = engine.reg_mr(buffer)
    peers = weft.dist.exchange(engine, reg.desc)    # one entry per rank
    peers[r].address, peers[r].descs[0]

Only bytes cross the collective (no pickle): each rank's engine address and
descriptors, length-prefixed, gathered with ``all_gather``
(CUDA tensors on the current device when the group's backend is NCCL, CPU
tensors otherwise). What another rank sent is decoded with the checks of
``PeerAddress.from_bytes`` / ``MrDesc.from_bytes``: garbled input raises
``DescriptorError``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from ._weft import MrDesc, PeerAddress, TransferEngine

__all__ = ["RankInfo", "exchange", "all_gather_bytes", "encode", "decode", "decode_error"]

_MAGIC = b"wfx1"
#: The largest payload a rank may announce: every rank allocates the group
#: size times the largest announced (an address and a descriptor take about
#: a hundred bytes each).
_MAX_PAYLOAD = 64 << 10


def decode_error(rank: int, why: str) -> Exception:
    """A ``DescriptorError`` (kind ``bootstrap``) about rank `rank`'s payload."""
    from ._errors import DescriptorError

    e = DescriptorError(f"rank {rank}: bad bootstrap payload: {why}")
    e.kind = "bootstrap"
    return e


@dataclass(frozen=True)
class RankInfo:
    """What one rank published: its engine's address and descriptors."""

    rank: int
    address: PeerAddress
    descs: List[MrDesc]


def encode(address: PeerAddress, descs: Sequence[MrDesc]) -> bytes:
    """One rank's payload: magic, address, then each descriptor, each
    length-prefixed (u32, little-endian)."""
    parts = [address.to_bytes()] + [d.to_bytes() for d in descs]
    out = bytearray(_MAGIC)
    out += struct.pack("<I", len(parts))
    for p in parts:
        out += struct.pack("<I", len(p)) + p
    return bytes(out)


def decode(rank: int, data: bytes) -> RankInfo:
    """Parses what `encode` produced; anything else raises ``DescriptorError``."""
    def bad(why: str) -> Exception:
        return decode_error(rank, why)

    if data[:4] != _MAGIC:
        raise bad("not a weft payload")
    pos = 4
    if len(data) < pos + 4:
        raise bad("truncated")
    (n,) = struct.unpack_from("<I", data, pos)
    pos += 4
    if n < 1 or n > (len(data) - pos) // 4:
        raise bad(f"{n} parts do not fit {len(data)} bytes")
    parts = []
    for _ in range(n):
        if len(data) < pos + 4:
            raise bad("truncated")
        (k,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if k > len(data) - pos:
            raise bad("a part runs past the end")
        parts.append(data[pos : pos + k])
        pos += k
    if pos != len(data):
        raise bad(f"{len(data) - pos} trailing bytes")
    return RankInfo(rank, PeerAddress.from_bytes(parts[0]), [MrDesc.from_bytes(p) for p in parts[1:]])


def exchange(engine: TransferEngine, *descs: MrDesc, group: Optional[Any] = None) -> List[RankInfo]:
    """All-gathers every rank's engine address and `descs` over the
    ``torch.distributed`` process group `group` (default: the world). A
    collective: every rank of the group must call it. Returns one
    `RankInfo` per rank, in rank order (this rank's own included)."""
    import torch
    import torch.distributed as dist

    rows = all_gather_bytes(encode(engine.address, descs), group=group)
    return [decode(r, row) for r, row in enumerate(rows)]


def all_gather_bytes(payload: bytes, group: Optional[Any] = None) -> List[bytes]:
    """All-gathers one non-empty byte string per rank (at most 64 KiB) over
    the ``torch.distributed`` process group `group` (default: the world):
    a collective, every rank of the group must call it. Returns every
    rank's bytes in rank order; what the others sent is untrusted (decode
    it with its own checks). A rank announcing an empty or oversized
    payload raises ``DescriptorError`` (kind ``bootstrap``) on every rank."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lens = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lens, mine, group=group)
    lens_l = [int(x.item()) for x in lens]
    for r, n in enumerate(lens_l):
        if not 0 < n <= _MAX_PAYLOAD:
            raise decode_error(r, f"announced {n} bytes (limit {_MAX_PAYLOAD})")
    width = max(lens_l)
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    rows = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(rows, buf, group=group)
    return [rows[r][: lens_l[r]].cpu().numpy().tobytes() for r in range(world)]
