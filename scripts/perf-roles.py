#!/usr/bin/env python3
"""Aggregates `perf script --no-inline -F tid,ip,sym` call-graph samples by
thread role, then by leaf symbol. A spawned thread's role is its entry
function (the frame under __rust_begin_short_backtrace); the main thread's
is the first known bench function on its stack.

Record and convert:
  perf record -e cpu-clock -F 2000 --call-graph dwarf,8192 -o p.data -- weft-bench ...
  perf script -i p.data --no-inline -F tid,ip,sym > p.txt
Usage: perf-roles.py p.txt [TOP]"""
import collections, re, sys
MAIN = [("main: hand_over (raw hand-off feeder)", "hand_over"),
        ("main: raw loop", "RawPair::drive_inner"),
        ("main: raw scatter", "raw_scatter"),
        ("main: engine setup", "EnginePair::on"),
        ("main: engine setup", "engine_on"),
        ("main: engine setup", "EngineBuilder::build")]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
text = open(sys.argv[1], errors="replace").read()
per = collections.defaultdict(collections.Counter)
clk = collections.defaultdict(collections.Counter)
tot = collections.Counter()
for s in text.split("\n\n"):
    lines = [l.strip() for l in s.strip().split("\n") if l.strip()]
    if len(lines) < 2:
        continue
    frames = [re.sub(r"^[0-9a-f]+ ", "", l) for l in lines[1:]]
    if any("weft_bench::main" in f for f in frames):
        role = next((r for r, k in MAIN if any(k in f for f in frames)), "main: submit/wait/other")
    else:
        i = next((i for i, f in enumerate(frames) if "__rust_begin_short_backtrace" in f), None)
        if i is None:
            role = "other"
        else:
            entry = frames[i - 1] if i > 0 else frames[i]
            role = "thread: " + re.sub(r"<[^<>]*>", "", entry)[:70]
    tot[role] += 1
    per[role][frames[0][:100]] += 1
    if "clock_gettime" in frames[0] or "Timespec" in frames[0]:
        clk[role][" < ".join(f[:60] for f in frames[1:4])] += 1
n = sum(tot.values())
print(f"samples: {n}")
for r, c in tot.most_common():
    print(f"{100*c/n:6.2f}% {r}")
for r, c in tot.most_common():
    if c < n * 0.01:
        continue
    print(f"\n== {r} ({c} samples), by leaf symbol")
    for k, v in per[r].most_common(top):
        print(f"{100*v/c:6.2f}% {k}")
    for k, v in clk[r].most_common(4):
        print(f"   clock read from: {100*v/c:5.2f}% {k}")
