"""HistoPipe's decisions (RhymeRL section 6), as plain functions over lengths and times.

* **Ranking (section 6.2).** Prompts are ranked by their historical response length (the median
  of the prompt's group in its last rollout) and split into ``N`` ranking groups of equal size
  (``rank_groups``; prompts of equal length, e.g. cut off at the same budget, are split by key,
  not all put in one group). A prompt that comes after the split joins the group its length
  falls in (``rank_boundaries`` / ``ranking_group``).
  ``rank_correlation`` measures whether those ranks predict anything (Spearman).
* **Alternation (section 6.2).** On odd steps ranking groups go to workers ``0..N-1`` in ascending
  order of length, on even steps in descending order (``worker_order``).
* **Migration thresholds (section 6.3).** A rollout migrates when it is among the last ``alpha``
  (10%) of its ranking group's rollouts still running *and* has generated more than ``beta`` x
  the longest historical response in its ranking group; ``beta`` is the 75th percentile of last
  epoch's growth rates, at least 1.1 (``migration_beta``, ``should_migrate``).
* **Two-tier scheduling (section 6.4, Figure 12).** Workers are allocated to ranking groups so that
  their completion times are linear, ``t0 + i * d``: a binary search for the smallest gradient
  ``d`` whose allocation fits in the available workers (``plan_allocation``), with ``t0`` at
  least the last training time. ``group_time`` is ``tau(l, dp)`` from the profiled cost model.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Mapping, Optional, Sequence

#: RhymeRL section 6.3 defaults
MIGRATE_ALPHA = 0.10
MIN_BETA = 1.1


def rank_groups(lengths: Mapping[str, float], n: int) -> dict[str, int]:
    """Each prompt's ranking group (0 = shortest): ``lengths`` (prompt -> historical length)
    sorted by length, ties by prompt, and cut into ``n`` groups whose sizes differ by at most one."""
    if n < 1:
        raise ValueError(f"need >= 1 ranking groups, got {n}")
    order = sorted(lengths, key=lambda u: (float(lengths[u]), u))
    return {u: i * n // len(order) for i, u in enumerate(order)}


def rank_boundaries(lengths: Sequence[float], n: int) -> list[float]:
    """The ``n - 1`` length boundaries that split ``lengths`` (historical lengths of the known
    prompts) into ``n`` equal ranking groups, ascending."""
    if n < 1:
        raise ValueError(f"need >= 1 ranking groups, got {n}")
    xs = sorted(float(x) for x in lengths)
    if not xs:
        return []
    return [xs[min(len(xs) - 1, math.ceil(i * len(xs) / n))] for i in range(1, n)]


def ranking_group(length: float, boundaries: Sequence[float]) -> int:
    """The ranking group (0 = shortest) of a prompt whose historical length is ``length``."""
    return bisect.bisect_right(boundaries, float(length))


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation of paired lengths (ties get their mean rank); None for fewer
    than 3 pairs or when either side is constant. HistoPipe's check that historical ranks predict
    the next rollout's (section 6.1 reports them stable; small models at temperature 1 are not)."""
    if len(xs) != len(ys):
        raise ValueError(f"rank_correlation needs paired values, got {len(xs)} and {len(ys)}")
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0
        i = j + 1
    return ranks


def worker_order(step: int, n: int) -> list[int]:
    """Which ranking group each of the ``n`` worker slots serves at ``step`` (1-based): ascending
    on odd steps, descending on even steps."""
    order = list(range(n))
    return order if step % 2 == 1 else order[::-1]


def migration_beta(growth_p75: Optional[float]) -> float:
    """beta: the 75th percentile of last epoch's growth rates, at least 1.1 (1.1 without any)."""
    if growth_p75 is None or not math.isfinite(growth_p75):
        return MIN_BETA
    return max(MIN_BETA, float(growth_p75))


def should_migrate(generated: int, group_max_hist: Optional[float], beta: float, running_in_group: int,
                   group_size: int, alpha: float = MIGRATE_ALPHA) -> bool:
    """Both of section 6.3's conditions: among the last ``alpha`` of its ranking group's rollouts
    still running (``running_in_group`` of ``group_size``, itself included), and longer than
    ``beta`` x the ranking group's longest historical response."""
    if group_max_hist is None or group_size <= 0:
        return False
    last = running_in_group <= max(1, math.ceil(alpha * group_size))
    return last and generated > beta * group_max_hist


def migration_threshold(group_max_hist: float, beta: float) -> int:
    """Tokens after which a rollout of the ranking group exceeds the length condition."""
    return int(math.floor(beta * group_max_hist)) + 1


# -- two-tier scheduling (Figure 12) ---------------------------------------------------------------
Tau = Callable[[float, int], float]  # tau(representative length, workers) -> seconds


def workers_needed(d: float, lens: Sequence[float], tau: Tau, t0: float, min_wks: int, max_wks: int):
    """Figure 12's ``calWks``: (total workers, plan) giving group ``i`` the fewest workers that
    finish it by ``t0 + i * d``; (inf, []) when some group cannot make it with ``max_wks``."""
    plan = []
    for i, length in enumerate(lens):
        target = t0 + i * d
        k = next((k for k in range(min_wks, max_wks + 1) if tau(length, k) <= target * (1 + 1e-12)), None)
        if k is None:
            return math.inf, []
        plan.append(k)
    return sum(plan), plan


def plan_allocation(lens: Sequence[float], wks: int, tau: Tau, t_train: float = 0.0, min_wks: int = 1,
                    max_wks: Optional[int] = None, precision: Optional[float] = None,
                    t0_workers: Optional[int] = None) -> tuple[list[int], float, float]:
    """Figure 12's ``planAllocation``: workers per ranking group (``lens`` ascending) so that group
    ``i`` completes by ``t0 + i * d`` with the smallest ``d`` found by binary search (to
    ``precision`` seconds; default 1% of the initial range). Returns (plan, d, t0).

    ``t0 = max(tau(lens[0], t0_workers), t_train)``: the shortest group never finishes before the
    last training step did (so the next step's weights are ready). Figure 12 uses ``MAX_WKS`` for
    ``t0_workers``, which hands the shortest group the most workers unless ``t_train`` dominates
    (as in the paper's runs); the default here is the equal share ``wks // len(lens)``, so short
    groups get at most an equal share and long ones the rest (section 6.4: "fewer GPUs to the
    short and medium groups, extra GPUs to the few long groups"). ``max_wks`` (most workers per
    group) defaults to what is left after every other group got ``min_wks``. The search starts
    from the smallest ``d`` at which ``min_wks`` suffice for every group after the first (Figure 12
    takes the last group's; this one is always feasible). Workers the plan leaves over go, one at
    a time, to the group that would otherwise complete last (they would idle; not in the paper).
    """
    n = len(lens)
    if n == 0:
        return [], 0.0, 0.0
    if list(lens) != sorted(lens):
        raise ValueError("lens must be ascending (ranking groups, shortest first)")
    if n * min_wks > wks:
        raise ValueError(f"{n} ranking groups need at least {n * min_wks} workers, have {wks}")
    max_wks = wks - (n - 1) * min_wks if max_wks is None else max_wks
    if not 1 <= min_wks <= max_wks:
        raise ValueError(f"need 1 <= min_wks <= max_wks, got {min_wks}, {max_wks}")
    t0_workers = max(min_wks, min(max_wks, wks // n)) if t0_workers is None else t0_workers
    t0 = max(tau(lens[0], t0_workers), t_train)
    if n == 1:
        return [min(wks, max_wks)], 0.0, t0
    hi = max(0.0, max((tau(lens[i], min_wks) - t0) / i for i in range(1, n)))
    lo = 0.0
    p = precision if precision is not None else max(hi * 0.01, 1e-9)
    need, plan = workers_needed(hi, lens, tau, t0, min_wks, max_wks)
    if need > wks:
        raise ValueError(f"no allocation of {wks} workers fits (tau must not grow with more workers)")
    while hi - lo > p:
        mid = (lo + hi) / 2
        need, cand = workers_needed(mid, lens, tau, t0, min_wks, max_wks)
        if need > wks:
            lo = mid
        else:
            plan, hi = cand, mid
    plan = list(plan)
    left = wks - sum(plan)
    while left > 0:
        ends = [tau(lens[i], plan[i]) if plan[i] < max_wks else -math.inf for i in range(n)]
        i = max(range(n), key=lambda j: ends[j])
        if ends[i] == -math.inf:
            break
        plan[i] += 1
        left -= 1
    return plan, hi, t0


def group_time(cost, requests: int, length: float, workers: int, prompt_len: float = 0.0,
               tokens_per_step: float = 1.0, draft_per_step: float = 0.0,
               spec_batch: Optional[Callable[[float], Optional[int]]] = None) -> float:
    """``tau(l, dp)`` from a ``CostModel``: ``requests`` responses of ``length`` tokens spread over
    ``workers`` instances, each decoding in waves of the concurrency its KV cache and
    ``max_num_seqs`` allow (context: prompt plus half the response on average). With HistoSpec
    (section 6.4: tau is profiled "also considering the impact of speculative decoding"), a request
    gains ``tokens_per_step`` tokens per step for ``draft_per_step`` verified draft tokens, unless
    the batch is above ``spec_batch(context)``, HistoSpec's cut-off (then plain decoding)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if requests <= 0 or length <= 0:
        return 0.0
    per = math.ceil(requests / workers)
    ctx = prompt_len + length / 2.0
    fit = max(1, int(cost.kv_capacity_tokens // max(1.0, prompt_len + length)))
    batch = max(1, min(per, int(cost.max_num_seqs), fit))
    waves = math.ceil(per / batch)
    if tokens_per_step > 1.0 and spec_batch is not None:
        most = spec_batch(ctx)
        if most is not None and batch > most:
            tokens_per_step, draft_per_step = 1.0, 0.0
    steps = length / max(1.0, tokens_per_step)
    return waves * steps * cost.step_time(batch, batch * ctx, 0, batch * draft_per_step)
