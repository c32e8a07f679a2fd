"""Rollout metrics shared by real and simulated A/B runs (``summary.json`` schema ``verl_ext.ab/1``).

Every field is derived from the pool's ``RequestRecord`` list, so a real engine and the
simulator produce comparable numbers by construction. Definitions (also in
docs/USAGE.md, "summary.json"):

* ``wall_s``: first dispatch to last completion;
* ``throughput_tok_s``: output tokens / ``wall_s``;
* ``tail_s``: ``wall_s`` minus the time at which 90% of requests had finished;
* ``latency_*``: per-request completion time minus the rollout's start (the first dispatch of
  any request): every request of a synchronous rollout is there from the start, so a strategy
  that holds requests in a buffer (``seer``, ``rhyme``) is charged for the wait, and arms compare;
* ``tokens_per_step``: output tokens / engine steps in which the request produced tokens, averaged
  over tokens (1.0 without speculation, higher with accepted drafts);
* ``mean_reward``: mean rule-based reward over all samples.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Optional, Sequence

import numpy as np

from verl_ext.pipe.pool import RequestRecord

SCHEMA = "verl_ext.ab/1"
REQUIRED_FIELDS = (
    "wall_s",
    "requests",
    "output_tokens",
    "throughput_tok_s",
    "tail_s",
    "latency_p50_s",
    "latency_p90_s",
    "latency_max_s",
    "tokens_per_step",
    "mean_reward",
)


def request_spans(records: Iterable[RequestRecord]) -> dict[str, tuple[float, float, int, Optional[int]]]:
    """Per request id: (first submit, last finish, output tokens, steps), merging chunks."""
    spans: dict[str, list] = {}
    for r in records:
        s = spans.get(r.request_id)
        if s is None:
            spans[r.request_id] = [r.submit_s, r.finish_s, r.output_tokens, r.num_steps]
            continue
        s[0] = min(s[0], r.submit_s)
        s[1] = max(s[1], r.finish_s)
        s[2] += r.output_tokens
        s[3] = None if s[3] is None or r.num_steps is None else s[3] + r.num_steps
    return {k: tuple(v) for k, v in spans.items()}


def rollout_metrics(records: Sequence[RequestRecord], rewards: Sequence[float],
                    delivered_tokens: Optional[int] = None) -> dict:
    """``output_tokens`` and ``throughput_tok_s`` count ``delivered_tokens`` (the tokens of the
    responses the strategy returned) when given, else the records' tokens. They differ where
    engine work is thrown away: a Best-of-N copy that loses is aborted after generating tokens
    (``specactor``), and those count in the records. ``tokens_per_step`` and ``per_instance``
    stay the engines' (every recorded token and step)."""
    spans = request_spans(records)
    if not spans:
        raise ValueError("no requests were recorded")
    start = min(s[0] for s in spans.values())
    finishes = np.sort(np.array([s[1] for s in spans.values()]) - start)
    latencies = finishes  # completion times since the rollout's start
    engine_tokens = sum(s[2] for s in spans.values())
    tokens = engine_tokens if delivered_tokens is None else delivered_tokens
    steps = [s[3] for s in spans.values()]
    wall = float(finishes[-1])
    k90 = max(0, math.ceil(0.9 * len(finishes)) - 1)
    per_instance: dict[str, dict] = defaultdict(lambda: {"requests": 0, "output_tokens": 0})
    for r in records:
        per_instance[r.instance]["requests"] += 1
        per_instance[r.instance]["output_tokens"] += r.output_tokens
    for stats in per_instance.values():
        stats["throughput_tok_s"] = stats["output_tokens"] / wall if wall > 0 else 0.0
    return {
        "wall_s": wall,
        "requests": len(spans),
        "output_tokens": int(tokens),
        "throughput_tok_s": tokens / wall if wall > 0 else 0.0,
        "tail_s": wall - float(finishes[k90]),
        "latency_p50_s": float(np.percentile(latencies, 50)),
        "latency_p90_s": float(np.percentile(latencies, 90)),
        "latency_max_s": float(latencies.max()),
        "tokens_per_step": (engine_tokens / sum(steps)) if steps and None not in steps and sum(steps) > 0 else None,
        "mean_reward": float(np.mean(rewards)) if len(rewards) else None,
        "per_instance": dict(sorted(per_instance.items())),
    }
