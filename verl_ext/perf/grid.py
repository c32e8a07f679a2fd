"""The grid fit: a ``CostModel`` from windows measured on real engines (``verl-ext fit grid``).

A window is ``steps`` consecutive engine steps of one instance (``ProfileSample``). Only decode
and prefill windows are fitted; drafting (``spec``) windows and their greedy references (``ref``)
check the assumption that a draft token costs like a batched token. The fit minimises the
squared relative error of every window's time (:func:`verl_ext.perf.lstsq.relative_nnls`), with
one nuisance coefficient for the request round trip of prefill windows, and finds
``max(weight_s, token_s * T)`` by searching ``weight_s`` over a grid that includes 0 and, for
each value, every split of the windows into weight-bound and compute-bound ones. The
measurement itself is :mod:`verl_ext.measure.grid`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from verl_ext.perf.cost import CostModel
from verl_ext.perf.lstsq import relative_nnls

# -- samples --------------------------------------------------------------------------------------


@dataclass
class ProfileSample:
    """One measured window of ``steps`` consecutive engine steps on one instance.

    The token counts are sums over the window's steps, in the conventions of
    ``CostModel.step_time`` (``batch``: requests per step; ``kv_tokens``: KV tokens the step's
    requests hold; ``prefill_tokens``; ``draft_tokens``)."""

    kind: str  # fitted: "decode" | "prefill"; checks only: "spec" (drafting engine) | "ref" (its greedy reference)
    steps: float
    time_s: float
    batch: float
    kv_tokens: float
    prefill_tokens: float = 0.0
    draft_tokens: float = 0.0
    latency_windows: int = 0  # 1 when the window starts at submission (includes the request round trip)
    instance: str = ""
    requests: int = 0  # B
    prompt_tokens: int = 0  # P
    max_tokens: int = 0  # M

    @property
    def tokens(self) -> float:
        return self.batch + self.draft_tokens + self.prefill_tokens

    @classmethod
    def from_dict(cls, d: dict) -> "ProfileSample":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


def _as_samples(samples) -> list[ProfileSample]:
    out = []
    for s in samples:
        out.append(s if isinstance(s, ProfileSample) else ProfileSample.from_dict(s))
    if not out:
        raise ValueError("no samples to fit")
    for s in out:
        if not (s.steps > 0 and s.time_s > 0):
            raise ValueError(f"sample with non-positive steps or time: {s}")
    return out


# -- fitting --------------------------------------------------------------------------------------


#: window kinds that are fitted; the others only check the fit
FIT_KINDS = ("decode", "prefill")
# coefficient order of the linear part
_COEFS = ("overhead_s", "token_s", "kv_token_s", "prefill_token_s", "request_latency_s")


def _columns(s: Sequence[ProfileSample]):
    S = np.array([x.steps for x in s], dtype=np.float64)
    T = np.array([x.tokens for x in s], dtype=np.float64)
    KV = np.array([x.kv_tokens for x in s], dtype=np.float64)
    PF = np.array([x.prefill_tokens for x in s], dtype=np.float64)
    L = np.array([x.latency_windows for x in s], dtype=np.float64)
    y = np.array([x.time_s for x in s], dtype=np.float64)
    return S, T, KV, PF, L, y


def _predict(params: dict, S, T, KV, PF, L) -> np.ndarray:
    """Total time of windows under the model (within a window, all steps are taken to lie on the
    same side of the weight/compute knee: max(S * weight_s, token_s * T))."""
    return (
        S * params["overhead_s"]
        + np.maximum(S * params["weight_s"], params["token_s"] * T)
        + params["kv_token_s"] * KV
        + params["prefill_token_s"] * PF
        + params["request_latency_s"] * L
    )


def _solve(S, T, KV, PF, L, y, weight_s: float, bound: np.ndarray):
    """Relative-error NNLS with the windows in ``bound`` pinned to the weight floor."""
    Tc = np.where(bound, 0.0, T)
    x = relative_nnls([S, Tc, KV, PF, L], y, target=y - np.where(bound, S * weight_s, 0.0))
    return dict(zip(_COEFS, x.tolist()), weight_s=float(weight_s))


def _sse(params, cols, y) -> float:
    r = (_predict(params, *cols) - y) / y
    return float(r @ r)


def fit_cost_model(samples, base: CostModel, weight_grid: Optional[Sequence[float]] = None) -> tuple[CostModel, dict]:
    """Fit ``overhead_s, weight_s, token_s, kv_token_s, prefill_token_s`` to measured windows.

    ``samples``: ``ProfileSample``s (or their dicts). Only ``"decode"``/``"prefill"`` windows are
    fitted; ``"spec"`` and ``"ref"`` windows check the draft-token assumption
    (``report["spec_check"]``, their errors in ``report["check_rel_err"]``). ``base`` supplies every
    other field (name, capacity, limits, provenance). Returns the fitted model and a report:
    ``r2`` (per-step mean times), per-sample ``rel_err``, ``mean_abs_rel_err``,
    ``max_abs_rel_err``, ``request_latency_s`` and the search details."""
    all_samples = _as_samples(samples)
    fit_s = [s for s in all_samples if s.kind in FIT_KINDS]
    check_s = [s for s in all_samples if s.kind not in FIT_KINDS]
    if len(fit_s) < 3:
        raise ValueError(f"need at least 3 decode or prefill windows to fit, got {len(fit_s)}")
    cols = _columns(fit_s)
    S, T, KV, PF, L, y = cols
    cols = cols[:5]
    per_step = y / S
    tbar = T / S
    order = np.argsort(tbar, kind="stable")

    def best_for(w: float):
        if w <= 0:
            p = _solve(S, T, KV, PF, L, y, 0.0, np.zeros(len(y), dtype=bool))
            return _sse(p, cols, y), p
        best = None
        bound = np.zeros(len(y), dtype=bool)
        for k in range(len(y) + 1):  # the k windows with the fewest tokens per step are weight-bound
            if k:
                bound[order[k - 1]] = True
                if k < len(y) and tbar[order[k]] == tbar[order[k - 1]]:
                    continue  # equal tokens per step must fall on the same side
            p = _solve(S, T, KV, PF, L, y, w, bound)
            e = _sse(p, cols, y)
            if best is None or e < best[0]:
                best = (e, p)
        return best

    if weight_grid is None:
        hi = float(np.max(per_step))
        lo = max(float(np.min(per_step)) * 1e-3, 1e-9)
        weight_grid = [0.0] + list(np.geomspace(lo, hi, 48))
    results = [(w, *best_for(float(w))) for w in weight_grid]
    w0, e0, p0 = min(results, key=lambda r: r[1])
    # refine around the best grid point
    grid = sorted(float(w) for w in weight_grid)
    i = grid.index(float(w0))
    if w0 > 0:
        lo_w = grid[i - 1] if i > 0 else w0 / 2
        hi_w = grid[i + 1] if i + 1 < len(grid) else w0 * 2
        for w in np.linspace(max(lo_w, 0.0), hi_w, 25):
            if w > 0:
                e, p = best_for(float(w))
                if e < e0:
                    w0, e0, p0 = float(w), e, p
    params = p0
    pred = _predict(params, *cols)
    rel = (pred - y) / y
    ps_pred = pred / S
    ss_res = float(np.sum((ps_pred - per_step) ** 2))
    ss_tot = float(np.sum((per_step - per_step.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    fitted = replace(
        base,
        overhead_s=float(params["overhead_s"]),
        weight_s=float(params["weight_s"]),
        token_s=float(params["token_s"]),
        kv_token_s=float(params["kv_token_s"]),
        prefill_token_s=float(params["prefill_token_s"]),
    )
    report = {
        "n_samples": len(fit_s),
        "r2": r2,
        "mean_abs_rel_err": float(np.mean(np.abs(rel))),
        "max_abs_rel_err": float(np.max(np.abs(rel))),
        "rel_err": [float(r) for r in rel],
        "request_latency_s": float(params["request_latency_s"]),
        "weight_grid_points": len(weight_grid),
        "objective": "sum of squared relative errors of window times",
    }
    by_kind = {}
    for kind in sorted({s.kind for s in fit_s}):
        m = np.array([s.kind == kind for s in fit_s])
        by_kind[kind] = {"n": int(m.sum()), "mean_abs_rel_err": float(np.mean(np.abs(rel[m]))),
                         "max_abs_rel_err": float(np.max(np.abs(rel[m])))}
    report["by_kind"] = by_kind
    if check_s:
        c_cols = _columns(check_s)
        report["check_rel_err"] = [float(r) for r in (_predict(params, *c_cols[:5]) - c_cols[5]) / c_cols[5]]
        if any(s.kind == "spec" for s in check_s):
            report["spec_check"] = _spec_check([s for s in check_s if s.kind == "spec"],
                                               [s for s in check_s if s.kind == "ref"], params)
    return fitted, report


def _spec_check(spec_s: Sequence[ProfileSample], ref_s: Sequence[ProfileSample], params: dict) -> dict:
    """How drafting windows compare with the model (a draft token costs ``token_s``) and with
    their greedy reference windows (same batch, prompts and lengths on an engine without the
    drafter): ``extra ms per step = a + c * token_s * drafts per step`` by least squares, so
    ``c`` is the measured cost of a draft token in units of ``token_s`` and ``a`` what the
    drafting engine adds to every step whether or not it drafts."""
    S, T, KV, PF, L, y = _columns(spec_s)
    pred = _predict(params, S, T, KV, PF, L)
    rel = (pred - y) / y
    D = np.array([s.draft_tokens for s in spec_s], dtype=np.float64)
    out = {
        "n": len(spec_s),
        "rel_err": [float(r) for r in rel],
        "mean_abs_rel_err": float(np.mean(np.abs(rel))),
        "max_abs_rel_err": float(np.max(np.abs(rel))),
        "draft_tokens_per_step": float(D.sum() / S.sum()),
        "draft_cost_in_token_s": None,
        "drafting_step_overhead_s": None,
        "pairs": [],
    }
    refs = {(r.instance, r.requests, r.prompt_tokens, r.max_tokens): r for r in ref_s}
    xs, ys = [], []
    for sp in spec_s:
        ref = refs.get((sp.instance, sp.requests, sp.prompt_tokens, sp.max_tokens))
        if ref is None or ref.steps <= 0:
            continue
        d = sp.draft_tokens / sp.steps
        extra = sp.time_s / sp.steps - ref.time_s / ref.steps
        xs.append(d * params["token_s"])
        ys.append(extra)
        out["pairs"].append({"instance": sp.instance, "requests": sp.requests, "drafts_per_step": d,
                             "spec_step_s": sp.time_s / sp.steps, "ref_step_s": ref.time_s / ref.steps})
    if len(xs) >= 2 and np.ptp(xs) > 0:
        A = np.stack([np.ones(len(xs)), np.array(xs)], axis=1)
        a, c = np.linalg.lstsq(A, np.array(ys), rcond=None)[0]
        out["drafting_step_overhead_s"] = float(a)
        out["draft_cost_in_token_s"] = float(c)
    return out
