"""The first slice of the Python API over the simulated fabric."""

from __future__ import annotations

import gc
import pickle
import random
import threading
import time

import numpy as np
import pytest

import weft


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_providers_lists_loopback():
    ps = {p.spec: p for p in weft.providers()}
    assert ps["loopback"].available and ps["loopback"].reason is None
    for p in ps.values():
        assert p.available == (p.reason is None)


def test_unknown_provider():
    with pytest.raises(weft.UnknownProviderError) as ei:
        weft.TransferEngine("no-such-fabric")
    assert isinstance(ei.value, ValueError)
    assert "loopback" in str(ei.value)  # lists the known specs


def test_unavailable_provider():
    ps = {p.spec: p for p in weft.providers()}
    missing = [spec for spec, p in ps.items() if not p.available]
    if not missing:
        pytest.skip("every provider is available on this host")
    with pytest.raises(weft.ProviderUnavailableError) as ei:
        weft.TransferEngine(missing[0])
    assert ei.value.kind is not None


def test_bad_profile():
    with pytest.raises(weft.InvalidArgumentError):
        weft.provider("loopback", profile="fast")


def test_hierarchy():
    assert issubclass(weft.OutOfBoundsError, weft.InvalidArgumentError)
    assert issubclass(weft.InvalidArgumentError, ValueError)
    assert issubclass(weft.WaitTimeoutError, TimeoutError)
    assert issubclass(weft.RemoteAccessError, weft.TransportError)
    assert issubclass(weft.TransportError, weft.WeftError)


@pytest.mark.parametrize("nbytes", [1, 4096, 3 << 20])
def test_single_write_with_imm(pair, nbytes):
    a, b = pair
    src, dst = pattern(nbytes, nbytes), np.zeros(nbytes, dtype=np.uint8)
    s, d = a.reg_mr(src), b.reg_mr(dst)
    imm = b.alloc_imm()
    # The descriptor travels as bytes, as it would between processes.
    desc = weft.MrDesc.from_bytes(d.desc.to_bytes())
    assert desc == d.desc and hash(desc) == hash(d.desc)
    assert desc.nbytes == nbytes and desc.nic_count == 1
    round_ = b.expect_imm_count(imm, b.imm_counts().single_write(nbytes))
    t = a.submit_single_write(nbytes, s, desc, imm=imm)
    t.wait(timeout=60)
    round_.wait(timeout=60)
    assert t.done() and t.exception() is None and round_.done()
    assert np.array_equal(src, dst)


def test_offsets_and_other_buffers(pair):
    a, b = pair
    src = bytearray(b"x" * 100)
    dst = memoryview(bytearray(200))
    s, d = a.reg_mr(src), b.reg_mr(dst)
    a.submit_single_write(10, s, d.desc, src_offset=5, dst_offset=150).wait(timeout=60)
    assert bytes(dst[150:160]) == b"x" * 10
    assert bytes(dst[:150]) == bytes(150) and bytes(dst[160:]) == bytes(40)
    assert s.obj is src and s.nbytes == 100 and s.device == "cpu"


def test_out_of_bounds_writes_nothing(pair):
    a, b = pair
    src, dst = pattern(64, 1), np.zeros(32, dtype=np.uint8)
    s, d = a.reg_mr(src), b.reg_mr(dst)
    with pytest.raises(weft.OutOfBoundsError):
        a.submit_single_write(64, s, d.desc)
    with pytest.raises(weft.OutOfBoundsError):
        a.submit_single_write(16, s, d.desc, src_offset=60)
    assert not dst.any()


def test_read_only_buffer(pair):
    a, _ = pair
    ro = a.reg_mr(b"constant")
    assert not ro.writable
    with pytest.raises(weft.ReadOnlyBufferError):
        ro.desc
    with pytest.raises(weft.ReadOnlyBufferError):
        a.reg_mr(b"constant", writable=True)


def test_refused_objects(pair):
    a, _ = pair
    with pytest.raises(TypeError):
        a.reg_mr(12345)
    with pytest.raises(weft.InvalidArgumentError):
        a.reg_mr(bytearray())
    with pytest.raises(weft.InvalidArgumentError):
        a.reg_mr(np.zeros((8, 8), dtype=np.uint8)[:, ::2])  # not C-contiguous


def test_unreg_then_use(pair):
    a, b = pair
    src, dst = bytearray(16), bytearray(16)
    with a.reg_mr(src) as s:
        d = b.reg_mr(dst)
    assert not s.registered
    with pytest.raises(weft.StaleRegistrationError):
        a.submit_single_write(16, s, d.desc)
    # The export was released: the bytearray can be resized again.
    src.extend(b"more")
    d.unreg()
    with pytest.raises(weft.StaleRegistrationError):
        d.desc


def test_registration_keeps_object_alive(pair):
    a, b = pair
    s = a.reg_mr(pattern(4096, 3))  # no other reference to the array
    gc.collect()
    dst = np.zeros(4096, dtype=np.uint8)
    d = b.reg_mr(dst)
    a.submit_single_write(4096, s, d.desc).wait(timeout=60)
    assert np.array_equal(dst, pattern(4096, 3))
    del s
    gc.collect()  # dropping the handle does not deregister: the engine holds it


def test_descriptor_garbage_never_crashes():
    rng = random.Random(21)
    for n in range(1000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        try:
            weft.MrDesc.from_bytes(data)
        except weft.DescriptorError:
            pass
    with pytest.raises(weft.DescriptorError):
        weft.MrDesc.from_bytes(b"")


def test_descriptor_truncated_and_trailing(pair):
    _, b = pair
    raw = b.reg_mr(bytearray(8)).desc.to_bytes()
    with pytest.raises(weft.DescriptorError):
        weft.MrDesc.from_bytes(raw[:-1])
    with pytest.raises(weft.DescriptorError):
        weft.MrDesc.from_bytes(raw + b"\0")
    assert pickle.loads(pickle.dumps(raw)) == raw


def test_wait_timeout_releases_gil(pair):
    _, b = pair
    imm = b.alloc_imm()
    never = b.expect_imm_count(imm, 1)
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    th = threading.Thread(target=count)
    th.start()
    try:
        with pytest.raises(weft.WaitTimeoutError):
            never.wait(timeout=0.3)
    finally:
        stop.set()
        th.join()
    assert ticks > 0  # the other thread ran while we waited
    assert not never.done() and never.exception() is None
    with pytest.raises(weft.InvalidArgumentError):
        never.wait(timeout=-1)


def test_imm_double_arm_and_free(pair):
    _, b = pair
    imm = b.alloc_imm()
    r = b.expect_imm_count(imm, 5)
    with pytest.raises(weft.ImmAlreadyArmedError):
        b.expect_imm_count(imm, 5)
    with pytest.raises(weft.InvalidArgumentError):
        imm.release()  # fails the armed round, and says so
    assert not imm.held
    with pytest.raises(weft.InvalidArgumentError):
        r.wait(timeout=60)
    assert isinstance(r.exception(), weft.InvalidArgumentError)
    assert b.expect_imm_count(b.alloc_imm(), 0).wait(timeout=60) is None


def test_shutdown_and_context_manager():
    backend = weft.provider("loopback")
    with weft.TransferEngine(backend) as a:
        s = a.reg_mr(bytearray(8))
        imm = a.alloc_imm()
        pending = a.expect_imm_count(imm, 1)
    with pytest.raises(weft.ShutDownError):
        pending.wait(timeout=60)
    with pytest.raises(weft.ShutDownError):
        a.submit_single_write(8, s, s.desc)
    a.shutdown()  # idempotent


def test_two_nics():
    backend = weft.provider("loopback", nics=2, profile="ideal")
    with weft.TransferEngine(backend) as a, weft.TransferEngine(backend) as b:
        src, dst = pattern(1 << 20, 5), np.zeros(1 << 20, dtype=np.uint8)
        s, d = a.reg_mr(src), b.reg_mr(dst)
        assert d.desc.nic_count == 2
        a.submit_single_write(src.nbytes, s, d.desc).wait(timeout=60)
        assert np.array_equal(src, dst)
        one = weft.TransferEngine(weft.provider("loopback"))
        try:
            s1 = one.reg_mr(bytearray(16))
            with pytest.raises(weft.NicCountMismatchError):
                one.submit_single_write(16, s1, d.desc)
        finally:
            one.shutdown()


def test_remove_peer(pair):
    a, b = pair
    src, dst = bytearray(b"y" * 64), bytearray(64)
    s, d = a.reg_mr(src), b.reg_mr(dst)
    a.submit_single_write(64, s, d.desc).wait(timeout=60)
    a.remove_peer(b.address)
    a.remove_peer(b.address)  # already removed: nothing happens
    dst[:] = bytes(64)
    with pytest.raises(weft.PeerRemovedError) as ei:
        a.submit_single_write(64, s, d.desc).wait(timeout=60)
    assert ei.value.kind == "peer_removed"
    assert isinstance(ei.value, weft.TransportError)
    assert bytes(dst) == bytes(64)
