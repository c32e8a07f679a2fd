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

Between events the batch is fixed, so the instance plans all steps up to the next finish (or
capacity limit) at once as arrays, and schedules one timer at its end. A submit or abort in
the middle takes effect at the next step boundary, as in a real engine. Emitted tokens are
the trace's (``verl_ext.sim.source``). Not modelled: prefix caching, chunked prefill across
steps, and output processing overlapping the next step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Optional

import numpy as np

from verl_ext.engine.instance import FINISH_ABORT, Completion, GenRequest, Instance, Telemetry
from verl_ext.sim.source import Target, TokenView, TraceSource


class _Req:
    __slots__ = ("request", "target", "future", "pos", "left", "kv", "steps", "emit", "draft", "sj", "aborted", "ctx0")

    def __init__(self, request: GenRequest, target: Target, future: asyncio.Future):
        self.request = request
        self.target = target
        self.future = future
        self.pos = 0  # tokens emitted so far
        self.left = len(target.tokens)  # tokens still to emit
        self.kv = 0  # KV tokens held (0 while waiting)
        self.steps = 0
        self.emit: Optional[np.ndarray] = None  # replayed schedule: tokens emitted per step
        self.draft: Optional[np.ndarray] = None  # tokens drafted per step
        self.sj = 0  # next step of the schedule
        self.aborted = False
        self.ctx0 = target.prompt_len


class SimInstance(Instance):
    def __init__(self, name: str, cost, source: TraceSource, drafter=None, record_timeline: bool = True):
        self.name = name
        self.cost = cost
        self.source = source
        self.drafter = drafter
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self._by_id: dict[str, _Req] = {}
        self._kv = 0
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_steps = 0
        self._t0 = 0.0
        self._tcum = np.zeros(1)  # planned step end times, relative to _t0
        self._plan = None  # (E, D, P0) of the current plan; E/D None for plain decoding
        self._prefill = 0
        self._admit_next_step = False
        self._aborts = 0  # aborted requests not yet resolved
        # cumulative counters
        self.generated = 0
        self.steps = 0
        self.request_steps = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.preemptions = 0
        self.kv_peak = 0
        self.busy_s = 0.0
        self.timeline: Optional[list[tuple]] = [] if record_timeline else None

    # -- the Instance contract ----------------------------------------------------------------
    async def generate(self, request: GenRequest, on_tokens=None) -> Completion:
        completion = await self._generate(request)
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
        r = _Req(request, target, loop.create_future())
        if len(target.tokens) == 0:  # nothing left of the trace response
            return Completion(request.request_id, TokenView(target.tokens), target.finish_reason, num_steps=0)
        self._by_id[request.request_id] = r
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

    def telemetry(self) -> Telemetry:
        return Telemetry(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_cache_usage=self._kv / self.cost.kv_capacity_tokens,
            generated_tokens=self.generated,
            steps=self.steps,
            request_steps=self.request_steps,
            drafts=self.drafts,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
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
                                  self.generated, self.draft_tokens, self.accepted_tokens))
        if self.running:
            self._make_plan()
            self._schedule(loop, len(self._tcum) - 1)
        else:
            self._plan = None
            self._tcum = np.zeros(1)

    def _advance(self, steps: int) -> list[_Req]:
        """Apply the first ``steps`` planned steps; returns the requests that finished."""
        E, D, _ = self._plan
        B = len(self.running)
        if E is None:
            emitted = np.full(B, steps, dtype=np.int64)
            drafted = np.zeros(B, dtype=np.int64)
            per_step_drafts = 0
        else:
            emitted = E[:, :steps].sum(axis=1)
            drafted = D[:, :steps].sum(axis=1)
            per_step_drafts = int((D[:, :steps] > 0).sum())
        done = []
        for r, e in zip(self.running, emitted.tolist()):
            r.pos += e
            r.left -= e
            r.kv += e
            r.steps += steps
            r.sj += steps
            if r.left == 0:
                done.append(r)
        total = int(emitted.sum())
        dtot = int(drafted.sum())
        self._kv += total
        self.kv_peak = max(self.kv_peak, self._kv)
        self.generated += total
        self.steps += steps
        self.request_steps += B * steps
        self.busy_s += float(self._tcum[steps])
        if dtot:
            self.drafts += per_step_drafts
            self.draft_tokens += dtot
            self.accepted_tokens += total - B * steps
        return done

    def _release(self, r: _Req) -> None:
        self.running.remove(r)
        self._kv -= r.kv
        r.kv = 0
        if self.drafter is not None and self.drafter.per_step:
            self.drafter.finish(self._key(r), r.ctx0 + r.pos)

    def _resolve(self, r: _Req, reason: str) -> None:
        self._by_id.pop(r.request.request_id, None)
        if r.aborted:
            self._aborts -= 1
        if not r.future.done():
            tokens = TokenView(r.target.tokens[: r.pos])
            r.future.set_result(Completion(r.request.request_id, tokens, reason, num_steps=r.steps))

    # -- scheduling ---------------------------------------------------------------------------
    def _key(self, r: _Req) -> str:
        return f"{self.name}\x00{r.request.request_id}"

    def _admit(self) -> None:
        cost = self.cost
        cap = cost.kv_capacity_tokens
        k = self.drafter.spec.k if self.drafter is not None else 0
        # preempt (recompute) until the next step fits: every request needs room for 1 + k tokens
        while len(self.running) > 1 and self._kv + len(self.running) * (1 + k) > cap:
            victim = self.running.pop()
            self._kv -= victim.kv
            victim.kv = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1
        prefill = 0
        self._admit_next_step = False
        while self.waiting and len(self.running) < cost.max_num_seqs:
            r = self.waiting[0]
            ctx = r.ctx0 + r.pos
            if self._kv + ctx + (len(self.running) + 1) * (1 + k) > cap:
                break
            if prefill and prefill + ctx > cost.max_batched_tokens:
                self._admit_next_step = True  # the step's prefill budget is spent; the next step admits more
                break
            self.waiting.popleft()
            r.kv = ctx
            self._kv += ctx
            prefill += ctx
            self.running.append(r)
            if self.drafter is not None and r.emit is None and not self.drafter.per_step:
                r.emit, r.draft = self.drafter.schedule(self._key(r), r.request, r.target)
                r.sj = 0
            elif self.drafter is not None and self.drafter.per_step and not self.drafter.started(self._key(r)):
                self.drafter.start(self._key(r), r.request, r.target)
        self.kv_peak = max(self.kv_peak, self._kv)
        self._prefill = prefill

    def _make_plan(self) -> None:
        cost = self.cost
        cap = cost.kv_capacity_tokens
        B = len(self.running)
        P0 = self._prefill
        left = np.fromiter((r.left for r in self.running), dtype=np.int64, count=B)
        if self.drafter is None:
            n_fin = int(left.min())
            n_cap = max(1, (cap - self._kv) // B)  # steps until the cache is full
            n = min(n_fin, n_cap)
            s = np.arange(n, dtype=np.float64)
            tau = cost.step_time(B, self._kv + B * s, 0, 0)
            E = D = None
        else:
            if self.drafter.per_step:
                keys = [self._key(r) for r in self.running]
                pos = np.fromiter((r.ctx0 + r.pos for r in self.running), dtype=np.int64, count=B)
                e, d = self.drafter.step(keys, pos)
                E, D = e[:, None], d[:, None]
            else:
                n_fin = min(len(r.emit) - r.sj for r in self.running)
                E = np.stack([r.emit[r.sj: r.sj + n_fin] for r in self.running]).astype(np.int64)
                D = np.stack([r.draft[r.sj: r.sj + n_fin] for r in self.running]).astype(np.int64)
            k = self.drafter.spec.k
            kv_before = self._kv + np.concatenate([[0], np.cumsum(E.sum(axis=0))[:-1]])
            ok = kv_before + B * (1 + k) <= cap
            n = int(np.argmin(ok)) if not ok.all() else E.shape[1]
            n = max(1, n)
            E, D = E[:, :n], D[:, :n]
            tau = cost.step_time(B, kv_before[:n], 0, D.sum(axis=0))
        tau = np.asarray(tau, dtype=np.float64).copy()
        if P0:
            tau[0] = cost.step_time(B, self._kv, P0, 0 if D is None else D[:, 0].sum())
        if self._admit_next_step:  # end the plan after one step so the next step admits
            tau = tau[:1]
            if E is not None:
                E, D = E[:, :1], D[:, :1]
        self._tcum = np.concatenate([[0.0], np.cumsum(tau)])
        self._plan = (E, D, P0)
