"""Lightweight sample reallocation: RLHFSpec section 6.1.

An instance's throughput rises with its sample count and then flattens (Figure 9): past the
turning point (the *threshold*) one more sample adds almost nothing, below it one more sample
adds almost a whole sample's worth. So samples move from instances above the threshold
(s-instances) to instances below it (d-instances), maximising what the d-instances gain
(Equation 6) subject to: an s-instance keeps at least ``threshold`` samples, a d-instance ends
with at most ``threshold``, and each instance takes part in at most one migration per decision.

* ``turning_point``: the threshold from the profiled cost model (the profiler's offline data),
  evaluated with the per-sample workload the instances measure now (tokens emitted and draft
  tokens verified per sample and step, context per sample): the threshold is updated online.
* ``plan_reallocation``: the paper's greedy. Instances sorted by sample count; the fullest
  s-instance pairs with the emptiest d-instance (the largest difference first), then the next
  two, until either side runs out; each pair moves ``min(s_cur - threshold, threshold - d_cur)``.
* ``pick_samples``: which samples move: shorter sequences first (less KV to move or re-prefill)
  and lower average acceptance (less throughput lost while the sample is in transit), ranked by
  ``sequence length x (1 + accepted tokens per step)``.

How a sample moves (abort, resume from its generated tokens) is the strategy's job
(``verl_ext.pipe.rlhfspec.strategy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

#: the turning point: the first sample count whose marginal throughput falls below this fraction
#: of the first sample's
TURN = 0.5


@dataclass(frozen=True)
class Move:
    source: str
    dest: str
    samples: int


def plan_reallocation(counts: Mapping[str, int], threshold: int) -> list[Move]:
    """The greedy of section 6.1 over ``counts`` (samples per instance)."""
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    order = sorted(counts, key=lambda name: (counts[name], name))
    dests = [n for n in order if counts[n] < threshold]  # emptiest first
    sources = [n for n in reversed(order) if counts[n] > threshold]  # fullest first
    moves = []
    for src, dst in zip(sources, dests):
        n = min(counts[src] - threshold, threshold - counts[dst])
        if n > 0:
            moves.append(Move(src, dst, n))
    return moves


def turning_point(cost, tokens_per_step: float = 1.0, drafts_per_step: float = 0.0, context: float = 1024.0,
                  turn: float = TURN, max_samples: Optional[int] = None) -> int:
    """The sample count past which an instance of ``cost`` gains less than ``turn`` x the first
    sample's throughput from one more sample, when each sample emits ``tokens_per_step`` tokens
    and verifies ``drafts_per_step`` draft tokens per step at ``context`` KV tokens:
    throughput(S) = S x tokens_per_step / step_time(S, S x context, 0, S x drafts_per_step)."""
    if not 0.0 < turn < 1.0:
        raise ValueError(f"turn must be in (0, 1), got {turn}")
    top = int(max_samples or cost.max_num_seqs)
    s = np.arange(0, top + 1, dtype=np.float64)
    t = np.asarray(cost.step_time(np.maximum(s, 1), np.maximum(s, 1) * context, 0, s * drafts_per_step))
    thr = s * tokens_per_step / t
    gain = np.diff(thr)  # gain[i] = thr(i + 1) - thr(i)
    low = np.flatnonzero(gain[1:] < turn * gain[0])  # first S whose next sample gains too little
    return int(low[0] + 1) if low.size else top


def pick_samples(candidates: Sequence[tuple], n: int) -> list:
    """The ``n`` candidates ``(key, sequence length, accepted tokens per step)`` cheapest to
    move; returns their keys."""
    ranked = sorted(candidates, key=lambda c: (c[1] * (1.0 + max(0.0, c[2])), c[1], str(c[0])))
    return [c[0] for c in ranked[: max(0, n)]]
