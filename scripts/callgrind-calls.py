#!/usr/bin/env python3
"""Per-call costs from a callgrind output file.

For every function whose name contains one of PATTERNs: how often it was
called, its inclusive cost per call (every event the file recorded: Ir, and
the cache events with --cache-sim=yes), split by caller, and its callees'
costs per call. The numbers come from the call edges (`calls=` lines), so a
function's cost is counted per call even where callgrind_annotate only shows
totals. Used for the instruction counts in docs/benchmarks.md ("Targets").

usage: scripts/callgrind-calls.py CALLGRIND_OUT PATTERN [PATTERN...]
"""
import collections
import re
import sys


def parse(path):
    names = {}
    edges = {}
    calls = collections.Counter()
    events = ["Ir"]
    cur = cfn = None
    pending = None

    def name(s):
        m = re.match(r"\((\d+)\)(?: (.*))?", s)
        if not m:
            return s
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names[m.group(1)]

    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("events:"):
                events = line.split()[1:]
            elif pending is not None:
                vals = [int(x) for x in line.split()[1:]]
                vals += [0] * (len(events) - len(vals))
                key = (cur, cfn)
                old = edges.get(key)
                edges[key] = vals if old is None else [a + b for a, b in zip(old, vals)]
                calls[key] += pending
                pending = None
            elif line.startswith("fn="):
                cur = name(line[3:])
            elif line.startswith("cfn="):
                cfn = name(line[4:])
            elif line.startswith("calls="):
                pending = int(line[6:].split()[0])
    return events, edges, calls


def fmt(events, vals, n):
    return " ".join(f"{e}={v / max(n, 1):.1f}" for e, v in zip(events, vals))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    events, edges, calls = parse(sys.argv[1])
    for pat in sys.argv[2:]:
        callees = sorted({b for (a, b) in edges if pat in b and a != b})
        for fn in callees:
            into = [(a, v, calls[(a, b)]) for (a, b), v in edges.items() if b == fn and a != b]
            n = sum(k for _, _, k in into)
            tot = [sum(v[i] for _, v, _ in into) for i in range(len(events))]
            print(f"== {fn}\n   calls={n} per call: {fmt(events, tot, n)}")
            for a, v, k in sorted(into, key=lambda x: -x[1][0]):
                print(f"   <- {a[:100]}  calls={k} per call: {fmt(events, v, k)}")
            outs = [(b, v, calls[(a, b)]) for (a, b), v in edges.items() if a == fn and a != b]
            for b, v, k in sorted(outs, key=lambda x: -x[1][0]):
                print(f"   -> {b[:100]}  calls={k} per call: {fmt(events, v, k)}")


if __name__ == "__main__":
    main()
