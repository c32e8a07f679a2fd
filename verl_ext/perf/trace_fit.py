"""The trace fit: a ``CostModel`` from a real rollout's engine steps (``verl-ext fit trace``).

:func:`verl_ext.measure.trace.trace_windows` reads each instance's engine steps back from a
recorded trace's per-token arrival times and groups decode steps into windows; drafting traces
also carry each step's drafts, recomputed by replaying the request-scope drafter. The linear
model (``weight_s`` = 0: the compute-bound CPU form) is fitted to them by relative-error
NNLS. Validate on rollouts that were not fitted (``scripts/bench_sim.py validate``).
"""

from __future__ import annotations

import numpy as np

from verl_ext.perf.cost import CostModel
from verl_ext.perf.lstsq import relative_nnls

#: arrival-time gap that separates two engine steps (steps take tens of ms on CPU)
STEP_GAP_S = 0.012
WINDOW_STEPS = 6


def fit_windows(w: list[dict], base: CostModel) -> tuple[CostModel, dict]:
    """Fit overhead, token, KV, prefill and draft costs to ``trace_windows``' windows (recorded in
    the fitted JSON, so a shipped profile can be checked against them); the other fields
    (capacity, limits) come from ``base``."""
    import dataclasses

    if len(w) < 5:
        raise ValueError(f"need at least 5 measured windows, got {len(w)}")
    S, B, KV, P, D, y = (np.array([x[k] for x in w], dtype=np.float64) for k in
                         ("steps", "batch", "kv_tokens", "prefill_tokens", "draft_tokens", "time_s"))
    cols = [S, B + P + D, KV, P, D]
    x = relative_nnls(cols, y)
    overhead, token, kv, prefill, draft = (float(v) for v in x)
    pred = np.stack(cols, axis=1) @ x
    rel = (pred - y) / y
    fitted = dataclasses.replace(base, overhead_s=overhead, weight_s=0.0, token_s=token, kv_token_s=kv,
                                 prefill_token_s=prefill, draft_token_s=draft)
    report = {"windows": len(w), "draft_windows": int((D > 0).sum()), "mean_abs_rel_err": float(np.abs(rel).mean()),
              "max_abs_rel_err": float(np.abs(rel).max()), "total_time_error": float(pred.sum() / y.sum() - 1)}
    return fitted, report
