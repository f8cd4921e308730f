"""CUDA tensors through weft (the GPU host): GPU→GPU writes over the
loopback fabric, CUDA registrations through torch and DLPack, and a UVM
watcher bumped by a torch CUDA kernel.

Skips without torch or a GPU; `WEFT_REQUIRE_GPU=1` turns the skip into a
failure (as xtask's `WEFT_CUDA_REQUIRE_GPU`). The watcher word is a pinned
(page-locked, mapped) torch CPU tensor; `torch.as_tensor(watcher,
device="cuda")` aliases it through `__cuda_array_interface__`, so any CUDA
kernel writing that tensor (here torch's `add_`) bumps the watched word.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import weft

pytestmark = pytest.mark.gpu

try:
    import torch

    _HAVE = torch.cuda.is_available()
    _WHY = "torch.cuda.is_available() is False"
except ImportError:
    torch = None
    _HAVE = False
    _WHY = "torch is not installed"


@pytest.fixture(scope="module")
def cuda():
    if not _HAVE:
        if os.environ.get("WEFT_REQUIRE_GPU") == "1":
            pytest.fail(f"WEFT_REQUIRE_GPU=1 but {_WHY}")
        print(f"SKIP: {_WHY}")
        pytest.skip(_WHY)
    return torch.device("cuda:0")


@pytest.fixture
def gpu_pair(cuda):
    backend = weft.provider("loopback", nics=2, seed=5)
    a = weft.TransferEngine(backend, device="cuda:0")
    b = weft.TransferEngine(backend, device="cuda:0")
    try:
        yield a, b
    finally:
        a.shutdown()
        b.shutdown()


def test_single_write_gpu_to_gpu(gpu_pair, cuda):
    a, b = gpu_pair
    n = 64 << 20
    g = torch.Generator(device=cuda).manual_seed(21)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=cuda, generator=g)
    dst = torch.zeros(n, dtype=torch.uint8, device=cuda)
    torch.cuda.synchronize()  # the producing stream is done before the NIC reads
    s, d = a.reg_mr(src), b.reg_mr(dst)
    assert s.device == "cuda:0" and s.addr == src.data_ptr() and s.nbytes == n
    imm = b.alloc_imm()
    rnd = b.expect_imm_count(imm, b.imm_counts().single_write(n))
    a.submit_single_write(n, s, d.desc, imm=imm).wait(timeout=120)
    rnd.wait(timeout=120)
    assert torch.equal(dst, src)


def test_paged_writes_gpu_to_gpu(gpu_pair, cuda):
    a, b = gpu_pair
    page, pages = 4096, 256
    src = torch.arange(page * pages // 4, dtype=torch.int32, device=cuda)
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    s, d = a.reg_mr(src), b.reg_mr(dst)
    si = np.random.default_rng(3).permutation(pages)[:64]
    di = np.arange(64, dtype=np.int64) * 2
    a.submit_paged_writes(page, s, si, d.desc, di).wait(timeout=120)
    sb, db = src.view(torch.uint8).cpu().numpy(), dst.view(torch.uint8).cpu().numpy()
    for x, y in zip(si, di):
        assert np.array_equal(db[y * page : (y + 1) * page], sb[x * page : (x + 1) * page])


def test_host_to_gpu_and_dlpack_and_raw(gpu_pair, cuda):
    a, b = gpu_pair
    host = torch.arange(4096, dtype=torch.uint8)  # a CPU tensor (no buffer protocol)
    dev = torch.zeros(4096, dtype=torch.uint8, device=cuda)
    dev2 = torch.zeros(4096, dtype=torch.uint8, device=cuda)
    s = a.reg_mr(host)
    d = b.reg_mr(torch.utils.dlpack.to_dlpack(dev))  # a DLPack capsule
    assert d.device == "cuda:0" and d.addr == dev.data_ptr()
    r = b.reg_mr((dev2.data_ptr(), 4096, "cuda:0"), keepalive=dev2)
    a.submit_single_write(4096, s, d.desc).wait(timeout=60)
    a.submit_single_write(4096, s, r.desc).wait(timeout=60)
    assert torch.equal(dev.cpu(), host) and torch.equal(dev2.cpu(), host)


def test_cuda_tensor_on_host_engine_refused(cuda):
    with weft.TransferEngine("loopback") as e:
        t = torch.zeros(16, device=cuda)
        with pytest.raises(weft.InvalidArgumentError):
            e.reg_mr(t)
        with pytest.raises(weft.InvalidArgumentError):
            e.reg_mr(torch.zeros(16), device="cuda:0")  # a CPU tensor, expected on GPU


def test_uvm_watcher_bumped_by_torch_kernel(gpu_pair, cuda):
    a, _ = gpu_pair
    seen: list = []
    last = threading.Event()
    bumps = 1000

    def cb(old, new):
        seen.append((old, new))
        if new == bumps:
            last.set()

    word = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    w = a.alloc_uvm_watcher(cb, word=word)
    assert w.addr == word.data_ptr()
    g = torch.as_tensor(w, device=cuda)  # a CUDA tensor aliasing the pinned word
    assert g.data_ptr() == w.addr and g.dtype == torch.int64
    for _ in range(bumps):
        g.add_(1)  # a torch CUDA kernel writing host-mapped memory
    torch.cuda.synchronize()
    assert last.wait(60), seen[-5:]
    news = [n for _, n in seen]
    assert news == sorted(news) and news[-1] == bumps and w.value == bumps
    w.close()


WRITER = """
import sys, torch, weft
spec = sys.argv[2]
kw = dict(domain="same-machine", hmem=True) if spec.startswith("libfabric") else {}
with weft.TransferEngine(spec, device="cuda:0", **kw) as eng:
    n = int(sys.argv[1])
    g = torch.Generator(device="cuda").manual_seed(7)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
    torch.cuda.synchronize()
    s = eng.reg_mr(src)
    print("ready", flush=True)
    desc = weft.MrDesc.from_bytes(bytes.fromhex(sys.stdin.readline().strip()))
    imm = int(sys.stdin.readline())
    for k in range(4):
        part = n // 4
        eng.submit_single_write(part, s, desc, imm=imm, src_offset=k * part, dst_offset=k * part).wait(timeout=120)
    print("done", flush=True)
    sys.stdin.readline()
"""


def test_cuda_tensors_cross_processes_over_cuda_shm(cuda):
    """GPU to GPU across processes: a child writes its CUDA tensor into this
    process's, through engines over libfabric shm with ``hmem=True``. Needs
    a libfabric built with CUDA (``WEFT_LIBFABRIC_PATH``, docs/gpu.md);
    skips without one unless ``WEFT_REQUIRE_CUDA_LIBFABRIC=1``."""
    cross_processes(cuda, "libfabric:shm", os.environ.get("WEFT_REQUIRE_CUDA_LIBFABRIC") == "1")


def test_cuda_tensors_cross_processes_over_nvlink(cuda):
    """The same over the same-host backend: the child maps this process's
    tensor with CUDA IPC and copies into it on its own stream."""
    cross_processes(cuda, "nvlink", True)


def cross_processes(cuda, spec, required):
    import subprocess
    import sys

    n = 32 << 20
    dst = torch.zeros(n, dtype=torch.uint8, device=cuda)
    kw = dict(domain="same-machine", hmem=True) if spec.startswith("libfabric") else {}
    with weft.TransferEngine(spec, device="cuda:0", **kw) as eng:
        try:
            d = eng.reg_mr(dst)
        except weft.UnsupportedError as e:
            if required:
                pytest.fail(f"WEFT_REQUIRE_CUDA_LIBFABRIC=1 but: {e}")
            print(f"SKIP: this libfabric cannot register CUDA memory: {e}")
            pytest.skip(str(e))
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(n), spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "ready"
            imm = eng.alloc_imm()
            rnd = eng.expect_imm_count(imm, 4 * eng.imm_counts().single_write(n // 4))
            child.stdin.write(d.desc.to_bytes().hex() + "\n" + str(int(imm)) + "\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "done"
            rnd.wait(timeout=120)
            # No synchronisation: the bytes are in place when the round fires.
            g = torch.Generator(device=cuda).manual_seed(7)
            want = torch.randint(0, 256, (n,), dtype=torch.uint8, device=cuda, generator=g)
            assert torch.equal(dst, want)
            child.stdin.write("bye\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


KV_PREFILL = """
import sys, time, torch, weft, weft.kv as kv
spec = sys.argv[1]
kw = dict(domain="same-machine", hmem=True) if spec.startswith("libfabric") else {}
L, NB = 8, 64
layers = [torch.zeros(2, NB, 16, 8, 128, dtype=torch.float16, device="cuda") for _ in range(L)]
g = torch.Generator(device="cuda").manual_seed(11)
blocks = list(range(10, 50))
for t in layers:
    t[:, blocks] = torch.randn(2, len(blocks), 16, 8, 128, generator=g, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
with weft.TransferEngine(spec, device="cuda:0", **kw) as eng:
    pre = kv.KvPrefiller(eng, kv.layout_for(layers, kv_heads=2, num_pages=NB), layers)
    print(pre.address.to_bytes().hex(), flush=True)
    pre.offer(b"gpu-prompt", blocks)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        done, failed = pre.poll()
        if done or failed:
            print("served", done, failed, flush=True)
            break
        time.sleep(0.001)
    sys.stdin.readline()
    pre.shutdown()
"""


@pytest.mark.parametrize("spec", ["nvlink", "libfabric:shm"])
def test_kv_prompt_moves_between_processes_in_cuda_tensors(cuda, spec):
    """weft.kv with vLLM-shaped per-layer CUDA tensors (fp16 ``[2, blocks,
    16, 8, 128]``, 8 layers): a prefill process offers 40 blocks, this
    process requests them into other block ids; every byte checked on the
    GPU. libfabric shm needs a CUDA-enabled libfabric (skips without one
    unless ``WEFT_REQUIRE_CUDA_LIBFABRIC=1``)."""
    import subprocess
    import sys
    import time

    import weft.kv as kv

    kw = dict(domain="same-machine", hmem=True) if spec.startswith("libfabric") else {}
    L, NB = 8, 64
    layers = [torch.zeros(2, NB, 16, 8, 128, dtype=torch.float16, device=cuda) for _ in range(L)]
    with weft.TransferEngine(spec, device="cuda:0", **kw) as eng:
        try:
            eng.reg_mr(layers[0]).unreg()
        except weft.UnsupportedError as e:
            if os.environ.get("WEFT_REQUIRE_CUDA_LIBFABRIC") == "1" or spec == "nvlink":
                pytest.fail(f"cannot register CUDA memory on {spec}: {e}")
            print(f"SKIP: this libfabric cannot register CUDA memory: {e}")
            pytest.skip(str(e))
        child = subprocess.Popen(
            [sys.executable, "-c", KV_PREFILL, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            addr = bytes.fromhex(child.stdout.readline().strip())
            with kv.KvDecoder(eng, kv.layout_for(layers, kv_heads=2, num_pages=NB), layers) as dec:
                p = dec.add_prefiller(addr)
                dblocks = list(range(63, 23, -1))
                t0 = time.perf_counter()
                rid = dec.request(dblocks, p, b"gpu-prompt")
                end = time.monotonic() + 120
                while True:
                    done, failed = dec.poll()
                    if done or failed:
                        break
                    assert time.monotonic() < end, "no outcome in 120 s"
                    time.sleep(0.0005)
                took = time.perf_counter() - t0
                assert (done, failed) == ([rid], []), failed
                print(f"kv over {spec}: {L * 2 * 40 * 32} KiB in {took * 1e3:.2f} ms (request to poll)")
            # No synchronisation: the bytes are in place when poll() says so.
            g = torch.Generator(device=cuda).manual_seed(11)
            for t in layers:
                want = torch.randn(2, 40, 16, 8, 128, generator=g, device=cuda, dtype=torch.float16)
                assert torch.equal(t[:, dblocks], want)
            assert "served [b'gpu-prompt'] []" in child.stdout.readline()
            child.stdin.write("bye\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


@pytest.mark.fabric
def test_rl_cuda_tensors_across_processes(cuda, tmp_path):
    """weft.rl with torch CUDA tensors: four trainer processes load whole
    CUDA parameters (load_local cuts their DTensor-style pieces), two
    inference processes read the versions back onto the GPU; every byte
    checked, fp8 targets included (test_rl's processes, device "cuda")."""
    import test_rl

    test_rl.run_rl_ranks(tmp_path, device="cuda")
