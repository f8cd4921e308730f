"""Test helper: runs one Python process per rank and collects what they
printed (shared by the multi-process tests here and in ../tests_torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence


def run_ranks(
    script: str,
    argvs: Sequence[Sequence[str]],
    *,
    cwd: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    timeout: float = 180,
) -> List[str]:
    """Starts ``python -c script *argv`` for every argv, waits for all
    (killing every one still running after `timeout` seconds), asserts each
    exited with 0 (showing its stderr's tail if not) and returns each one's
    stripped stdout, in order."""
    full_env = dict(os.environ, **(env or {}))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *argv],
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            p.kill()
    # On a failure, every process's exit status and stderr: what the
    # others did at the time often says why one failed.
    assert all(p.returncode == 0 for p in procs), "\n".join(
        f"process {i} ({list(argvs[i])}) exited {p.returncode}: {err[-3000:]}"
        for i, (p, (_, err)) in enumerate(zip(procs, outs))
    )
    return [out.strip() for out, _ in outs]
