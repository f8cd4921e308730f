"""reg_mr over every kind of object: torch-like tensors (duck-typed, so CI
needs no torch), DLPack capsules and producers, raw (ptr, nbytes, device)
tuples; refusals leave memory untouched."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import weft


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class _Device:
    def __init__(self, kind: str, index=None):
        self.type, self.index = kind, index

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class FakeTensor:
    """The part of torch.Tensor's interface reg_mr reads, over a numpy array."""

    def __init__(self, arr: np.ndarray, device=("cpu", None)):
        self.arr = arr
        self.device = _Device(*device)

    def data_ptr(self) -> int:
        return self.arr.ctypes.data

    def numel(self) -> int:
        return self.arr.size

    def element_size(self) -> int:
        return self.arr.itemsize

    def is_contiguous(self) -> bool:
        return self.arr.flags.c_contiguous


class DlpackOnly:
    """A producer with ``__dlpack__`` and no buffer protocol (like cupy)."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


def _roundtrip(a, b, src_obj, dst_obj, nbytes):
    s, d = a.reg_mr(src_obj), b.reg_mr(dst_obj)
    a.submit_single_write(nbytes, s, d.desc).wait(timeout=60)
    return s, d


def test_fake_tensor_cpu(pair):
    a, b = pair
    src, dst = pattern(4096, 1).view(np.float32), np.zeros(1024, dtype=np.float32)
    s, d = _roundtrip(a, b, FakeTensor(src), FakeTensor(dst), 4096)
    assert np.array_equal(dst.view(np.uint8), src.view(np.uint8))
    assert s.nbytes == 4096 and s.device == "cpu" and s.addr == src.ctypes.data


def test_fake_tensor_refusals(pair):
    a, _ = pair
    arr = np.zeros((8, 8), dtype=np.int16)
    with pytest.raises(weft.InvalidArgumentError, match="contiguous"):
        a.reg_mr(FakeTensor(arr[:, ::2]))
    with pytest.raises(weft.InvalidArgumentError, match="mps"):
        a.reg_mr(FakeTensor(arr, ("mps", 0)))
    # A CUDA tensor on an engine without a CUDA group: refused, not guessed.
    with pytest.raises(weft.InvalidArgumentError, match="cuda:0"):
        a.reg_mr(FakeTensor(arr, ("cuda", 0)))
    with pytest.raises(weft.InvalidArgumentError, match="empty"):
        a.reg_mr(FakeTensor(np.zeros(0, dtype=np.float32)))
    # The expected device does not match.
    with pytest.raises(weft.InvalidArgumentError, match="device=cuda:1"):
        a.reg_mr(FakeTensor(arr), device="cuda:1")
    with pytest.raises(weft.InvalidArgumentError):
        a.reg_mr(arr, device="tpu")


def test_dlpack_capsule(pair):
    a, b = pair
    src, dst = pattern(1000, 2), np.zeros(1000, dtype=np.uint8)
    cap = dst.__dlpack__()
    s, d = _roundtrip(a, b, src.__dlpack__(), cap, 1000)
    assert np.array_equal(dst, src)
    assert d.addr == dst.ctypes.data and d.nbytes == 1000
    # The capsule was consumed: registering it again is refused.
    with pytest.raises(TypeError):
        b.reg_mr(cap)
    d.unreg()  # runs the producer's deleter


def test_dlpack_producer_and_offset_view(pair):
    a, b = pair
    src = pattern(512, 3)
    backing = np.zeros(1024, dtype=np.uint8)
    view = backing[256:768]  # DLPack data + byte_offset
    s, d = _roundtrip(a, b, DlpackOnly(src), DlpackOnly(view), 512)
    assert np.array_equal(view, src)
    assert not backing[:256].any() and not backing[768:].any()


NUMPY_DLPACK_1 = tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 1)


def test_dlpack_read_only_is_source_only(pair):
    a, b = pair
    ro = pattern(64, 4)
    ro.flags.writeable = False
    if not NUMPY_DLPACK_1:
        # numpy < 2.1 speaks DLPack 0.8, which cannot flag read-only memory:
        # its __dlpack__ refuses, and reg_mr says so.
        with pytest.raises(weft.InvalidArgumentError, match="__dlpack__"):
            a.reg_mr(DlpackOnly(ro))
        return
    r = a.reg_mr(DlpackOnly(ro))  # versioned DLPack: READ_ONLY flag
    assert not r.writable
    with pytest.raises(weft.ReadOnlyBufferError):
        r.desc
    with pytest.raises(weft.ReadOnlyBufferError):
        a.reg_mr(DlpackOnly(ro), writable=True)
    dst = np.zeros(64, dtype=np.uint8)
    d = b.reg_mr(dst)
    a.submit_single_write(64, r, d.desc).wait(timeout=60)  # still a source
    assert np.array_equal(dst, ro)


def test_dlpack_non_contiguous_refused(pair):
    a, _ = pair
    arr = np.zeros((16, 16), dtype=np.uint8)
    with pytest.raises(weft.InvalidArgumentError, match="contiguous"):
        a.reg_mr(arr[:, ::2].__dlpack__())


def test_raw_tuple(pair):
    a, b = pair
    src, dst = pattern(256, 5), np.zeros(256, dtype=np.uint8)
    s = a.reg_mr((src.ctypes.data, src.nbytes, "cpu"), keepalive=src)
    d = b.reg_mr((dst.ctypes.data, dst.nbytes, "cpu"), keepalive=dst)
    assert s.obj is src
    a.submit_single_write(256, s, d.desc).wait(timeout=60)
    assert np.array_equal(dst, src)
    with pytest.raises(TypeError):
        a.reg_mr((src.ctypes.data, "many"))
    with pytest.raises(weft.InvalidArgumentError):
        a.reg_mr((src.ctypes.data, 16, "gpu"))
    with pytest.raises(weft.InvalidArgumentError):
        a.reg_mr((0, 16, "cpu"))


def test_mmap_and_array_module(pair):
    import array

    a, b = pair
    src = array.array("i", range(64))
    m = mmap.mmap(-1, 4096)
    s, d = _roundtrip(a, b, src, m, 256)
    assert m[:256] == src.tobytes()
    d.unreg()
    m.close()  # the export was released at unreg


def test_too_small_destination_writes_nothing(pair):
    a, b = pair
    src, dst = pattern(128, 6), np.zeros(100, dtype=np.uint8)
    s, d = a.reg_mr(FakeTensor(src)), b.reg_mr(dst.__dlpack__())
    with pytest.raises(weft.OutOfBoundsError):
        a.submit_single_write(128, s, d.desc)
    assert not dst.any()
