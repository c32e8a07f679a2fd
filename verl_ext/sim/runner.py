"""``verl-ext sim``: strategies side by side on simulated instances over a trace.

The same strategies (``verl_ext.pipe``) and drafters (``verl_ext.spec``) as on real engines run
on ``SimInstance``s in virtual time. The workload is one epoch of a trace (recorded, or
synthetic: ``verl_ext.trace.synth``); the instances' step times come from a cost model
(``verl_ext.perf.cost``: a GPU preset or a ``verl-ext fit`` result). Outputs: the same
``summary.json`` schema as real runs (``kind: "sim"``), ``requests.jsonl``, and ``report.md``
with its PNGs (``verl_ext.sim.report``).
"""

from __future__ import annotations

import datetime as _dt
import multiprocessing as mp
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from verl_ext.compare.metrics import SCHEMA
from verl_ext.pipe.arms import make_arm, validate_strategies
from verl_ext.compare.outputs import check_out_dir, write_staged
from verl_ext.compare.run import run_strategy
from verl_ext.engine.instance import GenRequest
from verl_ext.pipe.lifecycle import UNSET, Lifecycle
from verl_ext.sim.defaults import DEFAULT_INSTANCES, DEFAULT_PRESET
from verl_ext.sim.kv_pool import DEFAULT_POOL_BW
from verl_ext.sim.workload import build_requests, epoch_spec, load_workload, select_epoch, trace_history, trace_keyed

#: an arm label ending in this runs its instances with a cluster KV pool (``verl_ext.sim.kv_pool``)
KV_POOL_SUFFIX = "@kvpool"


def split_kv_pool(label: str) -> tuple[str, bool]:
    """(the strategy label, whether the arm runs with a KV pool) of a ``--strategies`` entry."""
    if label.endswith(KV_POOL_SUFFIX):
        return label[: -len(KV_POOL_SUFFIX)], True
    return label, False


def make_kv_pool(cfg: "SimConfig"):
    """A fresh cluster KV pool for one arm: the preset's KV bytes per token over ``cfg.kv_pool_gbps``."""
    from verl_ext.perf.cost import preset_derivation
    from verl_ext.sim.kv_pool import KVPool, kv_bytes_per_token

    der = preset_derivation(cfg.preset)
    if der is None:
        raise ValueError(f"arms with {KV_POOL_SUFFIX} need a cost model with a 'derivation' section (the GPU presets) "
                         f"for the KV bytes per token; '{cfg.preset}' has none")
    return KVPool(kv_bytes_per_token(der) / (cfg.kv_pool_gbps * 1e9))



@dataclass
class SimConfig:
    strategies: list[str] = field(default_factory=lambda: ["baseline", "oracle"])
    trace: Optional[str] = None  # a trace file; None: the synthetic default scenario
    synth: dict = field(default_factory=dict)  # SynthConfig overrides for synthetic workloads
    similarity: str = "measured"  # synthetic token similarity level
    preset: str = DEFAULT_PRESET
    instances: int = DEFAULT_INSTANCES
    epoch: Optional[int] = None  # epoch to roll out; default: the last (earlier ones = history)
    max_tokens: Optional[int] = None  # default: the trace's longest response
    spec_k: int = 8
    replay: str = "auto"
    seed: int = 0
    out: str = "runs/ab_sim"
    #: consecutive training steps (``verl_ext.sim.pipeline``): None = one rollout in isolation;
    #: "sync" | "one_step_off" | "stream"
    pipeline: Optional[str] = None
    steps: int = 8  # with pipeline: the epoch's prompts in this many training steps
    t_train: Optional[float] = None  # with pipeline: seconds per training step (None: 15% of a sync step)
    #: ``<arm>@kvpool`` arms: the cluster KV pool's link bandwidth per GPU, GB/s (``verl_ext.sim.kv_pool``)
    kv_pool_gbps: float = DEFAULT_POOL_BW / 1e9
    #: charge veRL's dispatcher actor for every server call (``verl_ext.sim.dispatcher``)
    dispatcher: bool = True
    #: roll the trace's earlier epochs out first, untimed, on instances whose learned drafting
    #: state (RLHFSpec's acceptance map and prefill statistics, the batch cut-off's measured
    #: acceptance) the timed epoch's instances take over: what engines that serve every epoch of
    #: a run carry (``verl-ext ab --epochs 2``). Off: the timed epoch starts from cold engines.
    warm_epochs: bool = False
    #: vLLM engine arguments of the engines simulated, of those the cost model states
    #: (``CostModel.with_engine_args``: ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``)
    engine_args: dict = field(default_factory=dict)

    def cost_model(self):
        """The preset, with ``engine_args`` applied."""
        from verl_ext.perf.cost import load_cost_model

        return load_cost_model(self.preset).with_engine_args(self.engine_args)

    def validate(self) -> None:
        validate_strategies(self.strategies)
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        from verl_ext.sim.drafting import MODES

        if self.replay not in MODES:
            raise ValueError(f"unknown replay mode '{self.replay}'; valid: {list(MODES)}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"--max-tokens must be > 0, got {self.max_tokens}")
        if not (self.kv_pool_gbps > 0 and self.kv_pool_gbps != float("inf")):
            raise ValueError(f"--kv-pool-gbps must be a number of GB/s > 0, got {self.kv_pool_gbps}")
        if self.warm_epochs and self.pipeline is not None:
            raise ValueError("--warm-epochs is for one rollout; --pipeline's consecutive steps run on the same instances")
        if self.pipeline is not None:
            from verl_ext.sim.pipeline import MODES as PIPELINE_MODES

            if self.pipeline not in PIPELINE_MODES:
                raise ValueError(f"unknown --pipeline mode '{self.pipeline}'; valid: {list(PIPELINE_MODES)}")
            if self.steps < 1:
                raise ValueError(f"--steps must be >= 1, got {self.steps}")
            if self.t_train is not None and not (self.t_train >= 0 and self.t_train != float("inf")):
                raise ValueError(f"--t-train must be a number of seconds >= 0, got {self.t_train}")


@dataclass
class SimArm:
    name: str
    metrics: dict
    records: list
    instances: list  # SimInstance (timelines, counters); an arm run in a worker: ArmTimeline


@dataclass
class ArmTimeline:
    """What the report reads of an instance (its ``timeline``), for an arm run in a worker process."""
    timeline: Optional[list]


def default_jobs(arms: int) -> int:
    """Worker processes for ``arms`` arms: one per arm, at most the CPUs this process may run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(arms, cpus))


def run_sim_ab(cfg: SimConfig, progress: bool = True, trace=None, jobs: int = 1) -> dict:
    """Run every strategy in ``cfg`` on simulated instances; write outputs into ``cfg.out``.

    ``jobs``: arms run side by side in this many forked worker processes (1: one after another
    in this process; ``verl-ext sim`` passes ``default_jobs``). Arms share nothing, so each arm's
    figures are the same either way; only ``sim_seconds`` (each arm's own wall time) differs."""
    cfg.validate()
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if cfg.pipeline is not None:
        from verl_ext.sim.pipeline import run_pipeline_ab

        return run_pipeline_ab(cfg, progress=progress, trace=trace)
    cost = cfg.cost_model()
    arms = []
    for label in cfg.strategies:
        base, pooled = split_kv_pool(label)
        strategy, spec = make_arm(base, cfg.spec_k, allow_history=True, cost=cost)
        arms.append((label, strategy, spec, make_kv_pool(cfg) if pooled else None))
    out = Path(cfg.out)
    check_out_dir(out)
    t_load = time.perf_counter()
    trace = trace if trace is not None else load_workload(cfg)
    epoch, rows, history = select_epoch(trace, cfg.epoch)
    max_tokens, requests = _epoch_requests(cfg, trace, rows)
    load_s = time.perf_counter() - t_load

    def one(i: int, position: int = 0) -> SimArm:
        label, strategy, spec, kv_pool = arms[i]
        warm = _warm_instances(cfg, trace, epoch, strategy, spec, cost) if cfg.warm_epochs else None
        return run_arm(label, strategy, spec, trace, rows, history, cost, cfg.instances, cfg.replay, requests,
                       seed=cfg.seed, progress=progress, kv_pool=kv_pool, dispatcher=cfg.dispatcher,
                       warm_from=warm, bar_position=position)

    jobs = min(jobs, len(arms))
    if jobs > 1 and "fork" in mp.get_all_start_methods():
        results = _run_forked(one, _per_step_first(arms, cfg.replay), jobs)
    else:
        results = [one(i) for i in range(len(arms))]
    _add_ratios(results)
    summary = {
        "schema": SCHEMA,
        "kind": "sim",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "epoch": epoch, "max_tokens": max_tokens, "cost_model": cost.to_dict()},
        "workload": {
            "source": trace.meta.get("source"),
            "requests": len(rows),
            "prompts": len(set(trace.prompt_uid[rows].tolist())),
            "response_tokens": int(trace.response_lengths()[rows].sum()),
            "mean_response": float(trace.response_lengths()[rows].mean()),
            "max_response": int(trace.response_lengths()[rows].max()),
            "similarity": None if cfg.trace else cfg.similarity,
            "load_s": load_s,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "strategies": {r.name: r.metrics for r in results},
    }
    _write(out, summary, results)
    return summary


_FORKED_ARM = None  # the arm runner a forked worker calls (``_run_forked``)


def _forked_arm(i: int) -> SimArm:
    arm = _FORKED_ARM(i, position=i)
    return SimArm(arm.name, arm.metrics, arm.records, [ArmTimeline(getattr(s, "timeline", None)) for s in arm.instances])


def _run_forked(one, order: list[int], jobs: int) -> list[SimArm]:
    """``one(i)`` for every arm ``i`` in ``jobs`` forked worker processes, started in ``order``,
    returned in arm order. The workers inherit the loaded workload (copy on write) and send back
    metrics, records and timelines."""
    global _FORKED_ARM
    _FORKED_ARM = one
    try:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as ex:
            futures = {i: ex.submit(_forked_arm, i) for i in order}
            return [futures[i].result() for i in sorted(futures)]
    finally:
        _FORKED_ARM = None


def _per_step_first(arms: list, replay: str) -> list[int]:
    """Arm indices, those whose drafts replay every engine step (``exact`` mode: the slowest to
    simulate) first, so that workers do not wait on one started last."""
    from verl_ext.sim.drafting import replay_mode

    slow = [spec is not None and replay_mode(spec, replay) == "exact" for _, _, spec, _ in arms]
    return sorted(range(len(arms)), key=lambda i: not slow[i])


def _epoch_requests(cfg: SimConfig, trace, rows) -> tuple[int, list]:
    """(the response budget, the requests) of an epoch's ``rows``: ``cfg.max_tokens``, or the
    longest of those responses."""
    max_tokens = cfg.max_tokens or int(trace.response_lengths()[rows].max())
    return max_tokens, build_requests(trace, rows, max_tokens)


def _warm_instances(cfg: SimConfig, trace, epoch: int, strategy, spec, cost) -> Optional[list]:
    """``SimConfig.warm_epochs``: the trace's epochs before ``epoch`` rolled out in order, untimed,
    each on instances that take over the one before's drafting state; the last one's instances."""
    warm = None
    for e in [e for e in trace.epochs() if e < epoch]:
        _, rows_e, history_e = select_epoch(trace, e)
        arm = run_arm(f"warm e{e}", strategy, spec, trace, rows_e, history_e, cost, cfg.instances, cfg.replay,
                      _epoch_requests(cfg, trace, rows_e)[1], seed=cfg.seed, record_timeline=False,
                      dispatcher=cfg.dispatcher, warm_from=warm)
        warm = arm.instances
    return warm


def run_arm(label, strategy, spec, trace, rows, history, cost, instances: int, replay: str, requests,
            seed: int = 0, progress: bool = False, record_timeline: bool = True, kv_pool=None,
            dispatcher: bool = True, warm_from: Optional[list] = None, bar_position: int = 0) -> SimArm:
    """One strategy (with its drafting options ``spec`` or None) over trace ``rows`` on
    ``instances`` simulated instances of ``cost``; ``history`` feeds the history scope;
    ``kv_pool``: the instances' shared ``KVPool`` (None: none); ``dispatcher``: every call
    passes veRL's dispatcher actor (``SimDispatcher``); ``warm_from``: instances of an earlier
    epoch whose learned drafting state these take over (``SimInstance.carry_state``).
    ``metrics["sim_seconds"]`` is the simulator's own wall time, draft replay included."""
    from verl_ext.sim.clock import run_virtual
    from verl_ext.sim.drafting import make_drafter
    from verl_ext.sim.instance import SimInstance
    from verl_ext.sim.source import TraceSource

    t = time.perf_counter()
    source = TraceSource(trace, rows)
    spec = epoch_spec(spec, history, strategy.uses_history)
    # one index stands for every instance's drafter: their memory together
    drafter = make_drafter(spec, source, replay, history, max_bytes=spec.max_bytes * instances if spec else None)
    epoch = int(trace.epoch[rows[0]]) if len(rows) else 0
    history_store = UNSET
    if strategy.uses_history:  # history-driven strategies (rhyme): earlier epochs' rollouts
        from verl_ext.history import LocalHistory

        history_store = LocalHistory(trace_history(trace, epoch))
    life = Lifecycle(strategy, history=history_store)
    life.begin_step(epoch + 1)
    from verl_ext.sim.dispatcher import SimDispatcher

    via = SimDispatcher() if dispatcher else None
    keyed = trace_keyed(trace)
    sims = [SimInstance(f"sim-{i}", cost, source, drafter, record_timeline, kv_pool=kv_pool, dispatcher=via,
                        keyed_sampling=keyed) for i in range(instances)]
    for sim, before in zip(sims, warm_from or ()):
        sim.carry_state(before)
    rewards = {i: float(trace.reward[i]) for i in rows.tolist()}
    lengths = trace.response_lengths()

    def score(req: GenRequest, tokens) -> float:
        i = source.row_of(req.group_id, req.sample_index)
        r = rewards[i]
        return r if len(tokens) == lengths[i] and not np.isnan(r) else 0.0

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=f"{label:>10}", unit="req", leave=True, position=bar_position)

    async def main():
        import asyncio

        loop = asyncio.get_running_loop()
        return await run_strategy(strategy, sims, requests, score, seed=seed, on_finish=bar.update if bar else None,
                                  clock=loop.time, sample_telemetry=False, lifecycle=life)

    try:
        arm = run_virtual(main())
    finally:
        if bar is not None:
            bar.close()
    metrics = dict(arm.metrics)
    metrics["sim_seconds"] = time.perf_counter() - t
    metrics["preemptions"] = sum(i.preemptions for i in sims)
    metrics["prefill_tokens"] = sum(i.prefill_tokens for i in sims)
    metrics["prefix_hit_tokens"] = sum(i.prefix_hit_tokens for i in sims)
    if kv_pool is not None:
        metrics.update(kv_pool.stats())
    if via is not None:
        metrics.update(via.stats())
    metrics["history_tokens_received"] = sum(i.history_tokens_received for i in sims)
    metrics["history_stall_s"] = sum(i.history_stall_s for i in sims)
    generated = sum(i.counters.generated_tokens for i in sims)
    # the share of output tokens that came from accepted drafts (RhymeRL Fig. 17's speculation rate)
    metrics["speculation_rate"] = sum(i.counters.accepted_tokens for i in sims) / generated if generated else None
    late = sum(i.late_request_steps for i in sims)  # Seer Fig. 12: once most siblings have finished
    metrics["late_tokens_per_step"] = sum(i.late_tokens for i in sims) / late if late else None
    metrics["kv_peak_fraction"] = max(i.kv_peak for i in sims) / cost.kv_capacity_tokens
    metrics["busy_fraction"] = sum(i.busy_s for i in sims) / (len(sims) * metrics["wall_s"]) if metrics["wall_s"] else None
    if spec is not None:
        metrics["spec"] = {**spec.to_dict(), "replay": drafter.mode}
    return SimArm(label, metrics, [asdict(r) for r in arm.pool.records], sims)


def _add_ratios(results: list[SimArm]) -> None:
    """Throughput relative to baseline and to the oracle, where those arms ran."""
    by = {r.name: r.metrics for r in results}
    for r in results:
        for ref in ("baseline", "oracle"):
            if ref in by and by[ref]["throughput_tok_s"]:
                r.metrics[f"vs_{ref}"] = r.metrics["throughput_tok_s"] / by[ref]["throughput_tok_s"]


def _write(out: Path, summary: dict, results: list[SimArm]) -> None:
    from verl_ext.sim.report import write_report

    write_staged(out, summary, results, lambda staging: write_report(staging, summary, results))
