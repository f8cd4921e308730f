"""WeftConnector against the real vLLM package: vLLM's own v1 Scheduler
(prefill and decode instances, loading the connector from
``kv_connector_module_path``) drives worker-side connectors in two other
processes over libfabric tcp and shm, with CPU tensors as KV caches. Blocks
are checked byte for byte; killed processes and aborted requests end with
the blocks reported and nothing written after."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from vllm.v1.request import RequestStatus

import pd_worker
import vllm_fixtures as F

PROVIDERS = ["libfabric:tcp", "libfabric:shm"]


class Worker:
    """A worker process and its pipe."""

    def __init__(self, root: Path, role: str, provider: str, shape: F.Shape, rank: int, extra: dict) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=pd_worker.serve, args=(child, str(root), role, provider, extra, shape, rank), daemon=True)
        self.proc.start()
        self.handshake = self.recv(timeout=180)[1]

    def recv(self, timeout: float = 60) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.proc.pid} did not answer in {timeout} s")
        r = self.conn.recv()
        if isinstance(r, tuple) and r and r[0] == "error":
            raise AssertionError(f"worker failed:\n{r[1]}")
        return r

    def call(self, *cmd: Any, timeout: float = 60) -> Any:
        self.conn.send(cmd)
        return self.recv(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=30)
            except (EOFError, BrokenPipeError, TimeoutError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class Instance:
    """One vLLM instance: its real Scheduler here, its TP workers each in a
    process of its own."""

    def __init__(self, root: Path, role: str, provider: str, shape: F.Shape = F.Shape(), **extra: Any) -> None:
        # A decode instance's forward computes only the tokens after the
        # prompt: no fake KV is written into loaded blocks.
        self.computes = role == "kv_producer"
        self.vc = F.vllm_config(root, role, provider, tp=shape.tp, **extra)
        self.sched = F.scheduler(self.vc, shape)
        self.workers = [Worker(root, role, provider, shape, r, extra) for r in range(shape.tp)]
        self.worker = self.workers[0]
        # what some but not yet all workers reported (vLLM's aggregator
        # reports a transfer once every worker has)
        self._partial: dict[tuple[str, str], int] = {}
        self.finished: dict[str, dict] = {}
        self.recv_meta: dict[str, Any] = {}
        self.new_blocks: dict[str, list[int]] = {}
        self.recved: set[str] = set()
        self.invalid: set[int] = set()
        # decode: each load's bytes, checked when the worker reports it
        # (before vLLM may reuse the blocks)
        self.checks: dict[str, Optional[str]] = {}

    def step(self) -> list[str]:
        """One engine step: schedule, run the worker's connector (and the
        fake forward: scheduled prompts get their KV), feed the outputs
        back. Returns the ids scheduled."""
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        for rid, r in getattr(meta, "reqs_to_recv", {}).items():
            self.recv_meta[rid] = r
        for nr in out.scheduled_new_reqs:
            self.new_blocks[nr.req_id] = list(nr.block_ids[0])
            if self.computes:
                for w in self.workers:
                    w.call("compute", self.sched.requests[nr.req_id].prompt_token_ids, list(nr.block_ids[0]))
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        for w in self.workers:
            s, r, inv = w.call("step", meta, out.finished_req_ids)
            sending |= self._all_reported("send", s)
            recving |= self._all_reported("recv", r)
            invalid |= inv
        self.recved |= recving
        self.invalid |= invalid
        for rid in recving:
            r = self.recv_meta.get(rid)
            if r is not None and rid in self.sched.requests:
                prompt = self.sched.requests[rid].prompt_token_ids
                bad = [w.call("check", prompt, r.local_block_ids, r.first) for w in self.workers]
                self.checks[rid] = next((b for b in bad if b is not None), None)
        ids = [nr.req_id for nr in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        reqs = [self.sched.requests[i] for i in ids]
        eo = self.sched.update_from_output(out, F.runner_output(reqs, sending, recving, invalid))
        self.finished.update(F.kv_transfer_params(eo))
        return ids

    def _all_reported(self, what: str, ids: set[str]) -> set[str]:
        done = set()
        for rid in ids:
            k = (what, rid)
            self._partial[k] = self._partial.get(k, 0) + 1
            if self._partial[k] == len(self.workers):
                del self._partial[k]
                done.add(rid)
        return done

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def empty(self) -> bool:
        pool = self.sched.kv_cache_manager.block_pool
        return not self.sched.requests and pool.get_num_free_blocks() == F.NUM_BLOCKS - 1


def run_until(cond, *instances: Instance, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        for i in instances:
            i.step()
        time.sleep(0.005)


@pytest.fixture
def pd(tmp_path, request):
    provider, extra = request.param
    p = Instance(tmp_path, "kv_producer", provider, **extra)
    d = Instance(tmp_path, "kv_consumer", provider, **extra)
    p.sched.connector.set_xfer_handshake_metadata({r: w.handshake for r, w in enumerate(p.workers)})
    yield p, d
    d.stop()
    p.stop()


def prefill(p: Instance, req_id: str, prompt: list[int]) -> dict:
    """A prefill request to its end: the kv_transfer_params it returns."""
    p.sched.add_request(F.request(req_id, prompt, params={"do_remote_decode": True}))
    run_until(lambda: req_id in p.finished, p)
    return p.finished[req_id]


FAST = {"heartbeat_timeout": 2.0, "hold": 20.0}


@pytest.mark.parametrize("pd", [(prov, FAST) for prov in PROVIDERS], indirect=True, ids=PROVIDERS)
def test_prompts_move_byte_exact_and_both_schedulers_end_empty(pd):
    p, d = pd
    # one block, a partial last block, an exact multiple, and a long prompt
    lens = {"a": 5, "b": 40, "c": 48, "d": 700}
    prompts = {k: [1000 * i + t for t in range(n)] for i, (k, n) in enumerate(lens.items())}
    params = {k: prefill(p, k, prompts[k]) for k in lens}
    for k, prm in params.items():
        assert prm["do_remote_prefill"] and prm["remote_request_id"] == k
        assert len(prm["remote_block_ids"]) == F.prompt_blocks(lens[k])
        # the prefill blocks stay held until the decode side took them
        assert p.sched.requests[k].status == RequestStatus.FINISHED_LENGTH_CAPPED
    for k in lens:
        d.sched.add_request(F.request(f"d-{k}", prompts[k], max_tokens=3, params=dict(params[k])))
    run_until(lambda: p.empty() and not d.sched.requests, p, d, timeout=60)
    assert d.invalid == set()
    for k, n in lens.items():
        r = d.recv_meta[f"d-{k}"]
        assert r.first == 0 and len(r.local_block_ids) == F.prompt_blocks(n)
        assert d.checks[f"d-{k}"] is None, f"{k}: {d.checks[f'd-{k}']}"
    assert d.empty() and p.empty()
    s = d.worker.call("stats")
    assert s["loads"] == len(lens) and s["loads_failed"] == 0, s
    # vLLM's KV transfer log, fed as its model runner feeds it
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging_ = KVConnectorLogging(d.vc.kv_transfer_config)
    logging_.observe(d.worker.call("kvstats"))
    lines: list[str] = []
    logging_.log(lambda fmt, *a: lines.append(fmt % a))
    blocks = sum(F.prompt_blocks(n) for n in lens.values())
    assert f"loads={len(lens)}, loads_failed=0" in lines[0], lines
    assert f"load_bytes={blocks * F.LAYERS * 2 * F.BLOCK * F.KV_HEADS * F.HEAD_DIM * 2}" in lines[0], lines
    assert d.worker.call("kvstats") is None  # reported once


@pytest.mark.parametrize("pd", [("libfabric:tcp", FAST)], indirect=True, ids=["tcp"])
def test_blocks_in_the_decode_prefix_cache_are_not_moved_again(pd):
    p, d = pd
    base = [7000 + t for t in range(64)]  # four full blocks
    longer = base + [9000 + t for t in range(40)]
    d.sched.add_request(F.request("d-base", base, max_tokens=2, params=dict(prefill(p, "base", base))))
    run_until(lambda: p.empty() and not d.sched.requests, p, d)
    assert d.checks["d-base"] is None, d.checks["d-base"]
    # the decode instance has `base`'s full blocks cached: the load of
    # `longer` starts after them and moves the rest only
    d.sched.add_request(F.request("d-longer", longer, max_tokens=2, params=dict(prefill(p, "longer", longer))))
    run_until(lambda: p.empty() and not d.sched.requests, p, d)
    r = d.recv_meta["d-longer"]
    assert r.first == 4 and len(r.local_block_ids) == F.prompt_blocks(len(longer)) - 4, (r.first, r.local_block_ids)
    assert d.checks["d-longer"] is None, d.checks["d-longer"]


@pytest.mark.parametrize("pd", [("libfabric:tcp", FAST)], indirect=True, ids=["tcp"])
def test_a_request_aborted_during_its_load_is_cancelled_and_nothing_lands_after(pd):
    p, d = pd
    prompt = list(range(5, 5 + 300))
    params = prefill(p, "x", prompt)
    # The prefill instance does not step: its offer is not made yet, the
    # decode worker's request waits for it at the prefiller.
    d.sched.add_request(F.request("d-x", prompt, max_tokens=2, params=dict(params)))
    d.step()
    assert d.sched.requests["d-x"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = d.recv_meta["d-x"].local_block_ids
    d.worker.call("fill", blocks, 0xA5)
    time.sleep(1.0)  # the request reaches the prefiller (and waits there)
    d.sched.finish_requests("d-x", RequestStatus.FINISHED_ABORTED)
    # vLLM keeps the blocks until the worker says the load ended
    assert "d-x" in d.sched.requests
    run_until(lambda: "d-x" in d.recved, d)
    assert not d.sched.requests and d.empty()
    # now the prefill instance offers: the cancelled request ends the
    # offer at once (long before its time to live), and nothing lands in
    # the freed decode blocks
    run_until(lambda: p.empty(), p, timeout=20)
    assert d.worker.call("holds", blocks, 0xA5), "bytes landed after the cancel"
    assert d.invalid == set(), "a cancelled load is not a load error"


@pytest.mark.parametrize("pd", [("libfabric:tcp", {**FAST, "offer_ttl": 3.0})], indirect=True, ids=["tcp"])
def test_a_prefill_killed_during_the_load_fails_the_blocks_and_nothing_lands_after(pd):
    p, d = pd
    prompt = list(range(9, 9 + 200))
    params = prefill(p, "y", prompt)
    d.sched.add_request(F.request("d-y", prompt, max_tokens=2, params=dict(params)))
    d.step()
    blocks = d.recv_meta["d-y"].local_block_ids
    d.worker.call("fill", blocks, 0x5A)
    p.worker.kill()
    run_until(lambda: "d-y" in d.recved, d, timeout=30)
    assert set(blocks) <= d.invalid, (blocks, d.invalid)
    time.sleep(0.5)
    assert d.worker.call("holds", blocks, 0x5A)
    s = d.worker.call("stats")
    assert s["loads_failed"] == 1, s
    assert s["prefillers"] == 0, "the dead prefill worker is still remembered"


@pytest.mark.parametrize("pd", [("libfabric:tcp", FAST)], indirect=True, ids=["tcp"])
def test_a_decode_killed_with_its_load_in_flight_frees_the_prefill_blocks(pd):
    p, d = pd
    prompt = list(range(11, 11 + 1400))  # 88 of the 96 blocks
    params = prefill(p, "z", prompt)
    d.sched.add_request(F.request("d-z", prompt, max_tokens=2, params=dict(params)))
    d.step()  # the load starts: the request reaches the prefiller
    time.sleep(1.0)
    d.worker.kill()
    # the prefill instance now offers the prompt to a dead decoder: the
    # offer fails (writes to a dead peer, or its heartbeats stop) and vLLM
    # frees the blocks, long before the offer's time to live
    run_until(lambda: p.empty(), p, timeout=30)
    s = p.worker.call("stats")
    assert s["offers_failed"] == 1 and s["prefiller"]["pending"] == 0, s


@pytest.mark.parametrize("pd", [("libfabric:tcp", FAST)], indirect=True, ids=["tcp"])
def test_garbled_kv_transfer_params_fail_the_load_not_the_worker(pd):
    """kv_transfer_params come from the router, unchecked by vLLM: garbage
    in them fails that request's load (its blocks reported), nothing
    else; a good request afterwards still moves."""
    p, d = pd
    good = prefill(p, "ok", [4000 + t for t in range(33)])
    bad = {
        "hex": {**good, "remote_addresses": ["zz"]},
        "bytes": {**good, "remote_addresses": ["00ff13"]},
        "empty": {**good, "remote_addresses": [""]},
        "type": {**good, "remote_addresses": 5},
        "tp": {**good, "tp_size": 2},
    }
    for k, prm in bad.items():
        d.sched.add_request(F.request(f"bad-{k}", [5000 + t for t in range(20)], max_tokens=2, params=prm))
    run_until(lambda: all(f"bad-{k}" in d.recved for k in bad), d)
    for k in bad:
        assert set(d.recv_meta[f"bad-{k}"].local_block_ids) <= d.invalid, k
    # a key too long for a request frame fails its load, not the prefiller
    d.sched.add_request(F.request("bad-key", [6000 + t for t in range(20)], max_tokens=2, params={**good, "remote_request_id": "k" * 70_000}))
    run_until(lambda: "bad-key" in d.recved, d)
    # remote-prefill parameters sent to a prefill instance are ignored: the
    # request is computed there, not parked waiting for a load
    p.sched.add_request(F.request("to-producer", [8000 + t for t in range(20)], max_tokens=1, params=dict(good)))
    p.step()
    assert "to-producer" not in p.sched.requests or p.sched.requests["to-producer"].status != RequestStatus.WAITING_FOR_REMOTE_KVS
    run_until(lambda: "to-producer" not in p.sched.requests, p)
    d.sched.add_request(F.request("d-ok", [4000 + t for t in range(33)], max_tokens=2, params=dict(good)))
    run_until(lambda: p.empty() and "d-ok" in d.checks, p, d)
    assert d.checks["d-ok"] is None, d.checks["d-ok"]
    assert d.worker.call("stats")["loads_failed"] == len(bad) + 1


@pytest.mark.parametrize(
    "ptp,dtp",
    [(2, 1), (1, 2), (2, 4)],
    ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2", "prefill-tp2-decode-tp4"],
)
def test_prefill_and_decode_with_different_tp_sizes_move_every_head(tmp_path, ptp, dtp):
    """HND caches: each decode rank gets its heads of every block from the
    prefill ranks holding them (at TP 4 the model's 2 KV heads are
    replicated, as vLLM does), byte for byte; each prefill rank's offer ends
    once every decode rank that reads it has."""
    extra = {**FAST, "decode_tp": dtp}
    p = Instance(tmp_path, "kv_producer", "libfabric:tcp", F.Shape(tp=ptp, layout="HND"), **extra)
    d = Instance(tmp_path, "kv_consumer", "libfabric:tcp", F.Shape(tp=dtp, layout="HND"), **extra)
    try:
        p.sched.connector.set_xfer_handshake_metadata({r: w.handshake for r, w in enumerate(p.workers)})
        lens = {"a": 5, "b": 48, "c": 300}
        prompts = {k: [100 * i + 3 + t for t in range(n)] for i, (k, n) in enumerate(lens.items())}
        params = {k: prefill(p, k, prompts[k]) for k in lens}
        for k in lens:
            assert params[k]["tp_size"] == ptp and len(params[k]["remote_addresses"]) == ptp
            d.sched.add_request(F.request(f"d-{k}", prompts[k], max_tokens=2, params=dict(params[k])))
        run_until(lambda: p.empty() and not d.sched.requests, p, d, timeout=60)
        assert d.invalid == set()
        for k in lens:
            assert d.checks[f"d-{k}"] is None, f"{k}: {d.checks[f'd-{k}']}"
        for w in d.workers:
            s = w.call("stats")
            assert s["loads"] == len(lens) and s["loads_failed"] == 0 and s["prefillers"] == ptp, s
        for w in p.workers:
            s = w.call("stats")
            assert s["offers"] == len(lens) and s["offers_failed"] == 0 and s["prefiller"]["pending"] == 0, s
    finally:
        d.stop()
        p.stop()


def test_a_tp_mismatch_on_nhd_caches_fails_the_load_naming_the_layout(tmp_path):
    """NHD interleaves a block's heads token by token: a load across TP
    sizes is a load error (blocks reported), not wrong bytes, and the
    prefill side, told the decode TP size, frees its blocks at once
    instead of holding them for the offer's time to live."""
    extra = {**FAST, "decode_tp": 1}
    p = Instance(tmp_path, "kv_producer", "libfabric:tcp", F.Shape(tp=2), **extra)
    d = Instance(tmp_path, "kv_consumer", "libfabric:tcp", F.Shape(tp=1), **extra)
    try:
        p.sched.connector.set_xfer_handshake_metadata({r: w.handshake for r, w in enumerate(p.workers)})
        prompt = [11 + t for t in range(40)]
        d.sched.add_request(F.request("d-x", prompt, max_tokens=2, params=dict(prefill(p, "x", prompt))))
        run_until(lambda: "d-x" in d.recved, d)
        assert set(d.recv_meta["d-x"].local_block_ids) <= d.invalid
        assert d.worker.call("stats")["loads_failed"] == 1
        run_until(lambda: p.empty(), p, timeout=20)  # the offer TTL is 120 s
    finally:
        d.stop()
        p.stop()
