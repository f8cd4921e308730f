"""weft.rl update bandwidth between processes, next to plain WRITEs of the
same bytes between the same processes in the same run.

Trainer and inference ranks are processes on this host. The model is
``--params`` bf16 tensors of ``--cols`` columns, ``--gib`` GiB in all, each
FSDP-sharded by rows over the trainers; every inference rank holds its
TP slice of rows of every tensor (so each byte lands once). Per round:

  rl    every rank calls ``step`` (trainers push the next version, inference
        ranks wait for every byte), timed from a common barrier to the last
        rank's return;
  raw   every trainer WRITEs as many bytes as it pushes in ``rl`` to one
        inference rank (``submit_single_write``, one call), timed the same
        way: the transport's own speed for the same bytes and peers.

Prints GB/s per round (model bytes / time) with min / median / max and the
rl/raw ratio of each round.

Usage (from the repo root, after `pip install ./python`):
  python python/bench/rl_bandwidth.py [--provider libfabric:shm] [--gib 1]
      [--trainers 2] [--inference 2] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time


def layout(args) -> tuple[list, list, int]:
    """(params, targets, model bytes) of the synthetic model."""
    rows = max(args.inference, int(args.gib * 2**30 / 2 / args.cols / args.params))
    mesh = ("mesh", [args.trainers], list(range(args.trainers)), [0])
    params = [(f"p{k}", rows, args.cols, mesh) for k in range(args.params)]
    cut = [rows * i // args.inference for i in range(args.inference + 1)]
    targets = [
        [(f"p{k}", [(f"p{k}", cut[i], cut[i + 1], 0, args.cols)], "none") for k in range(args.params)]
        for i in range(args.inference)
    ]
    return params, targets, 2 * rows * args.cols * args.params


def rank_main(role: str, rank: int, args, store_dir: str, barrier, results) -> None:
    import numpy as np

    import weft
    import weft.rl as rl

    params, targets, _ = layout(args)
    plan = rl.RlPlan(args.trainers, params, targets)
    eng = weft.TransferEngine(args.provider, domain="same-machine")
    me = rl.RlTrainer(eng, plan, rank) if role == "trainer" else rl.RlInference(eng, plan, rank)
    store = weft.rendezvous.open_store("dir:" + store_dir)
    session = weft.rendezvous.Session(store, ttl=30)
    ns = weft.rendezvous.Namespace(store, "bench")
    rl.publish_endpoint(ns, session, me)
    # The raw baseline: trainer t writes its share to inference t % I.
    share = 0
    if role == "trainer":
        share = sum((r1 - r0) * (c1 - c0) * 2 for _, (r0, r1), (c0, c1) in plan.pieces(rank))
        ns.publish_record(session, "share", f"trainer-{rank}", str(share).encode())
    shares = [int(ns.wait_record("share", f"trainer-{t}", timeout=120)) for t in range(args.trainers)]
    if role == "trainer":
        raw = eng.reg_mr(np.zeros(max(share, 1), np.uint8))
        for k, (_, (r0, r1), (c0, c1)) in enumerate(plan.pieces(rank)):
            g = np.random.default_rng(1000 * rank + k)
            me.load_piece(k, g.integers(0, 1 << 16, size=(r1 - r0, c1 - c0), dtype=np.uint16))
    else:
        mine = [t for t in range(args.trainers) if t % args.inference == rank]
        raw = eng.reg_mr(np.zeros(max(sum(shares[t] for t in mine), 1), np.uint8))
        ns.publish_mr(session, f"inference-{rank}", "raw", raw.desc)
    d = rl.wait_directory(ns, plan, timeout=120)
    if role == "trainer":
        i = rank % args.inference
        dst = ns.wait_mr(f"inference-{i}", "raw", timeout=120)
        offset = sum(shares[t] for t in range(rank) if t % args.inference == i)
    # Rounds -2 and -1 warm up: connections, and the pages of both
    # inference buffers (version v lands in buffer v % 2).
    for r in range(-2, args.rounds):
        barrier.wait()
        t0 = time.perf_counter()
        me.step(r + 2, d)
        results.put(("rl", r, time.perf_counter() - t0))
        barrier.wait()
        t0 = time.perf_counter()
        if role == "trainer":
            eng.submit_single_write(share, raw, dst, dst_offset=offset).wait(timeout=120)
        results.put(("raw", r, time.perf_counter() - t0 if role == "trainer" else 0.0))
    barrier.wait()  # the last acknowledgements are in before anyone leaves
    session.close()
    eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="libfabric:shm")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--params", type=int, default=16)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--inference", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    _, _, total = layout(args)
    ctx = mp.get_context("spawn")
    n = args.trainers + args.inference
    barrier, results = ctx.Barrier(n), ctx.Queue()
    with tempfile.TemporaryDirectory() as store_dir:
        roles = [("trainer", r) for r in range(args.trainers)] + [("inference", r) for r in range(args.inference)]
        procs = [ctx.Process(target=rank_main, args=(role, r, args, store_dir, barrier, results)) for role, r in roles]
        for p in procs:
            p.start()
        times: dict = {}
        for _ in range(2 * n * (args.rounds + 2)):
            kind, r, dt = results.get(timeout=600)
            times.setdefault((kind, r), []).append(dt)
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise SystemExit(f"a rank exited with {p.exitcode}")
    gbs = {kind: [total / max(times[(kind, r)]) / 1e9 for r in range(args.rounds)] for kind in ("rl", "raw")}
    ratio = [a / b for a, b in zip(gbs["rl"], gbs["raw"])]

    def mmm(xs: list) -> str:
        return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"

    print(
        f"{args.provider}: {total / 2**30:.2f} GiB, {args.trainers} trainers -> {args.inference} inference ranks, "
        f"{args.rounds} rounds (min / median / max)"
    )
    print(f"  weft.rl update  {mmm(gbs['rl'])} GB/s")
    print(f"  raw WRITEs      {mmm(gbs['raw'])} GB/s")
    print(f"  rl / raw        {mmm(ratio)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bytes": total, "gbs": gbs, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
