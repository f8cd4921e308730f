"""What gets installed: only the `weft` package (no bundled libfabric,
libibverbs or CUDA library), and an extension that links none of them."""

from __future__ import annotations

import importlib.metadata as md
import os
import struct
import zipfile

import weft
from weft import _weft

# What an abi3 extension built by rustc may link: the C runtime only.
ALLOWED_NEEDED = {
    "libc.so.6",
    "libm.so.6",
    "libgcc_s.so.1",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}


def dt_needed(path: str) -> list:
    """DT_NEEDED entries of a 64-bit little-endian ELF file."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not ELF64 LE"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for sh in sections:
        if sh[1] != 6:  # SHT_DYNAMIC
            continue
        dyn_off, dyn_size, strtab = sh[4], sh[5], sections[sh[6]]
        for off in range(dyn_off, dyn_off + dyn_size, 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strtab[4] + val
                needed.append(data[start : data.index(b"\0", start)].decode())
    return needed


def test_extension_links_no_fabric_or_cuda_library():
    needed = dt_needed(_weft.__file__)
    assert "libc.so.6" in needed  # the parser found the dynamic section
    assert set(needed) <= ALLOWED_NEEDED, needed
    assert not any(n.startswith("libpython") for n in needed)


def _check_wheel_names(names) -> None:
    for n in names:
        top = n.split("/")[0]
        assert top == "weft" or top.endswith(".dist-info"), n
        assert ".libs" not in n, n
        base = os.path.basename(n)
        for lib in ("libfabric", "libibverbs", "libcuda", "libnvrtc", "libpython"):
            assert not base.startswith(lib), n
    sos = [n for n in names if ".so" in os.path.basename(n)]
    assert sos == ["weft/_weft.abi3.so"], sos


def test_wheel_files():
    # CI (cargo xtask test) builds the wheel, installs it and passes its
    # path; otherwise check the installed distribution's file list.
    wheel = os.environ.get("WEFT_WHEEL")
    if wheel:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
        assert "weft/py.typed" in names and "weft/_weft.pyi" in names
        _check_wheel_names(names)
        return
    files = [str(f) for f in (md.files("weft-rdma") or [])]
    editable = any(f.endswith(".pth") for f in files)
    if editable:  # maturin develop: the package is the source tree
        names = ["weft/" + n for n in os.listdir(os.path.dirname(weft.__file__)) if n != "__pycache__"]
    else:
        names = [f for f in files if "__pycache__" not in f and not f.startswith("..")]
    _check_wheel_names(names)


def test_version_and_distribution():
    assert weft.__version__ == md.version("weft-rdma")
