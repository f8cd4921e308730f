"""Every submit and control call of the engine over the simulated fabric."""

from __future__ import annotations

import queue
import threading

import numpy as np

import pytest

import weft


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_address_and_desc_bytes(pair):
    a, b = pair
    addr = a.address
    again = weft.PeerAddress.from_bytes(addr.to_bytes())
    assert again == addr and hash(again) == hash(addr) and addr != b.address
    assert addr.nic_count == 1
    with pytest.raises(weft.DescriptorError):
        weft.PeerAddress.from_bytes(b"\xff" * 7)
    d = b.reg_mr(bytearray(64)).desc
    assert weft.MrDesc.from_bytes(d.to_bytes()) == d and d.nbytes == 64


def test_send_and_recvs(pair):
    a, b = pair
    got: list = []
    done = threading.Event()

    def on_message(data):
        assert isinstance(data, bytes)
        got.append(data)
        if len(got) == 20:
            done.set()

    b.submit_recvs(256, 8, on_message)
    msgs = [bytes([i]) * (i + 1) for i in range(20)]
    for i, m in enumerate(msgs):
        # bytes, bytearray and memoryview are all bytes-like.
        data = m if i % 3 == 0 else bytearray(m) if i % 3 == 1 else memoryview(m)
        a.submit_send(b.address, data).wait(timeout=60)
    assert done.wait(60)
    assert sorted(got) == sorted(msgs)  # delivery order is not guaranteed
    with pytest.raises(TypeError):
        a.submit_send(b.address, 42)
    with pytest.raises(weft.InvalidArgumentError):
        b.submit_recvs(0, 1, got.append)
    with pytest.raises(TypeError):
        b.submit_recvs(16, 1, "not callable")


def test_recv_queue(pair):
    a, b = pair
    q = b.recv_queue(256, 8)
    assert q.max_message == 256 and len(q) == 0 and not q.closed
    assert q.try_recv() is None
    assert q.recv(timeout=0.01) is None
    msgs = [bytes([i]) * (i + 1) for i in range(20)]
    for m in msgs:
        a.submit_send(b.address, m).wait(timeout=60)
    got = [q.recv(timeout=60) for _ in msgs]
    assert all(isinstance(m, bytes) for m in got)
    assert sorted(got) == sorted(msgs)  # delivery order is not guaranteed
    assert q.try_recv() is None
    # A receiver waiting in another thread (GIL released) gets a late
    # message, and is woken by close().
    out: list = []
    t = threading.Thread(target=lambda: out.append(q.recv(timeout=60)))
    t.start()
    a.submit_send(b.address, b"late").wait(timeout=60)
    t.join(60)
    assert out == [b"late"]

    def waiting() -> None:
        try:
            q.recv(timeout=60)
        except ValueError as e:
            out.append(str(e))

    t = threading.Thread(target=waiting)
    t.start()
    q.close()
    t.join(60)
    assert not t.is_alive() and "closed" in out[-1]
    assert q.closed
    with pytest.raises(ValueError):
        q.try_recv()
    # Messages to a closed queue are discarded; the sender still completes.
    a.submit_send(b.address, b"dropped").wait(timeout=60)
    with pytest.raises(ValueError):
        a.recv_queue(8, 1).recv(timeout=-1)
    with pytest.raises(weft.InvalidArgumentError):
        b.recv_queue(0, 1)


def test_recv_queue_names_the_sender(loopback_trio):
    a, b, c = loopback_trio
    q = c.recv_queue(64, 8)
    peers = [a.address, b.address]
    for i in range(6):
        (a if i % 2 == 0 else b).submit_send(c.address, bytes([i])).wait(timeout=60)
    got = [q.recv_from(peers, timeout=60) for _ in range(6)]
    assert sorted(got) == sorted((bytes([i]), i % 2) for i in range(6))
    c.submit_send(c.address, b"self").wait(timeout=60)
    assert q.recv_from(peers, timeout=60) == (b"self", None)
    assert q.try_recv_from(peers) is None
    assert q.recv_from([], timeout=0) is None


def test_receive_callback_names_the_sender(loopback_trio):
    a, b, c = loopback_trio
    got: "queue.Queue[tuple]" = queue.Queue()
    c.submit_recvs(64, 8, lambda data, i: got.put((data, i)), peers=[a.address, b.address])
    for i in range(6):
        (a if i % 2 == 0 else b).submit_send(c.address, bytes([i])).wait(timeout=60)
    c.submit_send(c.address, b"self").wait(timeout=60)
    msgs = [got.get(timeout=60) for _ in range(7)]
    assert sorted(msgs, key=repr) == sorted([(bytes([i]), i % 2) for i in range(6)] + [(b"self", None)], key=repr)


@pytest.mark.parametrize("kind", ["list", "numpy", "numpy-u32"])
def test_paged_writes(pair, kind):
    a, b = pair
    page, pages = 512, 16
    src = pattern(page * pages, 7)
    dst = np.zeros(page * pages, dtype=np.uint8)
    s, d = a.reg_mr(src), b.reg_mr(dst)
    si = [3, 0, 15, 7]
    di = [1, 2, 9, 14]
    conv = {
        "list": lambda x: x,
        "numpy": lambda x: np.array(x, dtype=np.int64),
        "numpy-u32": lambda x: np.array(x, dtype=np.uint32),
    }[kind]
    imm = b.alloc_imm()
    rnd = b.expect_imm_count(imm, b.imm_counts().paged_writes(page, len(si)))
    a.submit_paged_writes(page, s, conv(si), d.desc, conv(di), imm=imm).wait(timeout=60)
    rnd.wait(timeout=60)
    want = np.zeros_like(dst)
    for x, y in zip(si, di):
        want[y * page : (y + 1) * page] = src[x * page : (x + 1) * page]
    assert np.array_equal(dst, want)


def test_paged_writes_stride_and_offset(pair):
    a, b = pair
    src, dst = pattern(4096, 8), np.zeros(4096, dtype=np.uint8)
    s, d = a.reg_mr(src), b.reg_mr(dst)
    # 100-byte pages at stride 1000, destination shifted by 10.
    a.submit_paged_writes(
        100, s, [0, 2], d.desc, [1, 3], src_stride=1000, dst_stride=1000, dst_offset=10
    ).wait(timeout=60)
    assert np.array_equal(dst[1010:1110], src[0:100])
    assert np.array_equal(dst[3010:3110], src[2000:2100])
    assert dst[:1010].sum() == 0


def test_paged_writes_bad_indices_write_nothing(pair):
    a, b = pair
    src, dst = pattern(1024, 9), np.zeros(1024, dtype=np.uint8)
    s, d = a.reg_mr(src), b.reg_mr(dst)
    with pytest.raises(TypeError):
        a.submit_paged_writes(64, s, [0.0, 1.0], d.desc, [0, 1])
    with pytest.raises(TypeError):
        a.submit_paged_writes(64, s, np.array([0.0, 1.0]), d.desc, [0, 1])
    with pytest.raises(weft.InvalidArgumentError):
        a.submit_paged_writes(64, s, [-1], d.desc, [0])
    with pytest.raises(weft.InvalidArgumentError):
        a.submit_paged_writes(64, s, [0, 1], d.desc, [0])  # count mismatch
    with pytest.raises(weft.OutOfBoundsError):
        a.submit_paged_writes(64, s, [0], d.desc, [16])  # past the end
    assert not dst.any()


def test_scatter_and_barrier():
    backend = weft.provider("loopback", seed=11)
    with weft.TransferEngine(backend) as a:
        peers = [weft.TransferEngine(backend) for _ in range(3)]
        try:
            src = pattern(3000, 10)
            dsts = [np.zeros(1000, dtype=np.uint8) for _ in peers]
            regs = [p.reg_mr(d) for p, d in zip(peers, dsts)]
            s = a.reg_mr(src)
            group = a.add_peer_group([p.address for p in peers])
            assert len(group) == 3
            imm = 77
            held = [p.reserve_imm(imm) for p in peers]  # kept for the rounds
            assert all(h == imm for h in held)
            counts = [p.imm_counts() for p in peers]
            rounds = [
                p.expect_imm_count(imm, c.scatter_dst(1000) + c.barrier())
                for p, c in zip(peers, counts)
            ]
            sd = [weft.ScatterDst(r.desc, 1000, src_offset=1000 * j) for j, r in enumerate(regs)]
            a.submit_scatter(group, s, sd, imm=imm).wait(timeout=60)
            a.submit_barrier(group, imm, [r.desc for r in regs]).wait(timeout=60)
            for j, (r, d) in enumerate(zip(rounds, dsts)):
                r.wait(timeout=60)
                assert np.array_equal(d, src[1000 * j : 1000 * (j + 1)])
            # mode by_bytes, and a wrong destination count is refused.
            a.submit_scatter(group, s, sd, mode="by_bytes").wait(timeout=60)
            with pytest.raises(weft.InvalidArgumentError):
                a.submit_scatter(group, s, sd[:2])
            with pytest.raises(weft.InvalidArgumentError):
                a.submit_scatter(group, s, sd, mode="sideways")
        finally:
            for p in peers:
                p.shutdown()


def test_scatter_targets():
    """Destinations checked once, then scattered to with other slices each
    time (tuples, then an (n, 3) numpy array); unmatched descriptors go by
    address; the refusals are typed and write nothing."""
    backend = weft.provider("loopback", seed=12)
    with weft.TransferEngine(backend) as a:
        peers = [weft.TransferEngine(backend) for _ in range(3)]
        try:
            src = pattern(4000, 11)
            dsts = [np.zeros(2000, dtype=np.uint8) for _ in peers]
            regs = [p.reg_mr(d) for p, d in zip(peers, dsts)]
            s = a.reg_mr(src)
            group = a.add_peer_group([p.address for p in peers])
            targets = a.scatter_targets(group, [r.desc for r in regs])
            assert len(targets) == 3 and targets.matched and targets.nics == 1
            want = [np.zeros(2000, dtype=np.uint8) for _ in peers]

            def scatter(t, slices, to=lambda j: j):
                a.submit_scatter_to(t, s, slices, mode="by_bytes").wait(timeout=60)
                for j, (so, do, n) in enumerate(np.asarray(slices).tolist()):
                    want[to(j)][do : do + n] = src[so : so + n]
                for d, w in zip(dsts, want):
                    assert np.array_equal(d, w)

            scatter(targets, [(100 * j, 0, 500 + j) for j in range(3)])
            scatter(targets, np.array([[3000 - 7 * j, 1000 + j, 900 - j] for j in range(3)], dtype=np.uint64))
            # Each member handed the next member's region: resolved by address.
            shifted = a.scatter_targets(group, [regs[(j + 1) % 3].desc for j in range(3)])
            assert not shifted.matched
            scatter(shifted, [[50 * j, 1500, 300] for j in range(3)], to=lambda j: (j + 1) % 3)

            ok = [(0, 0, 1)] * 3
            refused = [
                (weft.InvalidArgumentError, ok[:2]),  # one slice per destination
                (weft.OutOfBoundsError, [(0, 1990, 11), (0, 0, 1), (0, 0, 1)]),
                (weft.OutOfBoundsError, [(0, 0, 1), (3999, 0, 2), (0, 0, 1)]),
                (weft.InvalidArgumentError, [(0, 0), (0, 0, 1), (0, 0, 1)]),
                (weft.InvalidArgumentError, [(0, -1, 1), (0, 0, 1), (0, 0, 1)]),
                (weft.InvalidArgumentError, [(0, 2**64, 1), (0, 0, 1), (0, 0, 1)]),
                (weft.InvalidArgumentError, [(0, 2**200, 1), (0, 0, 1), (0, 0, 1)]),
                (weft.InvalidArgumentError, np.zeros(9, dtype=np.uint64)),  # not (n, 3)
                (TypeError, np.zeros((3, 3), dtype=np.float32)),
                (TypeError, [(0, True, 1), (0, 0, 1), (0, 0, 1)]),
                (TypeError, [{0, 1, 2}, (0, 0, 1), (0, 0, 1)]),  # a set has no order
            ]
            for err, slices in refused:
                with pytest.raises(err):
                    a.submit_scatter_to(targets, s, slices)
            with pytest.raises(weft.InvalidArgumentError):
                a.scatter_targets(group, [regs[0].desc])  # one descriptor per member
            foreign = peers[0].scatter_targets(
                peers[0].add_peer_group([p.address for p in peers]), [r.desc for r in regs]
            )
            with pytest.raises(weft.InvalidArgumentError):
                a.submit_scatter_to(foreign, s, ok)  # targets of another engine
            # Nothing refused was queued: the next scatter is the only change.
            scatter(targets, [(7, 1900, 100)] * 3)
        finally:
            for p in peers:
                p.shutdown()


def test_imm_calls(pair):
    a, _ = pair
    imm = a.alloc_imm()
    assert 0 <= imm < a.imm_capacity
    assert a.imm_pending(imm) == 0
    with pytest.raises(weft.ImmError):
        a.reserve_imm(int(imm))  # already taken
    imm.release()
    assert not imm.held
    imm.release()  # idempotent
    again = a.reserve_imm(int(imm))
    assert again == imm and again.held and hash(again) == hash(int(imm))
    with again:
        pass
    assert not again.held


def test_imm_returns_when_dropped(pair):
    a, _ = pair
    imm = a.alloc_imm()
    v = int(imm)
    del imm  # garbage: the value returns to the allocator
    assert int(a.alloc_imm()) == v
    # A round keeps its Imm alive until it ends.
    r = a.expect_imm_count(a.alloc_imm(), 1)
    with pytest.raises(weft.ImmError):
        a.reserve_imm(v)
    assert not r.done()


def test_uvm_watcher_host_word(pair):
    a, _ = pair
    seen: list = []
    last = threading.Event()

    def cb(old, new):
        seen.append((old, new))
        if new == 50:
            last.set()

    w = a.alloc_uvm_watcher(cb)
    assert w.addr != 0 and w.value == 0
    for v in range(1, 51):
        w.store(v)
    assert last.wait(60)
    news = [n for _, n in seen]
    assert news == sorted(news) and news[-1] == 50  # may coalesce, never go back
    assert all(o < n for o, n in seen)
    assert np.asarray(w)[0] == 50  # __array_interface__ views the word
    w.close()
    with pytest.raises(ValueError):
        w.value


def test_uvm_watcher_on_caller_word(pair):
    a, _ = pair
    word = np.zeros(1, dtype=np.uint64)
    seen = threading.Event()
    w = a.alloc_uvm_watcher(lambda o, n: seen.set() if n == 9 else None, word=word)
    assert w.addr == word.ctypes.data
    word[0] = 9  # any writer of the memory (a GPU kernel on pinned memory)
    assert seen.wait(60)
    w.close()
    with pytest.raises(weft.InvalidArgumentError):
        a.alloc_uvm_watcher(print, word=np.zeros(1, dtype=np.uint32))  # 4 bytes
    with pytest.raises(weft.InvalidArgumentError):
        a.alloc_uvm_watcher(print, word=np.zeros(16, dtype=np.uint8)[1:9])  # unaligned
    with pytest.raises(TypeError):
        a.alloc_uvm_watcher(None)


def test_stats_and_repr(pair):
    a, b = pair
    st = a.stats()
    assert st["callback_errors"] == 0 and len(st["groups"]) == 1
    assert set(st["groups"][0]) == {"queued", "in_flight", "pending_wrs", "transfers_ok", "transfers_failed"}
    assert "loopback" in repr(a)


def test_hmem_option_reaches_libfabric():
    """``hmem=True`` (GPU memory registered with the provider) is accepted
    and leaves host memory working; a non-bool is refused."""
    if not any(p.spec == "libfabric:shm" and p.available for p in weft.providers()):
        pytest.skip("libfabric:shm unavailable here")
    with weft.TransferEngine("libfabric:shm", domain="same-machine", hmem=True) as e:
        r = e.reg_mr(np.zeros(4096, dtype=np.uint8))
        assert r.nbytes == 4096 and r.device == "cpu"
    b = weft.provider("libfabric:shm", domain="same-machine", hmem=True, hmem_ipc=True)
    assert b.spec == "libfabric:shm"
    with pytest.raises(TypeError):
        weft.TransferEngine("libfabric:shm", hmem="yes")
