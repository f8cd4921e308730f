"""One engine over two fabrics from Python: ``same_host=True`` adds an
nvlink NIC after the backend's, and peers on this host are reached through
it (the backend's NICs carry the rest)."""

from __future__ import annotations

import numpy as np
import pytest

import weft


def test_same_host_peers_go_through_nvlink():
    backend = weft.provider("loopback", profile="ideal")
    a = weft.TransferEngine(backend, same_host=True)
    b = weft.TransferEngine(backend, same_host=True)
    plain = weft.TransferEngine(backend)
    try:
        n = 1 << 16
        src = np.arange(n, dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        s, d = a.reg_mr(src), b.reg_mr(dst)
        nvlink = a.paths_to(d.desc)
        assert len(nvlink) == 1 and nvlink[0].startswith("nvlink"), nvlink
        # A peer without the nvlink NIC is reached through the backend's.
        other = plain.reg_mr(np.zeros(16, dtype=np.uint8))
        nic = a.paths_to(other.desc)
        assert len(nic) == 1 and not nic[0].startswith("nvlink"), nic
        imm = b.alloc_imm()
        rnd = b.expect_imm_count(imm, b.imm_counts().single_write(n))
        a.submit_single_write(n, s, d.desc, imm=imm).wait(timeout=30)
        rnd.wait(timeout=30)
        assert (dst == src).all()
    finally:
        for e in (a, b, plain):
            e.shutdown()


def test_same_host_on_nvlink_itself_is_refused():
    with pytest.raises(weft.InvalidArgumentError):
        weft.TransferEngine("nvlink", same_host=True)
