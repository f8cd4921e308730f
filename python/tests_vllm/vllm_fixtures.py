"""Helpers shared by the vLLM tests: a VllmConfig for a tiny local model
(no download: a config.json written here, tokenizer skipped), vLLM's own
v1 Scheduler loading ``weft.vllm`` by module path, requests and the model
runner outputs a GPU worker would return — written here from vLLM's public
types."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
LAYERS = 4
KV_HEADS = 2
HEAD_DIM = 64
NUM_BLOCKS = 96
EOS = 2

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": KV_HEADS * 2 * HEAD_DIM,
    "intermediate_size": 256,
    "num_attention_heads": KV_HEADS * 2,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": LAYERS,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": EOS,
}

_hash_ready = False


@dataclasses.dataclass(frozen=True)
class Shape:
    """An instance's tensor-parallel size and its workers' KV cache layout:
    ``"NHD"`` (memory ``[2, blocks, block, heads, head_dim]``, vLLM's
    default) or ``"HND"`` (memory ``[2, blocks, heads, block, head_dim]``,
    handed to the connector as vLLM does: the NHD shape, permuted)."""

    tp: int = 1
    layout: str = "NHD"

    def heads(self, rank: int) -> list[int]:
        """The model's KV heads TP rank ``rank`` holds (vLLM's split: a
        contiguous share, or one head replicated over ``tp / KV_HEADS``
        ranks)."""
        if KV_HEADS >= self.tp:
            n = KV_HEADS // self.tp
            return list(range(rank * n, (rank + 1) * n))
        return [rank // (self.tp // KV_HEADS)]


def model_dir(root: Path) -> str:
    d = root / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


def vllm_config(root: Path, role: str, provider: str, tp: int = 1, **extra: Any) -> VllmConfig:
    """A VllmConfig on vLLM's CPU device config with WeftConnector; ``tp``
    is set after vLLM's checks (no process group is made here)."""
    mc = ModelConfig(model=model_dir(root), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=4096)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=4096, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True)
    kt = KVTransferConfig(
        kv_connector="WeftConnector",
        kv_connector_module_path="weft.vllm",
        kv_role=role,
        engine_id=f"{role}-engine",
        kv_connector_extra_config={"provider": provider, **extra},
    )
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
    vc.parallel_config.tensor_parallel_size = tp
    return vc


def kv_cache_config(shape: Shape = Shape()) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=len(shape.heads(0)), head_size=HEAD_DIM, dtype=torch.float16)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def scheduler(vc: VllmConfig, shape: Shape = Shape()) -> Scheduler:
    """vLLM's own v1 Scheduler; it loads the connector from the config."""
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kv_cache_config(shape),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
    )


def request(req_id: str, prompt: list[int], max_tokens: int = 1, params: Optional[dict] = None) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    r = Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    r.kv_transfer_params = params
    return r


def runner_output(
    reqs: Iterable[Request],
    sending: Optional[set[str]] = None,
    recving: Optional[set[str]] = None,
    invalid: Optional[set[int]] = None,
) -> ModelRunnerOutput:
    """What a worker returns for one step: one sampled token per scheduled
    request (never EOS), plus the connector's output."""
    ids = [r.request_id for r in reqs]
    kvo = None
    if sending or recving or invalid:
        kvo = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None, invalid_block_ids=invalid or set())
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kvo,
    )


def kv_transfer_params(engine_outputs: dict) -> dict[str, dict]:
    """request id -> kv_transfer_params of the finished requests."""
    out = {}
    for eco in engine_outputs.values():
        for o in eco.outputs:
            if o.kv_transfer_params is not None:
                out[o.request_id] = o.kv_transfer_params
    return out


def prompt_blocks(prompt_len: int) -> int:
    return (prompt_len + BLOCK - 1) // BLOCK


def pattern(prompt: list[int], layer: int, kv: int, j: int) -> torch.Tensor:
    """The bytes of block ``j`` (K or V) of ``layer`` for a prompt, every
    head of the model: what the fake prefill forward writes and the decode
    side checks. Like real KV, they depend on the tokens up to the block's
    end only, so blocks shared through a prefix cache hold the same bytes
    for every prompt. A rank's share under HND: ``rank_pattern``."""
    nbytes = BLOCK * KV_HEADS * HEAD_DIM * 2
    upto = ",".join(map(str, prompt[: (j + 1) * BLOCK]))
    g = torch.Generator().manual_seed(zlib.crc32(f"{upto}/{layer}/{kv}".encode()))
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def env_ok() -> None:
    # vLLM picks its "unspecified" platform when VLLM_TARGET_DEVICE is unset;
    # =cpu would demand triton-cpu.
    os.environ.pop("VLLM_TARGET_DEVICE", None)


def rank_pattern(prompt: list[int], layer: int, kv: int, j: int, shape: Shape, rank: int) -> torch.Tensor:
    """What TP rank ``rank`` of ``shape`` holds of ``pattern``: its heads,
    in order — the pattern read as ``[heads, block, head_dim]`` under HND,
    as ``[block, heads, head_dim]`` under NHD."""
    full = pattern(prompt, layer, kv, j)
    heads = shape.heads(rank)
    if shape.layout == "HND":
        return full.view(KV_HEADS, -1)[heads].reshape(-1)
    return full.view(BLOCK, KV_HEADS, -1)[:, heads].reshape(-1)
