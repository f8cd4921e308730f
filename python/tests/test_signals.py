"""Ctrl-C during a blocking wait raises KeyboardInterrupt promptly."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import sys, threading, time, weft
    eng = weft.TransferEngine("loopback")
    t = eng.expect_imm_count(eng.alloc_imm(), 1)  # never fires
    main = threading.main_thread().ident

    def announce():
        # "ready" once the main thread is inside t.wait() (its frame sits
        # on the WAIT line), so the signal cannot land before the wait.
        while sys._current_frames()[main].f_lineno != WAIT:
            time.sleep(0.01)
        print("ready", flush=True)

    WAIT = sys._getframe().f_lineno + 3
    threading.Thread(target=announce, daemon=True).start()
    try:
        t.wait()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    eng.shutdown()
    try:
        t.wait(timeout=10)
    except weft.ShutDownError:
        print("shut down", flush=True)
    """
)


def test_sigint_interrupts_wait():
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
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
