"""weft.kv from Python: KvDecoder and KvPrefiller on numpy arrays (the
serving stack's own KV cache), over the loopback fabric and across two
processes over libfabric tcp."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import weft
import weft.kv as kv

LAYERS, BLOCKS, BLOCK_BYTES = 3, 32, 512


def caches(n: int = LAYERS) -> list[np.ndarray]:
    """vLLM-like per-layer tensors: [2 (K, V), blocks, block bytes]."""
    return [np.zeros((2, BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(n)]


def fill(layers: list[np.ndarray], blocks: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in layers:
        t[:, blocks] = rng.integers(0, 256, (2, len(blocks), BLOCK_BYTES), dtype=np.uint8)


def same(dst: list[np.ndarray], dblocks: list[int], src: list[np.ndarray], sblocks: list[int]) -> bool:
    return all(np.array_equal(d[:, dblocks], s[:, sblocks]) for d, s in zip(dst, src))


def poll_until(side, want: int, timeout: float = 20.0):
    done, failed = [], []
    end = time.monotonic() + timeout
    while len(done) + len(failed) < want:
        d, f = side.poll()
        done += d
        failed += f
        if time.monotonic() > end:
            raise AssertionError(f"only {done} {failed} after {timeout} s")
        time.sleep(0.005)
    return done, failed


@pytest.fixture
def pd(loopback_pair):
    a, b = loopback_pair
    pk, dk = caches(), caches()
    layout = kv.layout_for(pk, kv_heads=2, num_pages=BLOCKS)
    pre = kv.KvPrefiller(a, layout, pk, hold=0.5)
    dec = kv.KvDecoder(b, layout, dk)
    p = dec.add_prefiller(pre.address)
    yield pre, dec, p, pk, dk
    dec.shutdown()
    pre.shutdown()


def test_layout_for_reads_per_layer_tensors_and_refuses_what_does_not_split():
    layout = kv.layout_for(caches(), kv_heads=2, num_pages=BLOCKS)
    assert (layout.layers, layout.kv_heads, layout.num_pages, layout.page_len) == (LAYERS, 2, BLOCKS, BLOCK_BYTES)
    assert layout.layer_bytes == 2 * BLOCKS * BLOCK_BYTES and layout.steps == LAYERS
    with pytest.raises(weft.KvError):
        kv.layout_for([np.zeros(10, np.uint8), np.zeros(11, np.uint8)], kv_heads=1, num_pages=10)
    with pytest.raises(weft.KvError):
        kv.layout_for(caches(), kv_heads=3, num_pages=BLOCKS)
    with pytest.raises(weft.KvError) as e:
        kv.KvLayout(layers=0, kv_heads=1, page_len=16, num_pages=4)
    assert e.value.kind == "layout"
    with pytest.raises(weft.InvalidArgumentError):
        kv.KvLayout(layers=1, kv_heads=1, page_len=16, num_pages=4, order="sideways")


def test_offered_prompts_move_byte_exact_whichever_comes_first(pd):
    pre, dec, p, pk, dk = pd
    fill(pk, [4, 5, 6], 1)
    pre.offer(b"first", [4, 5, 6])
    r1 = dec.request([10, 2, 30], p, b"first")
    assert dec.wait(r1, 20)
    # the request comes first and waits for its offer
    r2 = dec.request([0, 1], p, b"second")
    time.sleep(0.1)
    assert dec.poll() == ([r1], [])
    assert dec.pending == 1
    fill(pk, [20, 21], 2)
    pre.offer(b"second", [20, 21])
    done, failed = poll_until(dec, 1)
    assert (done, failed) == ([r2], [])
    assert same(dk, [10, 2, 30], pk, [4, 5, 6]) and same(dk, [0, 1], pk, [20, 21])
    assert sorted(poll_until(pre, 2)[0]) == [b"first", b"second"]
    assert dec.poll() == ([], []) and pre.pending == 0
    assert dec.stats()["completed"] == 2 and pre.stats()["completed"] == 2


def test_a_decoder_holding_a_prefix_asks_for_the_rest_only(pd):
    pre, dec, p, pk, dk = pd
    fill(pk, [8, 9, 10, 11], 3)
    pre.offer(b"long", [8, 9, 10, 11])
    rid = dec.request([15, 16], p, b"long", first=2)
    assert poll_until(dec, 1) == ([rid], [])
    assert same(dk, [15, 16], pk, [10, 11])
    # past the offer's end: refused, nothing written
    pre.offer(b"short", [1])
    dk[0][:, 17] = 0xEE
    rid = dec.request([17, 18], p, b"short", first=0)
    _, failed = poll_until(dec, 1)
    assert [(i, k) for i, k, _ in failed] == [(rid, "refused")]
    assert (dk[0][:, 17] == 0xEE).all()


def test_refusals_expiry_cancel_and_busy_blocks(pd):
    pre, dec, p, pk, dk = pd
    # nobody offered this key: refused once the hold time passed
    rid = dec.request([3], p, b"nobody")
    _, failed = poll_until(dec, 1)
    assert failed[0][:2] == (rid, "refused")
    # a withdrawn offer is gone at once
    pre.offer(b"gone", [2])
    assert pre.withdraw(b"gone") and not pre.withdraw(b"gone")
    with pytest.raises(weft.KvError) as e:
        pre.offer(b"twice", [1])
        pre.offer(b"twice", [2])
    assert e.value.kind == "invalid_route"
    # blocks of a request in flight cannot be asked for again
    held = dec.request([7, 8], p, b"slow")
    with pytest.raises(weft.KvError) as e:
        dec.request([8, 9], p, b"other")
    assert e.value.kind == "page_taken"
    # cancelling it ends it (once no write can land) and frees its blocks
    assert dec.cancel(held)
    _, failed = poll_until(dec, 1)
    assert failed[0][:2] == (held, "cancelled")
    assert not dec.cancel(held)
    r = dec.request([8], p, b"twice")
    assert poll_until(dec, 1)[0] == [r]
    with pytest.raises(weft.InvalidArgumentError):
        dec.wait(12345)


def test_an_offer_nobody_asks_for_expires():
    with weft.TransferEngine(weft.provider("loopback")) as e:
        pk = caches(1)
        pre = kv.KvPrefiller(e, kv.layout_for(pk, kv_heads=2, num_pages=BLOCKS), pk)
        pre.offer(b"lonely", [2], ttl=0.1)
        done, failed = poll_until(pre, 1)
        assert done == [] and [(k, kind) for k, kind, _ in failed] == [(b"lonely", "expired")]
        with pytest.raises(weft.KvError):
            pre.ready(b"lonely", 1)
        pre.shutdown()
        pre.shutdown()


def test_layer_by_layer_readiness_posts_as_layers_are_reported(pd):
    pre, dec, p, pk, dk = pd
    pre.offer(b"lw", [12, 13], ready=0)
    rid = dec.request([5, 6], p, b"lw")
    for layer in range(LAYERS):
        pk[layer][:, [12, 13]] = layer + 1
        time.sleep(0.05)
        assert dec.poll() == ([], []), f"done before layer {layer} was ready"
        pre.ready(b"lw", layer + 1)
    assert poll_until(dec, 1) == ([rid], [])
    assert same(dk, [5, 6], pk, [12, 13])


def test_a_whole_cache_tensor_and_a_tail():
    layout = kv.KvLayout(layers=2, kv_heads=1, page_len=256, num_pages=8, tail_len=64, tail_slots=2)
    backend = weft.provider("loopback")
    with weft.TransferEngine(backend) as a, weft.TransferEngine(backend) as b:
        pk = np.random.default_rng(5).integers(0, 256, layout.kv_bytes, dtype=np.uint8)
        ptail = np.random.default_rng(6).integers(0, 256, 128, dtype=np.uint8)
        dk, dtail = np.zeros(layout.kv_bytes, np.uint8), np.zeros(128, np.uint8)
        with kv.KvPrefiller(a, layout, pk, tail=ptail) as pre, kv.KvDecoder(b, layout, dk, tail=dtail) as dec:
            pre.offer(b"t", [3, 4], tail_slot=1)
            rid = dec.request([0, 1], dec.add_prefiller(pre.address.to_bytes()), b"t")
            assert poll_until(dec, 1) == ([rid], [])
            for layer in range(2):
                base = layer * 8 * 256
                assert np.array_equal(dk[base : base + 512], pk[base + 3 * 256 : base + 5 * 256])
            assert np.array_equal(dtail[:64], ptail[64:])  # decoder slot 0 <- prefill slot 1
        with pytest.raises(weft.KvError) as e:
            kv.KvDecoder(b, layout, dk)  # the layout has a tail: a tail region is needed
        assert e.value.kind == "layout"


def test_bad_arguments_are_refused():
    backend = weft.provider("loopback")
    with weft.TransferEngine(backend) as e:
        layout = kv.layout_for(caches(), kv_heads=2, num_pages=BLOCKS)
        with pytest.raises(weft.KvError):
            kv.KvDecoder(e, layout, caches(2))  # 2 regions for 3 layers
        with pytest.raises(weft.KvError):
            kv.KvDecoder(e, layout, [np.zeros(16, np.uint8)] * 3)  # layers too small
        with pytest.raises(weft.InvalidArgumentError):
            kv.KvDecoder(e, layout, [])
        with pytest.raises(ValueError):
            kv.KvDecoder(e, layout, caches(), heartbeat_interval=2.0, heartbeat_timeout=1.0)
        with pytest.raises(weft.ReadOnlyBufferError):
            ro = caches()
            ro[0].flags.writeable = False
            kv.KvDecoder(e, layout, ro)
        with kv.KvDecoder(e, layout, caches()) as dec:
            with pytest.raises(weft.DescriptorError):
                dec.add_prefiller(b"\x00garbage")
            with pytest.raises(weft.KvError) as err:
                dec.request([BLOCKS], 0, b"k")
            assert err.value.kind == "page_taken"
            with pytest.raises(weft.KvError):
                dec.request([1, 1], 0, b"k")


PREFILL = r"""
import sys, time, numpy as np, weft, weft.kv as kv
layers = [np.zeros((2, 32, 512), np.uint8) for _ in range(3)]
rng = np.random.default_rng(42)
for t in layers:
    t[:, [4, 5, 6]] = rng.integers(0, 256, (2, 3, 512), dtype=np.uint8)
e = weft.TransferEngine(sys.argv[1])
pre = kv.KvPrefiller(e, kv.layout_for(layers, kv_heads=2, num_pages=32), layers)
sys.stdout.write(pre.address.to_bytes().hex() + "\n"); sys.stdout.flush()
pre.offer(b"across", [4, 5, 6])
end = time.monotonic() + 60
while time.monotonic() < end:
    done, failed = pre.poll()
    if done or failed:
        print("served", done, failed, flush=True)
        break
    time.sleep(0.01)
pre.shutdown(); e.shutdown()
"""


@pytest.mark.fabric
@pytest.mark.parametrize("spec", ["libfabric:tcp", "libfabric:shm"])
def test_two_processes_over_libfabric(spec):
    if not any(s.spec == spec and s.available for s in weft.providers()):
        pytest.skip(f"{spec} not available here")
    proc = subprocess.Popen([sys.executable, "-c", PREFILL, spec], stdout=subprocess.PIPE, text=True)
    try:
        addr = bytes.fromhex(proc.stdout.readline().strip())
        dk = caches()
        with weft.TransferEngine(spec) as e, kv.KvDecoder(e, kv.layout_for(dk, kv_heads=2, num_pages=BLOCKS), dk) as dec:
            rid = dec.request([1, 2, 3], dec.add_prefiller(addr), b"across")
            assert poll_until(dec, 1, timeout=60) == ([rid], [])
        rng = np.random.default_rng(42)
        for t in dk:
            assert np.array_equal(t[:, [1, 2, 3]], rng.integers(0, 256, (2, 3, 512), dtype=np.uint8))
        assert "served [b'across'] []" in proc.stdout.readline()
    finally:
        proc.wait(60)


def test_tp_mismatch_two_decode_ranks_read_one_prefill_rank():
    """Prefill TP 1 holds both KV heads; decode TP 2 ranks hold one each:
    the prefill rank's offer serves both decode ranks' requests."""
    assert kv.tp_readers(kv_heads=2, prefill_tp=1, decode_tp=2, prefill_rank=0) == 2
    assert kv.tp_readers(kv_heads=8, prefill_tp=4, decode_tp=8, prefill_rank=3) == 2
    assert kv.tp_readers(kv_heads=8, prefill_tp=8, decode_tp=4, prefill_rank=5) == 1
    with pytest.raises(weft.KvError):
        kv.tp_readers(kv_heads=3, prefill_tp=2, decode_tp=1, prefill_rank=0)
    backend = weft.provider("loopback")
    pl = kv.KvLayout(layers=2, kv_heads=2, page_len=256, num_pages=8)
    dl = kv.KvLayout(layers=2, kv_heads=1, page_len=256, num_pages=8)
    pk = np.random.default_rng(9).integers(0, 256, pl.kv_bytes, dtype=np.uint8)
    dks = [np.zeros(dl.kv_bytes, np.uint8) for _ in range(2)]
    engines = [weft.TransferEngine(backend) for _ in range(3)]
    try:
        pre = kv.KvPrefiller(engines[0], pl, pk)
        decs = [kv.KvDecoder(engines[1 + r], dl, dks[r]) for r in range(2)]
        pre.offer(b"tp", [5, 6], requests=kv.tp_readers(2, 1, 2, 0))
        rids = [
            d.request_tp([0, 1], [d.add_prefiller(pre.address)], b"tp", kv_heads=2, prefill_tp=1, decode_tp=2, decode_rank=r)
            for r, d in enumerate(decs)
        ]
        for d, rid in zip(decs, rids):
            assert poll_until(d, 1) == ([rid], [])
        assert poll_until(pre, 1) == ([b"tp"], [])
        for r in range(2):
            for layer in range(2):
                src = layer * pl.layer_bytes + (r * 8 + 5) * 256  # prefill head r, pages 5..7
                dst = layer * dl.layer_bytes
                assert np.array_equal(dks[r][dst : dst + 512], pk[src : src + 512]), (r, layer)
        for d in decs:
            d.shutdown()
        pre.shutdown()
    finally:
        for e in engines:
            e.shutdown()
