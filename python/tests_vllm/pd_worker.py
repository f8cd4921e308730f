"""A vLLM worker's side of WeftConnector in a process of its own: the test
sends it each step's connector metadata (built by vLLM's real Scheduler in
the test process) and it calls the connector in the order vLLM's model
runner does (bind, start_load_kv, wait_for_save, get_finished,
get_block_ids_with_load_errors, clear). Its KV caches are CPU tensors in
vLLM's FlashAttention shape ``[2, num_blocks, block, heads, head_dim]``,
laid out NHD or HND (``vllm_fixtures.Shape``), its share of the model's
heads at its TP rank."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

import vllm_fixtures as F


def caches(shape: F.Shape, rank: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The KV tensors handed to the connector, and the same memory as
    ``[2, num_blocks, ...]`` tensors in memory order (one block of K or V
    is ``mem[layer][k, b]``)."""
    h = len(shape.heads(rank))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(F.LAYERS)]
    if shape.layout == "HND":
        mem = [torch.zeros(2, F.NUM_BLOCKS, h, F.BLOCK, F.HEAD_DIM, dtype=torch.float16) for _ in names]
        return {n: m.permute(0, 1, 3, 2, 4) for n, m in zip(names, mem)}, mem
    mem = [torch.zeros(2, F.NUM_BLOCKS, F.BLOCK, h, F.HEAD_DIM, dtype=torch.float16) for _ in names]
    return dict(zip(names, mem)), mem


def serve(conn: Any, root: str, role: str, provider: str, extra: dict, shape: F.Shape, rank: int) -> None:
    F.env_ok()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from weft.vllm import WeftConnector

    vc = F.vllm_config(Path(root), role, provider, tp=shape.tp, **extra)
    w = WeftConnector(vc, KVConnectorRole.WORKER, F.kv_cache_config(shape))
    # vLLM asks its TP group; these workers have none
    w._tp_rank = lambda: rank  # type: ignore[method-assign]
    kv, mem = caches(shape, rank)
    w.register_kv_caches(kv)
    conn.send(("ready", w.get_handshake_metadata()))

    def block(layer: int, k: int, b: int) -> torch.Tensor:
        return mem[layer][k, b].view(torch.uint8).view(-1)

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
                for layer in range(F.LAYERS):
                    for k in range(2):
                        for j, b in enumerate(blocks):
                            block(layer, k, b)[:] = F.rank_pattern(prompt, layer, k, j, shape, rank)
                conn.send(None)
            elif cmd == "check":  # blocks[i] must hold block first + i of prompt
                prompt, blocks, first = args
                bad = None
                for layer in range(F.LAYERS):
                    for k in range(2):
                        for i, b in enumerate(blocks):
                            if not torch.equal(block(layer, k, b), F.rank_pattern(prompt, layer, k, first + i, shape, rank)):
                                bad = bad or f"rank {rank} layer {layer} kv {k} block {b} (prompt block {first + i})"
                conn.send(bad)
            elif cmd == "fill":  # a sentinel in blocks
                blocks, byte = args
                for m in mem:
                    m.view(torch.uint8)[:, blocks] = byte
                conn.send(None)
            elif cmd == "holds":  # whether blocks still hold only the sentinel
                blocks, byte = args
                conn.send(all(bool((m.view(torch.uint8)[:, blocks] == byte).all()) for m in mem))
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
