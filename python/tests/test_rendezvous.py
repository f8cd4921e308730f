"""weft.rendezvous from Python: stores, sessions, namespaces, watches, and
two processes finding each other through a directory store."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import weft
from weft import rendezvous as rv


def test_publish_find_and_write(loopback_pair):
    a, b = loopback_pair
    store = rv.open_store("mem")
    assert store.endpoint == "mem"
    dst = np.zeros(4096, np.uint8)
    reg = b.reg_mr(dst)
    with rv.Session(store, ttl=5) as sb:
        ns = rv.Namespace(store, "job")
        ns.publish_engine(sb, "decode-0", b)
        ns.publish_mr(sb, "decode-0", "kv", reg.desc)
        rec = ns.wait_peer("decode-0", timeout=5)
        assert rec.name == "decode-0" and rec.generation == b.incarnation and rec.group_count == 1
        assert rec.address() == b.address
        with pytest.raises(weft.InvalidArgumentError):
            rec.address(1)
        desc = ns.wait_mr("decode-0", "kv", timeout=5)
        assert desc == reg.desc
        src = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        a.submit_single_write(4096, a.reg_mr(src), desc).wait(timeout=30)
        assert np.array_equal(dst, src)
        assert [p.name for p in ns.peers()] == ["decode-0"]
        assert ns.peer("nobody") is None and ns.mr("decode-0", "nothing") is None
    # Closing the session withdrew what it published.
    assert ns.peer("decode-0") is None


def test_watch_sees_join_update_and_leave(loopback_pair):
    a, b = loopback_pair
    store = rv.open_store("mem")
    ns = rv.Namespace(store, "w")
    w = ns.watch_peers()
    assert w.recv(timeout=0.05) is None
    s = rv.Session(store, ttl=5)
    ns.publish_engine(s, "p", a)
    ev = w.recv(timeout=5)
    assert (ev.kind, ev.name, ev.record.generation) == ("join", "p", a.incarnation)
    ns.publish_engine(s, "p", b)  # a restarted process republishes
    ev = w.recv(timeout=5)
    assert (ev.kind, ev.record.generation) == ("update", b.incarnation)
    s.close()
    s.close()  # idempotent
    ev = w.recv(timeout=5)
    assert (ev.kind, ev.name, ev.record) == ("leave", "p", None)
    with pytest.raises(weft.RendezvousError) as e:
        ns.publish_engine(s, "p", a)
    assert e.value.kind == "closed"


def test_refusals():
    with pytest.raises(weft.InvalidRendezvousArgumentError) as e:
        rv.open_store("zookeeper:somewhere")
    assert isinstance(e.value, ValueError) and e.value.kind == "spec"
    store = rv.open_store("mem")
    for bad in ["has/slash", ""]:
        with pytest.raises(weft.InvalidRendezvousArgumentError) as e:
            rv.Namespace(store, bad)
        assert e.value.kind == "invalid_key"
    with pytest.raises(weft.InvalidRendezvousArgumentError) as e:
        rv.Namespace(store, "ok").peer("a/b")
    assert e.value.kind == "invalid_key"
    ok = rv.Namespace(store, "ok")
    t0 = time.monotonic()
    with pytest.raises(weft.RendezvousTimeoutError) as e:
        ok.wait_peer("never", timeout=0.2)
    assert isinstance(e.value, TimeoutError) and time.monotonic() - t0 < 10
    with pytest.raises(weft.InvalidArgumentError):
        ok.wait_peer("never", timeout=float("nan"))
    with pytest.raises(weft.InvalidArgumentError):
        rv.Session(store, ttl=-1)
    for huge in [1e19, float("inf")]:
        with pytest.raises(weft.InvalidArgumentError):
            rv.Session(store, ttl=huge)
        with pytest.raises(weft.InvalidArgumentError):
            ok.wait_peer("never", timeout=huge)


def test_garbage_records_are_skipped(tmp_path):
    store = rv.open_store(f"dir:{tmp_path}")
    ns = rv.Namespace(store, "g")
    # Another writer of the directory left garbage where a record goes.
    with rv.Session(store, ttl=5) as s:
        e = weft.TransferEngine(weft.provider("loopback"))
        try:
            ns.publish_engine(s, "good", e)
            # A directory store keeps a key per file (name escaped), its
            # lease's 8 bytes, then the value.
            kv = tmp_path / "kv"
            good = (kv / "weft%2Fg%2Fpeers%2Fgood").read_bytes()
            (kv / "weft%2Fg%2Fpeers%2Fbad").write_bytes(good[:8] + good[8:20] + b"\xff" * 7)
            (kv / "weft%2Fg%2Fpeers%2Fshort").write_bytes(good[:8])
            names = [p.name for p in ns.peers()]
            assert names == ["good"] and ns.skipped_records >= 2
            with pytest.raises(weft.RendezvousError) as err:
                ns.peer("bad")
            assert err.value.kind == "record"
        finally:
            e.shutdown()


CHILD = r"""
import sys, numpy as np, weft
from weft import rendezvous as rv
spec, root = sys.argv[1], sys.argv[2]
store = rv.open_store("dir:" + root)
ns = rv.Namespace(store, "job")
with weft.TransferEngine(spec, domain="same-machine") as eng, rv.Session(store, ttl=5) as s:
    buf = np.zeros(1 << 16, np.uint8)
    reg = eng.reg_mr(buf)
    imm = eng.alloc_imm()
    done = eng.expect_imm_count(imm, eng.imm_counts().single_write(1 << 16))
    ns.publish_mr(s, "reader", "buf", reg.desc)
    ns.publish_engine(s, "reader", eng)
    # The writer publishes which immediate to use after finding us.
    ns.wait_peer("writer", timeout=60)
    open(root + "/imm", "w").write(str(int(imm)))
    done.wait(timeout=60)
    assert np.array_equal(buf, (np.arange(1 << 16) % 251).astype(np.uint8))
    print("ok", flush=True)
"""


@pytest.mark.fabric
def test_two_processes_meet_in_a_directory(tmp_path):
    spec = "libfabric:tcp"
    status = {p.spec: p for p in weft.providers()}[spec]
    if not status.available:
        pytest.skip(f"{spec}: {status.reason}")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, spec, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        store = rv.open_store(f"dir:{tmp_path}")
        ns = rv.Namespace(store, "job")
        with weft.TransferEngine(spec, domain="same-machine") as eng, rv.Session(store, ttl=5) as s:
            rec = ns.wait_peer("reader", timeout=60)
            desc = ns.wait_mr("reader", "buf", timeout=60)
            assert desc.incarnation == rec.generation
            ns.publish_engine(s, "writer", eng)
            path = tmp_path / "imm"
            deadline = time.monotonic() + 60
            while not path.exists() or not path.read_text():
                assert time.monotonic() < deadline, "reader never wrote its immediate"
                time.sleep(0.01)
            src = (np.arange(1 << 16) % 251).astype(np.uint8)
            eng.submit_single_write(1 << 16, eng.reg_mr(src), desc, imm=int(path.read_text())).wait(timeout=60)
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0 and out.strip() == "ok"
    finally:
        child.kill()
        child.wait()


DYING = r"""
import sys, time, weft
from weft import rendezvous as rv
store = rv.open_store("etcd:" + sys.argv[1])
eng = weft.TransferEngine(weft.provider("loopback"))
s = rv.Session(store, ttl=2)
rv.Namespace(store, "job").publish_engine(s, "doomed", eng)
print("published", flush=True)
time.sleep(600)  # until killed: its lease then expires
"""


def test_etcd_lease_ends_with_its_process(etcd, loopback_pair):
    """Over a real etcd: records published under a session are found and
    watched from another handle; a publisher SIGKILLed mid-lease leaves
    once its lease expires."""
    a, _ = loopback_pair
    store = rv.open_store(f"etcd:{etcd}")
    assert store.endpoint == f"etcd:{etcd}"
    ns = rv.Namespace(store, "job")
    with rv.Session(store, ttl=5) as s:
        ns.publish_engine(s, "alive", a)
        assert rv.Namespace(rv.open_store(f"etcd:{etcd}"), "job").wait_peer("alive", timeout=10).address() == a.address
    watch = ns.watch_peers()
    child = subprocess.Popen([sys.executable, "-c", DYING, etcd], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "published"
        seen = {}
        deadline = time.monotonic() + 30
        while "leave" not in seen.get("doomed", ()) and time.monotonic() < deadline:
            ev = watch.recv(timeout=1.0)
            if ev is None:
                continue
            seen.setdefault(ev.name, []).append(ev.kind)
            if ev.name == "doomed" and ev.kind == "join":
                child.kill()
                child.wait()
                killed = time.monotonic()
        assert seen.get("doomed", [])[:1] == ["join"], seen
        assert "leave" in seen["doomed"], f"the dead publisher's record stayed: {seen}"
        assert time.monotonic() - killed < 15
        assert ns.peer("doomed") is None
    finally:
        child.kill()
        child.wait()


def test_application_records_bytes(tmp_path):
    """An application's own records: bytes under (kind, name), waited for,
    gone when the session closes; a key with a '/' is refused; a waiter
    times out with the typed error."""
    store = rv.open_store(f"dir:{tmp_path}")
    ns = rv.Namespace(store, "app")
    assert ns.record("targets", "inference-0") is None
    with rv.Session(store, ttl=10) as s:
        ns.publish_record(s, "targets", "inference-0", b"\x00[1, 2]\xff")
        assert ns.wait_record("targets", "inference-0", timeout=5) == b"\x00[1, 2]\xff"
        assert rv.Namespace(store, "app").record("targets", "inference-0") == b"\x00[1, 2]\xff"
        assert ns.record("other", "inference-0") is None
        with pytest.raises(weft.InvalidRendezvousArgumentError):
            ns.publish_record(s, "a/b", "x", b"")
    assert ns.record("targets", "inference-0") is None
    with pytest.raises(weft.RendezvousTimeoutError):
        ns.wait_record("targets", "inference-0", timeout=0.2)
