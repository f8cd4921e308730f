"""Shared fixtures for the weft pytest suite (loopback, no hardware)."""

from __future__ import annotations

import os

import pytest

import weft

_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_sessionstart(session: pytest.Session) -> None:
    # The source tree's `python/weft` has no extension module: make sure the
    # installed package is the one under test.
    assert not os.path.abspath(weft._weft.__file__).startswith(_SRC + os.sep), (
        "testing the source tree: run pytest from the repo root after pip install ./python"
    )


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
