"""Adaptive draft length: Seer's adaptive speculation range (section 4.4).

Seer pre-computes, per model, thresholds for "a single request" and "the whole batch", and each
instance derives the maximum draft length from its current concurrency: few drafts while the
batch is large (a step is already compute-bound, and verifying drafts costs as much as decoding),
long drafts in the tail, when the batch is small (a step is memory-bound and extra tokens are
almost free). Grouped drafting pays off most for requests whose siblings have finished: the
group's suffix tree then holds complete responses to match against (Seer, Table 2).

Here the thresholds are ``k`` (most drafts for one request in a step) and ``knee_tokens``: the
tokens one step can process before it turns compute-bound, ``(overhead_s + weight_s) /
(token_s + draft_token_s)`` of the instance's cost model (``CostModel.draft_thresholds``; the
profiler measures it, it is not a guess). A step of ``B`` requests spends at most ``knee_tokens
- B`` draft tokens in total, shared out in proportion to ``1 + sibling_boost * f`` where ``f`` is
the fraction of the request's group that has finished.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def draft_caps(
    k: int,
    batch_size: int,
    knee_tokens: int,
    finished_frac: Optional[np.ndarray] = None,
    sibling_boost: float = 1.0,
) -> np.ndarray:
    """Most draft tokens for each of ``batch_size`` requests in one step (int64 array).

    ``knee_tokens <= 0`` means no batch threshold: every request may draft ``k``. Otherwise the
    step's budget ``max(0, knee_tokens - batch_size)`` is split in proportion to the weights
    ``1 + sibling_boost * finished_frac`` (largest remainders first), each capped at ``k``.
    """
    b = int(batch_size)
    if b <= 0:
        return np.zeros(0, dtype=np.int64)
    if knee_tokens <= 0:
        return np.full(b, int(k), dtype=np.int64)
    budget = max(0, int(knee_tokens) - b)
    if budget == 0:
        return np.zeros(b, dtype=np.int64)
    if finished_frac is None:
        w = np.ones(b)
    else:
        f = np.clip(np.nan_to_num(np.asarray(finished_frac, dtype=np.float64), nan=0.0), 0.0, 1.0)
        if f.shape != (b,):
            raise ValueError(f"finished_frac has shape {f.shape}, expected ({b},)")
        w = 1.0 + max(0.0, float(sibling_boost)) * f
    share = budget * w / w.sum()
    caps = np.floor(share).astype(np.int64)
    rest = budget - int(caps.sum())
    if rest > 0:  # largest remainders first, then larger weights, then batch order
        order = np.lexsort((np.arange(b), -w, -(share - caps)))
        caps[order[:rest]] += 1
    return np.minimum(caps, int(k))
