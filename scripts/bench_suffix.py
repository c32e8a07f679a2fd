"""Suffix-tree draft index benchmark: cost, memory and exact-match acceptance, side by side with
arctic-inference's SuffixDecodingCache (optional) and vLLM's n-gram proposer.

    OMP_NUM_THREADS=1 python scripts/bench_suffix.py                 # full table
    OMP_NUM_THREADS=1 python scripts/bench_suffix.py --quick --json  # one JSON object, < 60 s

arctic-inference is used when importable, or from .cache/arctic (bash scripts/build_arctic.sh).
Acceptance replays real responses of the default model (data/replay_smollm2_arith.json.gz, made
by scripts/make_replay_data.py): two sampling seeds stand in for two epochs. A verification step
drafts up to k tokens, accepts the longest prefix equal to the real response, and gains one more
token (the target's own); "tokens/step" is response tokens / steps, "accept" is accepted /
drafted tokens.

The process runs pinned to one core. verl_ext's batched proposal is timed in ``--rounds`` rounds
(default 5): ``propose_us_per_request_b<B>`` is their median and ``..._spread`` their [min, max].
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from verl_ext.spec import DraftIndex, scope_mask  # noqa: E402

DEPTH = 32
MIN_PROB = 0.3
KS = (4, 8, 16)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def load_arctic():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        local = REPO / ".cache" / "arctic"
        if not local.exists():
            return None
        sys.path.insert(0, str(local))
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError:
            return None
    return SuffixDecodingCache


def make_ngram(k, max_len, max_seqs=256):
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(prompt_lookup_min=2, prompt_lookup_max=5, num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return NgramProposer(cfg)


# ------------------------------------------------------------------------------------ cost
def grpo_like(rng, groups, g, length, vocab=32000, mutate=0.05):
    """`groups` prompt groups of `g` similar responses (5% of tokens changed)."""
    out = []
    for _ in range(groups):
        base = rng.integers(0, vocab, length, dtype=np.int64)
        resp = []
        for _ in range(g):
            r = base.copy()
            m = rng.random(length) < mutate
            r[m] = rng.integers(0, vocab, int(m.sum()))
            resp.append(r.astype(np.int32))
        out.append(resp)
    return out


def rounds(fn, n: int) -> tuple[float, list[float]]:
    """``fn()`` (a time) ``n`` times: the median and [min, max], so that one noisy round reads
    neither as a regression nor hides one."""
    times = sorted(fn() for _ in range(n))
    return float(np.median(times)), [times[0], times[-1]]


def pin_one_core() -> int | None:
    """Run on one core (the first this process may use): the scheduler moving the benchmark
    between cores is one source of the swing. Returns the core, or None where it cannot pin."""
    try:
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return core
    except (AttributeError, OSError):
        return None


def bench_cost(quick, arctic_cls, n_rounds=5):
    rng = np.random.default_rng(0)
    res = {}
    length = 1024 if quick else 4096
    data = grpo_like(rng, 2 if quick else 4, 16, length)
    # bulk appends (native path: what the engine's batched sync does) and one-token calls
    idx = DraftIndex(DEPTH, 0, 16)
    t0 = time.perf_counter()
    for gi, group in enumerate(data):
        for si, r in enumerate(group):
            for c in range(0, length, 64):
                idx.group_append(f"g{gi}", f"s{si}", r[c:c + 64])
    n = sum(len(r) for g in data for r in g)
    res["append_us_per_token"] = (time.perf_counter() - t0) / n * 1e6
    st = idx.stats()
    res["bytes_per_token"] = st["bytes"] / st["tokens"]
    idx2 = DraftIndex(DEPTH, 0, 16)
    r0 = data[0][0][:2048].tolist()
    t0 = time.perf_counter()
    for t in r0:
        idx2.group_append("g", "s", [t])
    res["append_call_us_per_token"] = (time.perf_counter() - t0) / len(r0) * 1e6
    rnd = DraftIndex(DEPTH, 0, 16)
    for s in range(100 if quick else 500):
        rnd.group_append("r", str(s), rng.integers(0, 2000, 2048))
    st = rnd.stats()
    res["bytes_per_token_random"] = st["bytes"] / st["tokens"]
    if arctic_cls is not None:
        res["arctic"] = arctic_cost(arctic_cls, data, quick, rng)

    # propose at batch 1/64/256 with 4k-token contexts (prompt 512 + response 3584)
    ctx_len = 4096
    batch_sizes = (1, 64, 256)
    bmax = max(batch_sizes)
    groups = grpo_like(rng, bmax // 16, 16, ctx_len - 512)
    prompts = rng.integers(0, 32000, (bmax // 16, 512)).astype(np.int32)
    rows = np.zeros((bmax, ctx_len), np.int32)
    for i in range(bmax):
        rows[i, :512] = prompts[i // 16]
        rows[i, 512:] = groups[i // 16][i % 16]
    lens = np.full(bmax, ctx_len, np.int64)
    idx = DraftIndex(DEPTH, 0, 16)
    keys = [f"r{i}" for i in range(bmax)]
    for i, key in enumerate(keys):
        idx.start_request(key, rows[i, :512], group=f"g{i // 16}")
        idx.append(key, rows[i, 512:])
    reps = 20 if quick else 100
    mask = scope_mask("request+group")
    for b in batch_sizes:
        idx.batch_propose_lists(keys[:b], 8, rows, lens, scopes=mask)

        def one_round(b=b):
            t0 = time.perf_counter()
            for _ in range(reps):
                idx.batch_propose_lists(keys[:b], 8, rows, lens, scopes=mask)
            return (time.perf_counter() - t0) / (reps * b) * 1e6

        med, spread = rounds(one_round, n_rounds)
        res[f"propose_us_per_request_b{b}"] = med
        res[f"propose_us_per_request_b{b}_spread"] = spread
    try:
        ngram = make_ngram(8, ctx_len + 64, bmax)
        sampled = [[int(rows[i, ctx_len - 1])] for i in range(bmax)]
        for b in batch_sizes:
            ngram.propose(8, sampled[:b], lens[:b].astype(np.int32), rows)
            t0 = time.perf_counter()
            for _ in range(max(2, reps // 4)):
                ngram.propose(8, sampled[:b], lens[:b].astype(np.int32), rows)
            res.setdefault("ngram", {})[f"propose_us_per_request_b{b}"] = (time.perf_counter() - t0) / (max(2, reps // 4) * b) * 1e6
    except Exception as exc:  # vLLM missing or changed: the peer is optional
        res["ngram"] = {"error": str(exc)}
    if arctic_cls is not None:
        cache = arctic_cls(max_tree_depth=DEPTH, max_cached_requests=-1)
        for i, key in enumerate(keys):
            cache.start_request(key, rows[i, :512])
            cache.add_active_response(key, rows[i, 512:])
        pats = [np.ascontiguousarray(rows[i, ctx_len - DEPTH:ctx_len]) for i in range(bmax)]
        for b in batch_sizes:
            t0 = time.perf_counter()
            r = max(2, reps // 4)
            for _ in range(r):
                for i in range(b):
                    cache.speculate(keys[i], pats[i], max_spec_tokens=8, min_token_prob=MIN_PROB)
            res["arctic"][f"propose_us_per_request_b{b}"] = (time.perf_counter() - t0) / (r * b) * 1e6
    return res


def arctic_cost(cls, data, quick, rng):
    out = {}
    cache = cls(max_tree_depth=DEPTH, max_cached_requests=-1)
    n = 0
    t0 = time.perf_counter()
    for gi, group in enumerate(data):
        for si, r in enumerate(group):
            key = f"g{gi}s{si}"
            cache.start_request(key, np.zeros(1, np.int32))
            for c in range(0, len(r), 64):
                cache.add_active_response(key, r[c:c + 64])
            n += len(r)
            cache.stop_request(key)
    out["append_us_per_token"] = (time.perf_counter() - t0) / n * 1e6
    try:
        out["bytes_per_token"] = cache._global_tree.estimate_memory() / n
    except AttributeError:
        pass
    c2 = cls(max_tree_depth=DEPTH, max_cached_requests=-1)
    for s in range(100 if quick else 500):
        c2.start_request(str(s), np.zeros(1, np.int32))
        c2.add_active_response(str(s), rng.integers(0, 2000, 2048).astype(np.int32))
        c2.stop_request(str(s))
    try:
        out["bytes_per_token_random"] = c2._global_tree.estimate_memory() / ((100 if quick else 500) * 2048)
    except AttributeError:
        pass
    return out


# ------------------------------------------------------------------------------ acceptance
def load_replay(path, quick):
    with gzip.open(path, "rt") as f:
        d = json.load(f)
    p = 6 if quick else len(d["prompts"])
    return d["prompts"][:p], [e[:p] for e in d["epochs"]], [r[:p] for r in d["rewards"]]


def history_weight(reward):
    # RhymeRL ranks branches by summed reward; the floor keeps prompts whose responses all
    # failed (reward 0) usable for drafting.
    return max(float(reward), 0.0) + 0.1


class Tally:
    def __init__(self):
        self.tokens = self.steps = self.drafted = self.accepted = 0

    def step(self, draft, truth):
        acc = 0
        for a, b in zip(draft, truth):
            if a != b:
                break
            acc += 1
        adv = min(acc + 1, len(truth))
        self.steps += 1
        self.drafted += len(draft)
        self.accepted += min(acc, adv)
        self.tokens += adv
        return adv

    def result(self):
        return {
            "tokens_per_step": self.tokens / max(1, self.steps),
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
        }


def replay_ours(prompts, epochs, rewards, scopes, k):
    """Every group decodes in lockstep; each live request makes one verification step per round."""
    mask = scope_mask(scopes)
    idx = DraftIndex(DEPTH, 0, max(KS))
    tally = Tally()
    for pi, (prompt, group) in enumerate(zip(prompts, epochs[1])):
        if "history" in scopes:
            for r, w in zip(epochs[0][pi], rewards[0][pi]):
                idx.add_history(f"p{pi}", np.asarray(r, np.int64), history_weight(w))
        keys = [f"p{pi}s{j}" for j in range(len(group))]
        for key in keys:
            idx.start_request(key, np.asarray(prompt, np.int64), group=f"p{pi}", history=f"p{pi}")
        pos = [0] * len(group)
        live = [j for j in range(len(group)) if group[j]]
        while live:
            drafts = idx.batch_propose_lists([keys[j] for j in live], [k] * len(live), scopes=mask, min_prob=MIN_PROB)
            for j, d in zip(live, drafts):
                truth = group[j][pos[j]:]
                adv = tally.step(d[: len(truth) - 1] if len(truth) > 1 else [], truth)
                idx.append(keys[j], np.asarray(truth[:adv], np.int64))
                pos[j] += adv
            live = [j for j in live if pos[j] < len(group[j])]
        for key in keys:
            idx.finish(key)
    return tally.result()


def replay_arctic(cls, prompts, epochs, rewards, scopes, k):
    """arctic's cache: a local tree (prompt + own response) plus a global tree. One cache per
    prompt, so its global tree holds that group's responses (request+group) or, pre-loaded,
    last epoch's responses (request+history; plain counts, arctic has no rewards)."""
    tally = Tally()
    for pi, (prompt, group) in enumerate(zip(prompts, epochs[1])):
        use_global = "group" in scopes or "history" in scopes
        cache = cls(max_tree_depth=DEPTH, max_cached_requests=-1 if use_global else 0)
        if "history" in scopes:
            for j, r in enumerate(epochs[0][pi]):
                cache.start_request(f"h{j}", np.asarray(prompt, np.int32))
                cache.add_active_response(f"h{j}", np.asarray(r, np.int32))
                cache.stop_request(f"h{j}")
        keys = [f"s{j}" for j in range(len(group))]
        ctx = [list(prompt) for _ in group]
        for key in keys:
            cache.start_request(key, np.asarray(prompt, np.int32))
        pos = [0] * len(group)
        live = [j for j in range(len(group)) if group[j]]
        while live:
            for j in live:
                truth = group[j][pos[j]:]
                pat = np.asarray(ctx[j][-DEPTH:], np.int32)
                d = cache.speculate(keys[j], pat, max_spec_tokens=k, min_token_prob=MIN_PROB).token_ids
                adv = tally.step(list(d)[: len(truth) - 1] if len(truth) > 1 else [], truth)
                if "group" in scopes or "request" in scopes:
                    cache.add_active_response(keys[j], np.asarray(truth[:adv], np.int32))
                ctx[j].extend(truth[:adv])
                pos[j] += adv
            live = [j for j in live if pos[j] < len(group[j])]
        for key in keys:
            cache.stop_request(key)
    return tally.result()


def replay_ngram(prompts, epochs, k):
    ngram = make_ngram(k, 4096, 1)
    tally = Tally()
    row = np.zeros((1, 4096), np.int32)
    for prompt, group in zip(prompts, epochs[1]):
        for resp in group:
            ctx = list(prompt)
            pos = 0
            while pos < len(resp):
                row[0, : len(ctx)] = ctx
                d = ngram.propose(k, [[ctx[-1]]], np.array([len(ctx)], np.int32), row)[0]
                truth = resp[pos:]
                adv = tally.step(list(d)[: len(truth) - 1] if len(truth) > 1 else [], truth)
                ctx.extend(truth[:adv])
                pos += adv
    return tally.result()


def bench_accept(path, quick, arctic_cls):
    prompts, epochs, rewards = load_replay(path, quick)
    scopes = ["request", "group", "history", "request+group", "request+history", "request+group+history"]
    ks = (8,) if quick else KS
    out = {"ours": {}, "data": {"prompts": len(prompts), "samples": len(epochs[1][0]),
                                "tokens": sum(len(r) for g in epochs[1] for r in g)}}
    for s in scopes:
        out["ours"][s] = {str(k): replay_ours(prompts, epochs, rewards, s, k) for k in ks}
    if arctic_cls is not None:
        out["arctic"] = {s: {str(k): replay_arctic(arctic_cls, prompts, epochs, rewards, s, k) for k in ks}
                         for s in ("request", "request+group", "request+history")}
    try:
        out["ngram"] = {"request": {str(k): replay_ngram(prompts, epochs, k) for k in ks}}
    except Exception as exc:
        out["ngram"] = {"error": str(exc)}
    return out


def table(res):
    lines = ["cost (lower is better)", f"  {'':34}{'verl_ext':>10}{'arctic':>10}{'vllm ngram':>12}"]
    a, g = res.get("arctic", {}), res.get("ngram", {})

    def row(label, key, fmt="{:.2f}"):
        vals = [res.get(key), a.get(key), g.get(key) if isinstance(g, dict) else None]
        lines.append(f"  {label:34}" + "".join((fmt.format(v) if isinstance(v, (int, float)) else "-").rjust(w) for v, w in zip(vals, (10, 10, 12))))

    row("append us/token (bulk)", "append_us_per_token")
    row("append us/token (1-token calls)", "append_call_us_per_token")
    for b in (1, 64, 256):  # verl_ext's figure: the median of its rounds
        row(f"propose us/request, batch {b}", f"propose_us_per_request_b{b}")
        lo, hi = res[f"propose_us_per_request_b{b}_spread"]
        lines.append(f"  {'  min-max of ' + str(res['meta']['rounds']) + ' rounds':34}"
                     f"{f'{lo:.2f}-{hi:.2f}':>10}")
    row("bytes/token, GRPO-like groups", "bytes_per_token", "{:.0f}")
    row("bytes/token, random tokens", "bytes_per_token_random", "{:.0f}")
    acc = res["accept"]
    lines.append(f"acceptance on {acc['data']['prompts']} prompts x {acc['data']['samples']} samples "
                 f"({acc['data']['tokens']} tokens): tokens/step (acceptance rate)")
    ks = sorted({int(k) for s in acc["ours"].values() for k in s})
    lines.append(f"  {'scope':28}{'':10}" + "".join(f"{'k=' + str(k):>16}" for k in ks))
    for peer in ("ours", "arctic", "ngram"):
        for scope, by_k in (acc.get(peer) or {}).items():
            if not isinstance(by_k, dict):
                continue
            cells = "".join(f"{by_k[str(k)]['tokens_per_step']:>8.2f} ({by_k[str(k)]['acceptance_rate']:.2f})".rjust(16) for k in ks if str(k) in by_k)
            lines.append(f"  {scope:28}{ {'ours': 'verl_ext', 'arctic': 'arctic', 'ngram': 'vllm ngram'}[peer]:10}{cells}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, k=8 only (< 60 s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--data", default=str(REPO / "data" / "replay_smollm2_arith.json.gz"))
    p.add_argument("--no-arctic", action="store_true")
    p.add_argument("--rounds", type=int, default=5,
                   help="timed rounds of each batched proposal: the median is reported, with [min, max]")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    core = pin_one_core()
    t0 = time.perf_counter()
    arctic = None if args.no_arctic else load_arctic()
    log(f"arctic-inference: {'yes' if arctic else 'not available (bash scripts/build_arctic.sh)'}")
    res = bench_cost(args.quick, arctic, args.rounds)
    res["accept"] = bench_accept(args.data, args.quick, arctic)
    res["meta"] = {
        "date": dt.date.today().isoformat(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "quick": args.quick,
        "pinned_core": core,
        "rounds": args.rounds,
        "max_depth": DEPTH,
        "min_prob": MIN_PROB,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res) if args.json else table(res))


if __name__ == "__main__":
    main()
