"""A vLLM worker's side of WeftConnector in a process of its own: the test
sends it each step's connector metadata (built by vLLM's real Scheduler in
the test process) and it calls the connector in the order vLLM's model
runner does (bind, start_load_kv, wait_for_save, get_finished,
get_block_ids_with_load_errors, clear). Its KV caches are CPU tensors in
vLLM's FlashAttention layout ``[2, num_blocks, block, heads, head_dim]``."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

import vllm_fixtures as F


def caches() -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(2, F.NUM_BLOCKS, F.BLOCK, F.KV_HEADS, F.HEAD_DIM, dtype=torch.float16)
        for i in range(F.LAYERS)
    }


def serve(conn: Any, root: str, role: str, provider: str, extra: dict) -> None:
    F.env_ok()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from weft.vllm import WeftConnector

    vc = F.vllm_config(Path(root), role, provider, **extra)
    w = WeftConnector(vc, KVConnectorRole.WORKER, F.kv_cache_config())
    kv = caches()
    w.register_kv_caches(kv)
    conn.send(("ready", w.get_handshake_metadata()))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "step":
                meta, finished = args
                w.bind_connector_metadata(meta)
                w.start_load_kv(None)
                w.wait_for_save()
                sending, recving = w.get_finished(finished)
                errors = w.get_block_ids_with_load_errors()
                w.clear_connector_metadata()
                conn.send((sending or set(), recving or set(), errors))
            elif cmd == "compute":  # the prefill forward: prompt blocks get their KV
                prompt, blocks = args
                for layer, t in enumerate(kv.values()):
                    for k in range(2):
                        for j, b in enumerate(blocks):
                            t.view(torch.uint8)[k, b].view(-1)[:] = F.pattern(prompt, layer, k, j)
                conn.send(None)
            elif cmd == "check":  # blocks[i] must hold block first + i of prompt
                prompt, blocks, first = args
                bad = None
                for layer, t in enumerate(kv.values()):
                    for k in range(2):
                        for i, b in enumerate(blocks):
                            if not torch.equal(t.view(torch.uint8)[k, b].view(-1), F.pattern(prompt, layer, k, first + i)):
                                bad = bad or f"layer {layer} kv {k} block {b} (prompt block {first + i})"
                conn.send(bad)
            elif cmd == "fill":  # a sentinel in blocks
                blocks, byte = args
                for t in kv.values():
                    t.view(torch.uint8)[:, blocks] = byte
                conn.send(None)
            elif cmd == "holds":  # whether blocks still hold only the sentinel
                blocks, byte = args
                conn.send(all(bool((t.view(torch.uint8)[:, blocks] == byte).all()) for t in kv.values()))
            elif cmd == "stats":
                conn.send(w.stats())
            elif cmd == "kvstats":  # what vLLM's model runner sends its logger
                s = w.get_kv_connector_stats()
                conn.send(None if s is None else s.to_dict())
            elif cmd == "stop":
                w.shutdown()
                conn.send(None)
                return
        except Exception:  # reported to the test, which fails
            conn.send(("error", traceback.format_exc()))
