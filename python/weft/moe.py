"""MoE dispatch/combine from Python: expert-parallel ranks, one per process,
each on its own engine.

Two levels:

- :class:`MoeRank` (weft-moe's CPU driver): opaque token rows in, rows per
  local expert out; expert outputs in, weighted sums out. Every rank of a
  group gives its ``info()`` to the others and ``connect``s::

      import weft, weft.moe as moe
      eng = weft.TransferEngine("libfabric:tcp")
      r = moe.MoeRank(eng, rank, ranks, experts=256, topk=8, max_tokens=128,
                      token_bytes=7168 + 56 * 4, hidden=7168)
      moe.connect(r)                      # all-gather over torch.distributed
      rows, offsets, src, pair, layout = r.dispatch(tokens, topk_ids, topk_weights)
      # row i: token pair[i] // topk, choice pair[i] % topk of rank src[i]
      y = r.combine(expert_outputs, layout)

- :class:`Buffer`: DeepEP's low-latency API (``low_latency_dispatch`` /
  ``low_latency_combine`` on torch tensors, DeepEP's layouts) over
  ``MoeRank``s it creates per shape; :mod:`weft.deep_ep` makes it importable
  as ``deep_ep``. Tensors may live on any device, but the data path is the
  host's: inputs are copied to host memory, moved by the engine, and the
  results copied back to the input's device (synchronously, on the current
  stream). The GPU kernels of weft-moe (Rust, ``weft_moe::cuda``) are not
  reachable from Python yet, and neither CUDA graph capture nor more than
  one step in flight per shape is supported.

fp8 (``use_fp8=True``; weft quantises as it packs the rows, the
``MoeRank`` option ``dispatch="fp8"``), DeepEP's formulas in f32: per
token and 128 columns, ``amax = max(|x|, 1e-4)``; ``scale_inv = amax · f32(1/448)`` and
``x_fp8 = e4m3(clamp(x · (448 / amax), ±448))``, or with ``round_scale``
``scale_inv = 2^ceil(log2(amax · f32(1/448)))`` (exact, from the bits) and ``x_fp8 = e4m3(clamp(x
/ scale_inv, ±448))``; ``recv_x`` is ``(x_fp8, scale_inv)``, ``x ≈ x_fp8 ·
scale_inv``. (Not checked bit for bit against DeepEP's kernels: DeepEP is
not installed here.) Combine:
``out[t] = Σ_k w[t,k] · y(t,k)`` over the ``k`` whose ``topk_idx`` is not
``-1``, in f32 with fused multiply-adds in ``k`` order, rounded to bf16.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._errors import MoeError
from ._weft import MoeLayout, MoeRank, TransferEngine

__all__ = [
    "MoeRank",
    "MoeLayout",
    "MoeError",
    "connect",
    "Buffer",
    "EventOverlap",
    "Handle",
]



def _err(kind: str, message: str) -> MoeError:
    e = MoeError(message)
    e.kind = kind
    return e


def connect(rank: MoeRank, group: Optional[Any] = None) -> None:
    """Connects `rank` to the other ranks of the ``torch.distributed``
    process group `group` (default: the world; group rank r must hold MoE
    rank r): all-gathers every rank's ``info()`` and checks it. A
    collective."""
    from .dist import all_gather_bytes

    rank.connect(all_gather_bytes(rank.info(), group=group))


def _global_ranks(group: Any) -> Optional[List[int]]:
    """The global ranks of ``group``'s members in group-rank order
    (``None`` for the default group: group ranks are global ranks)."""
    import torch.distributed as dist

    if group is None or group == dist.group.WORLD:
        return None
    return [dist.get_global_rank(group, g) for g in range(dist.get_world_size(group))]


def _swap(send: Any, recv: Dict[int, Any], group: Any) -> None:
    """Sends ``send`` to and receives ``recv[g]`` from every group rank
    ``g`` of ``recv``, in one batch of point-to-point operations."""
    import torch.distributed as dist

    glob = _global_ranks(group)
    to = (lambda g: g) if glob is None else glob.__getitem__
    ops = [dist.P2POp(dist.isend, send, to(g), group) for g in recv]
    ops += [dist.P2POp(dist.irecv, t, to(g), group) for g, t in recv.items()]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _exchange(info: bytes, me: int, active: List[int], group: Any) -> List[bytes]:
    """Every active rank's ``info()`` (in rank order), exchanged point to
    point over the ``torch.distributed`` group with the active ranks only:
    lengths first, then the bytes."""
    import torch

    peers = [g for g in active if g != me]
    lens = {g: torch.zeros(1, dtype=torch.int64) for g in peers}
    _swap(torch.tensor([len(info)], dtype=torch.int64), lens, group)
    bufs = {}
    for g in peers:
        n = int(lens[g][0])
        if not 0 < n <= 1 << 16:
            raise _err("peer_info", f"rank {g} announced {n} bytes of info")
        bufs[g] = torch.empty(n, dtype=torch.uint8)
    _swap(torch.frombuffer(bytearray(info), dtype=torch.uint8), bufs, group)
    return [info if g == me else bytes(bufs[g].numpy()) for g in active]


class EventOverlap:
    """DeepEP's ``EventOverlap``: a CUDA event recorded after an operation
    (``None`` when there is nothing to wait for), usable as a context
    manager that makes the current stream wait for it on exit."""

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes the current CUDA stream wait for the event."""
        if self.event is not None:
            import torch

            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()


def _event(device: Any) -> EventOverlap:
    import torch

    if device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return EventOverlap(ev)
    return EventOverlap(None)


def _no_hook() -> None:
    """The receive hook: the data has arrived when dispatch returns."""


class _Step:
    """What a handle carries beyond DeepEP's five entries."""

    def __init__(
        self, key: tuple, rank: MoeRank, layout: MoeLayout, offsets: List[int], topk_idx: Any, tokens: int
    ) -> None:
        self.key = key
        self.rank = rank
        self.layout = layout
        self.offsets = offsets
        self.topk_idx = topk_idx
        self.tokens = tokens


class Handle(tuple):
    """DeepEP's low-latency handle, ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)`` (unpacks like
    DeepEP's five-tuple), with weft's step as an attribute."""

    step: _Step

    def __new__(cls, items: tuple, step: _Step) -> "Handle":
        h = super().__new__(cls, items)
        h.step = step
        return h


#: The next MoE instance (immediate range) per engine: every Buffer on an
#: engine, on every rank in the same order, takes the next one. Held
#: weakly: an engine's count goes with it (a later engine at the same
#: address starts at 0, as its peers' do).
_INSTANCES: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

#: Ranks of failed steps a Buffer keeps registered at most (the oldest is
#: shut down first; a dispatch that succeeds shuts them all down).
_MAX_RETIRED = 4


def _shutdown(r: MoeRank) -> None:
    try:
        r.shutdown()
    except MoeError:
        pass


def _not_supported(call: str) -> NotImplementedError:
    return NotImplementedError(
        f"weft's DeepEP shim does not support {call} (low-latency dispatch/combine only; docs/python.md)"
    )


class Buffer:
    """DeepEP's ``deep_ep.Buffer``, low-latency mode, over weft (module
    docs). ``group`` is the ``torch.distributed`` process group of the
    expert-parallel ranks, one process each. ``num_nvl_bytes``,
    ``num_rdma_bytes``, ``num_qps_per_rank``, the NVLink and fabric flags
    and ``enable_shrink`` are accepted and ignored: buffers are sized per
    shape when a shape is first used (masking works without
    ``enable_shrink``). A step that fails on any rank (a
    refused argument, a dead or stalled peer) fails on every rank — the
    others time out — and the shape's rank is rebuilt, on every rank, by
    the next call. Keyword-only extras: ``engine`` (a ``weft.TransferEngine`` to use),
    else one is opened on ``provider`` (default ``$WEFT_MOE_PROVIDER`` or
    ``"libfabric:tcp"``) with ``domain``; ``timeout`` (seconds) bounds every
    round, so a dead rank surfaces as ``MoeError`` (kind ``timeout``) on the
    others."""

    #: DeepEP's SM budget for its kernels; kept for compatibility.
    num_sms: int = 20

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Optional[Any] = None,
        *,
        engine: Optional[TransferEngine] = None,
        provider: Optional[str] = None,
        domain: Optional[str] = None,
        timeout: float = 10.0,
    ) -> None:
        import torch.distributed as dist

        if group is None:
            raise _not_supported("Buffer(comm=...) without a torch.distributed group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._own_engine = engine is None
        if engine is None:
            spec = provider or os.environ.get("WEFT_MOE_PROVIDER", "libfabric:tcp")
            engine = TransferEngine(spec, domain=domain) if domain else TransferEngine(spec)
        self.engine = engine
        self._timeout = timeout
        self._ranks: Dict[tuple, MoeRank] = {}
        self._retired: List[MoeRank] = []
        self._destroyed = False
        self._masked: List[int] = []
        # Where the active ranks exchange infos once a rank is masked: the
        # group itself when it is gloo's, else a gloo group over the same
        # ranks, made now while every rank is alive (point-to-point sends
        # of host tensors; a NCCL communicator with a dead peer is gone).
        self._p2p = group
        if dist.get_backend(group) != "gloo":
            self._p2p = dist.new_group(_global_ranks(group), backend="gloo", use_local_synchronization=True)

    # ---- sizes ----

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes weft registers per rank for this shape (bf16 tokens, the
        larger of the two formats, and any top-k up to 32)."""
        return MoeRank.buffer_bytes(
            num_ranks,
            num_experts,
            min(num_experts, 32),
            num_max_dispatch_tokens_per_rank,
            2 * hidden,
            hidden,
        )

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets ``Buffer.num_sms`` (kept for compatibility; unused)."""
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (as DeepEP's)."""
        import torch

        if torch.cuda.is_available():
            return _event(torch.device("cuda", torch.cuda.current_device()))
        return EventOverlap(None)

    # ---- the low-latency path ----

    def _check(self) -> None:
        if self._destroyed:
            raise _err("destroyed", "this Buffer was destroyed")
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise _not_supported("CUDA graph capture (the host data path copies synchronously)")
        except AttributeError:  # pragma: no cover - old torch
            pass

    def _forget(self, key: tuple) -> None:
        """Drops the shape's rank after a failed step (every rank of the
        group fails that step, so every rank rebuilds it on its next call).
        Its memory stays registered until the next dispatch succeeds
        (`_bury`): peers may still be writing the failed step's rows into
        it, and over tcp a WRITE into memory deregistered under it resets
        the connection, which ends that peer for this engine."""
        r = self._ranks.pop(key, None)
        if r is not None:
            self._retired.append(r)
            while len(self._retired) > _MAX_RETIRED:
                _shutdown(self._retired.pop(0))

    def _bury(self) -> None:
        """Shuts down the ranks of failed steps once a dispatch succeeded:
        every peer has left those steps (it took part in this one)."""
        while self._retired:
            _shutdown(self._retired.pop())

    def _rank_for(self, key: tuple) -> MoeRank:
        tokens, hidden, experts, topk, fp8 = key
        r = self._ranks.get(key)
        if r is None:
            instance = _INSTANCES.get(self.engine, 0)
            _INSTANCES[self.engine] = instance + 1
            row = hidden + hidden // 32 if fp8 else 2 * hidden
            r = MoeRank(
                self.engine,
                self.rank,
                self.group_size,
                experts,
                topk,
                tokens,
                row,
                hidden,
                out_dtype="bf16",
                dispatch=("raw", "fp8", "fp8_round_scale")[fp8],
                instance=instance,
                timeout=self._timeout,
                masked=self._masked,
            )
            if self._masked:
                # No collective: a masked rank may be dead.
                active = [g for g in range(self.group_size) if g not in self._masked]
                r.connect(_exchange(r.info(), self.rank, active, self._p2p))
            else:
                connect(r, self.group)
            self._ranks[key] = r
        return r

    # ---- masked ranks (DeepEP's shrink mode) ----

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks rank `rank_to_mask`: later steps
        neither send to it nor wait for it, and pairs naming its experts are
        dropped (not sent, not summed). Every active rank must make the same
        change before its next step; the shapes' ranks are rebuilt over the
        active ranks then, exchanging their infos point to point (no
        collective: the masked rank may be dead). A dead rank is not masked
        by itself: a step that times out raises ``MoeError``, and the caller
        masks. Unmasking a masked rank (a replacement joining) is not
        supported: build a new ``Buffer`` on every rank instead."""
        if not 0 <= rank_to_mask < self.group_size:
            raise _err("config", f"rank {rank_to_mask} is not in 0..{self.group_size}")
        if mask and rank_to_mask == self.rank:
            raise _err("config", f"rank {rank_to_mask} cannot mask itself")
        if not mask:
            if rank_to_mask in self._masked:
                raise _not_supported("low_latency_update_mask_buffer(rank, mask=False) of a masked rank")
            return
        self._set_mask(sorted(set(self._masked) | {rank_to_mask}))

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Writes 1 for every masked rank and 0 for the others into
        ``mask_status`` (``[num_ranks]``, an integer tensor)."""
        import torch

        if mask_status.numel() < self.group_size:
            raise _err("shape", f"mask_status holds {mask_status.numel()} of {self.group_size} ranks")
        status = torch.zeros(self.group_size, dtype=mask_status.dtype)
        for m in self._masked:
            status[m] = 1
        mask_status.view(-1)[: self.group_size].copy_(status.to(mask_status.device))

    def low_latency_clean_mask_buffer(self) -> None:
        """Nothing to do while no rank is masked; unmasking is not
        supported (see ``low_latency_update_mask_buffer``)."""
        if self._masked:
            raise _not_supported("low_latency_clean_mask_buffer with masked ranks")

    def _set_mask(self, masked: List[int]) -> None:
        if masked == self._masked:
            return
        self._masked = masked
        for key in list(self._ranks):
            self._forget(key)

    def low_latency_dispatch(
        self,
        x: Any,
        topk_idx: Any,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[Any] = None,
        dispatch_wait_recv_cost_stats: Optional[Any] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> Tuple[Any, Any, tuple, EventOverlap, Optional[Callable[[], None]]]:
        """Sends each token (``x``: bf16 ``[T, H]``) to its ``topk_idx``
        experts (int64 ``[T, K]``, ``-1`` = none; distinct per token).
        A collective over the group. Returns ``(recv_x, recv_count, handle,
        event, hook)``: ``recv_x`` is ``(x_fp8 [E_local, T_max·N, H],
        scales f32 [E_local, T_max·N, H/128])`` with ``use_fp8`` (scales
        column-major in the last two dimensions, as DeepEP's), else bf16
        ``[E_local, T_max·N, H]``; expert ``e``'s ``recv_count[e]`` rows
        come first, by source rank then source token. ``handle`` is
        DeepEP's ``(src_info, layout_range, T_max, H, num_experts)`` (a
        :class:`Handle`, carrying weft's step): ``src_info[e, i]`` is row
        i's token index at its source, ``layout_range[e, s] = begin << 32
        | count`` of source s's rows."""
        import torch

        self._check()
        if use_ue8m0:
            raise _not_supported("low_latency_dispatch(use_ue8m0=True)")
        if dispatch_wait_recv_cost_stats is not None:
            raise _not_supported("low_latency_dispatch(dispatch_wait_recv_cost_stats=...)")
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise _err("shape", f"x: bf16 [tokens, hidden] expected, got {x.dtype} {tuple(x.shape)}")
        t, h = x.shape
        if topk_idx.dim() != 2 or topk_idx.shape[0] != t:
            raise _err("shape", f"topk_idx: [{t}, topk] expected, got {tuple(topk_idx.shape)}")
        if use_fp8 and h % 128:
            raise _err("shape", f"hidden {h}: fp8 needs a multiple of 128")
        ids = topk_idx.detach().to("cpu", torch.int64).contiguous()
        srt = ids.sort(dim=1).values
        if bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()):
            raise _err("shape", "topk_idx names an expert twice for one token")
        # bf16 rows as they are: with fp8, weft quantises them when it
        # packs them (the rule above).
        rows = x.detach().to("cpu").contiguous().view(torch.uint8)
        fmt = (2 if round_scale else 1) if use_fp8 else 0
        key = (num_max_dispatch_tokens_per_rank, h, num_experts, ids.shape[1], fmt)
        r = self._rank_for(key)
        try:
            data, offsets, src_rank, src_pair, layout = r.dispatch(rows.numpy(), ids.numpy())
            recv_x, recv_count, handle = self._unpack(key, r, data, offsets, src_rank, src_pair, layout, ids, t, x.device)
        except MoeError:
            self._forget(key)
            raise
        self._bury()
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count.to(cumulative_local_expert_recv_stats.device)
        event = _event(x.device) if async_finish else EventOverlap(None)
        return recv_x, recv_count, handle, event, (_no_hook if return_recv_hook else None)

    def _unpack(
        self,
        key: tuple,
        r: MoeRank,
        data: bytes,
        offsets: List[int],
        src_rank: List[int],
        src_pair: List[int],
        layout: MoeLayout,
        ids: Any,
        t: int,
        device: Any,
    ) -> Tuple[Any, Any, tuple]:
        import torch

        t_max, h, experts, topk, fp8 = key
        n, loc = self.group_size, r.local_experts
        width = h + h // 32 if fp8 else 2 * h
        tb = width
        cap = t_max * n
        # What peers sent decides the counts: a rank naming one expert
        # twice for a token (possible with MoeRank directly) would not fit
        # DeepEP's layout.
        if len(data) != offsets[-1] * tb:
            raise _err("bad_routes", f"{len(data)} bytes for {offsets[-1]} rows of {tb}")
        for e in range(loc):
            if offsets[e + 1] - offsets[e] > cap:
                raise _err("bad_routes", f"expert {e}: {offsets[e + 1] - offsets[e]} rows, DeepEP's layout holds {cap}")
        got = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, tb) if data else torch.empty(0, tb, dtype=torch.uint8)
        recv = torch.zeros(loc, cap, h if fp8 else 2 * h, dtype=torch.uint8)
        scales = torch.zeros(loc, h // 128, cap, dtype=torch.float32).transpose(1, 2) if fp8 else None
        src_info = torch.full((loc, cap), -1, dtype=torch.int32)
        layout_range = torch.zeros(loc, n, dtype=torch.int64)
        counts = []
        srcs = torch.tensor(src_rank, dtype=torch.int64)
        # weft checked every pair index against max_tokens·topk.
        tokens = torch.tensor(src_pair, dtype=torch.int64) // topk
        for e in range(loc):
            a, b = offsets[e], offsets[e + 1]
            counts.append(b - a)
            if b > a:
                blk = got[a:b]
                recv[e, : b - a] = blk[:, : (h if fp8 else 2 * h)]
                if fp8:
                    scales[e, : b - a] = blk[:, h:width].contiguous().view(torch.float32)
                src_info[e, : b - a] = tokens[a:b].to(torch.int32)
                per = torch.bincount(srcs[a:b], minlength=n)
                begin = torch.cumsum(per, 0) - per
                layout_range[e] = (begin << 32) | per
        recv_count = torch.tensor(counts, dtype=torch.int32)
        if fp8:
            recv_x: Any = (recv.view(torch.float8_e4m3fn).to(device), scales.to(device))
        else:
            recv_x = recv.view(torch.bfloat16).to(device)
        step = _Step(key, r, layout, offsets, ids, t)
        handle = Handle((src_info.to(device), layout_range.to(device), t_max, h, experts), step)
        return recv_x, recv_count.to(device), handle

    def low_latency_combine(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[Any] = None,
        combine_wait_recv_cost_stats: Optional[Any] = None,
    ) -> Tuple[Any, EventOverlap, Optional[Callable[[], None]]]:
        """Sends the experts' outputs (``x``: bf16 ``[E_local, T_max·N,
        H]``, rows as dispatch placed them) back and returns ``(combined_x
        bf16 [T, H], event, hook)``: the weighted sum over each token's
        experts with ``topk_weights`` (f32 ``[T, K]``). ``topk_idx`` must be
        the dispatch's. ``out`` is written in place when given. A
        collective."""
        import torch

        self._check()
        if use_logfmt:
            raise _not_supported("low_latency_combine(use_logfmt=True)")
        if zero_copy:
            raise _not_supported("low_latency_combine(zero_copy=True)")
        if combine_wait_recv_cost_stats is not None:
            raise _not_supported("low_latency_combine(combine_wait_recv_cost_stats=...)")
        if not isinstance(handle, Handle):
            raise _err("stale_layout", "handle: not one low_latency_dispatch of this shim returned")
        _, _, t_max, h, _ = handle
        st = handle.step
        loc = st.rank.local_experts
        if x.dim() != 3 or tuple(x.shape) != (loc, t_max * self.group_size, h) or x.dtype != torch.bfloat16:
            raise _err(
                "shape",
                f"x: bf16 [{loc}, {t_max * self.group_size}, {h}] expected, got {x.dtype} {tuple(x.shape)}",
            )
        ids = topk_idx.detach().to("cpu", torch.int64)
        if tuple(ids.shape) != tuple(st.topk_idx.shape) or not torch.equal(ids, st.topk_idx):
            raise _err("shape", "topk_idx differs from the one given to low_latency_dispatch")
        w = topk_weights.detach().to("cpu", torch.float32).contiguous()
        if tuple(w.shape) != tuple(ids.shape):
            raise _err("shape", f"topk_weights: {tuple(ids.shape)} expected, got {tuple(w.shape)}")
        xc = x.detach().to("cpu")
        o = st.offsets
        parts = [xc[e, : o[e + 1] - o[e]] for e in range(loc)]
        rows = torch.cat(parts, dim=0).contiguous() if parts else torch.empty(0, h, dtype=torch.bfloat16)
        try:
            y = st.rank.combine(rows.view(torch.uint8).numpy(), st.layout, w.numpy())
        except MoeError:
            self._forget(st.key)
            raise
        comb = torch.frombuffer(bytearray(y), dtype=torch.bfloat16).view(st.tokens, h) if y else torch.empty(0, h, dtype=torch.bfloat16)
        if out is not None:
            out.copy_(comb)
            res = out
        else:
            res = comb.to(x.device)
        event = _event(x.device) if async_finish else EventOverlap(None)
        return res, event, (_no_hook if return_recv_hook else None)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: rounds complete on immediate counts, not on
        flags left in the buffers."""
        self._check()

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> Any:
        raise _not_supported("get_next_low_latency_combine_buffer (zero-copy combine)")

    def destroy(self) -> None:
        """Shuts every rank down (waits for their last rounds) and the
        engine if this Buffer opened it. A collective in effect: peers may
        still be finishing their last combine."""
        if self._destroyed:
            return
        self._destroyed = True
        for r in self._ranks.values():
            r.shutdown()
        self._ranks.clear()
        self._bury()
        if self._own_engine:
            self.engine.shutdown()

    # ---- DeepEP's normal (high-throughput) mode: not provided ----

    def get_dispatch_layout(self, *a: Any, **k: Any) -> Any:
        raise _not_supported("Buffer.get_dispatch_layout (normal mode)")

    def dispatch(self, *a: Any, **k: Any) -> Any:
        raise _not_supported("Buffer.dispatch (normal mode)")

    def combine(self, *a: Any, **k: Any) -> Any:
        raise _not_supported("Buffer.combine (normal mode)")

    def internode_dispatch(self, *a: Any, **k: Any) -> Any:
        raise _not_supported("Buffer.internode_dispatch (normal mode)")

    def internode_combine(self, *a: Any, **k: Any) -> Any:
        raise _not_supported("Buffer.internode_combine (normal mode)")

    def get_local_buffer_tensor(self, *a: Any, **k: Any) -> Any:
        raise _not_supported("Buffer.get_local_buffer_tensor")

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Any:
        raise _not_supported("Buffer.get_dispatch_config (normal mode)")

    @staticmethod
    def get_combine_config(num_ranks: int) -> Any:
        raise _not_supported("Buffer.get_combine_config (normal mode)")
