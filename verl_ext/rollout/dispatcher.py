"""The strategy host inside veRL: one async Ray actor that every agent-loop worker sends its
``generate`` calls to.

veRL's agent loops stay untouched (tokenisation, multi-turn tools, streaming reward, padding and
output order are veRL's own). Only the step "which server, and when" changes: instead of
``GlobalRequestLoadBalancer.acquire_server`` + ``server.generate``, ``StrategyLLMClient`` calls
``StrategyDispatcher.generate``, which hands the request to the selected strategy over
``ReplicaInstance`` wrappers of veRL's server handles.
"""

from __future__ import annotations

from typing import Any, Optional

from verl_ext.config.settings import VerlExtSettings
from verl_ext.engine.instance import GenRequest, SamplingSpec
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import make_strategy
from verl_ext.rollout.replica_instance import KWARGS_KEY, SAMPLING_KEY, TOKEN_OUTPUT_KEY, ReplicaInstance


def _lb_server_handles(load_balancer) -> dict:
    """Runs inside veRL's load-balancer actor (via Ray's public ``__ray_call__``).

    Version-specific hook point: veRL 0.9.1's ``GlobalRequestLoadBalancer`` keeps its
    ``server_id -> handle`` registry in ``_servers`` and has no public getter for the handles.
    """
    return dict(load_balancer._servers)


def server_handles_from_load_balancer(load_balancer_handle) -> dict:
    import ray

    try:
        handles = ray.get(load_balancer_handle.__ray_call__.remote(_lb_server_handles))
    except Exception as exc:
        raise RuntimeError(
            "verl_ext could not read the rollout server handles from veRL's load balancer "
            f"({type(exc).__name__}: {exc}); this veRL version is not supported (need 0.9.x)"
        ) from exc
    if not handles:
        raise RuntimeError("veRL's load balancer has no rollout servers registered")
    return handles


class StrategyDispatcher:
    """Plain class; ``ray.remote(StrategyDispatcher)`` makes it an async actor."""

    def __init__(self, settings: VerlExtSettings, servers: dict, max_tokens_default: Optional[int] = None):
        self.settings = settings
        self.strategy = make_strategy(settings.strategy, settings.options)
        self.pool = InstancePool(
            [ReplicaInstance(str(sid), h, max_tokens_default) for sid, h in servers.items()], seed=settings.seed
        )
        # veRL's server caps max_tokens at the rollout's response_length when it is absent
        self.max_tokens_default = max_tokens_default or (1 << 30)
        self._requests = 0
        self._output_tokens = 0

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs: Any):
        """Same arguments as veRL's ``server.generate`` (plus the caller's sticky ``request_id``)."""
        params = dict(sampling_params)
        max_tokens = params.get("max_tokens", params.get("max_new_tokens", self.max_tokens_default))
        request = GenRequest(
            request_id=request_id,
            group_id=request_id,  # veRL's agent loops do not pass the prompt's uid to generate()
            prompt_ids=prompt_ids,
            sampling=SamplingSpec(
                temperature=float(params.get("temperature", 1.0)),
                top_p=float(params.get("top_p", 1.0)),
                top_k=int(params.get("top_k", -1)),
                max_tokens=int(max_tokens),
            ),
            extra={SAMPLING_KEY: params, KWARGS_KEY: kwargs},
        )
        completion = await self.strategy.submit(request, self.pool)
        self._requests += 1
        self._output_tokens += len(completion.token_ids)
        return completion.extra[TOKEN_OUTPUT_KEY]

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Dispatcher counters since the last call, prefixed for veRL's tracking."""
        out = {
            "verl_ext/requests": float(self._requests),
            "verl_ext/output_tokens": float(self._output_tokens),
            **{f"verl_ext/{self.settings.strategy}/{k}": float(v) for k, v in self.strategy.metrics().items()},
        }
        for name, count in self.pool.inflight.items():
            out[f"verl_ext/inflight/{name}"] = float(count)
        if reset:
            self._requests = self._output_tokens = 0
        return out
