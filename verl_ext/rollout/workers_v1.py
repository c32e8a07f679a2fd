"""V1 (TransferQueue) agent-loop worker: runs each trajectory with its ``uid`` known to the
dispatching client (``verl_ext.rollout.trajectory``), and reports finished trajectories: trace rows
(see ``verl_ext.rollout.trace_hook``) and the history workers' feed (``StrategyDispatcher.ingest``).

Imported only by the V1 manager (it needs veRL's V1 module and TransferQueue). The collector handle, trace settings and dispatcher handle travel on the worker's
LLM client (``StrategyLLMClient.verl_ext_trace`` / ``verl_ext_history``), which veRL passes to
every worker.
"""

from __future__ import annotations

import logging

from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

from verl_ext.rollout.trajectory import trajectory as trajectory_of
from verl_ext.rollout.trace_hook import TRACE_KEY, history_items, v1_rows
from verl_ext.rollout.verl_compat import WORKER_HOOKS_V1, require_methods

logger = logging.getLogger(__name__)

# veRL decorates AgentLoopWorkerTQ with @ray.remote; subclass the plain class underneath.
_Base = getattr(AgentLoopWorkerTQ, "__ray_actor_class__", AgentLoopWorkerTQ)
require_methods(_Base, WORKER_HOOKS_V1)


class TracingAgentLoopWorkerTQ(_Base):
    def __init__(self, *args, **kwargs):
        # Ray ships an actor class's ``__init__`` by value. veRL's ``AgentLoopWorkerTQ.__init__``
        # calls zero-argument ``super()``, and a by-value copy of it carries its own copy of the
        # class in its ``__class__`` cell, so in the worker ``super()`` fails ("obj must be an
        # instance or subtype of type"). Ours is shipped by reference and calls the worker's own
        # import of veRL's ``__init__``.
        _Base.__init__(self, *args, **kwargs)

    def _verl_ext_trace(self):
        """(collector handle, TraceSettings, response_length) or None."""
        return getattr(self.llm_client, "verl_ext_trace", None)

    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        outputs = output if isinstance(output, list) else [output]
        infos = [o.extra_fields.pop(TRACE_KEY, None) for o in outputs]  # keep it out of TransferQueue
        result = await super()._agent_loop_postprocess(output, validate, **kwargs)
        history = getattr(self.llm_client, "verl_ext_history", None)
        if history is not None and not validate and outputs:
            try:  # after veRL's post-processing, which computed the reward
                history.ingest.remote(int(kwargs.get("global_steps", -1)), history_items(outputs, kwargs))
            except Exception as exc:  # history is an optimisation: never break a rollout
                logger.error("verl_ext: could not feed the history workers (%s: %s)", type(exc).__name__, exc)
        tracing = self._verl_ext_trace()
        if tracing is not None and not validate and outputs:
            collector, settings, response_length = tracing
            try:
                step = int(kwargs.get("global_steps", -1))
                if settings.records(step):
                    collector.add.remote(step, str(kwargs["uid"]), v1_rows(outputs, infos, kwargs, response_length))
            except Exception as exc:  # tracing must never break a rollout
                logger.error("verl_ext: could not record trace rows (%s: %s)", type(exc).__name__, exc)
        return result

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False) -> None:
        uid = prompt.get("uid")
        step = prompt.get("global_steps", trajectory.get("step", -1))
        try:
            with trajectory_of(uid):
                await super()._run_prompt(prompt, sampling_params, trajectory, trace=trace)
        finally:
            tracing = self._verl_ext_trace()
            if tracing is not None and not trajectory.get("validate", False):
                try:
                    collector, settings, _ = tracing
                    if settings.records(int(step)):
                        collector.done.remote(int(step), str(uid))
                except Exception as exc:
                    logger.error("verl_ext: could not report a finished prompt (%s: %s)", type(exc).__name__, exc)
