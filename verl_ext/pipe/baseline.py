"""``baseline``: what veRL 0.9.1 does today.

Each of the ``n`` samples of a prompt is an independent request. All requests are dispatched at
once, each to the instance with the fewest in-flight requests at dispatch time, sticky by
request id (``GlobalRequestLoadBalancer.acquire_server`` in ``verl/workers/rollout/router.py``).
A/B runs compare every other strategy against this.
"""

from __future__ import annotations

from verl_ext.engine.instance import Completion, GenRequest
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import Strategy, register_strategy


@register_strategy("baseline")
class BaselineStrategy(Strategy):
    async def submit(self, request: GenRequest, pool: InstancePool) -> Completion:
        # Sticky by request id: later turns of a multi-turn trajectory reuse the instance.
        return await pool.run(pool.least_loaded(request.request_id), request)
