"""KvCache transfer for disaggregated serving, on the serving stack's own
KV cache tensors (host or CUDA).

A decode process registers its cache with a :class:`KvDecoder` and fills
block ids of it from prefill processes; a prefill process registers its
cache with a :class:`KvPrefiller` and *offers* each finished prompt's
blocks under a key that the router hands both sides (a request id). The
prefiller writes (one-sided RDMA WRITE with immediates: one paged write
per layer) straight into the decoder's blocks; the decoder knows a request
is complete when the immediates say every byte landed. Both sides
heartbeat each other: a dead peer fails its requests. Serving loops call
``poll()`` every step; it never blocks and no Python callback runs on the
transfer path::

    import weft, weft.kv as kv

    layout = kv.layout_for(kv_caches, block_bytes=...)     # or kv.KvLayout(...)
    # decode process
    dec = kv.KvDecoder(weft.TransferEngine("libfabric:tcp"), layout, kv_caches)
    p = dec.add_prefiller(prefill_address_bytes)
    rid = dec.request(block_ids, p, key=b"req-42")
    done, failed = dec.poll()                              # each step
    # prefill process
    pre = kv.KvPrefiller(weft.TransferEngine("libfabric:tcp"), layout, kv_caches)
    pre.offer(b"req-42", block_ids)                        # the prompt is computed
    done, failed = pre.poll()                              # then free the blocks

A cache is one tensor holding every layer (``[layer][head][page]`` bytes)
or a list of per-layer tensors (vLLM's ``kv_caches``); each layer holds
``kv_heads`` "heads" of ``num_pages`` pages of ``page_len`` bytes. For
vLLM's ``[2, num_blocks, ...]`` layer tensors that is ``kv_heads=2`` (K and
V), ``num_pages=num_blocks`` and ``page_len`` the bytes of one block of K.
Errors are :class:`weft.KvError` with a ``kind``.
"""

from __future__ import annotations

from typing import Any, Sequence

from ._errors import KvError
from ._weft import KvDecoder, KvLayout, KvPrefiller, tp_readers

__all__ = ["KvDecoder", "KvError", "KvLayout", "KvPrefiller", "layout_for", "tp_readers"]


def _nbytes(t: Any) -> int:
    if hasattr(t, "nbytes") and not callable(t.nbytes):
        return int(t.nbytes)
    return int(t.numel()) * int(t.element_size())


def layout_for(
    layers: Sequence[Any], kv_heads: int, num_pages: int, tail_len: int = 0, tail_slots: int = 0
) -> KvLayout:
    """The layout of per-layer tensors ``layers`` (all the same size), each
    holding ``kv_heads`` heads of ``num_pages`` equal pages, heads before
    pages: for vLLM's ``[2, num_blocks, block_size, heads, head_dim]``
    tensors, ``kv_heads=2`` and ``num_pages=num_blocks``."""
    if not layers:
        raise KvError("no layers")
    sizes = {_nbytes(t) for t in layers}
    if len(sizes) != 1:
        raise KvError(f"per-layer tensors differ in size: {sorted(sizes)}")
    per_layer = sizes.pop()
    if kv_heads <= 0 or num_pages <= 0 or per_layer % (kv_heads * num_pages):
        raise KvError(
            f"a layer of {per_layer} bytes does not split into {kv_heads} heads x {num_pages} pages"
        )
    return KvLayout(
        layers=len(layers),
        kv_heads=kv_heads,
        page_len=per_layer // (kv_heads * num_pages),
        num_pages=num_pages,
        tail_len=tail_len,
        tail_slots=tail_slots,
    )
