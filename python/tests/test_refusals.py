"""What reg_mr refuses, and how: memory whose items are not plain bytes
(Python object pointers, C pointers) is never registered; read-only arrays
register as sources on every numpy; a non-contiguous object is named in
the error with a way out."""

from __future__ import annotations

import array
import ctypes
import subprocess
import sys

import numpy as np
import pytest

import weft


class _Device:
    type, index = "cpu", None

    def __str__(self) -> str:
        return "cpu"


class DtypeTensor:
    """A torch-like tensor over a numpy array that also shows its dtype."""

    def __init__(self, arr: np.ndarray):
        self.arr, self.device, self.dtype = arr, _Device(), arr.dtype

    def data_ptr(self) -> int:
        return self.arr.ctypes.data

    def numel(self) -> int:
        return self.arr.size

    def element_size(self) -> int:
        return self.arr.itemsize

    def is_contiguous(self) -> bool:
        return self.arr.flags.c_contiguous


class InterfaceTensor(DtypeTensor):
    """A torch-like tensor with no dtype attribute, only
    ``__array_interface__`` (whose typestr tells what its items are)."""

    def __init__(self, arr: np.ndarray):
        super().__init__(arr)
        del self.dtype

    @property
    def __array_interface__(self):
        return self.arr.__array_interface__


class CudaInterfaceTensor(InterfaceTensor):
    """As InterfaceTensor, through ``__cuda_array_interface__``."""

    @property
    def __array_interface__(self):
        raise AttributeError("__array_interface__")

    @property
    def __cuda_array_interface__(self):
        return self.arr.__array_interface__


class DlpackOnly:
    """A producer with ``__dlpack__`` and no buffer protocol (like cupy)."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


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


class _WithPointer(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("p", ctypes.c_void_p)]


class _Plain(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("d", ctypes.c_double)]


def _objects() -> np.ndarray:
    return np.array([object(), "text", 12345678901234567890, None], dtype=object)


def _pointer_objects():
    """Objects whose items hold pointers, with a name for the test id."""
    structured = np.zeros(4, dtype=[("n", "<i8"), ("o", "O")])
    return [
        ("numpy-object", _objects()),
        ("numpy-structured-with-object", structured),
        ("numpy-nested-structured-object", np.zeros(2, dtype=[("s", [("o", "O")])])),
        ("memoryview-of-object-array", memoryview(_objects())),
        ("ctypes-py_object", (ctypes.py_object * 4)()),
        ("ctypes-void-p", (ctypes.c_void_p * 4)()),
        ("ctypes-char-p", (ctypes.c_char_p * 4)()),
        ("ctypes-wchar-p", (ctypes.c_wchar_p * 4)()),
        ("ctypes-struct-with-pointer", (_WithPointer * 2)()),
        ("ctypes-int-pointer", (ctypes.POINTER(ctypes.c_int) * 4)()),
        ("tensor-with-object-dtype", DtypeTensor(_objects())),
        ("tensor-array-interface-object", InterfaceTensor(_objects())),
        ("tensor-cuda-array-interface-object", CudaInterfaceTensor(_objects())),
    ]


@pytest.mark.parametrize("name,obj", _pointer_objects(), ids=[n for n, _ in _pointer_objects()])
def test_pointer_items_are_refused(pair, name, obj):
    a, _ = pair
    with pytest.raises(weft.InvalidArgumentError) as ei:
        a.reg_mr(obj)
    assert ei.value.kind == "unsupported_dtype", (name, ei.value.kind)
    assert "pointer" in str(ei.value)
    with pytest.raises(weft.InvalidArgumentError):
        a.reg_mr(obj, writable=False)  # not even as a source: peers would read addresses


def test_object_array_is_never_written(tmp_path):
    """A write into an object array overwrites its PyObject pointers and
    crashes the receiver: the registration itself is refused. Run in a
    child process, so a regression fails this test instead of killing the
    suite."""
    code = (
        "import numpy as np, weft\n"
        "backend = weft.provider('loopback')\n"
        "a, b = weft.TransferEngine(backend), weft.TransferEngine(backend)\n"
        "target = np.array([object(), 'text', None, 1.5], dtype=object)\n"
        "src = a.reg_mr(np.full(target.nbytes, 0x41, dtype=np.uint8))\n"
        "try:\n"
        "    d = b.reg_mr(target)\n"
        "except weft.InvalidArgumentError as e:\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    a.submit_single_write(target.nbytes, src, d.desc).wait(timeout=60)\n"
        "    print('written:', target[1], target[2])\n"
        "a.shutdown(); b.shutdown()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, f"receiver died (rc {r.returncode}): {r.stdout}{r.stderr[-2000:]}"
    assert r.stdout.startswith("refused:") and "object" in r.stdout, r.stdout


def test_send_refuses_pointer_items(pair):
    a, b = pair
    with pytest.raises(weft.InvalidArgumentError, match="pointer") as ei:
        a.submit_send(b.address, _objects())
    assert ei.value.kind == "unsupported_dtype"


@pytest.mark.parametrize(
    "obj",
    [
        np.zeros(16, dtype=np.uint8),
        np.zeros(4, dtype=np.float16),
        np.zeros(4, dtype=np.complex128),
        np.zeros(4, dtype=np.bool_),
        np.zeros(4, dtype="S3"),
        np.zeros(4, dtype="U3"),
        np.zeros(4, dtype="V8"),
        np.zeros(4, dtype=[("a", "<i4"), ("Obj", "<f8")]),  # a field *named* O... is fine
        np.zeros(4, dtype=[("a", "<i4", (2,)), ("b", [("c", "u1")])]),
        np.zeros(4, dtype=(np.int32, (2, 3))),
        array.array("d", [1.0, 2.0]),
        (ctypes.c_int * 4)(),
        (_Plain * 2)(),
        bytearray(8),
        DtypeTensor(np.zeros(4, dtype=np.float32)),
        InterfaceTensor(np.zeros(4, dtype=np.int64)),
    ],
    ids=lambda o: getattr(getattr(o, "dtype", None), "str", type(o).__name__),
)
def test_plain_items_register(pair, obj):
    a, _ = pair
    r = a.reg_mr(obj)
    assert r.writable and r.nbytes > 0
    r.desc  # a write target


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


def test_non_contiguous_numpy_names_the_array(pair):
    a, _ = pair
    x = np.zeros((16, 16), dtype=np.uint8)[:, ::2]
    with pytest.raises(weft.InvalidArgumentError) as ei:
        a.reg_mr(x)
    msg = str(ei.value)
    assert "numpy array is not C-contiguous" in msg, msg
    assert "strides (16, 2)" in msg and "np.ascontiguousarray" in msg, msg
    assert "DLPack" not in msg, msg
    assert ei.value.kind == "not_contiguous"


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda x: memoryview(x), "memoryview"),
        (lambda x: DlpackOnly(x), "DlpackOnly"),
        (lambda x: x.__dlpack__(), "DLPack capsule"),
        (lambda x: DtypeTensor(x), "DtypeTensor"),
    ],
    ids=["memoryview", "dlpack-producer", "dlpack-capsule", "tensor"],
)
def test_non_contiguous_names_the_object(pair, make, name):
    a, _ = pair
    x = np.zeros((16, 16), dtype=np.uint16)[:, ::2]
    with pytest.raises(weft.InvalidArgumentError) as ei:
        a.reg_mr(make(x))
    msg = str(ei.value)
    assert f"{name} is not C-contiguous" in msg, msg
    assert ei.value.kind == "not_contiguous"
