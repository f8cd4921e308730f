"""A WRITE with a stale descriptor (the target unregistered the region)
fails at once with ``RemoteAccessError`` and later writes to the same peer
land, across processes. Over shm the provider itself would drop such a
WRITE without ever completing it, and every later write to that peer would
wait behind it; weft checks the target's key table first."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import weft

TARGET = textwrap.dedent(
    """
    import sys, numpy as np, weft
    spec = sys.argv[1]
    with weft.TransferEngine(spec, domain="same-machine") as eng:
        print(eng.address.to_bytes().hex(), flush=True)
        old = eng.reg_mr(np.zeros(4096, dtype=np.uint8))
        print(old.desc.to_bytes().hex(), flush=True)
        old.unreg()
        inbox = np.zeros(4096, dtype=np.uint8)
        new = eng.reg_mr(inbox)
        print(new.desc.to_bytes().hex(), flush=True)
        assert sys.stdin.readline().strip() == "done"
        print("ok" if (inbox == 9).all() else "bytes wrong: %r" % inbox[:8], flush=True)
    """
)


def available(spec: str) -> bool:
    return any(p.spec == spec and p.available for p in weft.providers())


@pytest.mark.parametrize("spec", ["libfabric:shm"])
def test_stale_descriptor_fails_fast_and_later_writes_land(spec):
    if not available(spec):
        pytest.skip(f"{spec} unavailable here")
    target = subprocess.Popen(
        [sys.executable, "-c", TARGET, spec],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert target.stdout is not None and target.stdin is not None
        read = lambda: bytes.fromhex(target.stdout.readline().strip())  # noqa: E731
        read()  # its address (carried by the descriptors too)
        stale = weft.MrDesc.from_bytes(read())
        fresh = weft.MrDesc.from_bytes(read())
        with weft.TransferEngine(spec, domain="same-machine", write_timeout=60.0) as eng:
            src = eng.reg_mr(np.full(4096, 9, dtype=np.uint8))
            with pytest.raises(weft.RemoteAccessError) as info:
                eng.submit_single_write(4096, src, stale).wait(timeout=30)
            assert info.value.kind == "remote_access"
            for _ in range(3):
                eng.submit_single_write(4096, src, fresh).wait(timeout=30)
        target.stdin.write("done\n")
        target.stdin.flush()
        assert target.stdout.readline().strip() == "ok"
        assert target.wait(timeout=60) == 0
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
