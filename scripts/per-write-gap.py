#!/usr/bin/env python3
"""Per-write time of weft's single WRITEs against the design floor, from
`weft-bench p2p` / `all` CSVs: for each backend, NIC count and size (up to
4 KiB), the time one write takes (size / bandwidth) for weft and for "raw
behind a hand-off" (the raw loop behind the engine's queue hand-off, the
same row), and the difference. Rows of several runs (a `run` column, as in
docs/data/h200-i24-*.csv) or of several rounds are pooled: the medians and
the range of the per-row differences are printed.

The difference is what the engine adds per write where both loops are
bound by their posting thread; on the null backend it is the engine's own
per-write cost, which docs/benchmarks.md compares with the shm rows
("What the shm singles' gap is made of").

usage: scripts/per-write-gap.py RUN.csv [RUN.csv ...] [--variant SUBSTRING]
"""
import collections
import csv
import statistics as st
import sys

FLOOR = "raw behind a hand-off"
MAX_SIZE = 4096


def main(argv):
    variant = None
    files = []
    it = iter(argv)
    for a in it:
        if a == "--variant":
            variant = next(it, None)
        else:
            files.append(a)
    if not files:
        print(__doc__, file=sys.stderr)
        return 2
    groups = collections.defaultdict(list)
    for f in files:
        for r in csv.DictReader(open(f)):
            if variant is not None and variant not in r.get("variant", ""):
                continue
            if (
                r.get("case") != "single_write"
                or r.get("metric") != "bandwidth"
                or r.get("baseline_name") != FLOOR
                or r.get("status", "ok") != "ok"
            ):
                continue
            size = int(r["size_bytes"] or 0)
            if not 0 < size <= MAX_SIZE:
                continue
            weft_ns = size / float(r["weft"])
            floor_ns = size / float(r["baseline"])
            groups[(r["backend"], int(r["nics"]), size)].append((weft_ns, floor_ns))
    print(f"{'backend':<14} {'nics':>4} {'size':>5} {'n':>3} {'weft ns':>8} "
          f"{'floor ns':>8} {'gap ns':>7} {'gap range':>13} {'floor/weft':>10}")
    for (backend, nics, size), v in sorted(groups.items()):
        w = st.median(x[0] for x in v)
        b = st.median(x[1] for x in v)
        gaps = sorted(x[0] - x[1] for x in v)
        print(f"{backend:<14} {nics:>4} {size:>5} {len(v):>3} {w:>8.0f} {b:>8.0f} "
              f"{st.median(gaps):>7.0f} {gaps[0]:>6.0f}..{gaps[-1]:<6.0f} {b / w:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
