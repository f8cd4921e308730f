"""Signals stay the application's: Ctrl-C during a blocking wait raises
KeyboardInterrupt, and an application's SIGTERM handler installed before the
engine runs, on every provider (libfabric's libraries install handlers of
their own when they load; weft puts the application's back)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import sys, threading, time, weft
    spec, what = sys.argv[1], sys.argv[2]
    kw = {} if spec == "loopback" else {"domain": "same-machine"}
    eng = weft.TransferEngine(spec, **kw)
    if what == "recv":
        q = eng.recv_queue(64, 1)  # nothing is ever sent
        wait, wait_after = q.recv, lambda: q.recv(timeout=10)
    else:
        t = eng.expect_imm_count(eng.alloc_imm(), 1)  # never fires
        wait, wait_after = t.wait, lambda: t.wait(timeout=10)
    main = threading.main_thread().ident

    def announce():
        # "ready" once the main thread is inside wait() (its frame sits
        # on the WAIT line), so the signal cannot land before the wait.
        while sys._current_frames()[main].f_lineno != WAIT:
            time.sleep(0.01)
        print("ready", flush=True)

    WAIT = sys._getframe().f_lineno + 3
    threading.Thread(target=announce, daemon=True).start()
    try:
        wait()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    eng.shutdown()
    try:
        wait_after()
    except weft.ShutDownError:
        print("shut down", flush=True)
    """
)


SPECS = ["loopback", "libfabric:tcp", "libfabric:shm"]


def available(spec: str) -> bool:
    import weft

    if spec == "loopback":
        return True
    return any(p.spec == spec and p.available for p in weft.providers())


@pytest.mark.parametrize(
    "spec,what", [(s, "transfer") for s in SPECS] + [("loopback", "recv")]
)
def test_sigint_interrupts_wait(spec, what):
    """`Transfer.wait()` and `RecvQueue.recv()` alike."""
    if not available(spec):
        pytest.skip(f"{spec} unavailable here")
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, spec, what],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGINT)
        # A hang bound, not a timing assertion.
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert out.split() == ["interrupted", "shut", "down"]


TERM_CHILD = textwrap.dedent(
    """
    import os, signal, sys, weft
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append("term"))
    spec = sys.argv[1]
    kw = {} if spec == "loopback" else {"domain": "same-machine"}
    with weft.TransferEngine(spec, **kw) as eng:
        eng.alloc_imm()
        os.kill(os.getpid(), signal.SIGTERM)
    print(" ".join(got) or "none", flush=True)
    """
)


@pytest.mark.parametrize("spec", SPECS)
def test_application_sigterm_handler_runs(spec):
    if not available(spec):
        pytest.skip(f"{spec} unavailable here")
    p = subprocess.run(
        [sys.executable, "-c", TERM_CHILD, spec], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["term"], p.stderr
