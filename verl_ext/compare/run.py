"""One arm, measured: a strategy's rollout of a request set over a set of instances, with the
``summary.json`` metrics (``verl_ext.compare.metrics``), the engines' drafting counters, the
strategy's mechanisms (``Lifecycle.mechanisms``) and a running-requests timeline. The same call
serves real engines (``verl-ext ab``) and simulated ones (``verl-ext sim``, over a virtual
``clock``), so both report the same figures by construction."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from verl_ext.compare.metrics import rollout_metrics
from verl_ext.engine.instance import GenRequest, Instance
from verl_ext.pipe.lifecycle import Lifecycle
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import Strategy

TELEMETRY_PERIOD_S = 0.05


@dataclass
class ArmResult:
    """One strategy's rollout over one set of instances."""

    completions: list
    rewards: list[float]
    metrics: dict
    pool: InstancePool
    timeline: dict  # instance -> [(t, running)]


async def _sample_telemetry(instances: Sequence[Instance], pool: InstancePool, timeline: dict, stop: asyncio.Event):
    while True:
        t = pool.now()
        for inst in instances:
            timeline[inst.name].append((t, inst.telemetry().running))
        if stop.is_set():  # the last sample is taken after the rollout ended
            return
        try:
            await asyncio.wait_for(stop.wait(), TELEMETRY_PERIOD_S)
        except asyncio.TimeoutError:
            pass


async def run_strategy(
    strategy: Strategy,
    instances: Sequence[Instance],
    requests: Sequence[GenRequest],
    score: Callable[[GenRequest, list[int]], float],
    seed: int = 0,
    on_finish: Optional[Callable[[], None]] = None,
    clock: Optional[Callable[[], float]] = None,
    sample_telemetry: bool = True,
    lifecycle: Optional[Lifecycle] = None,
) -> ArmResult:
    """Run ``requests`` through ``strategy`` on ``instances`` and measure it. ``clock``: the
    pool's clock (the simulator passes its virtual one); ``sample_telemetry=False`` skips the
    running-requests sampler (simulated instances log every change themselves); ``lifecycle``:
    the driver's ``Lifecycle`` of ``strategy`` (its history and step; default: a bare one)."""
    life = lifecycle if lifecycle is not None else Lifecycle(strategy)
    pool = InstancePool(instances, seed=seed, **({"clock": clock} if clock is not None else {}))
    if on_finish is not None:
        pool.on_finish = lambda record: on_finish()
    timeline = {inst.name: [] for inst in instances}
    stop = asyncio.Event()
    await strategy.prepare(pool)  # long-lived helpers start outside the timed rollout
    before = [inst.telemetry() for inst in instances]
    await life.mark(instances)
    pool.reset_clock()
    sampler = asyncio.ensure_future(_sample_telemetry(instances, pool, timeline, stop)) if sample_telemetry else None
    try:
        completions = await strategy.rollout(requests, pool)
    finally:
        stop.set()
        if sampler is not None:
            await sampler
        await strategy.close()
    rewards = [score(req, c.token_ids) for req, c in zip(requests, completions)]
    metrics = rollout_metrics(pool.records, rewards, delivered_tokens=sum(len(c.token_ids) for c in completions))
    after = [inst.telemetry() for inst in instances]
    if metrics["tokens_per_step"] is None:
        # engines that count steps per instance rather than per request (vLLM's stat logger)
        tokens = sum(a.generated_tokens - b.generated_tokens for a, b in zip(after, before))
        steps = sum(a.request_steps - b.request_steps for a, b in zip(after, before))
        metrics["tokens_per_step"] = tokens / steps if steps > 0 else None
    drafted = sum(a.draft_tokens - b.draft_tokens for a, b in zip(after, before))
    accepted = sum(a.accepted_tokens - b.accepted_tokens for a, b in zip(after, before))
    metrics["draft_tokens"] = drafted
    metrics["accepted_tokens"] = accepted
    metrics["draft_acceptance"] = accepted / drafted if drafted else None
    metrics.update({f"strategy/{k}": v for k, v in strategy.metrics().items()})
    metrics["mechanisms"] = await life.mechanisms(instances)
    return ArmResult(completions, rewards, metrics, pool, timeline)
