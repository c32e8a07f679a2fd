"""Workload-aware drafting strategy selection: RLHFSpec section 5.

Every engine step the selector picks the draft tokens that maximise Equation 2,
``al(n) / t_sd(n)``, over the candidate drafts the index proposed for the batch:

* ``al(n)``, the predicted tokens the step emits: one per request plus the sum of ``F(score)``
  over the selected draft nodes (section 5.2, Figure 8). ``F`` (``AcceptanceModel``) maps a node's
  score to the probability that the target accepts it, per depth bucket (a 1-D ``F`` overrates
  deep nodes against shallow ones of the same score, and the search then trades shallow drafts
  of many requests for deep drafts of a few: measured in docs/BENCHMARKS.md). RLHFSpec scores a node by its draft-model
  logit; this project drafts without a model, so the score is the node's cumulative empirical
  probability in the suffix tree (``DraftIndex.batch_propose``'s conditional probabilities,
  multiplied along the draft); with a draft model it would be the logit product. ``F`` is fitted
  offline from replayed traces (``fit_acceptance``, ``verl-ext fit acceptance``) and
  updated online from the acceptances the engine observes (``observe``).
* ``t_sd(n)``, the predicted step time: a regression on ``N_seq`` (KV tokens of the batch) and
  ``N_draft`` (draft tokens verified), fitted by the profiler: the instance's ``CostModel``
  (``verl-ext fit grid``; presets for GPUs). ``StepTimePredictor`` puts the paper's bucket cache in
  front of it: ``N_seq`` in geometric buckets (``SEQ_BUCKETS_PER_OCTAVE``), each holding the
  predicted times over ``N_draft``, so a prediction is an array lookup (a miss costs one
  vectorised evaluation, microseconds). A step also carries the prefill the engine schedules with
  it (new samples joining the batch), which the selector cannot know in advance: drafts that ride
  free on a decode-only step push a step that also prefills over the compute knee. The selector
  therefore predicts the drafts' *expected* extra time over the prefill it has seen
  (``note_prefill``, called once per engine step): ``t(0) + (1 - q) (t(N_draft) - t(0)) + q
  (t(N_draft | P) - t(0 | P))``, ``q`` the recent share of steps that prefilled and ``P`` their
  mean prefill tokens (moving averages over about ``PREFILL_WINDOW`` steps). The prefill's own
  time stays out: Equation 2 is a ratio, and a denominator inflated by a cost the drafts do not
  change would make every draft look cheap. Measured in docs/BENCHMARKS.md.
* The search (section 5.3): layer-level, with a max-priority queue over the draft forest and
  early stopping after ``patience`` consecutive falls of the objective (Equation 3), in native
  code (``csrc/draft_select.h``). On engines that verify linear drafts (vLLM) the result is a
  draft length per request (``select_lengths``); on tree-verification engines, a node mask
  (``select_nodes``).

A step without drafts scores ``B / t_sd(0)``: where verifying a draft token costs as much as
decoding one (a small model on a CPU), no draft pays and the selector drafts nothing.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from verl_ext.spec._suffix import acceptance_table, isotonic_rows, observe_chains, select_chains, select_tree
from verl_ext.spec._suffix import cumulative_scores as _cumulative_scores

#: points of F's piecewise-linear table over scores in [0, 1]
ACCEPTANCE_POINTS = 21
#: pseudo-observations per point that the prior (the offline fit, or F(s) = s) counts for
PRIOR_WEIGHT = 8.0
#: observations per point kept online (older ones fade: a moving window)
ONLINE_WINDOW = 4096.0
#: geometric N_seq buckets per doubling in the step-time cache (about 4.4% wide)
SEQ_BUCKETS_PER_OCTAVE = 16
#: consecutive falls of the objective that end the search (Equation 3's early stop)
PATIENCE = 4
#: engine steps the prefill statistics average over (exponential moving averages)
PREFILL_WINDOW = 64
#: the prefill share q is kept to this resolution in the cache key
PREFILL_SHARE_STEPS = 32


def pav(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Pool-adjacent-violators: the non-decreasing fit of ``y`` with weights ``w``, along the
    last axis (a 2-D ``y`` is fitted row by row). Native: F's table is refitted after every
    step's observations, on the engine and in the simulator."""
    y = np.asarray(y, dtype=np.float64)
    rows = np.ascontiguousarray(y.reshape(-1, y.shape[-1]) if y.ndim != 2 else y)
    w = np.ascontiguousarray(np.broadcast_to(np.asarray(w, dtype=np.float64), y.shape).reshape(rows.shape))
    return isotonic_rows(rows, w).reshape(y.shape)


#: depth buckets of F's rows (``csrc/draft_select.h``): 0, 1, 2, 3, 4-7, 8-15, 16+
DEPTH_BUCKETS = 7


#: depth 0..16 -> its bucket (16 and deeper: the last)
_BUCKET_OF = np.array([0, 1, 2, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6], dtype=np.int64)


def depth_bucket(depth) -> np.ndarray:
    return _BUCKET_OF[np.clip(np.asarray(depth, dtype=np.int64), 0, 16)]


class AcceptanceModel:
    """``F``: (node score, node depth) -> acceptance probability: per depth bucket
    (``DEPTH_BUCKETS``: a deep node of a draft is accepted less often than a shallow one of the
    same score), a monotone piecewise-linear table over the score.

    Each table point keeps (accepted, seen) counts of the observations nearest to it; the
    estimate shrinks towards the prior (the offline fit, or ``F(s) = s``: a suffix tree's
    empirical probability is itself an estimate) with ``prior_weight`` pseudo-counts, and is made
    non-decreasing in the score (``pav``, weighted by the observations: an unobserved point
    holding only its prior does not lift an observed one). Online counts are capped at
    ``window`` per point, so old evidence fades as new acceptances come in. ``prior``: one row
    (every depth) or one row per depth bucket.
    """

    def __init__(self, prior=None, points: int = ACCEPTANCE_POINTS, prior_weight: float = PRIOR_WEIGHT,
                 window: float = ONLINE_WINDOW):
        if prior is not None and len(prior):
            prior = np.atleast_2d(np.asarray(prior, dtype=np.float64))
            if prior.shape[0] not in (1, DEPTH_BUCKETS):
                raise ValueError(f"F's prior needs 1 or {DEPTH_BUCKETS} rows, got {prior.shape[0]}")
            points = prior.shape[1]
        else:
            prior = None
        if points < 2:
            raise ValueError(f"F needs at least 2 points, got {points}")
        self.grid = np.linspace(0.0, 1.0, points)
        base = np.tile(self.grid, (DEPTH_BUCKETS, 1)) if prior is None else np.broadcast_to(prior, (DEPTH_BUCKETS, points))
        self.prior = np.clip(np.array(base, dtype=np.float64), 0.0, 1.0)
        if prior_weight < 0 or window <= 0:
            raise ValueError("prior_weight must be >= 0 and window > 0")
        self.prior_weight = float(prior_weight)
        self.window = float(window)
        self.accepted = np.zeros((DEPTH_BUCKETS, points))
        self.seen = np.zeros((DEPTH_BUCKETS, points))
        self._table: Optional[np.ndarray] = None

    def table(self) -> np.ndarray:
        """F at the grid points, one row per depth bucket (float32, non-decreasing along rows):
        ``clip(pav((accepted + m prior) / max(seen + m, 1e-12), seen + 1), 0, 1)`` with ``m`` the
        prior weight, in one native call (refitted after every step's observations)."""
        if self._table is None:
            self._table = acceptance_table(self.accepted, self.seen, self.prior, self.prior_weight)
        return self._table

    def __call__(self, scores, depth=0) -> np.ndarray:
        s = np.clip(np.asarray(scores, dtype=np.float64), 0.0, 1.0)
        rows = self.table()[depth_bucket(np.broadcast_to(depth, s.shape))]
        pos = s * (len(self.grid) - 1)
        i = np.minimum(pos.astype(np.int64), len(self.grid) - 2)
        a = pos - i
        out = (1 - a) * np.take_along_axis(rows, i[..., None], -1)[..., 0] + a * np.take_along_axis(rows, i[..., None] + 1, -1)[..., 0]
        return out

    def observe(self, scores, accepted, depths=0) -> None:
        """Drafted nodes' scores and depths, and whether the target accepted each."""
        s = np.clip(np.asarray(scores, dtype=np.float64).ravel(), 0.0, 1.0)
        if not len(s):
            return
        a = np.asarray(accepted, dtype=np.float64).ravel()
        d = depth_bucket(np.broadcast_to(depths, np.shape(scores)).ravel())
        points = len(self.grid)
        flat = d * points + np.rint(s * (points - 1)).astype(np.int64)
        self.seen += np.bincount(flat, minlength=self.seen.size).reshape(self.seen.shape)
        self.accepted += np.bincount(flat, weights=a, minlength=self.seen.size).reshape(self.seen.shape)
        over = self.seen > self.window
        if over.any():
            f = self.window / self.seen[over]
            self.seen[over] *= f
            self.accepted[over] *= f
        self._table = None

    def observe_chains(self, scores: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """``observe`` for one step's linear drafts, in one native call: row i drafted
        ``drafted[i]`` tokens with cumulative ``scores[i, :drafted[i]]`` (depth = position), and
        the target accepted the first ``accepted[i]``."""
        observe_chains(scores, drafted, accepted, self.seen, self.accepted, self.window)
        self._table = None

    @classmethod
    def fit(cls, scores, accepted, depths=0, points: int = ACCEPTANCE_POINTS) -> "AcceptanceModel":
        """The offline fit: observations binned to the grid (no prior), as a prior table; a
        depth bucket without observations takes the one above it (or F(s) = s)."""
        m = cls(points=points, prior_weight=0.0, window=float("inf"))
        m.observe(scores, accepted, depths)
        rows = []
        for acc, seen in zip(m.accepted, m.seen):
            known = seen > 0
            if not known.any():
                rows.append(rows[-1] if rows else m.grid.copy())
                continue
            est = np.interp(m.grid, m.grid[known], acc[known] / seen[known])  # empty bins: from their neighbours
            rows.append(pav(est, seen + 1e-9))
        if not m.seen.any():
            raise ValueError("fit: no observations")
        return cls(prior=np.stack(rows))

    def to_dict(self) -> dict:
        return {"points": self.table().round(4).tolist(), "observations": float(self.seen.sum()),
                "depth_buckets": "0,1,2,3,4-7,8-15,16+"}

    @classmethod
    def from_file(cls, path: str) -> "AcceptanceModel":
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return cls(prior=d["acceptance"]["points"] if "acceptance" in d else d["points"])


class StepTimePredictor:
    """``t_sd(N_seq, N_draft)`` for a batch of ``B`` requests, from the profiled ``CostModel``,
    behind a bucketed cache: key (``B``, ``N_seq`` bucket) -> step times for ``N_draft`` =
    0, 1, ... (extended on demand), evaluated at the bucket's geometric centre."""

    def __init__(self, cost, per_octave: int = SEQ_BUCKETS_PER_OCTAVE, max_entries: int = 4096):
        self.cost = cost
        self.per_octave = per_octave
        self.max_entries = max_entries
        self._cache: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def bucket(self, n_seq: float) -> int:
        return int(math.floor(math.log2(max(1.0, float(n_seq))) * self.per_octave))

    def curve(self, batch: int, n_seq: float, n_draft: int, prefill: tuple = (0.0, 0.0)) -> np.ndarray:
        """Predicted step times for 0..``n_draft`` draft tokens (float64, length ``n_draft + 1``).
        ``prefill = (q, P)``: a share ``q`` of steps also prefills ``P`` tokens. The curve is then
        the decode-only time at no drafts plus the drafts' expected extra time, ``(1 - q)
        (t(n) - t(0)) + q (t(n | P) - t(0 | P))``: the prefill's own time is excluded. ``q`` is
        rounded to 1/``PREFILL_SHARE_STEPS`` and ``P`` to a geometric bucket."""
        q = round(min(1.0, max(0.0, float(prefill[0]))) * PREFILL_SHARE_STEPS)
        p = self.bucket(prefill[1]) if q and prefill[1] >= 1 else -1
        key = (int(batch), self.bucket(n_seq), q if p >= 0 else 0, p)
        c = self._cache.get(key)
        if c is not None and len(c) > n_draft:
            self.hits += 1
            self._cache.move_to_end(key)
            return c[: n_draft + 1]
        self.misses += 1
        centre = 2.0 ** ((key[1] + 0.5) / self.per_octave)
        size = max(n_draft + 1, 2 * len(c) if c is not None else 64)
        drafts = np.arange(size, dtype=np.float64)
        c = np.asarray(self.cost.step_time(batch, centre, 0, drafts), dtype=np.float64)
        if p >= 0:
            share = q / PREFILL_SHARE_STEPS
            tokens = 2.0 ** ((p + 0.5) / self.per_octave)
            with_prefill = np.asarray(self.cost.step_time(batch, centre, tokens, drafts), dtype=np.float64)
            # the drafts' expected extra cost; the prefill's own time is not the drafts' to pay
            # (counting it would lower every step's tokens per second and make drafts look cheap)
            c = c + share * ((with_prefill - with_prefill[0]) - (c - c[0]))
        self._cache[key] = c
        if len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return c[: n_draft + 1]


@dataclass
class Selection:
    """One step's decision."""

    n: int  # draft tokens selected
    evaluations: int  # objective evaluations
    objective: float  # predicted tokens per second of the step
    al: float  # predicted tokens emitted


class DraftSelector:
    """One engine's selector: ``F`` (online), the step-time predictor, and the search."""

    def __init__(self, cost, acceptance: Optional[AcceptanceModel] = None, patience: int = PATIENCE):
        if patience < 0:
            raise ValueError(f"patience must be >= 0 (0 = exhaustive), got {patience}")
        self.acceptance = acceptance or AcceptanceModel()
        self.predictor = StepTimePredictor(cost)
        self.patience = patience
        # counters
        self.steps = 0
        self.candidate_tokens = 0
        self.selected_tokens = 0
        self.evaluations = 0
        self.select_s = 0.0
        # recent prefill: share of steps that prefilled, and their mean prefill tokens
        self.prefill_share = 0.0
        self.prefill_tokens = 0.0

    def note_prefill(self, tokens: float) -> None:
        """One engine step ran with ``tokens`` prefill tokens (0: a decode-only step)."""
        a = 1.0 / PREFILL_WINDOW
        hit = tokens > 0
        self.prefill_share += a * (float(hit) - self.prefill_share)
        if hit:
            self.prefill_tokens = float(tokens) if self.prefill_tokens == 0 else (
                self.prefill_tokens + a * (float(tokens) - self.prefill_tokens))

    def select_lengths(self, scores: np.ndarray, lens: np.ndarray, n_seq: float,
                       patience: Optional[int] = None) -> tuple[np.ndarray, Selection]:
        """Draft length per request (int32) for linear verification. ``scores``: (B, W) float
        cumulative scores of each request's candidate draft, ``lens``: candidate lengths."""
        t0 = time.perf_counter()
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        lens = np.ascontiguousarray(lens, dtype=np.int32)
        b = len(lens)
        total = int(lens.sum())
        curve = self.predictor.curve(b, n_seq, total, (self.prefill_share, self.prefill_tokens))
        caps, (n, ev, obj, al) = select_chains(scores, lens, self.acceptance.table(), curve, float(b),
                                               self.patience if patience is None else patience)
        self.steps += 1
        self.candidate_tokens += total
        self.selected_tokens += int(n)
        self.evaluations += int(ev)
        self.select_s += time.perf_counter() - t0
        return caps, Selection(int(n), int(ev), float(obj), float(al))

    def select_nodes(self, parents: np.ndarray, scores: np.ndarray, batch: int, n_seq: float,
                     patience: Optional[int] = None) -> tuple[np.ndarray, Selection]:
        """Selected node mask of a draft forest (tree verification); ``batch`` requests."""
        parents = np.ascontiguousarray(parents, dtype=np.int32)
        curve = self.predictor.curve(batch, n_seq, len(parents), (self.prefill_share, self.prefill_tokens))
        mask, (n, ev, obj, al) = select_tree(parents, np.ascontiguousarray(scores, dtype=np.float32),
                                             self.acceptance.table(), curve, float(batch),
                                             self.patience if patience is None else patience)
        return mask, Selection(int(n), int(ev), float(obj), float(al))

    def observe(self, scores: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Last step's outcome: row i drafted ``drafted[i]`` tokens with ``scores[i, :drafted[i]]``
        and the target accepted the first ``accepted[i]`` of them."""
        drafted = np.asarray(drafted, dtype=np.int64)
        if not drafted.any():
            return
        self.acceptance.observe_chains(scores, drafted, accepted)

    def stats(self) -> dict:
        return {
            "select_steps": self.steps,
            "select_candidate_tokens": self.candidate_tokens,
            "select_selected_tokens": self.selected_tokens,
            "select_evaluations": self.evaluations,
            "select_s": self.select_s,
            "select_cache_hits": self.predictor.hits,
            "select_cache_misses": self.predictor.misses,
            "select_prefill_share": self.prefill_share,
            "select_prefill_tokens": self.prefill_tokens,
        }


def cumulative_scores(probs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Node scores from per-token conditional probabilities: float32 products along each draft
    (0 past its length), native."""
    p = np.asarray(probs, dtype=np.float32)
    if p.ndim != 2 or not p.shape[1]:
        return np.zeros((len(lens), 0), dtype=np.float32)
    return _cumulative_scores(p, lens)
