"""SpecActor's performance model and plans (section 4.1): token generation speed (TGS)
of coupled and decoupled speculation, the decoupled execution plan (Algorithm 1) and the
request-level reconfiguration (Algorithm 2).

Times are affine in the batch size ``b`` (fitted offline, like the paper):

* draft: ``D(b) = b * D' + alpha`` for one draft token of every request in the batch;
* verify: ``V_w(b) = b * V'_w + beta_w`` for verifying ``w`` draft tokens of every request.

Decoupled execution pipelines drafting (on ``g_d`` drafter GPUs) and verification (on the
verifier's ``g_v`` GPUs) with a window of ``w`` tokens: a round takes ``IL = max(w D(b), V_w(b))``
and yields ``tau_w = sum_{a<w} p^a (1-p) (a+1)/2 + w p^w`` tokens per request: a rejection at
position ``a`` keeps ``a + 1`` tokens but wastes the next window (drafted ahead from the rejected
prefix: at most ``2w - 1`` wasted tokens), hence the ``/2``. Coupled execution (classic
speculative decoding: draft ``w``, then verify) takes ``w D(b) + V_w(b)`` per step and yields
``(1 - p^{w+1}) / (1 - p)`` tokens (the accepted prefix plus the verifier's own token). Plain
decoding takes ``V_0(b)`` per token. ``p`` is the per-token acceptance probability.

``SpecTimes.affine`` takes the paper's fitted affine forms; ``SpecTimes.from_cost`` evaluates the
profiled ``CostModel`` directly (its roofline is piecewise, which an affine fit over the whole
batch range misstates at small batches). The formulas above are the paper's either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

#: the longest window any plan considers (vLLM's rejection sampler allows 128)
MAX_WINDOW = 32
COUPLED = "coupled"
DECOUPLED = "decoupled"


@dataclass(frozen=True)
class AffineTime:
    """``t(b) = slope * b + intercept`` seconds."""

    slope: float
    intercept: float

    def __call__(self, b):
        return self.slope * b + self.intercept

    @classmethod
    def fit(cls, fn: Callable[[int], float], batches: Sequence[int]) -> "AffineTime":
        """Least-squares affine fit of ``fn`` over ``batches`` (non-negative coefficients)."""
        b = np.asarray(batches, dtype=np.float64)
        y = np.array([float(fn(int(x))) for x in batches])
        if len(b) == 1:
            return cls(0.0, float(y[0]))
        slope, intercept = np.polyfit(b, y, 1)
        if intercept < 0:  # keep the form physical: through the origin
            slope, intercept = float((b @ y) / (b @ b)), 0.0
        if slope < 0:
            slope, intercept = 0.0, float(y.mean())
        return cls(float(slope), float(intercept))


def tau_decoupled(p: float, w: int) -> float:
    """Expected tokens per round of a decoupled window ``w`` (the paper's ``tau_w``)."""
    if w <= 0:
        return 1.0
    a = np.arange(w)
    return float(np.sum(p ** a * (1.0 - p) * (a + 1) / 2.0) + w * p ** w)


def tau_coupled(p: float, w: int) -> float:
    """Expected tokens per coupled step with ``w`` draft tokens: accepted prefix + 1."""
    if w <= 0:
        return 1.0
    if p >= 1.0:
        return float(w + 1)
    return float((1.0 - p ** (w + 1)) / (1.0 - p))


class SpecTimes:
    """The draft and verify times of one drafting method against one verifier configuration.

    ``draft(b)``: ``D(b)``, one draft token for ``b`` requests on one drafter GPU (a model-free
    drafter runs on the CPU: ``drafter_gpus == 0``); ``verify(b, w)``: ``V_w(b)``, one verifier
    step of ``b`` requests with ``w`` draft tokens each (``w = 0``: plain decoding).
    ``verify_gpus``: ``g_v``. Build with ``affine`` (the paper's fitted form) or ``from_cost``
    (the profiled ``CostModel`` itself: its roofline is not affine across the batch range, and an
    affine fit over ``1..256`` misstates small batches by several times)."""

    def __init__(self, draft: Callable[[float], float], verify: Callable[[float, int], float],
                 verify_gpus: int = 1, drafter_gpus: int = 1):
        self.draft = draft
        self.verify = verify
        self.verify_gpus = int(verify_gpus)
        self.drafter_gpus = int(drafter_gpus)

    @classmethod
    def affine(cls, draft: AffineTime, verify_slope: Sequence[float], verify_intercept: Sequence[float],
               verify_gpus: int = 1, drafter_gpus: int = 1) -> "SpecTimes":
        """``D(b) = b D' + alpha``; ``V_w(b) = b V'_w + beta_w`` (``verify_*[w]``, the last entry
        for longer windows)."""
        vs, vi = tuple(map(float, verify_slope)), tuple(map(float, verify_intercept))
        if len(vs) != len(vi) or not vs:
            raise ValueError("verify_slope and verify_intercept need one entry per window, from w = 0")

        def verify(b, w):
            w = min(max(int(w), 0), len(vs) - 1)
            return vs[w] * b + vi[w]

        return cls(draft, verify, verify_gpus, drafter_gpus)

    @classmethod
    def from_cost(cls, verifier, drafter=None, *, context: float = 1024.0, verify_gpus: int = 1,
                  cpu_draft_s: Optional[AffineTime] = None) -> "SpecTimes":
        """From cost models: ``verifier`` (``CostModel`` of the trained model's instance; its step
        with ``w`` draft tokens per request is ``V_w``) and ``drafter`` (``CostModel`` of a draft
        model on one GPU; its decode step is ``D``), or ``cpu_draft_s`` for a model-free drafter
        (per batch, on the CPU). ``context``: tokens per request the steps attend to."""

        def verify(b, w):
            return float(verifier.step_time(b, b * context, 0, b * max(int(w), 0)))

        if drafter is not None:
            return cls(lambda b: float(drafter.step_time(b, b * context)), verify, verify_gpus, 1)
        d = cpu_draft_s if cpu_draft_s is not None else AffineTime(0.0, 0.0)
        return cls(lambda b: float(d(b)), verify, verify_gpus, 0)

    def draft_time(self, b: float, g_d: int = 1) -> float:
        """One draft token for ``b`` requests on ``g_d`` drafter GPUs (data parallel)."""
        if self.drafter_gpus == 0 or g_d <= 1:
            return float(self.draft(b))
        return float(self.draft(math.ceil(b / g_d)))

    def tgs_decoupled(self, p: float, w: int, b: float, g_d: int = 1) -> float:
        il = max(w * self.draft_time(b, g_d), float(self.verify(b, w)))
        return tau_decoupled(p, w) / il

    def tgs_coupled(self, p: float, w: int, b: float) -> float:
        if w <= 0:
            return self.tgs_plain(b)
        return tau_coupled(p, w) / (w * self.draft_time(b) + float(self.verify(b, w)))

    def tgs_plain(self, b: float) -> float:
        return 1.0 / float(self.verify(b, 0))

    def best_window(self, p: float, b: float, mode: str = COUPLED, g_d: int = 1, w_max: int = MAX_WINDOW) -> tuple[int, float]:
        """``argmax_w TGS`` over ``1..w_max`` (ties: the smaller window)."""
        fn = (lambda w: self.tgs_coupled(p, w, b)) if mode == COUPLED else (lambda w: self.tgs_decoupled(p, w, b, g_d))
        best = (1, fn(1))
        for w in range(2, max(1, w_max) + 1):
            t = fn(w)
            if t > best[1]:
                best = (w, t)
        return best


# -- Algorithm 1: the decoupled execution plan -------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """``g_d`` drafter GPUs and ``g_v`` verifier GPUs per unit, window ``w``; ``tgs`` tokens/s per
    request at the unit's batch ``batch``; ``speedup`` over plain decoding on all GPUs."""

    g_d: int
    g_v: int
    w: int
    batch: int
    tgs: float
    speedup: float


def window_limit(times: SpecTimes, g_d: int, b: float, cap: int = MAX_WINDOW) -> int:
    """Algorithm 1 line 5: the window at which drafting ``w`` tokens takes as long as verifying
    them, ``ceil(V_1(b) / D(b))`` (the paper's ``max(ceil(V'/D'), ceil(beta/alpha))`` for affine
    times): beyond it a round is draft-bound and ``tau_w / (w D)`` only falls. At most ``cap``."""
    d = times.draft_time(b, g_d)
    if d <= 0:
        return cap
    return max(1, min(cap, math.ceil(float(times.verify(b, 1)) / d)))


def plan_decoupled(configs: Sequence[SpecTimes], batch: int, gpus: int, p: float, cap: int = MAX_WINDOW) -> Plan:
    """Algorithm 1: over verifier configurations (``configs``: one ``SpecTimes`` per ``g_v``),
    drafter GPUs ``g_d`` in ``1..g_v`` (0 for a CPU drafter) and windows up to the line-5 limit, the
    plan with the highest TGS for a global batch ``batch`` on ``gpus`` GPUs."""
    if batch <= 0 or gpus <= 0:
        raise ValueError(f"plan_decoupled needs a positive batch and GPU count, got {batch}, {gpus}")
    best: Optional[Plan] = None
    base = None
    for t in configs:
        g_v = t.verify_gpus
        plain_b = math.ceil(g_v * batch / gpus)
        base_t = t.tgs_plain(plain_b)
        base = base_t if base is None else max(base, base_t)
        for g_d in (range(1, g_v + 1) if t.drafter_gpus else (0,)):
            if g_d + g_v > gpus:
                break
            b = math.ceil((g_d + g_v) * batch / gpus)
            for w in range(1, window_limit(t, g_d, b, cap) + 1):
                cur = t.tgs_decoupled(p, w, b, g_d)
                if best is None or cur > best.tgs:
                    best = Plan(g_d, g_v, w, b, cur, 0.0)
    if best is None:
        raise ValueError(f"no plan fits {gpus} GPUs")
    return Plan(best.g_d, best.g_v, best.w, best.batch, best.tgs, best.tgs / base)


# -- Algorithm 2: request-level reconfiguration ------------------------------------------------------


@dataclass(frozen=True)
class RequestPlan:
    w: int
    mode: str  # COUPLED | DECOUPLED
    tgs: float


def reconfigure(times: SpecTimes, plan: Plan, rates: dict, cap: int = MAX_WINDOW) -> dict:
    """Algorithm 2: for each request whose acceptance rate (``rates``: request -> p) is below the
    average, the better of its best coupled and best decoupled window at ``b = 1``."""
    if not rates:
        return {}
    mean = float(np.mean(list(rates.values())))
    out = {}
    for rid, p in rates.items():
        if p >= mean:
            continue
        w_c, t_c = times.best_window(p, 1, COUPLED, w_max=cap)
        w_d, t_d = times.best_window(p, 1, DECOUPLED, g_d=max(plan.g_d, 1), w_max=cap)
        out[rid] = RequestPlan(w_d, DECOUPLED, t_d) if t_d > t_c else RequestPlan(w_c, COUPLED, t_c)
    return out
