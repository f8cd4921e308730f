"""A receiver hears that its writer died: a round armed with the writer's
address (``peers=``) fails with ``PeerGoneError`` once the writer, killed
mid-round in another process, is removed with ``remove_peer``; the
immediates it delivered before dying stay counted."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import weft

WRITER = textwrap.dedent(
    """
    import sys, time, numpy as np, weft
    spec = sys.argv[1]
    with weft.TransferEngine(spec, domain="same-machine") as eng:
        src = eng.reg_mr(np.full(4096, 7, dtype=np.uint8))
        print(eng.address.to_bytes().hex(), flush=True)
        desc = weft.MrDesc.from_bytes(bytes.fromhex(sys.stdin.readline().strip()))
        imm = int(sys.stdin.readline())
        eng.submit_single_write(4096, src, desc, imm=imm).wait(timeout=60)
        print("wrote", flush=True)
        time.sleep(600)  # killed by the parent before its second write
    """
)


def available(spec: str) -> bool:
    return any(p.spec == spec and p.available for p in weft.providers())


@pytest.mark.parametrize("spec", ["libfabric:tcp", "libfabric:shm"])
def test_round_fails_when_its_killed_writer_is_removed(spec):
    if not available(spec):
        pytest.skip(f"{spec} unavailable here")
    with weft.TransferEngine(spec, domain="same-machine") as eng:
        inbox = np.zeros(4096, dtype=np.uint8)
        dst = eng.reg_mr(inbox)
        imm = eng.alloc_imm()
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert writer.stdout is not None and writer.stdin is not None
            peer = weft.PeerAddress.from_bytes(bytes.fromhex(writer.stdout.readline().strip()))
            one = eng.imm_counts().single_write(4096)
            # Two writes expected from the writer; it dies after the first.
            rnd = eng.expect_imm_count(imm, 2 * one, peers=[peer])
            writer.stdin.write(dst.desc.to_bytes().hex() + "\n" + str(int(imm)) + "\n")
            writer.stdin.flush()
            assert writer.stdout.readline().strip() == "wrote"
            writer.send_signal(signal.SIGKILL)
            writer.wait(timeout=60)
        finally:
            writer.kill()
        # The process supervisor (here: this test) tells the engine.
        eng.remove_peer(peer)
        with pytest.raises(weft.PeerGoneError) as e:
            rnd.wait(timeout=60)
        assert e.value.kind == "peer_gone"
        assert (inbox == 7).all()
        assert eng.imm_pending(imm) == one
