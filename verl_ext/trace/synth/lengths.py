"""Response lengths of a synthetic workload. ``sample_lengths(cfg)``: exact lengths
``[epochs, prompts, samples]`` in ``[min_len, max_len]`` with mean ``mean_len``: a lognormal body
(prompt difficulty correlated across epochs by ``epoch_rho``), outliers, forced truncations; the
same seed gives the same lengths. ``length_stats(trace)``: the tail-shape metrics the defaults are
fitted to (``calibration.SEED_TARGETS``): Seer §6.2.2 (the last 10% of requests take up to 50% of
rollout time), RLHFSpec §3.1 (p95 ~3.6x the median), RhymeRL §6.1 / Table 2 (~16% of responses
move up a rank group) and §6.3 (2.2-5.5% outliers). The model: docs/SIMULATOR.md,
"Synthetic workloads"."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from verl_ext.trace.format import Trace
from verl_ext.trace.synth.config import SynthConfig


def sample_lengths(cfg: SynthConfig, rng: Optional[np.random.Generator] = None) -> tuple[np.ndarray, dict]:
    """Lengths ``[epochs, prompts, samples]`` (int64) and the solved model parameters."""
    rng = np.random.default_rng([cfg.seed, 1]) if rng is None else rng
    E, P, G = cfg.epochs, cfg.prompts, cfg.samples
    z = np.empty((E, P))
    z[0] = rng.standard_normal(P)
    rho = float(cfg.epoch_rho)
    for e in range(1, E):
        z[e] = rho * z[e - 1] + math.sqrt(max(0.0, 1 - rho * rho)) * rng.standard_normal(P)
    rel = cfg.group_sigma * z[:, :, None] + cfg.sample_sigma * rng.standard_normal((E, P, G))
    outlier = rng.random((E, P, G)) < cfg.outlier_frac
    u = rng.random((E, P, G))
    overlong = rng.random((E, P, G)) < cfg.overlong_frac
    lo, hi = float(cfg.min_len), float(cfg.max_len)
    log_hi = math.log(hi)

    def lengths(mu):
        logl = np.minimum(mu + rel, log_hi)
        logl = np.where(outlier, logl + u * (log_hi - logl), logl)
        out = np.rint(np.clip(np.exp(logl), lo, hi))
        out[overlong] = hi
        return out

    a, b = math.log(lo) - 10 * (1 + cfg.group_sigma + cfg.sample_sigma), log_hi + 10
    target = float(cfg.mean_len)
    for _ in range(100):
        mid = 0.5 * (a + b)
        if lengths(mid).mean() < target:
            a = mid
        else:
            b = mid
        if b - a < 1e-9:
            break
    mu = 0.5 * (a + b)
    L = lengths(mu).astype(np.int64)
    return L, {"mu": mu, "median_len": math.exp(mu), "outliers": int(outlier.sum()), "overlong": int(overlong.sum())}


def _groups(trace: Trace) -> dict[tuple[int, str], np.ndarray]:
    """(epoch, prompt_uid) -> row indices sorted by sample_index."""
    order = np.lexsort((trace.sample_index, trace.prompt_uid.astype(str), trace.epoch))
    out: dict[tuple[int, str], list[int]] = {}
    for i in order.tolist():
        out.setdefault((int(trace.epoch[i]), trace.prompt_uid[i]), []).append(i)
    return {k: np.asarray(v, np.int64) for k, v in out.items()}


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 2:
        return float("nan")
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(float)
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable").astype(float)
    # average ranks for ties
    def avg(x, r):
        _, inv, cnt = np.unique(x, return_inverse=True, return_counts=True)
        s = np.bincount(inv, weights=r)
        return (s / cnt)[inv]
    ra, rb = avg(a, ra), avg(b, rb)
    c = np.corrcoef(ra, rb)[0, 1]
    return float(c)


def length_stats(trace: Trace, *, worker_batch: int = 256) -> dict:
    """Tail-shape metrics of a trace's response lengths.

    ``p50/p90/p99/max_over_mean``, ``p95_over_p50``; ``frac_at_max`` (responses with
    ``finish_reason == "length"``); ``within_group_cv`` (mean over groups of sd/mean) and
    ``within_group_icc`` (share of log-length variance between groups); ``tail_share_last10``
    (Seer §6.2.2 proxy: all requests start together and finish at a time proportional to their
    length, so the last 10% run from p90 to max: (max - p90) / max, per epoch, averaged);
    ``slot_idle_frac`` (SpecActor §2.2 proxy: each worker decodes ``worker_batch`` responses
    to completion; idle = 1 - mean/max length per worker, averaged); ``spearman_group_median``
    (adjacent epochs, prompts' median lengths); ``rank_up_8`` / ``rank_up_16`` (RhymeRL §6.1 /
    Table 2: prompts ranked by previous-epoch median into N equal groups, this epoch's
    responses ranked into N equal groups; fraction of responses in a higher group than their
    prompt's predicted one).
    """
    L = trace.response_lengths().astype(np.float64)
    out: dict = {"responses": int(L.size), "tokens": int(L.sum()), "mean": float(L.mean()) if L.size else float("nan")}
    if not L.size:
        return out
    m = L.mean()
    for q in (50, 90, 99):
        out[f"p{q}_over_mean"] = float(np.percentile(L, q) / m)
    out["max_over_mean"] = float(L.max() / m)
    out["p95_over_p50"] = float(np.percentile(L, 95) / np.percentile(L, 50))
    out["frac_at_max"] = float(np.mean(trace.finish_reason == "length"))
    by = _groups(trace)
    cvs, gmeans, gsizes, logs = [], [], [], []
    for rows in by.values():
        x = L[rows]
        if x.size > 1:
            cvs.append(x.std() / x.mean())
        lx = np.log(np.maximum(x, 1))
        logs.append(lx)
        gmeans.append(lx.mean())
        gsizes.append(x.size)
    out["within_group_cv"] = float(np.mean(cvs)) if cvs else float("nan")
    allg = np.concatenate(logs)
    tot = allg.var()
    within = np.sum([((lx - lx.mean()) ** 2).sum() for lx in logs]) / allg.size
    out["within_group_icc"] = float(1 - within / tot) if tot > 0 else float("nan")
    tails, idles = [], []
    rng = np.random.default_rng(0)
    for e in trace.epochs():
        x = L[trace.epoch == e]
        tails.append((x.max() - np.percentile(x, 90)) / x.max())
        perm = x[rng.permutation(x.size)]
        nw = max(1, x.size // worker_batch)
        w = np.array_split(perm, nw)
        idles.append(np.mean([1 - c.mean() / c.max() for c in w]))
    out["tail_share_last10"] = float(np.mean(tails))
    out["slot_idle_frac"] = float(np.mean(idles))
    epochs = trace.epochs()
    sp, up8, up16 = [], [], []
    for e0, e1 in zip(epochs[:-1], epochs[1:]):
        uids = sorted({u for (e, u) in by if e == e0} & {u for (e, u) in by if e == e1})
        if len(uids) < 2:
            continue
        med0 = np.array([np.median(L[by[(e0, u)]]) for u in uids])
        med1 = np.array([np.median(L[by[(e1, u)]]) for u in uids])
        sp.append(_spearman(med0, med1))
        for ng, acc in ((8, up8), (16, up16)):
            pred = np.empty(len(uids), np.int64)
            pred[np.argsort(med0, kind="stable")] = np.arange(len(uids)) * ng // len(uids)
            rows = np.concatenate([by[(e1, u)] for u in uids])
            owner = np.concatenate([np.full(by[(e1, u)].size, i) for i, u in enumerate(uids)])
            real = np.empty(rows.size, np.int64)
            real[np.argsort(L[rows], kind="stable")] = np.arange(rows.size) * ng // rows.size
            acc.append(float(np.mean(real > pred[owner])))
    out["spearman_group_median"] = float(np.mean(sp)) if sp else float("nan")
    out["rank_up_8"] = float(np.mean(up8)) if up8 else float("nan")
    out["rank_up_16"] = float(np.mean(up16)) if up16 else float("nan")
    return out
