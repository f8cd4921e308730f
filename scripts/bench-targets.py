#!/usr/bin/env python3
"""The benchmark targets from `weft-bench all` CSVs: one line per target
with the numbers it is judged by (weft, the target's baseline and the design
floor "raw behind a hand-off", all from the same run). Used for the "Targets"
table of docs/benchmarks.md.

usage: scripts/bench-targets.py RUN.csv [RUN.csv ...]
  (e.g. the loopback-null,loopback half and the libfabric:tcp,libfabric:shm
  half of one full run)"""
import csv
import statistics as st
import sys

rows = [r for f in sys.argv[1:] for r in csv.DictReader(open(f))]


def q(**kw):
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def one(**kw):
    r = q(**kw)
    return (float(r[0]["weft"]), float(r[0]["baseline"])) if r else None


def rng(xs):
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "n/a"


FLOOR = "raw behind a hand-off"
print("target | measured")
for be in ["loopback-null", "loopback", "libfabric:tcp", "libfabric:shm"]:
    first, floor, vs_floor = [], [], []
    for p in ["8 peers", "16 peers", "32 peers", "64 peers", "128 peers"]:
        h = one(bench="proxy", backend=be, param=p, metric="submit->first WR p50",
                baseline_name="queue hand-off floor")
        d = one(bench="proxy", backend=be, param=p, metric="submit->first WR p50",
                baseline_name=FLOOR)
        if h and d:
            first.append(h[0] / h[1])
            floor.append(d[1] / h[1])
            vs_floor.append(h[0] / d[1])
    if first:
        print(f"submit->first WR / hand-off floor, 8..128 peers ({be}) | weft {rng(first)}x; "
              f"design floor {rng(floor)}x; weft / design floor {rng(vs_floor)}")
    raw = one(bench="proxy", backend=be, param="64 peers", metric="submit->all posted p50",
              baseline_name="raw backend posting")
    fl = one(bench="proxy", backend=be, param="64 peers", metric="submit->all posted p50",
             baseline_name=FLOOR)
    if raw and fl:
        print(f"64-peer scatter all posted ({be}) | weft {raw[0]:.2f} us, raw {raw[1]:.2f} us: "
              f"{raw[0] - raw[1]:+.2f} us, {raw[0] / raw[1]:.2f}x; design floor {fl[1]:.2f} us: "
              f"{fl[1] - raw[1]:+.2f} us, {fl[1] / raw[1]:.2f}x; weft / floor {raw[0] / fl[1]:.2f}")
for be in ["loopback-null", "loopback", "libfabric:tcp", "libfabric:shm"]:
    parts = []
    for n in ["1", "2", "4", "8"]:
        rs = q(bench="p2p", case="paged_write", backend=be, nics=n, metric="page rate")
        r = [float(x["ratio"]) for x in rs if x["baseline_name"] == "raw backend"]
        f = [float(x["ratio"]) for x in rs if x["baseline_name"] == FLOOR]
        c = [float(x["ratio"]) for x in rs if x["baseline_name"] == FLOOR + ", page lists copied"]
        big = [float(x["ratio"]) for x in rs
               if x["baseline_name"] == "raw backend" and not x["param"].startswith("100 x")]
        if r:
            parts.append(f"{n} NICs median {st.median(r):.2f} ({rng(r)}; "
                         + (f">100-page {rng(big)}; " if big else "")
                         + f"weft/floor {st.median(f):.2f}"
                         + (f", weft/lists floor {st.median(c):.2f}" if c else "") + ")")
    if parts:
        print(f"paged / raw ({be}) | " + "; ".join(parts))
for be in ["loopback-null", "loopback", "libfabric:tcp", "libfabric:shm"]:
    for r in q(bench="imm", backend=be):
        print(f"imm {r['case']} {r['param']} ({be}) | {float(r['weft']):.3g} vs "
              f"{float(r['baseline']):.3g} ({r['baseline_name']}): {float(r['ratio']):.2f}")
for be in ["loopback-null", "loopback", "libfabric:tcp", "libfabric:shm"]:
    worst = []
    for n in ["1", "2", "4", "8"]:
        b = {x["param"]: float(x["weft"]) for x in q(bench="p2p", case="imm_only", backend=be, nics=n)
             if "armed before" in x["param"]}
        a = {x["param"]: float(x["weft"]) for x in q(bench="p2p", case="imm_only", backend=be, nics=n)
             if "armed after" in x["param"]}
        if b and a:
            worst.append(f"{n}: {list(b.values())[0]:.2f}/{list(a.values())[0]:.2f}")
    if worst:
        print(f"imm-only after 1 ms idle, armed before/after, p50 us ({be}) | " + ", ".join(worst))
for be in ["libfabric:tcp", "libfabric:shm"]:
    for bn in ["raw backend", "raw, target on own thread", FLOOR]:
        parts = []
        for n in ["1", "2", "4", "8"]:
            rs = q(bench="p2p", case="single_write", backend=be, nics=n, metric="bandwidth",
                   baseline_name=bn)
            small = [float(x["ratio"]) for x in rs if int(x["size_bytes"]) <= 4096]
            big = [float(x["ratio"]) for x in rs if int(x["size_bytes"]) > 4096]
            if rs:
                parts.append(f"{n}: {rng(small)} / {rng(big)}")
        if parts:
            print(f"single WRITE / {bn} ({be}), <=4 KiB / >4 KiB | " + "; ".join(parts))
for r in q(bench="pingpong"):
    if r["case"].startswith("cpu"):
        print(f"{r['case']} ({r['backend']}) | {float(r['weft']):.3g} {r['unit']}")
for be in ["libfabric:tcp", "libfabric:shm"]:
    for c in ["write_imm", "send_recv", "send_recv_polled"]:
        rs = q(bench="pingpong", case=c, backend=be)
        if rs:
            print(f"pingpong {c} / fi_pingpong ({be}) | " + ", ".join(
                f"{x['param']} {float(x['ratio']):.2f}" for x in rs))
for r in q(bench="poll"):
    if r["case"] == "idle_cpu_per_group" and r["metric"] == "engine threads CPU":
        lat = [x for x in q(bench="poll", case="submit_to_done_after_idle", backend=r["backend"])
               if x["param"].startswith(r["param"] + ", 64 B")]
        print(f"idle CPU / after-idle p50 ({r['backend']}, {r['param']}) | "
              f"{float(r['weft']):.4f} cores, "
              + (f"{float(lat[0]['weft']):.1f} us" if lat else "n/a"))
