"""``oracle``: longest-first with the true response lengths, the reference upper bound.

Only the simulator knows how long each response will be: it puts the trace's length in
``request.extra["true_len"]``. The oracle sorts all requests by true length, longest first,
and assigns each to the instance with the least total work (prompt + response tokens) so far
(LPT scheduling), submitting in that order so each instance's FCFS queue runs its longest
requests first. On real engines there are no true lengths and it refuses to run.
"""

from __future__ import annotations

from typing import Sequence

from verl_ext.engine.instance import Completion, GenRequest
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import Strategy, StrategyConfigError, gather_or_abort, register_strategy

TRUE_LEN = "true_len"


def true_len(request: GenRequest) -> int:
    try:
        return int(request.extra[TRUE_LEN])
    except (KeyError, TypeError, ValueError):
        raise StrategyConfigError(
            "oracle scheduling (strategy 'oracle', seer's lengths=oracle) needs each request's true "
            "response length, which only the simulator provides (`verl-ext sim`)"
        ) from None


@register_strategy("oracle")
class OracleStrategy(Strategy):
    async def submit(self, request: GenRequest, pool: InstancePool) -> Completion:
        true_len(request)
        return await pool.run(pool.least_loaded(request.request_id), request)

    async def rollout(self, requests: Sequence[GenRequest], pool: InstancePool) -> list[Completion]:
        lengths = [true_len(r) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: (-lengths[i], i))
        work = {name: 0 for name in pool.instances}
        coros = {}
        for i in order:
            name = min(work, key=lambda n: (work[n], n))
            work[name] += lengths[i] + len(requests[i].prompt_ids)
            coros[i] = pool.run(pool.instances[name], requests[i])
        # gather_or_abort starts them in this (longest-first) order
        results = await gather_or_abort([coros[i] for i in order])
        out = [None] * len(requests)
        for i, c in zip(order, results):
            out[i] = c
        return out
