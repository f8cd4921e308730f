"""Shared fixtures for the weft pytest suite (loopback, no hardware)."""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def _loopback_engines(n: int, **provider: object):
    """`n` engines on one simulated fabric, shut down afterwards."""
    backend = weft.provider("loopback", **provider)
    engines = [weft.TransferEngine(backend) for _ in range(n)]
    try:
        yield engines
    finally:
        for e in engines:
            e.shutdown()


@pytest.fixture(params=["ideal", "adversarial"])
def pair(request: pytest.FixtureRequest):
    """Two engines on one simulated fabric, under each profile."""
    with _loopback_engines(2, profile=request.param, seed=7) as (a, b):
        yield a, b


@pytest.fixture
def loopback_pair():
    """Two engines on one simulated fabric (default profile)."""
    with _loopback_engines(2, seed=5) as (a, b):
        yield a, b


@pytest.fixture
def loopback_trio():
    """Three engines on one simulated fabric (default profile)."""
    with _loopback_engines(3, seed=11) as engines:
        yield engines


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    """A private etcd on 127.0.0.1 (Debian's etcd-server), its client URL.

    Skips without an ``etcd`` binary (``WEFT_ETCD`` names another), unless
    ``WEFT_REQUIRE_ETCD=1`` (CI) makes that a failure.
    """
    import os
    import shutil
    import subprocess
    import time
    import urllib.request

    binary = os.environ.get("WEFT_ETCD") or shutil.which("etcd") or "/usr/bin/etcd"
    if not os.path.isfile(binary):
        if os.environ.get("WEFT_REQUIRE_ETCD") == "1":
            pytest.fail("WEFT_REQUIRE_ETCD=1 but no etcd binary (install etcd-server)")
        pytest.skip("no etcd binary (install Debian's etcd-server, or set WEFT_ETCD)")
    def start(attempt: int):
        # A port found free may be taken again before etcd binds it: then
        # etcd exits at once and the next attempt picks other ports.
        client, peer = _free_port(), _free_port()
        url, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        log_path = tmp_path / f"etcd-{attempt}.log"
        log = open(log_path, "wb")
        proc = subprocess.Popen(
            [
                binary,
                "--name=weft-test",
                f"--data-dir={tmp_path / f'etcd-data-{attempt}'}",
                f"--listen-client-urls={url}",
                f"--advertise-client-urls={url}",
                f"--listen-peer-urls={purl}",
                f"--initial-advertise-peer-urls={purl}",
                f"--initial-cluster=weft-test={purl}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200 and b"true" in r.read():
                        return url, proc, log
            except OSError:
                pass
            if proc.poll() is not None:
                log.close()
                if b"address already in use" in log_path.read_bytes() and attempt < 4:
                    return None
                pytest.fail(f"etcd exited: see {log_path}")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.close()
                pytest.fail("etcd not healthy after 30 s")
            time.sleep(0.05)

    started = None
    for attempt in range(5):
        started = start(attempt)
        if started is not None:
            break
    assert started is not None
    url, proc, log = started
    try:
        yield url
    finally:
        proc.kill()
        proc.wait()
        log.close()
