"""Consecutive training steps in the simulator: rollout and training as a pipeline.

A single simulated rollout (``verl_ext.sim.runner``) measures one step in isolation. RhymeRL's
HistoPipe (RhymeRL, section 6.2, Figure 10) gains across steps: the instances that drew short
ranking groups in step ``s`` start step ``s + 1`` (with long groups, alternation) while the others
still finish, so one step's tail overlaps the next step's work. This module replays one trace epoch
as ``steps`` training steps (its prompts shuffled into equal batches, the same for every arm) on
the same simulated instances, with a training phase of ``t_train`` seconds after each step's last
sample, in one of three modes:

* ``sync``: veRL's default, on-policy. Step ``s`` starts everywhere when training on step ``s - 1``
  has finished (its weights are the ones it samples with).
* ``one_step_off``: veRL's ``one_step_off_policy`` recipe (off-policyness 1). Step ``s`` starts
  everywhere when step ``s - 1``'s rollout has finished and the weights of training step
  ``s - 2`` are ready; training on step ``s - 1`` overlaps step ``s``'s rollout.
* ``stream``: RhymeRL's streaming pipeline with worker-controlled weight updates (section 4.2,
  Figure 10; off-policyness 1). Each instance starts step ``s`` as soon as it has nothing of step
  ``s - 1`` left and the weights of training step ``s - 2`` are ready. veRL 0.9's closest mode is
  the V1 ``separate_async`` trainer with ``max_off_policy_threshold`` 1.

Training on step ``s`` starts when its last sample is done and training on ``s - 1`` has finished.
``t_train`` defaults to 15% of a synchronous ``baseline`` step (``TRAIN_SHARE``: RhymeRL section 1
measures rollout at 84-91% of a step). Each step gets its own strategy object and ``InstancePool``
(in-flight counts of that step only: a least-loaded pick among an instance's own step), while the
instances themselves are shared and batch whatever work of any step they hold.

The modes other than ``sync`` change which weights generate a sample (off-policyness 1): they
measure what an off-policy trainer would gain, not something ``rollout=rhyme`` does to an
on-policy veRL run.

**Inter-step migration** (RhymeRL section 6.3, ``rhyme[inter_step=true]``; ``verl_ext.pipe.defer``):
in ``one_step_off`` and ``stream`` modes each step's strategy gets a carrier (none in the last
step). A deferred request leaves its step's rollout; once the next step is dispatched the pipeline
resumes it on that step's least-loaded instance (prompt + tokens re-prefilled), and it counts
towards that step's rollout end and training. Its whole GRPO group trains with that step
(``deferred_samples``: samples trained one step late); its first tokens were sampled with the
weights of the step before (off-policyness up to 2 for those tokens in these modes). ``sync``
refuses it: it is veRL's on-policy loop.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from verl_ext.engine.instance import Completion, GenRequest, Instance, Telemetry
from verl_ext.pipe import mechanisms
from verl_ext.pipe.chunks import Chunked
from verl_ext.pipe.lifecycle import Lifecycle
from verl_ext.pipe.defer import is_deferred, resume_deferred
from verl_ext.pipe.pool import InstancePool

MODES = ("sync", "one_step_off", "stream")
#: default training share of a synchronous step (RhymeRL section 1: rollout takes 84-91%)
TRAIN_SHARE = 0.15
#: virtual seconds between a step's dispatch and its instances' gates opening: every request of
#: the step has been routed by then (routing takes no virtual time)
_ROUTE_S = 1e-6


def _carrier(mode: str):
    """``make_arm``'s carrier for an arm in ``mode``: the off-policy modes carry deferred samples
    (None), the on-policy ``sync`` pipeline does not."""
    return None if mode != "sync" else "the on-policy `sync` pipeline"


def split_steps(prompt_uids: np.ndarray, rows: np.ndarray, steps: int, seed: int = 0) -> list[np.ndarray]:
    """The trace ``rows`` of one epoch as ``steps`` batches of whole prompts (all samples of a
    prompt in one step), shuffled with ``seed``; ``prompt_uids`` is the trace's uid column."""
    uids = np.array(sorted(set(prompt_uids[rows].tolist())), dtype=object)
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if steps > len(uids):
        raise ValueError(f"--steps {steps} is more than the epoch's {len(uids)} prompts")
    order = np.random.default_rng(seed).permutation(len(uids))
    batches = np.array_split(uids[order], steps)
    of_row = prompt_uids[rows]
    return [rows[np.isin(of_row, b)] for b in batches]


@dataclass
class StepTimes:
    """Virtual times (seconds from the start) of one training step."""

    step: int
    dispatch_s: float = math.nan  # the step's requests handed to its strategy
    first_start_s: float = math.nan  # the first instance began it
    rollout_end_s: float = math.nan  # its last sample finished
    train_start_s: float = math.nan
    train_end_s: float = math.nan
    output_tokens: int = 0  # tokens of the samples this step trains on
    deferred_out: int = 0  # requests deferred from this step to the next
    deferred_in: int = 0  # requests of the step before resumed in this step
    trained_samples: int = 0  # samples this step trains on (a deferred request's group moves with it)


class StepInstance(Instance):
    """The view of a shared instance that one step's pool sees: requests wait at the instance's
    gate for that step (``Pipeline``) and then run on the shared instance."""

    def __init__(self, inner: Instance, step: int, pipeline: "Pipeline"):
        self.inner = inner
        self.name = inner.name
        self.step = step
        self._p = pipeline

    async def generate(self, request: GenRequest, on_tokens=None) -> Completion:
        key = (self.name, self.step)
        p = self._p
        p.inflight[key] += 1
        try:
            await p.gate(*key).wait()
            return await (self.inner.generate(request) if on_tokens is None else self.inner.generate(request, on_tokens))
        finally:
            p.inflight[key] -= 1
            p.check_done(*key)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def telemetry(self) -> Telemetry:
        return self.inner.telemetry()


class Pipeline:
    """Gates, step boundaries and training phases over shared instances in virtual time."""

    def __init__(self, instances: Sequence[Instance], mode: str, t_train: float, steps: int):
        if mode not in MODES:
            raise ValueError(f"unknown pipeline mode '{mode}'; valid: {list(MODES)}")
        if t_train < 0 or not math.isfinite(t_train):
            raise ValueError(f"t_train must be a finite number of seconds >= 0, got {t_train}")
        self.instances = list(instances)
        self.mode = mode
        self.t_train = float(t_train)
        self.steps = steps
        self.inflight: dict = defaultdict(int)  # (instance, step) -> requests of that step on it
        self._gates: dict = {}
        self._done: set = {(i.name, 0) for i in self.instances}
        self._routed: set = set()
        self.times = [StepTimes(s) for s in range(steps + 1)]  # index 0: before the first step
        self.spans: dict = {}  # (instance, step) -> [start, end] of its work on that step
        self._trained = {s: asyncio.Event() for s in range(-1, steps + 1)}
        self._trained[-1].set()
        self._trained[0].set()
        self._rolled = {s: asyncio.Event() for s in range(0, steps + 1)}
        self._rolled[0].set()
        self._pools: dict = {}  # step -> its InstancePool, once dispatched
        self._carried: dict = defaultdict(list)  # step -> [(Chunked, on_done)] waiting for its dispatch
        self._resumed: dict = defaultdict(list)  # step -> [tasks] of deferred requests resumed in it
        self.deferred_samples = 0  # samples trained one step late (deferred requests and their groups)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def gate(self, name: str, step: int) -> asyncio.Event:
        g = self._gates.get((name, step))
        if g is None:
            g = self._gates[(name, step)] = asyncio.Event()
        return g

    def _try_open(self, name: str, step: int) -> None:
        """Open ``name``'s gate for ``step`` once the step is routed and (``stream``) the instance
        has finished the step before; the other modes' dispatch already waited for everything."""
        g = self.gate(name, step)
        if g.is_set() or step not in self._routed:
            return
        if self.mode == "stream" and (name, step - 1) not in self._done:
            return
        g.set()
        self.spans[(name, step)] = [self._now(), math.nan]
        t = self.times[step]
        if math.isnan(t.first_start_s):  # gates open in time order: the first is the earliest
            t.first_start_s = self._now()
        self.check_done(name, step)

    def check_done(self, name: str, step: int) -> None:
        """``name`` is done with ``step`` when its gate is open and none of the step's requests
        are on it (work that arrives later, e.g. a migrated request, still runs)."""
        key = (name, step)
        if key in self._done or not self.gate(name, step).is_set() or self.inflight[key] > 0:
            return
        self._done.add(key)
        self.spans[key][1] = self._now()
        if step < self.steps:
            self._try_open(name, step + 1)

    async def _routed_after(self, step: int) -> None:
        await asyncio.sleep(_ROUTE_S)
        self._routed.add(step)
        for inst in self.instances:
            self._try_open(inst.name, step)

    async def _weights_for(self, step: int) -> None:
        """Wait until step ``step`` may be dispatched."""
        if self.mode == "sync":
            await self._trained[step - 1].wait()
            return
        await self._trained[step - 2].wait()
        if self.mode == "one_step_off":
            await self._rolled[step - 1].wait()

    # -- inter-step migration ------------------------------------------------------------------------
    def carry(self, step: int, st: Chunked, on_done: Optional[Callable[[], None]] = None) -> None:
        """Resume the deferred request ``st`` in ``step`` (now if it is dispatched, else at its
        dispatch); ``on_done`` runs when it has finished."""
        if not 1 <= step <= self.steps:
            raise ValueError(f"cannot carry a request into step {step} of {self.steps}")
        self.times[step].deferred_in += 1
        self.times[step - 1].deferred_out += 1
        if step in self._pools:
            self._resume(step, st, on_done)
        else:
            self._carried[step].append((st, on_done))

    def _resume(self, step: int, st: Chunked, on_done) -> None:
        self._resumed[step].append(asyncio.ensure_future(self._run_resumed(self._pools[step], st, on_done)))

    @staticmethod
    async def _run_resumed(pool: InstancePool, st: Chunked, on_done) -> Completion:
        try:
            return await resume_deferred(st, pool)
        finally:
            if on_done is not None:
                on_done()

    async def _train(self, step: int, rollout: asyncio.Future) -> None:
        await rollout
        # requests deferred into this step: all are carried once the step before has rolled out
        await self._rolled[step - 1].wait()
        if self._resumed[step]:
            await asyncio.gather(*self._resumed[step])
        t = self.times[step]
        t.rollout_end_s = self._now()
        self._rolled[step].set()
        await self._trained[step - 1].wait()
        t.train_start_s = self._now()
        await asyncio.sleep(self.t_train)
        t.train_end_s = self._now()
        self._trained[step].set()

    async def run(self, step_requests: Sequence[Sequence[GenRequest]],
                  rollout: Callable[[int, Sequence[GenRequest], InstancePool], "asyncio.Future"],
                  seed: int = 0) -> list[list[Completion]]:
        """Run ``rollout(step, requests, pool)`` (a strategy's rollout; 1-based steps) for every
        step in turn as the mode allows; return each step's completions: a deferred request
        (``carry``) appears complete in the step that resumed it, after that step's own."""
        if len(step_requests) != self.steps:
            raise ValueError(f"expected {self.steps} steps of requests, got {len(step_requests)}")
        loop = asyncio.get_running_loop()
        rollouts, trains = [], []
        try:
            for s, reqs in enumerate(step_requests, start=1):
                await self._weights_for(s)
                self.times[s].dispatch_s = self._now()
                pool = InstancePool([StepInstance(i, s, self) for i in self.instances], seed=seed + s, clock=loop.time)
                pool.t0 = 0.0  # records in absolute virtual time
                self._pools[s] = pool
                for st, on_done in self._carried.pop(s, ()):
                    self._resume(s, st, on_done)
                task = asyncio.ensure_future(rollout(s, reqs, pool))
                rollouts.append(task)
                asyncio.ensure_future(self._routed_after(s))
                trains.append(asyncio.ensure_future(self._train(s, task)))
            await asyncio.gather(*trains)
            out = self._trained_sets(step_requests, [t.result() for t in rollouts])
        except BaseException:
            resumed = [t for ts in self._resumed.values() for t in ts]
            for t in (*rollouts, *trains, *resumed):
                t.cancel()
            await asyncio.gather(*rollouts, *trains, *resumed, return_exceptions=True)
            raise
        for s, comps in enumerate(out, start=1):
            self.times[s].output_tokens = sum(len(c.token_ids) for c in comps)
            self.times[s].trained_samples = len(comps)
        return out

    def _trained_sets(self, step_requests, results) -> list[list[Completion]]:
        """The completions each step trains on: its own, less the GRPO groups with a deferred
        member, which train with the next step together with the resumed request."""
        out, held = [], []
        for s, (reqs, comps) in enumerate(zip(step_requests, results), start=1):
            late = {r.group_id for r, c in zip(reqs, comps) if is_deferred(c)}
            mine = [c for r, c in zip(reqs, comps) if r.group_id not in late]
            waiting = [c for r, c in zip(reqs, comps) if r.group_id in late and not is_deferred(c)]
            out.append(held + mine + [t.result() for t in self._resumed[s]])
            held = waiting
            self.deferred_samples += len(waiting) + sum(is_deferred(c) for c in comps)
        return out

    # -- results -----------------------------------------------------------------------------------
    def metrics(self) -> dict:
        steps = self.times[1:]
        end = steps[-1].train_end_s
        rollout_end = max(t.rollout_end_s for t in steps)
        tokens = sum(t.output_tokens for t in steps)
        busy = sum(e - s for s, e in self.spans.values())
        n = len(self.instances)
        return {
            "pipeline_s": end,
            "rollout_span_s": rollout_end,
            "output_tokens": tokens,
            "throughput_tok_s": tokens / end if end > 0 else 0.0,
            "step_s": end / len(steps),
            "t_train_s": self.t_train,
            "deferred_samples": self.deferred_samples,
            # the fraction of instance-time, up to the last sample, an instance held no step's work
            "bubble_fraction": 1.0 - busy / (n * rollout_end) if rollout_end > 0 else None,
            "steps": [vars(t) for t in steps],
        }


@dataclass
class PipelineResult:
    name: str
    mode: str
    metrics: dict
    spans: dict = field(default_factory=dict)  # (instance, step) -> [start, end]
    records: list = field(default_factory=list)  # RequestRecord dicts (absolute times) with their step
    completions: Optional[list] = None  # per step, what it trained on (``keep_completions``)


def step_rollout(pipe: Pipeline, new_strategy: Callable, history=None, history_steps: int = 0, t_train: float = 0.0,
                 drafter=None, on_step: Optional[Callable] = None) -> Callable:
    """The ``rollout`` callback of ``Pipeline.run`` for a strategy on any instances (simulated or
    real): ``new_strategy(step)`` makes each step's strategy, which gets ``history`` (a history
    provider, for strategies with ``uses_history``), the global step ``history_steps + step``
    (history holds steps up to ``history_steps``), ``t_train`` as the last training time, and
    inter-step migration's carrier into ``pipe`` (none in the last step). ``drafter``: the
    simulator's shared drafter whose histories are loaded per step (``load_histories`` /
    ``drop_histories``; a deferred prompt's stay until its resumed request is done).
    ``on_step(step, strategy, pool)`` runs after each step's own rollout."""

    async def rollout(step: int, reqs, pool):
        strategy = new_strategy(step)
        uids = sorted({r.group_id for r in reqs})
        deferred: set = set()

        def carry(st: Chunked) -> None:
            uid = st.request.group_id
            deferred.add(uid)
            pipe.carry(step + 1, st, (lambda: drafter.drop_histories([uid])) if drafter is not None else None)

        life = Lifecycle(strategy, history=history, carrier=carry if step < pipe.steps else None)
        life.begin_step(history_steps + step, train_s=t_train, overlap=pipe.mode != "sync")
        if drafter is not None:
            drafter.load_histories(uids)
        try:
            out = await strategy.rollout(reqs, pool)
        finally:
            await strategy.close()
            if drafter is not None:
                drafter.drop_histories([u for u in uids if u not in deferred])
        if on_step is not None:
            on_step(step, strategy, pool)
        return out

    return rollout


# -- arms ------------------------------------------------------------------------------------------
def run_pipeline_arm(label: str, cfg, cost, trace, rows, history, batches, max_tokens: int, mode: str,
                     t_train: float, progress: bool = False, keep_completions: bool = False) -> PipelineResult:
    """One ``--strategies`` entry over ``batches`` (trace rows per step) in ``mode``: a fresh
    strategy object per step (steps overlap), the instances and their drafter shared."""
    from verl_ext.pipe.arms import make_arm
    from verl_ext.history import LocalHistory
    from verl_ext.sim.clock import run_virtual
    from verl_ext.sim.drafting import make_drafter
    from verl_ext.sim.instance import SimInstance
    from verl_ext.sim.workload import build_requests, epoch_spec, trace_history, trace_keyed
    from verl_ext.sim.source import TraceSource

    carrier = _carrier(mode)
    first, spec = make_arm(label, cfg.spec_k, allow_history=True, cost=cost, carrier=carrier)
    spec = epoch_spec(spec, history, first.uses_history)
    epoch = int(trace.epoch[rows[0]])
    store = trace_history(trace, epoch) if first.uses_history else None
    source = TraceSource(trace, rows)
    # one index stands for every instance's drafter (their memory together); it holds the
    # histories of the steps being rolled out, as the engines would
    drafter = make_drafter(spec, source, cfg.replay, history, preload=False,
                           max_bytes=spec.max_bytes * cfg.instances if spec else None)
    lazy = drafter is not None and drafter.lazy_history
    from verl_ext.sim.dispatcher import SimDispatcher

    via = SimDispatcher() if cfg.dispatcher else None
    keyed = trace_keyed(trace)
    sims = [SimInstance(f"sim-{i}", cost, source, drafter, record_timeline=False, dispatcher=via,
                        keyed_sampling=keyed) for i in range(cfg.instances)]
    step_requests = [build_requests(trace, b, max_tokens) for b in batches]
    pipe = Pipeline(sims, mode, t_train, len(batches))
    per_step: list[dict] = []
    pools: dict = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(batches), desc=f"{label[:24]:>24} {mode}", unit="step", leave=True)

    acted: dict = {}  # mechanism -> count, over the steps' strategies

    def on_step(step, strategy, pool):
        per_step.append({"step": step, **strategy.metrics()})
        for name, n in mechanisms.count(strategy).items():
            acted[name] = acted.get(name, 0) + n
        pools[step] = pool  # its records once the pipeline is done (a resumed request ends later)
        if bar is not None:
            bar.update()

    def new_strategy(step):
        return first if step == 1 else make_arm(label, cfg.spec_k, allow_history=True, cost=cost, carrier=carrier)[0]

    rollout = step_rollout(pipe, new_strategy, LocalHistory(store) if first.uses_history else None, epoch, t_train,
                           drafter if lazy else None, on_step)
    try:
        trained = run_virtual(pipe.run(step_requests, rollout, seed=cfg.seed))
    finally:
        if bar is not None:
            bar.close()
    records = [{"step": step, **asdict(r)} for step in sorted(pools) for r in pools[step].records]
    m = pipe.metrics()
    generated = sum(s.counters.generated_tokens for s in sims)
    request_steps = sum(s.counters.request_steps for s in sims)
    drafted = sum(s.counters.draft_tokens for s in sims)
    m.update({
        "requests": sum(len(r) for r in step_requests),
        "tokens_per_step": generated / request_steps if request_steps else None,
        "draft_acceptance": sum(s.counters.accepted_tokens for s in sims) / drafted if drafted else None,
        "preemptions": sum(s.preemptions for s in sims),
        "strategy_steps": sorted(per_step, key=lambda d: d["step"]),
    })
    for key in ("migrations", "deferrals", "histopipe_active", "histopipe_fallbacks", "histopipe_sync_off"):
        if any(key in d for d in per_step):
            m[f"strategy/{key}"] = float(sum(d.get(key, 0.0) for d in per_step))
    # the steps' own counts, and the drafters' (the instances outlive the steps: their counters
    # cover the whole pipeline)
    totals = mechanisms.count(first, run_virtual(mechanisms.read_drafters(sims)), acted_before=first.acted)
    m["mechanisms"] = {k: acted.get(k, 0) if src == "strategy" else totals[k] for k, src in type(first).mechanisms.items()}
    if spec is not None:
        m["spec"] = {**spec.to_dict(), "replay": drafter.mode}
    return PipelineResult(f"{label}@{mode}", mode, m, dict(pipe.spans), records,
                          trained if keep_completions else None)


def arm_mode(label: str, default: str) -> tuple[str, str]:
    """(strategy label, pipeline mode) of a ``--strategies`` entry: ``label@mode`` runs that arm in
    ``mode`` instead of ``--pipeline``'s."""
    base, at, mode = label.rpartition("@")
    if not at:
        return label, default
    if mode == "kvpool":
        raise ValueError(f"arm '{label}': @kvpool arms run in single-rollout simulations (no --pipeline)")
    if mode not in MODES:
        raise ValueError(f"arm '{label}': unknown pipeline mode '{mode}'; valid: {list(MODES)}")
    return base, mode


def run_pipeline_ab(cfg, progress: bool = True, trace=None) -> dict:
    """``verl-ext sim --pipeline MODE``: every strategy over the epoch's ``cfg.steps`` steps in
    ``cfg.pipeline`` mode (``label@mode`` for another), plus the reference ``baseline@sync``
    (veRL's synchronous loop) unless listed; writes ``cfg.out``."""
    import datetime as _dt
    import os
    import platform
    import time
    from pathlib import Path

    from verl_ext.compare.metrics import SCHEMA
    from verl_ext.pipe.arms import make_arm
    from verl_ext.compare.outputs import check_out_dir, write_staged
    from verl_ext.sim.workload import load_workload, select_epoch

    cfg.validate()
    cost = cfg.cost_model()
    arms = [arm_mode(label, cfg.pipeline) for label in cfg.strategies]
    for label, mode in arms:  # bad labels fail before any work
        make_arm(label, cfg.spec_k, allow_history=True, cost=cost, carrier=_carrier(mode))
    out = Path(cfg.out)
    check_out_dir(out)
    trace = trace if trace is not None else load_workload(cfg)
    epoch, rows, history = select_epoch(trace, cfg.epoch)
    batches = split_steps(trace.prompt_uid, rows, cfg.steps, cfg.seed)
    max_tokens = cfg.max_tokens or int(trace.response_lengths()[rows].max())
    t_wall = time.perf_counter()
    t_train = cfg.t_train
    if t_train is None:  # TRAIN_SHARE of a synchronous baseline step
        calib = run_pipeline_arm("baseline", cfg, cost, trace, rows, history, batches, max_tokens, "sync", 0.0)
        t_train = TRAIN_SHARE / (1.0 - TRAIN_SHARE) * calib.metrics["pipeline_s"] / cfg.steps
    if ("baseline", "sync") not in arms:
        arms.insert(0, ("baseline", "sync"))  # the reference: veRL's synchronous loop
    results = [run_pipeline_arm(label, cfg, cost, trace, rows, history, batches, max_tokens, mode, t_train, progress)
               for label, mode in arms]
    by = {r.name: r.metrics for r in results}
    ref = by["baseline@sync"]["throughput_tok_s"]
    for r in results:
        same = by.get(f"baseline@{r.mode}")
        r.metrics["vs_baseline_sync"] = r.metrics["throughput_tok_s"] / ref
        r.metrics["vs_baseline"] = r.metrics["throughput_tok_s"] / same["throughput_tok_s"] if same else None
    lengths = trace.response_lengths()[rows]
    summary = {
        "schema": SCHEMA,
        "kind": "sim_pipeline",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "epoch": epoch, "max_tokens": max_tokens, "t_train_s": t_train,
                   "cost_model": cost.to_dict()},
        "workload": {
            "source": trace.meta.get("source"),
            "requests": len(rows),
            "prompts": len(set(trace.prompt_uid[rows].tolist())),
            "steps": cfg.steps,
            "response_tokens": int(lengths.sum()),
            "mean_response": float(lengths.mean()),
            "max_response": int(lengths.max()),
            "similarity": None if cfg.trace else cfg.similarity,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "sim_seconds": time.perf_counter() - t_wall,
        "strategies": {r.name: r.metrics for r in results},
    }
    write_staged(out, summary, results, lambda staging: write_pipeline_report(staging, summary, results))
    return summary


# -- report ----------------------------------------------------------------------------------------
def format_pipeline_table(summary: dict) -> str:
    from verl_ext.compare.outputs import render_table

    return render_table(summary, [
        ("strategy", None, "{}"), ("total s", "pipeline_s", "{:.1f}"), ("s/step", "step_s", "{:.1f}"),
        ("tok/s", "throughput_tok_s", "{:,.0f}"), ("bubbles", "bubble_fraction", "{:.0%}"),
        ("tok/step", "tokens_per_step", "{:.2f}"), ("accept", "draft_acceptance", "{:.2f}"),
        ("vs baseline", "vs_baseline", "{:.3f}"), ("vs sync baseline", "vs_baseline_sync", "{:.3f}")])


def plot_steps(results: Sequence[PipelineResult], path) -> None:
    """One panel per arm: each instance's work on each step (alternating colours), so the bubbles
    between steps and the overlap of consecutive steps show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.0 + 1.8 * len(results)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        names = sorted({n for n, _ in r.spans}, key=lambda n: (len(n), n))
        row = {n: i for i, n in enumerate(names)}
        for (n, s), (a, b) in r.spans.items():
            if math.isfinite(a) and math.isfinite(b) and b > a:
                ax.broken_barh([(a, b - a)], (row[n] - 0.4, 0.8), color="C0" if s % 2 else "C1", lw=0)
        for st in r.metrics["steps"]:
            ax.axvspan(st["train_start_s"], st["train_end_s"], color="0.85", zorder=0)
        ax.set_title(f"{r.name}: instances over time, steps alternate colour, training shaded",
                     fontsize=9)
        ax.set_ylabel("instance")
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_pipeline_report(out, summary: dict, results: Sequence[PipelineResult]) -> None:
    from pathlib import Path

    out = Path(out)
    plot_steps(results, out / "steps.png")
    w = summary["workload"]
    c = summary["config"]
    lines = [
        f"# Simulated training pipeline: {c['pipeline']} mode",
        "",
        f"{w['requests']} requests ({w['prompts']} prompts, mean response {w['mean_response']:.0f}, max "
        f"{w['max_response']}) in {w['steps']} steps on {c['instances']} x {c['preset']}; training "
        f"{c['t_train_s']:.1f} s per step. Arms are `strategy@mode`; `vs baseline`: against `baseline` in "
        "the same mode; `vs sync baseline`: against veRL's synchronous on-policy loop (`baseline@sync`).",
        "",
        "```",
        format_pipeline_table(summary),
        "```",
        "",
        "![steps](steps.png)",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
