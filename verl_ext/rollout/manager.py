"""veRL-facing rollout manager: ``agent.agent_loop_manager_class=verl_ext.rollout.manager.VerlExtAgentLoopManager``.

veRL 0.9.1 builds the manager with ``cls.create(config=, llm_client=, teacher_client=,
reward_loop_worker_handles=)`` in both trainers: the V1 trainer (``trainer.use_v1=true``, the
default; ``verl/trainer/main_ppo.py``) and the legacy V0 ``RayPPOTrainer``
(``verl/trainer/ppo/ray_trainer.py``). ``VerlExtAgentLoopManager.create`` returns the matching
subclass: of ``AgentLoopManagerTQ`` (V1, outputs go to TransferQueue) or of ``AgentLoopManager``
(V0, ``generate_sequences`` returns a ``DataProto``).

Both subclasses keep veRL's agent loops and workers. The only change is the LLM client handed to
the workers: ``StrategyLLMClient`` sends each ``generate`` to the ``StrategyDispatcher`` actor,
where the selected strategy picks the server and the timing. If the dispatcher dies, the client
logs an error once and falls back to veRL's own load balancer, so a rollout is never lost.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Optional

import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.llm_server import LLMServerClient

from verl_ext.config.settings import VerlExtSettings
from verl_ext.rollout.dispatcher import StrategyDispatcher, server_handles_from_load_balancer
from verl_ext.trace import verl_hook

logger = logging.getLogger(__name__)


class StrategyLLMClient(LLMServerClient):
    """``LLMServerClient`` whose requests are scheduled by verl_ext's dispatcher."""

    def __init__(self, config, load_balancer_handle=None, dispatcher=None, trace=None, **kwargs):
        super().__init__(config, load_balancer_handle=load_balancer_handle, **kwargs)
        self._dispatcher = dispatcher
        self._dispatcher_failed = False
        #: (V1 collector handle or None, TraceSettings, response_length) when traces are recorded
        self.verl_ext_trace = trace

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs: Any):
        if self.verl_ext_trace is None:
            return await self._generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        submit_t = time.time()
        output = await self._generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        try:  # per-request trace info; the trace hook removes it before veRL stores the output
            output.extra_fields[verl_hook.TRACE_KEY] = verl_hook.request_info(
                output, sampling_params, self.verl_ext_trace[2], submit_t, time.time()
            )
        except Exception as exc:
            logger.error("verl_ext: no trace info for request %s (%s)", request_id, exc)
        return output

    async def _generate(self, request_id, *, prompt_ids, sampling_params, **kwargs: Any):
        if self._dispatcher is None or self._dispatcher_failed:
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        forwarded = {k: v for k, v in kwargs.items() if v is not None}
        try:
            output = await self._dispatcher.generate.remote(request_id, list(prompt_ids), dict(sampling_params), **forwarded)
        except ray.exceptions.RayActorError as exc:
            self._dispatcher_failed = True
            logger.error("verl_ext dispatcher is gone (%s); falling back to veRL's load balancer for this worker", exc)
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        steps = output.extra_fields.get("global_steps")
        output.extra_fields.setdefault("min_global_steps", steps)
        output.extra_fields.setdefault("max_global_steps", steps)
        return output


class _VerlExtManagerMixin:
    """Builds the dispatcher and swaps the workers' LLM client; the rest is veRL's manager."""

    _verl_ext_flavour = "v0"

    def __init__(self, config, llm_client, teacher_client=None, reward_loop_worker_handles=None):
        rollout = config.actor_rollout_ref.rollout
        self.verl_ext_settings = VerlExtSettings.from_custom(rollout.get("custom"))
        self.verl_ext_trace_recorder = None  # V0
        self.verl_ext_trace_collector = None  # V1
        trace = self._verl_ext_setup_trace(config)
        load_balancer = getattr(llm_client, "_load_balancer", None)
        if load_balancer is None:
            raise RuntimeError("verl_ext needs veRL's LLMServerClient with a load balancer handle")
        servers = server_handles_from_load_balancer(load_balancer)
        self.verl_ext_dispatcher = (
            ray.remote(StrategyDispatcher)
            .options(num_cpus=0, max_concurrency=100_000)
            .remote(self.verl_ext_settings, servers, rollout.get("response_length"), rollout.get("max_num_seqs"))
        )
        client = StrategyLLMClient(
            config, load_balancer_handle=load_balancer, dispatcher=self.verl_ext_dispatcher, trace=trace
        )
        logger.warning(
            "verl_ext: rollout strategy '%s' over %d server(s)", self.verl_ext_settings.strategy, len(servers)
        )
        super().__init__(config, client, teacher_client, reward_loop_worker_handles)
        if trace is not None:  # after veRL's __init__, which sets the worker class
            self.agent_loop_workers_class = ray.remote(self._verl_ext_worker_cls())

    def _verl_ext_setup_trace(self, config):
        """Trace recording (``custom.verl_ext.trace``): None when off; see ``verl_ext.trace.verl_hook``."""
        settings = self.verl_ext_settings.trace
        if not settings.enabled:
            return None
        directory = verl_hook.prepare_dir(settings.dir)
        if directory is None:
            return None
        meta = verl_hook.base_meta(config, self.verl_ext_settings, self._verl_ext_flavour)
        if self._verl_ext_flavour == "v1":
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
            self.verl_ext_trace_collector = (
                ray.remote(verl_hook.StepTraceCollector).options(num_cpus=0, scheduling_strategy=node).remote(directory, meta)
            )
        else:
            self.verl_ext_trace_recorder = verl_hook.V0Recorder(directory, settings.every, meta)
        logger.warning("verl_ext: recording rollout traces to %s (every %d step(s))", directory, settings.every)
        response_length = verl_hook._int_or_none(config.actor_rollout_ref.rollout.get("response_length"))
        return (self.verl_ext_trace_collector, settings, response_length)

    def verl_ext_metrics(self) -> dict[str, float]:
        try:
            return ray.get(self.verl_ext_dispatcher.metrics.remote())
        except Exception as exc:  # metrics must never break a step
            logger.warning("verl_ext: no dispatcher metrics (%s)", exc)
            return {}


class VerlExtAgentLoopManagerV0(_VerlExtManagerMixin, AgentLoopManager):
    """Legacy trainer (``trainer.use_v1=false``): ``generate_sequences`` returns a ``DataProto``."""

    @staticmethod
    def _verl_ext_worker_cls():
        from verl_ext.trace._verl_v0 import TracingAgentLoopWorker

        return TracingAgentLoopWorker

    @auto_await
    async def generate_sequences(self, prompts):
        output = await super().generate_sequences(prompts)
        # veRL's V0 trainer merges meta_info["timing"] into the step's logged metrics.
        output.meta_info.setdefault("timing", {}).update(self.verl_ext_metrics())
        if self.verl_ext_trace_recorder is not None:
            self.verl_ext_trace_recorder.record(prompts, output)  # never raises
        return output


@functools.cache
def _v1_cls():
    # Lazy: the V1 module needs the TransferQueue package, which the V0 trainer does not.
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    class VerlExtAgentLoopManagerTQ(_VerlExtManagerMixin, AgentLoopManagerTQ):
        _verl_ext_flavour = "v1"

        @staticmethod
        def _verl_ext_worker_cls():
            from verl_ext.trace._verl_v1 import TracingAgentLoopWorkerTQ

            return TracingAgentLoopWorkerTQ

        def generate_sequences(self, prompts):
            if self.verl_ext_trace_collector is not None:
                self._verl_ext_expect(prompts)
            return super().generate_sequences(prompts)

        def _verl_ext_expect(self, prompts) -> None:
            """Register the batch's prompts with the trace collector before dispatching them."""
            try:
                keys = set(prompts.keys())
                if "validate" in keys and bool(prompts["validate"]):
                    return
                step = int(prompts["global_steps"]) if "global_steps" in keys else -1
                if self.verl_ext_settings.trace.records(step):
                    uids = [str(u) for u in prompts["uid"]]
                    ray.get(self.verl_ext_trace_collector.expect.remote(step, uids), timeout=120)
            except Exception as exc:  # tracing must never break a rollout
                logger.error("verl_ext: could not register prompts for tracing (%s: %s)", type(exc).__name__, exc)

    return VerlExtAgentLoopManagerTQ


class VerlExtAgentLoopManager:
    """Factory named by ``agent.agent_loop_manager_class``; ``create`` returns the right subclass."""

    @classmethod
    def manager_cls(cls, config) -> type:
        use_v1 = bool(config.trainer.get("use_v1", True)) if "trainer" in config else True
        return _v1_cls() if use_v1 else VerlExtAgentLoopManagerV0

    @classmethod
    def create(cls, config, llm_client, teacher_client: Optional[dict] = None, reward_loop_worker_handles=None):
        return cls.manager_cls(config).create(
            config=config,
            llm_client=llm_client,
            teacher_client=teacher_client,
            reward_loop_worker_handles=reward_loop_worker_handles,
        )
