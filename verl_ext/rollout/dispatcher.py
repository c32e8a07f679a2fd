"""The strategy host inside veRL: one async Ray actor that every agent-loop worker sends its
``generate`` calls to.

veRL's agent loops stay untouched (tokenisation, multi-turn tools, streaming reward, padding and
output order are veRL's own). Only the step "which server, and when" changes: instead of
``GlobalRequestLoadBalancer.acquire_server`` + ``server.generate``, ``StrategyLLMClient`` calls
``StrategyDispatcher.generate``, which hands the request to the selected strategy over
``ReplicaInstance`` wrappers of veRL's server handles.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
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


#: prompt groups remembered for sample numbering (oldest forgotten first)
GROUP_CACHE_SIZE = 100_000


def prompt_group_id(prompt_ids) -> str:
    """The GRPO group of a request, from its prompt tokens.

    veRL's agent loops do not pass the prompt's ``uid`` to ``generate()``, but the ``n`` samples
    of one prompt send the same prompt tokens, so the tokens identify the group (two prompts with
    identical tokens share one group, which for length estimates and drafting is what a group
    means anyway). Later turns of a multi-turn trajectory have other prompts, so other groups.
    """
    h = hashlib.blake2b(digest_size=12)
    h.update(len(prompt_ids).to_bytes(4, "little"))
    for t in prompt_ids:
        h.update(int(t).to_bytes(4, "little", signed=True))
    return "p" + h.hexdigest()


class StrategyDispatcher:
    """Plain class; ``ray.remote(StrategyDispatcher)`` makes it an async actor."""

    def __init__(self, settings: VerlExtSettings, servers: dict, max_tokens_default: Optional[int] = None,
                 max_num_seqs: Optional[int] = None):
        self.settings = settings
        self.strategy = make_strategy(settings.strategy, settings.options)
        self.pool = InstancePool(
            [ReplicaInstance(str(sid), h, max_tokens_default, max_num_seqs) for sid, h in servers.items()],
            seed=settings.seed,
        )
        # veRL's server caps max_tokens at the rollout's response_length when it is absent
        self.max_tokens_default = max_tokens_default or (1 << 30)
        self._requests = 0
        self._output_tokens = 0
        self._group_sizes: OrderedDict[str, int] = OrderedDict()  # group id -> samples seen

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs: Any):
        """Same arguments as veRL's ``server.generate`` (plus the caller's sticky ``request_id``)."""
        params = dict(sampling_params)
        max_tokens = params.get("max_tokens", params.get("max_new_tokens", self.max_tokens_default))
        group_id = prompt_group_id(prompt_ids)
        sample_index = self._group_sizes.get(group_id, 0)
        self._group_sizes[group_id] = sample_index + 1
        self._group_sizes.move_to_end(group_id)
        if len(self._group_sizes) > GROUP_CACHE_SIZE:
            self._group_sizes.popitem(last=False)
        request = GenRequest(
            request_id=request_id,
            group_id=group_id,
            prompt_ids=prompt_ids,
            sample_index=sample_index,
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
        return merged_token_output(completion)

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


def merged_token_output(completion):
    """veRL's ``TokenOutput`` for a completion; for one generated in chunks (``seer``), the last
    chunk's output with the whole response's tokens and logprobs."""
    out = completion.extra[TOKEN_OUTPUT_KEY]
    if completion.extra.get("chunks", 1) <= 1:
        return out
    if out.routed_experts is not None:
        raise RuntimeError(
            "this request was generated in chunks, and its routed experts (MoE routing replay) cannot be "
            "joined across chunks; turn chunking off (custom.verl_ext.options.chunk_size=0) with routing replay"
        )
    return out.model_copy(update={"token_ids": list(completion.token_ids), "log_probs": completion.logprobs})
