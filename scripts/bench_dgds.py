"""Benchmark the grouped draft server (verl_ext.spec.dgds) against real Ray actors.

A synthetic rollout: ``--groups`` groups of ``--seqs`` responses, each ``--tokens`` long, produced
``--chunk`` tokens per response per round (the client's ``append_every``). Each round appends the
new tokens of every response, then runs one sync step (flush the appends to the shards, fetch each
instance's deltas, import them). ``--instances`` instance-like objects import into real
``DraftIndex`` copies (what the engine's drafter does); each group is served by ``--replicas``
of them. Reports append/fetch/import latency, bytes per sync step and totals, for each shard count.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_dgds.py --shards 1 2 --out runs/bench_dgds.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_ext.spec import DraftIndex  # noqa: E402
from verl_ext.spec.dgds import DGDSClient, import_deltas  # noqa: E402


class Importer:
    def __init__(self, name: str, depth: int):
        self.name = name
        self.index = DraftIndex(depth, 0, 8)
        self.refused = 0

    async def import_drafts(self, blobs):
        out = import_deltas(self.index, blobs)
        self.refused += sum(n < 0 for n in out)
        return out


async def run(shards: int, args) -> dict:
    rng = np.random.default_rng(args.seed)
    groups = [f"uid-{g}" for g in range(args.groups)]
    # responses of a group share most of their tokens (like sibling rollouts): a base text per
    # group with 10% of the tokens changed per response
    data = {}
    for g in groups:
        base = rng.integers(0, 32000, args.tokens, dtype=np.int32)
        for s in range(args.seqs):
            r = base.copy()
            m = rng.random(args.tokens) < 0.1
            r[m] = rng.integers(0, 32000, int(m.sum()))
            data[(g, f"{g}/r{s}")] = r
    client = DGDSClient(num_shards=shards, append_every=args.chunk, sync_interval_s=3600.0,
                        timeout_s=args.timeout, max_depth=args.depth)
    await client.start()
    instances = [Importer(f"i{i}", args.depth) for i in range(args.instances)]
    for gi, g in enumerate(groups):
        for r in range(args.replicas):
            client.serve(instances[(gi + r) % args.instances], g)
    rounds = (args.tokens + args.chunk - 1) // args.chunk
    step_s = []
    t_all = time.perf_counter()
    for rd in range(rounds):
        lo, hi = rd * args.chunk, min(args.tokens, (rd + 1) * args.chunk)
        for (g, seq), toks in data.items():
            client.append(g, seq, lo, toks[lo:hi])
            if hi == args.tokens:
                client.close(g, seq)
        t0 = time.perf_counter()
        await client.sync()
        step_s.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_all
    m = client.metrics()
    stats = [await h.stats.remote() for h in client.handles]
    await client.stop(flush=False)
    # check: every instance's copy of a served group equals the data
    g = groups[0]
    inst = instances[0]
    want = DraftIndex(args.depth, 0, 8)
    for (gg, seq), toks in data.items():
        if gg == g:
            want.group_append(g, seq, toks)
            want.group_close(g, seq)
    assert inst.index.dump(2, g) == want.dump(2, g), "imported tree differs from the data"
    assert m["degraded"] == 0 and sum(i.refused for i in instances) == 0
    st = np.asarray(step_s) * 1e3
    return {
        "shards": shards,
        "groups": args.groups,
        "seqs": args.seqs,
        "tokens_per_seq": args.tokens,
        "chunk": args.chunk,
        "instances": args.instances,
        "replicas": args.replicas,
        "rounds": rounds,
        "wall_s": wall,
        "tokens_per_s": args.groups * args.seqs * args.tokens / wall,
        "sync_step_ms_mean": float(st.mean()),
        "sync_step_ms_p99": float(np.percentile(st, 99)),
        "append_ms_mean": m["append_ms_mean"],
        "append_ms_p99": m["append_ms_p99"],
        "fetch_ms_mean": m["fetch_ms_mean"],
        "fetch_ms_p99": m["fetch_ms_p99"],
        "import_ms_mean": m["import_ms_mean"],
        "import_ms_p99": m["import_ms_p99"],
        "append_bytes_per_sync": m["append_bytes"] / rounds,
        "fetch_bytes_per_sync": m["bytes_per_sync"],
        "fetch_bytes_per_sync_max": m["bytes_per_sync_max"],
        "append_bytes_total": m["append_bytes"],
        "fetch_bytes_total": m["bytes_synced"],
        "append_calls": m["append_calls"],
        "fetch_calls": m["fetch_calls"],
        "server_tree_bytes": sum(s["bytes"] for s in stats),
        "server_tokens": sum(s["tokens"] for s in stats),
        "failures": m["failures"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=16, help="tokens per response per round (append_every)")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2, help="instances serving each group")
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-cpus", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import ray

    ray.init(num_cpus=args.num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        rows = [asyncio.run(run(s, args)) for s in args.shards]
    finally:
        ray.shutdown()
    cols = [("shards", "{:d}"), ("wall_s", "{:.1f}"), ("tokens_per_s", "{:,.0f}"), ("sync_step_ms_mean", "{:.1f}"),
            ("append_ms_mean", "{:.2f}"), ("append_ms_p99", "{:.2f}"), ("fetch_ms_mean", "{:.2f}"),
            ("fetch_ms_p99", "{:.2f}"), ("import_ms_mean", "{:.2f}"), ("append_bytes_per_sync", "{:,.0f}"),
            ("fetch_bytes_per_sync", "{:,.0f}")]
    print(f"{args.groups} groups x {args.seqs} seqs x {args.tokens} tokens, {args.chunk} tokens/append, "
          f"{args.instances} instances x {args.replicas} replicas per group, depth {args.depth}")
    print("  ".join(c for c, _ in cols))
    for r in rows:
        print("  ".join(f.format(r[c]).rjust(len(c)) for c, f in cols))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
