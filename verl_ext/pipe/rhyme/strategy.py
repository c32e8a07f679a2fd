"""``rhyme``: RhymeRL's rollout over a history provider (the history workers inside
veRL, a local ``HistoryStore`` over epochs in A/B runs, the trace's previous epoch in the
simulator; without history it dispatches like ``baseline`` until history exists).

* HistoSpec (section 5): ``engine_spec`` asks for engines that draft from each prompt's
  reward-weighted history tree, with the AIMD window and the profiled batch cut-off
  (``verl_ext.spec.policy``); engines that take drafter RPCs get the histories of the prompts
  their ranking group serves, every step.
* HistoPipe (section 6, ``verl_ext.pipe.rhyme.histopipe``): ranking groups by historical length, the
  two-tier instance split of Figure 12, alternation between steps, least-loaded dispatch within
  a block; it sits out steps whose historical ranks predict poorly (``min_rank_corr``).
* Intra-step migration (6.3): outliers past ``beta x`` their group's longest history continue on
  the least-loaded instance (``verl_ext.pipe.chunks``). Inter-step migration (opt-in,
  ``inter_step``) defers them to the next step, for drivers that carry deferred samples only
  (``verl_ext.pipe.defer``).

Knob ladder of Figure 14: ``histopipe=false``, ``two_tier=false``, ``histospec=false``,
``migration=false``. Rationale, knobs and metrics: docs/papers/rhymerl.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from verl_ext.engine.instance import Completion, GenRequest, Instance
from verl_ext.pipe.chunks import Chunked
from verl_ext.pipe.defer import NO_CARRIER, deferred_completion, is_deferred
from verl_ext.pipe.rhyme.delivery import HistoryDelivery
from verl_ext.pipe.rhyme.histopipe import (
    MIGRATE_ALPHA,
    group_time,
    migration_beta,
    migration_threshold,
    plan_allocation,
    rank_boundaries,
    rank_correlation,
    rank_groups,
    ranking_group,
    should_migrate,
    worker_order,
)
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import Strategy, StrategyConfigError, gather_or_abort, register_strategy

logger = logging.getLogger(__name__)

#: how long ``submit`` collects a step's requests before planning it (veRL sends them together)
PLAN_WINDOW_S = 0.05
#: fewest prompts a rank-correlation check needs to count
MIN_RANK_PAIRS = 8


@dataclass(frozen=True)
class RhymeOptions:
    """Knobs of ``rollout=rhyme`` (``custom.verl_ext.options``); defaults follow the paper."""

    #: HistoSpec: draft from the prompt's history tree
    histospec: bool = True
    #: HistoPipe: ranking groups on instance blocks: true | false | "auto". ``auto``: only where
    #: the driver overlaps rollouts with training (one-step-off and streaming pipelines, veRL's
    #: async trainers), where its alternation between steps can pay; a synchronous step
    #: dispatches like baseline (ranking groups on fixed blocks lose to least-loaded dispatch
    #: within one step: docs/BENCHMARKS.md, rhyme's ablation ladder)
    histopipe: Union[bool, str] = "auto"
    #: tier 2 by Figure 12's search (false: equal blocks)
    two_tier: bool = True
    #: intra-step migration of outliers
    migration: bool = True
    #: ranking groups; 0 = min(8, instances)
    ranking_groups: int = 0
    #: migration: the last fraction of a ranking group's requests that may migrate
    alpha: float = MIGRATE_ALPHA
    #: migration: re-check a request past its threshold every this many tokens
    recheck_tokens: int = 1024
    #: the last training step's time, seconds (tier 2's t0 floor; 0 = none)
    t_train_s: float = 0.0
    #: HistoSpec: most draft tokens per step (the AIMD window's ceiling)
    spec_k: int = 32
    aimd_start: int = 2
    aimd_step: int = 2
    min_match: int = 3
    max_match: int = 7
    #: HistoSpec: switch drafting off above the profiled batch size for the acceptance rate
    batch_cutoff: bool = True
    #: cost model (preset name or profile JSON) for tau and the cut-off on real engines;
    #: "" = the simulator's own, and no cut-off / proportional tier 2 on real engines
    profile: str = ""
    #: HistoPipe sits a step out (least-loaded dispatch) when historical ranks predicted lengths
    #: worse than this Spearman correlation: measured on the previous step's prompts, or before
    #: that, split-half within the history (-1 = never). Below 0.5 the ranks explain under a
    #: quarter of the variance of the next ranks; RhymeRL's workloads keep ~80% of responses in
    #: their predicted group of 8-16 (Table 2), far above it
    min_rank_corr: float = 0.5
    #: inter-step migration: defer outliers of the longest ranking groups to the next training
    #: step (off-policy; needs a driver that carries them, see the module docstring)
    inter_step: bool = False
    #: inter-step migration: the share of ranking groups, the longest, whose outliers are deferred
    #: (the others migrate within the step)
    inter_step_groups: float = 0.5

    def __post_init__(self):
        for name in ("histospec", "two_tier", "migration", "batch_cutoff", "inter_step"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.histopipe, bool) or self.histopipe == "auto"):
            raise ValueError(f"histopipe must be true, false or auto, got {self.histopipe!r}")
        if self.ranking_groups < 0:
            raise ValueError(f"ranking_groups must be >= 0 (0 = automatic), got {self.ranking_groups}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.recheck_tokens < 1:
            raise ValueError(f"recheck_tokens must be >= 1, got {self.recheck_tokens}")
        if self.t_train_s < 0:
            raise ValueError(f"t_train_s must be >= 0, got {self.t_train_s}")
        if not 1 <= self.spec_k <= 128:
            raise ValueError(f"spec_k must be in [1, 128], got {self.spec_k}")
        if not 1 <= self.aimd_start <= self.spec_k:
            raise ValueError(f"aimd_start must be in [1, spec_k], got {self.aimd_start}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")
        if not -1.0 <= self.min_rank_corr <= 1.0:
            raise ValueError(f"min_rank_corr must be in [-1, 1] (-1 = never fall back), got {self.min_rank_corr}")
        if not 0.0 < self.inter_step_groups <= 1.0:
            raise ValueError(f"inter_step_groups must be in (0, 1], got {self.inter_step_groups}")
        if self.inter_step and not (self.histopipe is not False and self.migration):
            raise ValueError("inter_step defers HistoPipe's migration outliers: it needs histopipe=true or auto "
                             "and migration=true")


@dataclass
class _Plan:
    """One step's HistoPipe plan."""

    step: int
    boundaries: list  # ranking group length boundaries
    blocks: list  # ranking group -> [Instance]
    max_hist: list  # ranking group -> longest historical response (None if unknown)
    beta: float
    lengths: dict  # uid -> (median, max)
    size: list = field(default_factory=list)  # requests per ranking group
    running: list = field(default_factory=list)  # unfinished requests per ranking group
    groups: dict = field(default_factory=dict)  # uid -> ranking group, of the prompts ranked

    def group_of(self, uid: str) -> Optional[int]:
        if uid in self.groups:
            return self.groups[uid]
        h = self.lengths.get(uid)
        return None if h is None else ranking_group(h[0], self.boundaries)


@register_strategy("rhyme")
class RhymeStrategy(Strategy):
    keys_samples = True  # a migrated or deferred request's parts emit the tokens of the whole
    mechanisms = {
        "history_draft_tokens_accepted": "drafter:history_accepted_tokens",  # HistoSpec
        "histopipe_placements": "strategy",  # HistoPipe: a request sent to its ranking group's block
        "migrations": "strategy",  # intra-step migration of an outlier
    }
    Options = RhymeOptions

    def parts_options(self) -> list[str]:
        return [name for name in ("migration", "inter_step") if getattr(self.options, name)]
    uses_history = True

    def __init__(self, options=None):
        super().__init__(options)
        self.history = None
        self.step = 0
        self._cost = self._load_profile()
        self._t_train_seen = 0.0
        self._overlap = False  # the driver overlaps rollouts with training (set_step_overlap)
        self._plan: Optional[_Plan] = None
        self._plan_step: Optional[int] = None  # the step self._plan was made for (None: none yet)
        self._planning: Optional[asyncio.Future] = None
        self._batch: list = []
        self._known: set = set()  # uids the step's plan covers, or that were placed late
        self._late: dict = {}  # uid -> its late placement (one per prompt, for its samples)
        self._spread = False  # this step serves histories to every drafting engine (no blocks)
        self._warned_no_history = False
        self._predicted: dict = {}  # uid -> historical median length, for the step being rolled out
        self._observed: dict = {}  # uid -> [response lengths] of that step
        self._carry = NO_CARRIER  # inter-step migration: the driver's carrier (set_deferral)
        self._m = {"migration_checks": 0, "deferrals": 0, "histopipe_active": 0, "histopipe_fallbacks": 0,
                   "histopipe_sync_off": 0,
                   "history_prompts": 0, "unknown_prompts": 0, "late_prompts": 0, "served_histories": 0,
                   "history_failures": 0, "history_serve_s": 0.0}
        self._delivery = HistoryDelivery(self._m, "rhyme")

    # -- inputs -------------------------------------------------------------------------------
    def set_history(self, history) -> None:
        """The history provider: ``lengths(uids, step)``, ``growth_percentile(q, step)`` and
        ``serve(uids, step)`` coroutines (``HistoryClient``, ``LocalHistory``), or None."""
        self.history = history

    def begin_step(self, step: int) -> None:
        """The training step the next requests belong to (1-based; odd = ascending order)."""
        self.step = int(step)

    @property
    def defers_samples(self) -> bool:
        return self.options.inter_step

    def set_deferral(self, carry) -> None:
        """Inter-step migration's carrier for this step: ``carry(state)`` takes a deferred
        request's ``Chunked`` state into the next step (None: no next step, migrate within it)."""
        self._carry = carry

    def set_step_overlap(self, overlap: bool) -> None:
        self._overlap = bool(overlap)

    def observe_train_time(self, seconds: float) -> None:
        """The last training step's time: tier 2's ``t0`` floor is the larger of it and
        ``t_train_s``."""
        self._t_train_seen = max(0.0, float(seconds))
        self._m["t_train_s"] = self._t_train_seen

    def _load_profile(self):
        if not self.options.profile:
            return None
        from verl_ext.perf.cost import load_cost_model

        try:
            return load_cost_model(self.options.profile)
        except (OSError, ValueError) as exc:
            raise StrategyConfigError(f"strategy 'rhyme': profile: {exc}") from exc

    def engine_spec(self, cost=None):
        """``cost``: the instances' cost model (the simulator's), used unless ``profile`` is set."""
        o = self.options
        if not o.profile:
            self._cost = cost
        if not o.histospec:
            return None
        from verl_ext.spec.options import SpecOptions

        cutoffs = self._cutoff_table()
        return SpecOptions(scopes="history", k=o.spec_k, min_match=o.min_match, max_match=o.max_match, min_prob=0.0,
                           aimd=True, aimd_start=o.aimd_start, aimd_step=o.aimd_step, batch_cutoffs=cutoffs)

    def _cutoff_table(self) -> tuple:
        """HistoSpec's batch cut-off table from the cost model (computed once per cost model), or
        () without one or with ``batch_cutoff`` off."""
        o = self.options
        if not o.batch_cutoff or self._cost is None:
            return ()
        from verl_ext.spec.cutoff import cutoff_table

        return cutoff_table(self._cost, o.aimd_start)

    # -- planning ------------------------------------------------------------------------------
    async def _make_plan(self, requests: Sequence[GenRequest], pool: InstancePool) -> Optional[_Plan]:
        o = self.options
        if self.history is None and not self._warned_no_history:
            self._warned_no_history = True
            logger.warning("rhyme: no history provider (set_history was not called); requests are dispatched "
                           "like baseline and HistoSpec has no history to draft from")
        self._known = {r.history_key for r in requests}
        self._late = {}
        self._spread = False
        if self.history is None:
            return None
        uids = sorted(self._known)
        sync_off = o.histopipe == "auto" and not self._overlap
        self._m["histopipe_sync_off"] = int(sync_off)
        self._m["histopipe_active"] = 0
        if not o.histopipe or sync_off:  # HistoSpec alone: every drafting engine gets the step's histories
            self._spread = True
            if o.histospec:
                self._serve_histories_soon([(list(pool.instances.values()), uids)])
            return None
        try:
            lengths = await self.history.lengths(uids, self.step or None)
            growth = await self.history.growth_percentile(75.0, self.step or None)
        except Exception as exc:  # a history worker problem costs the plan, never the rollout
            self._m["history_failures"] += 1
            logger.warning("rhyme: no history for this step (%s: %s); dispatching like baseline", type(exc).__name__, exc)
            return None
        self._m["history_prompts"] = len(lengths)
        self._m["unknown_prompts"] = len(uids) - len(lengths)
        corr = self._rank_reliability(lengths)
        self._predicted = {u: v[0] for u, v in lengths.items()}
        self._observed = {}
        self._m["histopipe_active"] = 0
        if not lengths:
            return None  # first epoch: HistoPipe off
        if corr is not None and corr < o.min_rank_corr:
            self._m["histopipe_fallbacks"] += 1
            logger.info("rhyme: step %d: historical ranks predict lengths poorly (Spearman %.2f < %.2f); "
                        "HistoPipe sits this step out", self.step, corr, o.min_rank_corr)
            self._spread = True
            if o.histospec:
                self._serve_histories_soon([(list(pool.instances.values()), uids)])
            return None
        instances = sorted(pool.instances.values(), key=lambda i: i.name)
        n = o.ranking_groups or min(8, len(instances))
        n = max(1, min(n, len(instances), len(lengths)))
        medians = {u: v[0] for u, v in lengths.items()}
        boundaries = rank_boundaries(medians.values(), n)  # for prompts that come later
        groups = rank_groups(medians, n)
        members: list[list[str]] = [[] for _ in range(n)]
        for u, g in groups.items():
            members[g].append(u)
        per_prompt = _samples_per_prompt(requests)
        plan_wks = self._allocate(members, medians, per_prompt, requests, len(instances), pool)
        order = worker_order(self.step or 1, n)  # slot j serves ranking group order[j]
        blocks: list[list[Instance]] = [[] for _ in range(n)]
        at = 0
        for g in order:
            blocks[g] = instances[at: at + plan_wks[g]]
            at += plan_wks[g]
        max_hist = [max((lengths[u][1] for u in members[g]), default=None) for g in range(n)]
        plan = _Plan(self.step, boundaries, blocks, max_hist, migration_beta(growth), lengths,
                     size=[0] * n, running=[0] * n, groups=groups)
        self._m["histopipe_active"] = 1
        self._m["ranking_groups"] = n
        self._m["beta"] = plan.beta
        for g in range(n):
            self._m[f"rank{g}_instances"] = len(blocks[g])
        if o.histospec:
            self._serve_histories_soon(list(zip(blocks, members)))
        return plan

    def _rank_reliability(self, lengths: dict) -> Optional[float]:
        """How well historical ranks predict lengths: Spearman between the last planned step's
        predictions and what its requests produced (at least ``MIN_RANK_PAIRS`` prompts), else
        between the two halves of each prompt's history (split-half). None: no evidence."""
        pairs = [(self._predicted[u], float(np.median(ls))) for u, ls in self._observed.items()
                 if ls and u in self._predicted]
        if len(pairs) >= MIN_RANK_PAIRS:
            corr, source = rank_correlation(*zip(*pairs)), 1
        else:
            halves = [(v[2], v[3]) for v in lengths.values() if len(v) >= 4]
            corr = rank_correlation(*zip(*halves)) if len(halves) >= MIN_RANK_PAIRS else None
            source = 0
        if corr is not None:
            self._m["rank_corr"] = corr
            self._m["rank_corr_observed"] = source
        return corr

    def _measured_spec(self, pool: InstancePool):
        """HistoSpec as the engines measured it so far (telemetry, cumulative): (tokens per drafted
        step, draft tokens per drafted step, the cut-off at the measured acceptance as a function
        of context), or (1, 0, None) before any draft or with drafting off."""
        if not self.options.histospec:
            return 1.0, 0.0, None
        t = [i.telemetry() for i in pool.instances.values()]
        drafts, drafted, accepted = (sum(getattr(x, f) for x in t) for f in ("drafts", "draft_tokens", "accepted_tokens"))
        if drafts <= 0 or drafted <= 0:
            return 1.0, 0.0, None
        tps = self._m["tau_tokens_per_step"] = 1.0 + accepted / drafts
        table = self._cutoff_table()
        if not table:
            return tps, drafted / drafts, None
        from verl_ext.spec.cutoff import BatchCutoff

        cut, rate = BatchCutoff(table), accepted / drafted
        return tps, drafted / drafts, lambda ctx: cut.max_batch(rate, ctx)

    def _allocate(self, members, medians, per_prompt: float, requests, wks: int, pool: InstancePool) -> list[int]:
        """Instances per ranking group: Figure 12 with the cost model's tau (with HistoSpec's
        measured rate, ``_measured_spec``), else in proportion to the groups' historical tokens
        (at least one each)."""
        n = len(members)
        work = [sum(medians[u] for u in members[g]) * per_prompt for g in range(n)]
        if self.options.two_tier and self._cost is not None and all(members):
            lens = [sum(medians[u] for u in m) / len(m) for m in members]  # representative lengths
            prompt_len = sum(len(r.prompt_ids) for r in requests) / max(1, len(requests))
            count = sum(len(m) for m in members) * per_prompt / n  # ranking groups are equal-sized
            cost = self._cost
            tps, drafts, spec_batch = self._measured_spec(pool)

            def tau(length, k):
                return group_time(cost, count, length, k, prompt_len, tps, drafts, spec_batch)

            try:
                plan, _, _ = plan_allocation(lens, wks, tau, t_train=max(self.options.t_train_s, self._t_train_seen))
                return plan
            except ValueError as exc:
                logger.warning("rhyme: tier-2 search failed (%s); instances in proportion to work", exc)
        if not self.options.two_tier:
            work = [1.0] * n
        return _proportional(work, wks)

    def _serve_histories_soon(self, assignments) -> None:
        """Deliver histories in the background (``HistoryDelivery.soon``)."""
        self._delivery.soon(self.history, self.step, assignments)

    async def close(self) -> None:
        await self._delivery.close()

    async def _serve_histories(self, assignments) -> None:
        await self._delivery.serve(self.history, self.step, assignments)

    # -- dispatch ------------------------------------------------------------------------------
    async def rollout(self, requests: Sequence[GenRequest], pool: InstancePool) -> list[Completion]:
        """A whole step at once (A/B runs, the simulator): planned from all its prompts."""
        requests = [self.keyed(r, pool) for r in requests]
        if self._plan_step != self.step:
            self._plan = await self._make_plan(requests, pool)
            self._plan_step = self.step
        for r in requests:
            self._count(r)
        return await gather_or_abort([self._run_observed(r, pool, self._plan) for r in requests])

    async def submit(self, request: GenRequest, pool: InstancePool) -> Completion:
        """One request at a time (veRL's agent loops): the step's first request opens a window of
        ``PLAN_WINDOW_S`` in which the step's other requests arrive (veRL sends them together);
        the plan is made from all of them. A prompt first seen later is placed by itself
        (``_place_late``)."""
        request = self.keyed(request, pool)
        if self._plan_step != self.step:
            if self._planning is None:
                self._batch = []
                self._planning = asyncio.ensure_future(self._plan_after_window(pool, self.step))
            self._batch.append(request)
            await asyncio.shield(self._planning)
        if request.history_key not in self._known:  # also one that came while the plan was being made
            await self._place_late(request.history_key, pool)
        self._count(request)
        return await self._run_observed(request, pool, self._plan)

    async def _place_late(self, uid: str, pool: InstancePool) -> None:
        """A prompt whose first request came after the step was planned (a later turn, a refill,
        an async trainer's next request): its history decides its ranking group as in the plan
        (the plan's boundaries), and that block's drafting engines get its history; without a
        plan, every drafting engine gets it when the step spreads histories. One lookup per
        prompt, which its other samples wait for."""
        task = self._late.get(uid)
        if task is None:
            task = self._late[uid] = asyncio.ensure_future(self._lookup_late(uid, pool))
        await asyncio.shield(task)

    async def _lookup_late(self, uid: str, pool: InstancePool) -> None:
        self._known.add(uid)
        self._m["late_prompts"] += 1
        plan, o = self._plan, self.options
        if self.history is None:
            return
        if self._spread:
            if o.histospec:
                self._serve_histories_soon([(list(pool.instances.values()), [uid])])
            return
        if plan is None:
            return
        try:
            found = await self.history.lengths([uid], self.step or None)
        except Exception as exc:  # costs this prompt its placement and drafts, never a request
            self._m["history_failures"] += 1
            logger.warning("rhyme: no history for a late prompt (%s: %s)", type(exc).__name__, exc)
            return
        if uid not in found:
            self._m["unknown_prompts"] += 1
            return
        plan.lengths[uid] = found[uid]
        self._predicted[uid] = found[uid][0]
        self._m["history_prompts"] += 1
        g = plan.group_of(uid)
        if o.histospec and plan.blocks[g]:
            self._serve_histories_soon([(plan.blocks[g], [uid])])

    async def _plan_after_window(self, pool: InstancePool, step: int) -> None:
        try:
            await asyncio.sleep(PLAN_WINDOW_S)
            self._plan = await self._make_plan(self._batch, pool)
        finally:
            self._plan_step = step
            self._planning = None

    def _count(self, r: GenRequest) -> None:
        plan = self._plan
        g = plan.group_of(r.history_key) if plan is not None else None
        if g is not None:
            plan.running[g] += 1
            plan.size[g] = max(plan.size[g], plan.running[g])

    async def _run_observed(self, r: GenRequest, pool: InstancePool, plan: Optional[_Plan]) -> Completion:
        c = await self._run(r, pool, plan)
        if r.history_key in self._predicted and not is_deferred(c):  # the rank check's evidence for the next step
            self._observed.setdefault(r.history_key, []).append(len(c.token_ids))
        return c

    def _pick(self, block: Sequence[Instance], pool: InstancePool) -> Instance:
        return min(block, key=lambda i: (pool.inflight[i.name], i.name))

    async def _run(self, r: GenRequest, pool: InstancePool, plan: Optional[_Plan]) -> Completion:
        g = plan.group_of(r.history_key) if plan is not None else None
        if g is None or not plan.blocks[g]:
            return await pool.run(pool.least_loaded(r.request_id), r)
        try:
            inst = self._pick(plan.blocks[g], pool)
            self.acted["histopipe_placements"] += 1
            top = plan.max_hist[g]
            if not self.options.migration or top is None:
                return await pool.run(inst, r)
            st = Chunked(r)
            # the first check comes after the token that passes the length condition
            chunk = min(migration_threshold(top, plan.beta), st.remaining)
            migrated = False
            while True:
                c = await pool.run(inst, st.next_request(chunk))
                st.add(c)
                if not st.more(chunk, c):
                    return st.result(c)
                if not migrated:
                    self._m["migration_checks"] += 1
                    if should_migrate(st.generated, top, plan.beta, plan.running[g], plan.size[g], self.options.alpha):
                        if self._defers(g, plan):
                            self._m["deferrals"] += 1
                            self._carry(st)
                            return deferred_completion(st, c)
                        others = [i for i in pool.instances.values() if i is not inst]
                        if others:
                            inst = self._pick(others, pool)
                        migrated = True
                        self.acted["migrations"] += 1
                chunk = st.remaining if migrated else min(self.options.recheck_tokens, st.remaining)
        finally:
            plan.running[g] -= 1

    def _defers(self, g: int, plan: _Plan) -> bool:
        """Whether an outlier of ranking group ``g`` is deferred to the next step rather than
        migrated within this one: inter-step migration on, a carrier for this step, and ``g``
        among the longest ``inter_step_groups`` of the plan's ranking groups."""
        o = self.options
        if not o.inter_step or self._carry is None:
            return False
        if self._carry is NO_CARRIER:
            raise StrategyConfigError("strategy 'rhyme': inter_step=true needs a driver that carries deferred "
                                      "samples to the next step; none was set (set_deferral)")
        n = len(plan.blocks)
        return g >= n - max(1, round(o.inter_step_groups * n))

    def metrics(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self._m.items()}, "migrations": float(self.acted["migrations"])}


def _samples_per_prompt(requests: Sequence[GenRequest]) -> float:
    groups = {r.history_key for r in requests}
    return len(requests) / max(1, len(groups))


def _proportional(work: Sequence[float], wks: int) -> list[int]:
    """``wks`` instances in proportion to ``work``, at least one each (largest remainders)."""
    n = len(work)
    if wks < n:
        raise ValueError(f"{n} ranking groups need at least {n} instances, have {wks}")
    total = sum(work)
    if total <= 0:
        work, total = [1.0] * n, float(n)
    extra = wks - n
    share = [extra * w / total for w in work]
    plan = [1 + math.floor(s) for s in share]
    left = wks - sum(plan)
    for i in sorted(range(n), key=lambda i: -(share[i] - math.floor(share[i])))[:left]:
        plan[i] += 1
    return plan

