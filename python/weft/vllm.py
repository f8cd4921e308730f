"""vLLM KV connector over weft: disaggregated prefill/decode with
``weft.kv``, loaded by vLLM without changes to vLLM::

    vllm serve ... --kv-transfer-config '{"kv_connector": "WeftConnector",
        "kv_connector_module_path": "weft.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"provider": "libfabric:efa"}}'

(``kv_role`` ``kv_consumer`` on the decode instances.) A router sends each
request to a prefill instance with ``kv_transfer_params={"do_remote_decode":
True}`` and ``max_tokens=1``, then to a decode instance with the
``kv_transfer_params`` the prefill instance returned — the same flow as
vLLM's NIXL connector, so the same proxies work.

How the bytes move (push, decoder-initiated): when the prefill request
finishes, the prefill worker *offers* its blocks under the request id and
keeps them (``request_finished`` delays their free). The decode worker
allocates its blocks, asks the prefill worker (one of weft's SENDs) for the
offer, and the prefill worker WRITEs every layer's blocks straight into the
decode blocks, with immediates; the decode worker knows the load is
complete when the immediates say every byte is in place — no extra round
trip, and the decode side never needs READ access to prefill memory, which
not every fabric offers. The prefill blocks are freed once their writes
completed (or the offer expired unused after ``offer_ttl`` seconds).

``kv_connector_extra_config`` keys: ``provider`` (a weft provider spec,
default ``"libfabric:tcp"``), ``nics`` (default 1), ``offer_ttl`` (seconds,
default 120), ``hold`` (seconds a decoder's request waits for its offer,
default 30), ``heartbeat_timeout`` (seconds, default 10), ``decode_tp``
(prefill side: the decode instances' TP size, default the prefill's own).

Supported: one KV cache group (full attention, or MLA's one latent);
per-layer KV tensors whose block dimension is known (``[2, num_blocks, ...]``
K/V first, or ``[num_blocks, ...]``) and dense in some dimension order;
host or CUDA memory (CUDA needs a provider that registers GPU memory);
decode-side prefix-cache hits (only the missing blocks move); aborts during
a load (the load is cancelled, and vLLM frees the blocks only once no write
can land); failed loads reported through ``get_block_ids_with_load_errors``.

Tensor parallelism: with equal TP sizes, decode TP rank ``r`` loads from
prefill TP rank ``r``, in any KV cache layout. Different TP sizes (either
way, and KV heads fewer than the TP size, which vLLM replicates) need the
heads of a block to sit apart in memory: vLLM's HND cache layout (memory
``[2, num_blocks, heads, block, head_dim]``), or MLA, whose one latent every
rank holds. Each decode rank then loads its heads from every prefill rank
that holds some of them, one paged write per (layer, K or V) from each;
under MLA the decode ranks spread their reads over the prefill ranks. The
prefill side must be told the decode TP size (``decode_tp``): an offer ends
once every decode rank that reads it has. The NHD layout keeps a block's
heads interleaved token by token, so it refuses a TP mismatch with a load
error naming the layout (as vLLM's NIXL connector does).

Not supported: hybrid (HMA) groups and layer-wise pipelining of the
transfer with the prefill forward.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import weft
import weft.kv as wkv
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("weft.vllm")

__all__ = ["WeftConnector", "WeftConnectorMetadata", "WeftHandshake", "WeftKVConnectorStats", "kv_layout"]


#: Longest ``remote_request_id`` taken (vLLM's ids are tens of bytes).
MAX_KEY = 1024


@dataclasses.dataclass
class WeftHandshake(KVConnectorHandshakeMetadata):
    """A worker's weft address (its prefiller's, on a producer)."""

    address: bytes


@dataclasses.dataclass
class RecvReq:
    """A load for the decode worker: its blocks and where the KV is."""

    local_block_ids: list[int]
    first: int
    params: dict[str, Any]


_COUNTS = ("loads", "loads_failed", "offers", "offers_failed", "load_bytes")


@dataclasses.dataclass
class WeftKVConnectorStats(KVConnectorStats):
    """What vLLM's KV transfer logging shows for this connector: loads and
    offers started and failed, bytes loaded, and each load's time from its
    start to the worker seeing it complete (seconds)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {**{k: 0 for k in _COUNTS}, "load_seconds": []}

    def aggregate(self, other: KVConnectorStats) -> "WeftKVConnectorStats":
        if not other.is_empty():
            for k in _COUNTS:
                self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
            self.data["load_seconds"] = list(self.data.get("load_seconds", [])) + list(other.data.get("load_seconds", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in _COUNTS}
        secs = sorted(self.data.get("load_seconds", []))
        if secs:
            out["load_ms_median"] = round(1e3 * secs[len(secs) // 2], 3)
            out["load_ms_max"] = round(1e3 * secs[-1], 3)
            total = sum(secs)
            if total > 0:
                out["load_gb_per_s"] = round(self.data.get("load_bytes", 0) / total / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in _COUNTS)


class WeftConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step."""

    def __init__(self) -> None:
        self.reqs_to_recv: dict[str, RecvReq] = {}
        self.reqs_to_offer: dict[str, list[int]] = {}
        self.reqs_to_cancel: set[str] = set()


def _physical(name: str, t: Any) -> tuple[Any, list[int]]:
    """``t`` with its dimensions in memory order (outermost first), as a
    contiguous view, and that order (indices into ``t``'s dimensions).
    vLLM hands a backend's logical shape, permuted from the memory layout
    when the cache layout is HND."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    p = t.permute(*order)
    if not p.is_contiguous():
        raise weft.KvError(f"layer {name}: KV tensor is not dense (shape {tuple(t.shape)}, strides {strides})")
    return p, order


def kv_layout(
    kv_caches: dict[str, Any], num_blocks: int, split_heads: Optional[int] = None
) -> tuple[wkv.KvLayout, list[Any]]:
    """The ``weft.kv`` layout of vLLM's per-layer KV tensors (in the dict's
    order) and the regions to register, read in memory order.

    The dimension of size ``num_blocks`` is the page index. With
    ``split_heads`` (the layer's KV heads) and a tensor whose memory holds
    K and V outermost and each block's heads before its tokens (vLLM's
    FlashAttention shape ``[2, num_blocks, block, heads, head_dim]`` in the
    HND cache layout), K and V are registered as layers of their own,
    ``split_heads`` heads of one block each, pages before heads: heads can
    then move between different tensor-parallel sizes. Otherwise the
    dimensions before the page index are "heads" (K and V) and those after
    it one page."""
    items = list(kv_caches.items())
    if not items:
        raise weft.KvError("no KV cache tensors")
    shape0, dtype0 = tuple(items[0][1].shape), items[0][1].dtype
    phys: list[Any] = []
    order0: Optional[list[int]] = None
    for name, x in items:
        if tuple(x.shape) != shape0 or x.dtype != dtype0:
            raise weft.KvError(f"layer {name}: {tuple(x.shape)} {x.dtype}, layer 0: {shape0} {dtype0}")
        p, order = _physical(name, x)
        if order0 is None:
            order0 = order
        elif order != order0:
            raise weft.KvError(f"layer {name}: memory order {order}, layer 0: {order0}")
        phys.append(p)
    assert order0 is not None
    try:
        ldim = shape0.index(num_blocks)
    except ValueError:
        raise weft.KvError(f"KV tensors {shape0} have no dimension of {num_blocks} blocks") from None
    pdim = order0.index(ldim)
    pshape = tuple(phys[0].shape)
    if split_heads is not None and splits_heads(shape0, order0, ldim, split_heads):
        # memory [2, num_blocks, heads, block, head_dim]: K and V each a layer
        regions = [half for p in phys for half in (p[0], p[1])]
        page = int(regions[0][0][0].numel()) * int(regions[0].element_size())
        return wkv.KvLayout(
            layers=len(regions), kv_heads=split_heads, page_len=page, num_pages=num_blocks, order="pages_before_heads"
        ), regions
    heads = 1
    for d in pshape[:pdim]:
        heads *= d
    return wkv.layout_for(phys, kv_heads=heads, num_pages=num_blocks), phys


def splits_heads(shape: tuple[int, ...], order: list[int], ldim: int, heads: int) -> bool:
    """Whether a KV tensor of logical ``shape`` (FlashAttention's ``[2,
    num_blocks, block, heads, head_dim]``, blocks at ``ldim``) whose memory
    order is ``order`` keeps K and V outermost and each block's heads
    before its tokens (HND)."""
    return (
        len(shape) == 5
        and ldim == 1
        and shape[0] == 2
        and shape[3] == heads
        and order[:2] == [0, 1]
        and order.index(3) < order.index(2)
    )


def _seed(request_id: str) -> int:
    """The seed every rank of a request uses for its TP route (it spreads
    an MLA latent's readers over the prefill ranks)."""
    return zlib.crc32(request_id.encode())


class WeftConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector moving KV blocks with weft (see the module)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "Optional[KVCacheConfig]" = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        extra = dict(kt.kv_connector_extra_config or {})
        self.engine_id: str = kt.engine_id or "weft"
        self.provider: str = str(extra.get("provider", "libfabric:tcp"))
        self.nics: int = int(extra.get("nics", 1))
        self.offer_ttl: float = float(extra.get("offer_ttl", 120.0))
        self.hold: float = float(extra.get("hold", 30.0))
        self.heartbeat_timeout: float = float(extra.get("heartbeat_timeout", 10.0))
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self.block_size: int = vllm_config.cache_config.block_size
        self.is_producer: bool = kt.is_kv_producer
        self.is_consumer: bool = kt.is_kv_consumer
        self.num_blocks: Optional[int] = getattr(kv_cache_config, "num_blocks", None)
        mc = vllm_config.model_config
        #: MLA: one latent per token, the same on every TP rank.
        self.use_mla: bool = bool(getattr(mc, "use_mla", False))
        #: The model's KV heads (1 for MLA), what TP splits.
        self.total_kv_heads: int = 1 if self.use_mla else int(mc.get_total_num_kv_heads())
        #: The decode instances' TP size, which a prefill worker needs to
        #: know how many decode ranks read each of its offers.
        self.decode_tp: int = int(extra.get("decode_tp", self.tp_size))
        if self.decode_tp < 1:
            raise ValueError(f"decode_tp must be >= 1, not {self.decode_tp}")
        self._local_heads: Optional[int] = None
        for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
            self._local_heads = getattr(g.kv_cache_spec, "num_kv_heads", None)
            break
        #: Whether heads are registered one by one (HND), so that prefill
        #: and decode may differ in TP size.
        self._split = False
        # scheduler side
        self._addresses: dict[int, bytes] = {}
        self._recv: dict[str, RecvReq] = {}
        self._offer: dict[str, list[int]] = {}
        self._cancel: set[str] = set()
        self._loading: set[str] = set()
        # worker side
        self._engines: list[weft.TransferEngine] = []
        self.decoder: Optional[wkv.KvDecoder] = None
        self.prefiller: Optional[wkv.KvPrefiller] = None
        # prefill worker address -> id (a dead one is forgotten)
        self._prefillers: dict[bytes, int] = {}
        self._busy: collections.Counter[bytes] = collections.Counter()
        self._by_rid: dict[int, tuple[str, list[int], list[bytes]]] = {}
        self._rid_of: dict[str, int] = {}
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        self._offered: set[str] = set()
        self._send_done: set[str] = set()
        self._finished_seen: set[str] = set()
        self._stats = {"loads": 0, "loads_failed": 0, "offers": 0, "offers_failed": 0}
        self._interval = WeftKVConnectorStats()
        self._started: dict[int, float] = {}
        self._block_bytes = 0

    # ---------------------------------------------------------------- worker

    def _tp_rank(self) -> int:
        if self.tp_size == 1:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Registers the worker's KV tensors: a prefiller on producers, a
        decoder on consumers (each with an engine of its own)."""
        if self.num_blocks is None:
            raise weft.KvError("WeftConnector needs kv_cache_config.num_blocks")
        split = None if self.use_mla else self._local_heads
        layout, layers = kv_layout(kv_caches, self.num_blocks, split_heads=split)
        self._split = split is not None and layout.layers == 2 * len(kv_caches)
        self._block_bytes = layout.layers * layout.kv_heads * layout.page_len
        hb = dict(heartbeat_interval=min(1.0, self.heartbeat_timeout / 10), heartbeat_timeout=self.heartbeat_timeout)
        if self.is_producer:
            eng = weft.TransferEngine(self.provider, nics=self.nics)
            self._engines.append(eng)
            self.prefiller = wkv.KvPrefiller(eng, layout, layers, hold=self.hold, **hb)
        if self.is_consumer:
            eng = weft.TransferEngine(self.provider, nics=self.nics)
            self._engines.append(eng)
            self.decoder = wkv.KvDecoder(eng, layout, layers, **hb)
        log.info("weft connector: %s over %s (%s)", layout, self.provider, "producer" if self.is_producer else "consumer")

    def get_handshake_metadata(self) -> Optional[WeftHandshake]:
        """The prefiller's address, for the scheduler to hand to decoders."""
        if self.prefiller is None:
            return None
        return WeftHandshake(address=self.prefiller.address.to_bytes())

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Starts this step's loads, offers and cancels (never blocks)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, WeftConnectorMetadata)
        if self.prefiller is not None:
            for req_id, blocks in meta.reqs_to_offer.items():
                try:
                    readers = 1
                    if self.decode_tp != self.tp_size:
                        if not (self._split or self.use_mla):
                            # the decode ranks' loads fail: free the blocks now
                            raise weft.KvError(f"decode TP {self.decode_tp} != prefill TP {self.tp_size} needs HND caches or MLA")
                        readers = wkv.tp_readers(
                            self.total_kv_heads, self.tp_size, self.decode_tp, self._tp_rank(), seed=_seed(req_id)
                        )
                    self.prefiller.offer(req_id.encode(), blocks, ttl=self.offer_ttl, requests=readers)
                    self._offered.add(req_id)
                    self._count("offers")
                except weft.KvError as e:
                    log.warning("weft connector: cannot offer %s: %s", req_id, e)
                    self._send_done.add(req_id)
        if self.decoder is not None:
            for req_id, r in meta.reqs_to_recv.items():
                self._start_load(req_id, r)
            for req_id in meta.reqs_to_cancel:
                rid = self._rid_of.get(req_id)
                if rid is not None:
                    self.decoder.cancel(rid)

    def _prefiller_id(self, addr: bytes) -> int:
        """The decoder's id of a prefill worker, added (and heartbeated) on
        first use. Forgetting a live one is not offered: a prefill worker
        whose decoder stops heartbeating retires that decoder for good."""
        assert self.decoder is not None
        pid = self._prefillers.get(addr)
        if pid is None:
            pid = self._prefillers[addr] = self.decoder.add_prefiller(addr)
        return pid

    def _forget(self, addr: bytes) -> None:
        """Drops a dead prefill worker (a restarted one has a new address)."""
        assert self.decoder is not None
        self._prefillers.pop(addr, None)
        self._busy.pop(addr, None)
        self.decoder.remove_prefiller(addr)

    def _start_load(self, req_id: str, r: RecvReq) -> None:
        assert self.decoder is not None
        p = r.params
        addrs: list[bytes] = []
        try:
            ptp = int(p.get("tp_size", 1))
            hexes = p["remote_addresses"]
            if ptp < 1 or len(hexes) != ptp:
                raise ValueError(f"{len(hexes)} remote addresses for prefill TP {ptp}")
            key = str(p["remote_request_id"]).encode()
            if len(key) > MAX_KEY:
                raise ValueError(f"remote_request_id of {len(key)} bytes (at most {MAX_KEY})")
            if ptp == self.tp_size:
                addrs = [bytes.fromhex(hexes[self._tp_rank()])]
                pid = self._prefiller_id(addrs[0])
                rid = self.decoder.request(r.local_block_ids, pid, key, first=r.first)
            else:
                if not (self._split or self.use_mla):
                    raise weft.KvError(
                        f"prefill TP {ptp} != decode TP {self.tp_size} needs the HND KV cache layout "
                        "(K and V outermost, heads before tokens) or MLA"
                    )
                addrs = [bytes.fromhex(h) for h in hexes]
                pids = [self._prefiller_id(a) for a in addrs]
                rid = self.decoder.request_tp(
                    r.local_block_ids,
                    pids,
                    key,
                    kv_heads=self.total_kv_heads,
                    prefill_tp=ptp,
                    decode_tp=self.tp_size,
                    decode_rank=self._tp_rank(),
                    first=r.first,
                    seed=_seed(str(p["remote_request_id"])),
                )
        except (weft.WeftError, KeyError, ValueError, IndexError, TypeError) as e:
            log.warning("weft connector: load of %s not started: %s", req_id, e)
            self._load_errors.update(r.local_block_ids)
            self._recv_done.add(req_id)
            self._count("loads_failed")
            return
        self._busy.update(addrs)
        self._by_rid[rid] = (req_id, r.local_block_ids, addrs)
        self._rid_of[req_id] = rid
        self._started[rid] = time.perf_counter()
        self._count("loads")

    def _count(self, what: str, n: int = 1) -> None:
        self._stats[what] = self._stats.get(what, 0) + n
        self._interval.data[what] = self._interval.data.get(what, 0) + n

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a request is scheduled only once its load completed."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: the prefill side offers whole prompts when they finish."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: offered blocks stay held until sent."""

    def _poll(self) -> None:
        if self.decoder is not None:
            done, failed = self.decoder.poll()
            now = time.perf_counter()
            for rid in done:
                req_id, blocks, addrs = self._by_rid.pop(rid)
                self._busy.subtract(addrs)
                self._rid_of.pop(req_id, None)
                self._recv_done.add(req_id)
                self._interval.data["load_seconds"].append(now - self._started.pop(rid, now))
                self._count("load_bytes", len(blocks) * self._block_bytes)
            for rid, kind, msg in failed:
                req_id, blocks, addrs = self._by_rid.pop(rid)
                self._busy.subtract(addrs)
                # A load from one prefill worker names the dead one (with
                # several sources the failure does not say which).
                if kind == "prefiller_dead" and len(addrs) == 1:
                    if addrs[0] in self._prefillers and not self._busy[addrs[0]]:
                        self._forget(addrs[0])
                self._rid_of.pop(req_id, None)
                self._started.pop(rid, None)
                self._recv_done.add(req_id)
                if kind == "cancelled":  # vLLM aborted it: not a load error
                    continue
                log.warning("weft connector: load of %s failed (%s): %s", req_id, kind, msg)
                self._load_errors.update(blocks)
                self._count("loads_failed")
        if self.prefiller is not None:
            done, failed = self.prefiller.poll()
            for key in done:
                self._send_done.add(key.decode())
            for key, kind, msg in failed:
                if kind not in ("expired", "cancelled"):
                    log.warning("weft connector: sending %s failed (%s): %s", key.decode(), kind, msg)
                self._count("offers_failed")
                self._send_done.add(key.decode())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Loads that ended (done or failed; failed blocks are in
        ``get_block_ids_with_load_errors``) and offers that ended (their
        blocks may be freed), each once."""
        # Only ids this worker sends for are remembered (no unbounded set).
        self._finished_seen.update(r for r in finished_req_ids if r in self._offered or r in self._send_done)
        self._poll()
        recving, self._recv_done = self._recv_done, set()
        # A send is reported only for requests vLLM told us finished.
        sending = {r for r in self._send_done if r in self._finished_seen}
        self._send_done -= sending
        self._finished_seen -= sending
        self._offered -= sending
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call."""
        errs, self._load_errors = self._load_errors, set()
        return errs

    def get_kv_connector_stats(self) -> Optional[WeftKVConnectorStats]:
        """This worker's loads and offers since the last call (vLLM's KV
        transfer logging), or None when there were none. weft's own
        counters are in Prometheus' format: ``weft.metrics_text()``."""
        if self._interval.is_empty():
            return None
        s, self._interval = self._interval, WeftKVConnectorStats()
        return s

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> WeftKVConnectorStats:
        """Stats from their serialized form (vLLM's logger process)."""
        return WeftKVConnectorStats(data=dict(data) if data else {})

    def stats(self) -> dict[str, Any]:
        """Loads and offers started and failed by this worker, with the
        decoder's and prefiller's own counters (``requests``: taken,
        completed, failed by kind) and what is in flight."""
        s: dict[str, Any] = dict(self._stats)
        s["prefillers"] = len(self._prefillers)
        if self.decoder is not None:
            s["decoder"] = {**self.decoder.stats(), "pending": self.decoder.pending}
        if self.prefiller is not None:
            s["prefiller"] = {**self.prefiller.stats(), "pending": self.prefiller.pending}
        return s

    def shutdown(self) -> None:
        """Ends every transfer and releases the KV registrations."""
        if self.decoder is not None:
            self.decoder.shutdown()
        if self.prefiller is not None:
            self.prefiller.shutdown(drain=2.0)
        for e in self._engines:
            e.shutdown()
        self._engines.clear()

    # ------------------------------------------------------------- scheduler

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Workers' addresses by TP rank (what decoders are sent to)."""
        for rank, m in metadata.items():
            if isinstance(m, WeftHandshake):
                self._addresses[int(rank)] = m.address

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """A decode request with remote KV: every prompt token not computed
        locally, loaded asynchronously. Only a consumer instance loads: on a
        producer such parameters are ignored (a load nothing would serve
        would hold the request's blocks for good)."""
        p = request.kv_transfer_params
        if not self.is_consumer:
            return 0, False
        if p and p.get("do_remote_prefill") and p.get("remote_addresses") and p.get("remote_request_id"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Records the blocks a remote load fills (once per request)."""
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill") or not self.is_consumer:
            return
        if num_external_tokens > 0:
            group = blocks.blocks[0]
            first = sum(1 for b in group if b.block_hash is not None and not b.is_null)
            local = blocks.get_unhashed_block_ids_all_groups()[0]
            self._recv[request.request_id] = RecvReq(list(local), first, dict(p))
            self._loading.add(request.request_id)
        p["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads, offers and cancels."""
        meta = WeftConnectorMetadata()
        meta.reqs_to_recv, self._recv = self._recv, {}
        meta.reqs_to_offer, self._offer = self._offer, {}
        meta.reqs_to_cancel, self._cancel = self._cancel, set()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Loads that ended are no longer cancellable."""
        for r in connector_output.finished_recving or ():
            self._loading.discard(r)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Prefill: offer the finished prompt's blocks (freed once sent or
        expired) and return the decode side's ``kv_transfer_params``.
        Decode: an abort during a load cancels it."""
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p:
            return False, None
        rid = request.request_id
        if rid in self._loading:
            # vLLM frees the blocks when the worker reports the load ended,
            # which it does once the cancel is confirmed. A load not yet
            # handed to the worker stays in this step's metadata: the
            # worker starts it and cancels it at once, and reports it.
            self._loading.discard(rid)
            self._cancel.add(rid)
            return False, None
        if not p.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        if not block_ids:
            return False, None
        if len(self._addresses) < self.tp_size:
            log.warning("weft connector: no worker addresses (handshake missing): %s not offered", rid)
            return False, None
        self._offer[rid] = list(block_ids)
        return True, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.engine_id,
            remote_request_id=rid,
            remote_block_ids=list(block_ids),
            remote_addresses=[self._addresses[r].hex() for r in range(self.tp_size)],
            tp_size=self.tp_size,
            remote_num_tokens=request.num_computed_tokens,
            remote_expiry=time.time() + self.offer_ttl,
        )
