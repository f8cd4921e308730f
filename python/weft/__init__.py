"""weft: portable RDMA point-to-point transfers, from Python.

Build an engine over a provider (``"loopback"``, ``"libfabric:tcp"``, ...),
register memory (numpy arrays and other buffer-protocol objects), hand the
registration's ``desc`` to a peer, and write into the peer's memory::

    import numpy as np, weft

    backend = weft.provider("loopback")
    with weft.TransferEngine(backend) as a, weft.TransferEngine(backend) as b:
        src = np.arange(1024, dtype=np.uint8)
        dst = np.zeros(1024, dtype=np.uint8)
        s, d = a.reg_mr(src), b.reg_mr(dst)
        a.submit_single_write(src.nbytes, s, d.desc).wait(timeout=10)

``weft.providers()`` lists the backends and why those unavailable here are.
Errors are subclasses of :class:`weft.WeftError`.
"""

from __future__ import annotations

try:
    from . import _weft
except ImportError as e:  # pragma: no cover - depends on how weft is imported
    raise ImportError(
        "weft's extension module weft._weft is missing: importing the source tree? "
        "Install the package first (pip install ./python) and run from elsewhere"
    ) from e

from ._errors import *  # noqa: F401,F403
from ._errors import __all__ as _errors_all
from ._weft import (
    Backend,
    ImmCounts,
    MrDesc,
    PeerAddress,
    PeerGroup,
    ProviderStatus,
    Imm,
    MetricsServer,
    Registration,
    ScatterDst,
    ScatterTargets,
    Transfer,
    TransferEngine,
    UvmWatcher,
    RecvQueue,
    metrics_text,
    provider,
    providers,
    serve_metrics,
)

from . import dist, kv, moe, rendezvous, rl  # noqa: E402  (submodules: weft.dist, weft.kv, weft.moe, weft.rendezvous, weft.rl)

__version__: str = _weft.__version__

__all__ = [
    "Backend",
    "ImmCounts",
    "MrDesc",
    "PeerAddress",
    "PeerGroup",
    "ProviderStatus",
    "Imm",
    "MetricsServer",
    "Registration",
    "ScatterDst",
    "ScatterTargets",
    "Transfer",
    "TransferEngine",
    "UvmWatcher",
    "RecvQueue",
    "metrics_text",
    "provider",
    "providers",
    "serve_metrics",
    "dist",
    "kv",
    "moe",
    "rendezvous",
    "rl",
    "__version__",
    *_errors_all,
]
