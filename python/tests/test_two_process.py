"""Two Python processes write into each other's memory over libfabric tcp
and shm: the example of docs/python.md, run exactly as written there."""

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
@pytest.mark.parametrize("spec", ["libfabric:tcp", "libfabric:shm"])
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
