"""Two Python processes write into each other's memory over libfabric tcp
and shm and over nvlink: the example of docs/python.md, run exactly as
written there."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import weft

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")


def example(name: str) -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    m = re.search(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)```", text, re.S)
    assert m, f"docs/python.md has no example {name}"
    return m.group(1)


@pytest.mark.fabric
@pytest.mark.parametrize("spec", ["libfabric:tcp", "libfabric:shm", "nvlink"])
def test_doc_example_two_processes(spec, tmp_path):
    status = {p.spec: p for p in weft.providers()}[spec]
    if not status.available:
        pytest.skip(f"{spec}: {status.reason}")
    script = tmp_path / "two_process.py"
    script.write_text(example("two_process.py"))
    # cwd is elsewhere, so only the installed weft can be imported.
    r = subprocess.run(
        [sys.executable, str(script), spec],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,  # a hang bound
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "side 0: received 1048576 bytes from the other process"


def test_doc_quickstart(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(example("quickstart.py"))
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr


PEER = """
import json, sys, time
import numpy as np, weft
eng = weft.TransferEngine(sys.argv[1], domain="same-machine")
buf = np.zeros(1 << 20, np.uint8)
print(json.dumps({"desc": eng.reg_mr(buf).desc.to_bytes().hex()}), flush=True)
time.sleep(600)  # until killed
"""


@pytest.mark.fabric
@pytest.mark.parametrize("spec", ["libfabric:tcp", "libfabric:shm", "nvlink"])
def test_peer_killed_fails_transfers(spec):
    """A peer SIGKILLed between writes: later writes fail with a
    TransportError subclass (no hang) and shutdown returns."""
    import numpy as np

    status = {p.spec: p for p in weft.providers()}[spec]
    if not status.available:
        pytest.skip(f"{spec}: {status.reason}")
    child = subprocess.Popen([sys.executable, "-c", PEER, spec], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        desc = weft.MrDesc.from_bytes(bytes.fromhex(__import__("json").loads(line)["desc"]))
        with weft.TransferEngine(spec, domain="same-machine") as eng:
            src = eng.reg_mr(np.ones(1 << 20, np.uint8))
            eng.submit_single_write(1 << 20, src, desc).wait(timeout=60)
            child.kill()
            child.wait(timeout=60)
            with pytest.raises(weft.TransportError):
                for _ in range(100):  # one of these meets the dead peer
                    eng.submit_single_write(1 << 20, src, desc).wait(timeout=60)
    finally:
        child.kill()
        child.wait(timeout=60)
