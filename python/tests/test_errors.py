"""Every error weft raises carries a machine-readable ``kind``, and every
engine call after ``shutdown()`` raises ``ShutDownError``."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import weft


@pytest.fixture
def shut():
    """An engine shut down after it registered memory, made a peer group
    and scatter targets and took an immediate value; a live peer."""
    backend = weft.provider("loopback", profile="ideal")
    a, b = weft.TransferEngine(backend), weft.TransferEngine(backend)
    s, d = a.reg_mr(np.zeros(64, np.uint8)), b.reg_mr(np.zeros(64, np.uint8))
    g = a.add_peer_group([b.address])
    targets = a.scatter_targets(g, [d.desc])
    a.shutdown()
    try:
        yield a, b, s, d, g, targets
    finally:
        b.shutdown()


AFTER_SHUTDOWN = {
    "reg_mr": lambda a, b, s, d, g, t: a.reg_mr(np.zeros(8, np.uint8)),
    "submit_single_write": lambda a, b, s, d, g, t: a.submit_single_write(8, s, d.desc),
    "submit_send": lambda a, b, s, d, g, t: a.submit_send(b.address, b"x"),
    "submit_recvs": lambda a, b, s, d, g, t: a.submit_recvs(8, 1, print),
    "recv_queue": lambda a, b, s, d, g, t: a.recv_queue(8, 1),
    "submit_paged_writes": lambda a, b, s, d, g, t: a.submit_paged_writes(8, s, [0], d.desc, [0]),
    "remove_peer": lambda a, b, s, d, g, t: a.remove_peer(b.address),
    "add_peer_group": lambda a, b, s, d, g, t: a.add_peer_group([b.address]),
    "submit_scatter": lambda a, b, s, d, g, t: a.submit_scatter(g, s, [weft.ScatterDst(d.desc, 8)]),
    "scatter_targets": lambda a, b, s, d, g, t: a.scatter_targets(g, [d.desc]),
    "submit_scatter_to": lambda a, b, s, d, g, t: a.submit_scatter_to(t, s, [(0, 0, 8)]),
    "submit_barrier": lambda a, b, s, d, g, t: a.submit_barrier(g, 1, [d.desc]),
    "alloc_uvm_watcher": lambda a, b, s, d, g, t: a.alloc_uvm_watcher(print),
    "alloc_uvm_watcher(word=)": lambda a, b, s, d, g, t: a.alloc_uvm_watcher(
        print, word=np.zeros(1, np.int64)
    ),
    "alloc_imm": lambda a, b, s, d, g, t: a.alloc_imm(),
    "reserve_imm": lambda a, b, s, d, g, t: a.reserve_imm(5),
    "imm_pending": lambda a, b, s, d, g, t: a.imm_pending(1),
    "expect_imm_count": lambda a, b, s, d, g, t: a.expect_imm_count(1, 1),
    "imm_counts": lambda a, b, s, d, g, t: a.imm_counts(),
    "paths_to": lambda a, b, s, d, g, t: a.paths_to(d.desc),
    "__enter__": lambda a, b, s, d, g, t: a.__enter__(),
}


@pytest.mark.parametrize("call", list(AFTER_SHUTDOWN), ids=list(AFTER_SHUTDOWN))
def test_engine_call_after_shutdown_raises(shut, call):
    with pytest.raises(weft.ShutDownError) as ei:
        AFTER_SHUTDOWN[call](*shut)
    assert ei.value.kind == "shut_down"


def test_what_still_works_after_shutdown(shut):
    a, _, s, _, _, _ = shut
    a.shutdown()  # idempotent
    assert a.stats()["callback_errors"] == 0  # counters stay readable
    assert "weft_transfers_ok_total" in a.metrics_text()
    assert a.provider == "loopback" and a.imm_capacity > 0
    assert isinstance(a.incarnation, int) and a.address is not None
    assert "TransferEngine" in repr(a)
    s.unreg()  # shutdown released it already: nothing to do


def test_every_engine_method_is_covered():
    """A new TransferEngine method gets a row in AFTER_SHUTDOWN (or is one
    of the calls documented to work after shutdown)."""
    works = {"shutdown", "stats", "metrics_text", "provider", "incarnation", "address", "imm_capacity"}
    public = {m for m in dir(weft.TransferEngine) if not m.startswith("_")}
    assert public == (set(AFTER_SHUTDOWN) - {"__enter__", "alloc_uvm_watcher(word=)"}) | works


def _provoked():
    """(class, callable raising it) for every class reachable on loopback."""
    backend = weft.provider("loopback", profile="ideal")
    a, b = weft.TransferEngine(backend), weft.TransferEngine(backend)
    two = weft.provider("loopback", nics=2, profile="ideal")
    c = weft.TransferEngine(two)
    src, dst = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    s, d = a.reg_mr(src), b.reg_mr(dst)
    d2 = c.reg_mr(np.zeros(64, np.uint8))
    stale = a.reg_mr(bytearray(8))
    stale.unreg()
    w = a.alloc_uvm_watcher(lambda o, n: None)
    w.close()
    held = b.alloc_imm()
    armed = b.alloc_imm()
    pending = b.expect_imm_count(armed, 1)
    dead = weft.TransferEngine(backend)
    dead.shutdown()

    def deadlock():
        out, done = [], threading.Event()

        def cb(_):
            try:
                pending.wait(timeout=60)
            except weft.WeftError as e:
                out.append(e)
            done.set()

        # A round not yet finished when its callback is attached: the
        # callback runs on weft's callback thread, where waiting is refused.
        trigger = b.alloc_imm()
        b.expect_imm_count(trigger, 1).add_done_callback(cb)
        a.submit_single_write(8, s, d.desc, imm=trigger)
        assert done.wait(60)
        raise out[0]

    def exhaust():
        keep = []
        while True:
            keep.append(a.alloc_imm())

    def gone():
        e = weft.TransferEngine(backend)
        r = e.reg_mr(np.zeros(64, np.uint8))
        desc = r.desc
        r.unreg()
        a.submit_single_write(8, s, desc).wait(timeout=60)

    def removed():
        x = weft.TransferEngine(backend)
        x.remove_peer(b.address)
        try:
            x.submit_single_write(8, x.reg_mr(np.zeros(8, np.uint8)), d.desc).wait(timeout=60)
        finally:
            x.shutdown()

    rows = [
        (weft.UnknownProviderError, lambda: weft.provider("no-such-fabric")),
        (weft.InvalidArgumentError, lambda: weft.provider("loopback", profile="fast")),
        (weft.InvalidArgumentError, lambda: weft.TransferEngine("loopback", nics=0)),
        (weft.InvalidArgumentError, lambda: a.reg_mr(bytearray())),
        (weft.InvalidArgumentError, lambda: a.reg_mr(np.zeros(4), device="tpu")),
        (weft.InvalidArgumentError, lambda: a.reg_mr(np.zeros(4), device="cuda:1")),
        (weft.InvalidArgumentError, lambda: a.reg_mr((0, 16, "cpu"))),
        (weft.InvalidArgumentError, lambda: a.reserve_imm(a.imm_capacity)),
        (weft.InvalidArgumentError, lambda: pending.wait(timeout=-1)),
        (weft.InvalidArgumentError, lambda: a.submit_scatter(a.add_peer_group([b.address]), s, [], mode="x")),
        (weft.InvalidArgumentError, lambda: w.store(1)),
        (weft.InvalidArgumentError, lambda: a.alloc_uvm_watcher(print, word=np.zeros(1, np.int8))),
        (weft.OutOfBoundsError, lambda: a.submit_single_write(128, s, d.desc)),
        (weft.NicCountMismatchError, lambda: a.submit_single_write(8, s, d2.desc)),
        (weft.DescriptorError, lambda: weft.MrDesc.from_bytes(b"xx")),
        (weft.ReadOnlyBufferError, lambda: a.reg_mr(b"constant", writable=True)),
        (weft.ReadOnlyBufferError, lambda: a.reg_mr(b"constant").desc),
        (weft.StaleRegistrationError, lambda: a.submit_single_write(8, stale, d.desc)),
        (weft.ShutDownError, lambda: dead.alloc_imm()),
        (weft.ImmAlreadyArmedError, lambda: b.expect_imm_count(armed, 1)),
        (weft.ImmInUseError, lambda: b.reserve_imm(int(held))),
        (weft.ExhaustedError, exhaust),
        (weft.RemoteAccessError, gone),
        (weft.PeerRemovedError, removed),
        (weft.WaitTimeoutError, lambda: pending.wait(timeout=0.01)),
        (weft.CallbackDeadlockError, deadlock),
    ]
    return rows, (a, b, c)


def test_every_error_carries_a_kind():
    rows, engines = _provoked()
    try:
        missing = []
        for cls, provoke in rows:
            try:
                provoke()
            except Exception as e:  # noqa: BLE001 - every outcome is recorded
                kind = getattr(e, "kind", None)
                if not isinstance(e, cls) or not (isinstance(kind, str) and kind):
                    missing.append(f"want {cls.__name__}, got {type(e).__name__}({e}): kind={kind!r}")
            else:
                missing.append(f"want {cls.__name__}, nothing raised")
        assert not missing, "errors without a kind:\n" + "\n".join(missing)
    finally:
        for e in engines:
            e.shutdown()


def test_every_error_class_has_a_kind():
    """Even one built by hand (e.g. in a test double) has a kind."""
    for name in weft._errors.__all__:
        cls = getattr(weft, name)
        kind = cls("x").kind
        assert isinstance(kind, str) and kind, name
