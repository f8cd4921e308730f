"""Shared fixtures for the weft pytest suite (loopback, no hardware)."""

from __future__ import annotations

import pytest

# Importing the source tree without a built extension fails here with
# weft's own ImportError ("pip install ./python"); an installed wheel or an
# editable (maturin develop) install both work.
import weft


def pytest_configure(config: pytest.Config) -> None:
    # Also registered in python/pyproject.toml; repeated here for runs whose
    # rootdir is elsewhere (the GPU host runs a copy of this folder).
    config.addinivalue_line("markers", "gpu: needs CUDA and torch")
    config.addinivalue_line("markers", "fabric: needs libfabric")


@pytest.fixture(params=["ideal", "adversarial"])
def pair(request: pytest.FixtureRequest):
    """Two engines on one simulated fabric."""
    backend = weft.provider("loopback", profile=request.param, seed=7)
    a, b = weft.TransferEngine(backend), weft.TransferEngine(backend)
    try:
        yield a, b
    finally:
        a.shutdown()
        b.shutdown()
