"""Metrics in Prometheus' text format: per engine, for every live engine of
the process, and served over HTTP."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import numpy as np
import pytest

import weft

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')


def parse(page: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a page; checks each family has one HELP and one TYPE."""
    out, types = [], {}
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"family {name} twice"
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, line
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        assert m.group(1) in types, f"sample before its TYPE: {line}"
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def value(page: str, name: str, **want: str) -> float:
    hits = [v for n, ls, v in parse(page) if n == name and all(ls.get(k) == w for k, w in want.items())]
    assert len(hits) == 1, (name, want, page)
    return hits[0]


def test_engine_page_counts_peers_transfers_and_failures(loopback_trio):
    a, b, c = loopback_trio
    src = np.arange(8192, dtype=np.uint8)
    db, dc = np.zeros(8192, dtype=np.uint8), np.zeros(8192, dtype=np.uint8)
    s, rb, rc = a.reg_mr(src), b.reg_mr(db), c.reg_mr(dc)
    a.submit_single_write(4096, s, rb.desc).wait(timeout=60)
    a.submit_single_write(100, s, rc.desc).wait(timeout=60)
    gone = rc.desc
    rc.unreg()
    with pytest.raises(weft.RemoteAccessError):
        a.submit_single_write(16, s, gone).wait(timeout=60)
    page = a.metrics_text()
    assert value(page, "weft_transfers_ok_total", group="0") == 2
    assert value(page, "weft_transfers_failed_total", group="0", kind="remote_access") == 1
    per_peer = {ls["peer"]: v for n, ls, v in parse(page) if n == "weft_peer_bytes_posted_total"}
    assert sorted(per_peer.values()) == [100 + 16, 4096], per_peer
    assert value(page, "weft_bytes_posted_total", group="0", nic="0") == 4096 + 100 + 16
    assert value(page, "weft_data_path_info", group="0", nic="0", provider="loopback") == 1
    assert value(page, "weft_python_callback_errors_total") == 0
    st = a.stats()["groups"][0]
    assert st["transfers_ok"] == 2 and st["transfers_failed"] == {"remote_access": 1}


def test_process_page_labels_every_live_engine(loopback_trio):
    page = weft.metrics_text()
    engines = loopback_trio
    incs = {f"{e.incarnation:016x}" for e in engines}
    seen = {ls["engine"] for n, ls, _ in parse(page) if n == "weft_data_path_info"}
    assert incs <= seen
    engines[0].shutdown()
    seen = {ls["engine"] for n, ls, _ in parse(weft.metrics_text()) if n == "weft_data_path_info"}
    assert f"{engines[0].incarnation:016x}" not in seen


def test_http_endpoint_serves_the_page(loopback_trio):
    with weft.serve_metrics() as server:
        host, port = server.address
        assert host == "127.0.0.1" and port > 0
        with urllib.request.urlopen(server.url, timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = r.read().decode()
        assert "weft_data_path_info" in body
        parse(body)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://{host}:{port}/other", timeout=10)
        assert e.value.code == 404
    assert "closed" in repr(server)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)


def test_serve_metrics_reports_a_taken_port():
    with weft.serve_metrics() as s:
        with pytest.raises(OSError, match="cannot serve metrics"):
            weft.serve_metrics(port=s.address[1])
