"""What reg_mr refuses, and how: read-only arrays register as sources on
every numpy."""

from __future__ import annotations

import numpy as np
import pytest

import weft


class OldNumpyArray(np.ndarray):
    """A numpy array whose ``__dlpack__`` behaves as numpy's before 2.1: no
    ``max_version``, and a read-only array cannot be exported at all. Its
    buffer export is numpy's own (a writable request on a read-only array
    raises ValueError)."""

    def __dlpack__(self, *, stream=None):
        if not self.flags.writeable:
            raise BufferError(
                "Cannot export readonly array since signalling readonly is unsupported by DLPack."
            )
        return super().__dlpack__(stream=stream)


@pytest.mark.parametrize("make", [lambda a: a, lambda a: a.view(OldNumpyArray)], ids=["numpy", "numpy-before-2.1"])
def test_read_only_numpy_registers_as_source(pair, make):
    a, b = pair
    ro = make(np.arange(64, dtype=np.uint8))
    ro.setflags(write=False)
    r = a.reg_mr(ro)
    assert not r.writable
    with pytest.raises(weft.ReadOnlyBufferError):
        r.desc
    with pytest.raises(weft.ReadOnlyBufferError):
        a.reg_mr(ro, writable=True)
    dst = np.zeros(64, dtype=np.uint8)
    a.submit_single_write(64, r, b.reg_mr(dst).desc).wait(timeout=60)
    assert np.array_equal(dst, ro)
