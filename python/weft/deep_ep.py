"""DeepEP's Python API (low-latency mode) on weft: code written for
``deep_ep`` runs unchanged for ``low_latency_dispatch`` /
``low_latency_combine``::

    import weft.deep_ep as deep_ep          # or: weft.deep_ep.install(); import deep_ep
    buf = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        128, 7168, group.size(), 256), low_latency_mode=True)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, 128, 256)
    out, event, hook = buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

What the shim supports, and what raises ``NotImplementedError`` naming the
call, is listed in docs/python.md; the semantics (fp8 rule, combine order)
are in :mod:`weft.moe`.
"""

from __future__ import annotations

import sys
from typing import Any

from .moe import Buffer, EventOverlap

__all__ = ["Buffer", "EventOverlap", "Config", "install"]


class Config:
    """DeepEP's normal-mode kernel config: not provided by the shim."""

    def __init__(self, *a: Any, **k: Any) -> None:
        raise NotImplementedError(
            "weft's DeepEP shim does not support deep_ep.Config (normal mode; low-latency dispatch/combine only)"
        )


def install() -> None:
    """Makes ``import deep_ep`` give this module."""
    sys.modules["deep_ep"] = sys.modules[__name__]
