"""Completion styles: callbacks on weft's callback thread, asyncio await
(no thread per transfer), timeouts, and callbacks that misbehave."""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import pytest

import weft


@pytest.fixture
def regs(pair):
    a, b = pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    return a, b, a.reg_mr(src), b.reg_mr(dst), src, dst


@pytest.fixture
def unraisable(monkeypatch):
    """Collects what callbacks raised (sys.unraisablehook)."""
    seen: list = []
    lock = threading.Lock()

    def hook(u):
        with lock:
            seen.append(u)

    monkeypatch.setattr(sys, "unraisablehook", hook)
    return seen


def test_callback_runs_on_weft_thread(regs):
    a, b, s, d, src, dst = regs
    main = threading.get_ident()
    got = []
    done = threading.Event()

    def cb(t):
        got.append((t, threading.get_ident(), t.done(), t.exception()))
        done.set()

    t = a.submit_single_write(4096, s, d.desc, callback=cb)
    assert done.wait(60)
    (t2, tid, was_done, exc) = got[0]
    assert t2 is t and tid != main and was_done and exc is None
    assert np.array_equal(dst, src)
    # Attached after completion: runs at once on this thread.
    late = []
    t.add_done_callback(lambda x: late.append(threading.get_ident()))
    assert late == [main]


def test_failed_transfer_reaches_callback(regs):
    a, b, s, d, _, dst = regs
    desc = d.desc
    d.unreg()
    errs = []
    done = threading.Event()
    t = a.submit_single_write(16, s, desc, callback=lambda t: (errs.append(t.exception()), done.set()))
    assert done.wait(60)
    assert isinstance(errs[0], weft.RemoteAccessError)
    with pytest.raises(weft.RemoteAccessError):
        t.wait(timeout=60)
    assert not dst.any()


def test_raising_callback_does_not_kill_engine(regs, unraisable):
    a, b, s, d, src, dst = regs

    def bad(t):
        raise RuntimeError("callback bug")

    a.submit_single_write(8, s, d.desc, callback=bad).wait(timeout=60)
    # The next 100 transfers still complete (and their callbacks run).
    ok = []
    ts = [a.submit_single_write(8, s, d.desc, callback=ok.append) for _ in range(100)]
    for t in ts:
        t.wait(timeout=60)
    barrier = threading.Event()
    a.submit_single_write(8, s, d.desc, callback=lambda t: barrier.set())
    assert barrier.wait(60)
    assert len(ok) == 100
    assert a.stats()["callback_errors"] == 1
    assert len(unraisable) == 1 and isinstance(unraisable[0].exc_value, RuntimeError)


def test_wait_inside_callback_is_refused(regs, unraisable):
    a, b, s, d, _, _ = regs
    pending = b.expect_imm_count(b.alloc_imm(), 1)  # never fires
    out = []
    done = threading.Event()

    def cb(t):
        try:
            pending.wait()
        except weft.CallbackDeadlockError as e:
            out.append(e)
        try:
            a.shutdown()
        except weft.CallbackDeadlockError as e:
            out.append(e)
        t.wait()  # already done: fine
        # Submitting from a callback is allowed.
        a.submit_single_write(8, s, d.desc, callback=lambda _: done.set())

    a.submit_single_write(8, s, d.desc, callback=cb)
    assert done.wait(60)
    assert len(out) == 2 and not unraisable


def test_raising_recv_callback(pair, unraisable):
    a, b = pair
    got = []
    done = threading.Event()

    def on_message(m):
        got.append(m)
        if m == b"boom":
            raise ValueError("recv callback bug")
        if m == b"after":
            done.set()

    b.submit_recvs(64, 4, on_message)
    a.submit_send(b.address, b"boom").wait(timeout=60)
    a.submit_send(b.address, b"after").wait(timeout=60)
    assert done.wait(60)
    assert b.stats()["callback_errors"] == 1 and len(unraisable) == 1


def test_raising_watcher_callback(pair, unraisable):
    a, _ = pair
    done = threading.Event()

    def cb(old, new):
        if new == 1:
            raise KeyError("watcher bug")
        done.set()

    w = a.alloc_uvm_watcher(cb)
    w.store(1)
    while not unraisable:  # the watcher reports the first change
        threading.Event().wait(0.01)
    w.store(2)
    assert done.wait(60)
    assert a.stats()["callback_errors"] == 1
    w.close()


def test_asyncio_gather_no_thread_per_transfer(regs):
    a, b, s, d, src, dst = regs
    before = threading.active_count()

    async def main():
        ts = [
            a.submit_single_write(4, s, d.desc, src_offset=4 * i, dst_offset=4 * i)
            for i in range(1000)
        ]
        await asyncio.gather(*ts)
        return threading.active_count()

    during = asyncio.run(main())
    assert during == before
    assert np.array_equal(dst[:4000], src[:4000])


def test_asyncio_error_and_done_transfer(regs):
    a, b, s, d, _, _ = regs

    async def main():
        t = a.submit_single_write(8, s, d.desc)
        await t
        await t  # awaiting a finished transfer resolves at once
        desc = d.desc
        d.unreg()
        with pytest.raises(weft.RemoteAccessError):
            await a.submit_single_write(8, s, desc)

    asyncio.run(main())


def test_asyncio_cancel_leaves_transfer(regs):
    a, b, _, _, _, _ = regs
    rnd = b.expect_imm_count(b.alloc_imm(), 1)

    async def main():
        task = asyncio.ensure_future(asyncio.wait_for(_aw(rnd), 0.05))
        with pytest.raises(asyncio.TimeoutError):
            await task

    async def _aw(t):
        return await t

    asyncio.run(main())
    assert not rnd.done()  # only the wait was cancelled


def test_wait_timeout_and_bad_timeout(pair):
    _, b = pair
    rnd = b.expect_imm_count(b.alloc_imm(), 1)
    with pytest.raises(weft.WaitTimeoutError):
        rnd.wait(timeout=0.05)
    assert isinstance(weft.WaitTimeoutError("x"), TimeoutError)
    with pytest.raises(weft.InvalidArgumentError):
        rnd.wait(timeout=-1)
    with pytest.raises(TypeError):
        rnd.add_done_callback(3)


def test_shutdown_fails_pending_rounds_and_runs_callbacks(pair):
    a, b = pair
    seen = []
    done = threading.Event()
    rnd = b.expect_imm_count(b.alloc_imm(), 1, callback=lambda t: (seen.append(t.exception()), done.set()))
    b.shutdown()
    assert done.wait(60)
    assert isinstance(seen[0], weft.ShutDownError)
    with pytest.raises(weft.ShutDownError):
        rnd.wait(timeout=60)
    with pytest.raises(weft.ShutDownError):
        b.expect_imm_count(b.alloc_imm(), 1)


def test_exit_without_shutdown_with_callbacks_in_flight(tmp_path):
    """Engines left running at exit are shut down by the module's atexit
    hook before the interpreter finalizes: no hang, no crash."""
    import subprocess

    code = (
        "import weft, numpy as np\n"
        "b = weft.provider('loopback'); a, c = weft.TransferEngine(b), weft.TransferEngine(b)\n"
        "s, d = a.reg_mr(np.zeros(1 << 20, np.uint8)), c.reg_mr(np.zeros(1 << 20, np.uint8))\n"
        "w = a.alloc_uvm_watcher(lambda o, n: None)\n"
        "for i in range(2000):\n"
        "    a.submit_single_write(4096, s, d.desc, callback=lambda t: None); w.store(i)\n"
        "print('bye')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "bye", r.stderr
