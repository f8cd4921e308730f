"""weft.dist: the bootstrap payload (checked without torch) and the
exchange over a real torch.distributed gloo group of two processes (skipped
where torch is not installed)."""

from __future__ import annotations

import socket

import pytest

import weft
from procs import run_ranks
from weft import dist as wd


def test_payload_round_trips_and_refuses_garbage():
    backend = weft.provider("loopback")
    with weft.TransferEngine(backend) as e:
        regs = [e.reg_mr(bytearray(64)), e.reg_mr(bytearray(128))]
        data = wd.encode(e.address, [r.desc for r in regs])
        info = wd.decode(3, data)
        assert info.rank == 3 and info.address == e.address
        assert info.descs == [r.desc for r in regs]
        assert wd.decode(0, wd.encode(e.address, [])).descs == []
        bad = [
            b"",
            b"nope" + data[4:],
            data[:-1],
            data + b"\0",
            data[:4] + b"\xff\xff\xff\xff" + data[8:],
            data[:4] + b"\0\0\0\0",
        ]
        # Every one-byte corruption either decodes to something or raises
        # DescriptorError: never another exception.
        for i in range(len(data)):
            bad.append(data[:i] + bytes([data[i] ^ 0x41]) + data[i + 1 :])
        for b in bad:
            try:
                wd.decode(1, b)
            except weft.DescriptorError:
                pass
        for b in bad[:6]:
            with pytest.raises(weft.DescriptorError):
                wd.decode(1, b)


RANK = r"""
import os, sys, numpy as np, torch.distributed as dist, weft, weft.dist
rank, world, spec = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=world)
with weft.TransferEngine(spec, domain="same-machine") as eng:
    buf = np.zeros(4096, np.uint8)
    reg = eng.reg_mr(buf)
    peers = weft.dist.exchange(eng, reg.desc)
    assert [p.rank for p in peers] == list(range(world))
    assert peers[rank].address == eng.address and peers[rank].descs == [reg.desc]
    # Each rank writes its rank number into the next rank's buffer.
    nxt = peers[(rank + 1) % world]
    src = np.full(4096, rank + 1, np.uint8)
    eng.submit_single_write(4096, eng.reg_mr(src), nxt.descs[0]).wait(timeout=60)
    dist.barrier()
    assert (buf == (rank - 1) % world + 1).all(), buf[:8]
    dist.barrier()
print("ok", flush=True)
"""


@pytest.mark.fabric
def test_exchange_over_gloo(tmp_path):
    pytest.importorskip("torch.distributed")
    spec = "libfabric:tcp"
    status = {p.spec: p for p in weft.providers()}[spec]
    if not status.available:
        pytest.skip(f"{spec}: {status.reason}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = 3
    outs = run_ranks(RANK, [[str(r), str(world), spec] for r in range(world)], env=env, timeout=120)
    assert outs == ["ok"] * world
