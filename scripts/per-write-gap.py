#!/usr/bin/env python3
"""Per-write time of weft's single WRITEs against the design floor and the
target's baseline, from `weft-bench p2p` / `all` CSVs.

For each backend, NIC count and size (up to 4 KiB): the time one write
takes (size / bandwidth) for weft, for the design floor ("raw behind a
hand-off": the raw loop behind the engine's queue hand-off) and, where the
CSV has it, for "raw, target on own thread" (the baseline of the 0.9×
single-WRITE targets on libfabric, docs/benchmarks.md, "Targets").
Printed: medians over the pooled rows, the gap weft − floor (median and
range over rows), floor / weft, and the budget: how much weft may take over
the floor and still be 0.9× the own-thread raw loop (raw / 0.9 − floor,
median; negative: not even the floor meets 0.9×).

Rows of several runs (`run` and `variant` columns) or of several rounds are
pooled; pick variants with --variant (substring; repeat for any of several)
and drop some with --exclude.

usage: scripts/per-write-gap.py RUN.csv [RUN.csv ...] [--variant S]... [--exclude S]...
"""
import collections
import csv
import statistics as st
import sys

FLOOR = "raw behind a hand-off"
OWN = "raw, target on own thread"
MAX_SIZE = 4096


def main(argv):
    variants, excludes, files = [], [], []
    it = iter(argv)
    for a in it:
        if a in ("--variant", "--exclude"):
            v = next(it, None)
            if v is None:
                print(f"{a} needs a value", file=sys.stderr)
                return 2
            (variants if a == "--variant" else excludes).append(v)
        else:
            files.append(a)
    if not files:
        print(__doc__, file=sys.stderr)
        return 2
    # (backend, nics, size) -> run key -> {baseline name: ns per write, "weft": ns}
    rows = collections.defaultdict(lambda: collections.defaultdict(dict))
    for f in files:
        for i, r in enumerate(csv.DictReader(open(f))):
            v = r.get("variant", "")
            if variants and not any(s in v for s in variants):
                continue
            if any(s in v for s in excludes):
                continue
            if (
                r.get("case") != "single_write"
                or r.get("metric") != "bandwidth"
                or r.get("status", "ok") != "ok"
                or r.get("baseline_name") not in (FLOOR, OWN)
            ):
                continue
            size = int(r["size_bytes"] or 0)
            if not 0 < size <= MAX_SIZE:
                continue
            # The rows of one measurement share weft's number; the run
            # column (or the file and weft's value) tells measurements apart.
            key = (f, r.get("run", ""), v, r["weft"])
            m = rows[(r["backend"], int(r["nics"]), size)][key]
            m["weft"] = size / float(r["weft"])
            m[r["baseline_name"]] = size / float(r["baseline"])
    print(f"{'backend':<14} {'nics':>4} {'size':>5} {'n':>3} {'weft':>6} {'floor':>6} "
          f"{'own':>6} {'gap':>5} {'gap range':>12} {'fl/weft':>7} {'budget':>6}   (ns per write)")
    for (backend, nics, size), ms in sorted(rows.items()):
        ms = [m for m in ms.values() if FLOOR in m]
        if not ms:
            continue
        w = st.median(m["weft"] for m in ms)
        b = st.median(m[FLOOR] for m in ms)
        gaps = sorted(m["weft"] - m[FLOOR] for m in ms)
        own = [m for m in ms if OWN in m]
        own_s = f"{st.median(m[OWN] for m in own):>6.0f}" if own else f"{'-':>6}"
        budget = (
            f"{st.median(m[OWN] / 0.9 - m[FLOOR] for m in own):>6.0f}" if own else f"{'-':>6}"
        )
        print(f"{backend:<14} {nics:>4} {size:>5} {len(ms):>3} {w:>6.0f} {b:>6.0f} {own_s} "
              f"{st.median(gaps):>5.0f} {gaps[0]:>5.0f}..{gaps[-1]:<5.0f} {b / w:>7.2f} {budget}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
