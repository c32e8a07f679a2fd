"""V0 agent-loop workers (veRL's legacy trainer).

``TrajectoryAgentLoopWorker`` runs each trajectory with its ``uid`` known to the dispatching client
(``verl_ext.rollout.trajectory``), so that the dispatcher groups its requests by veRL's GRPO group.

``TracingAgentLoopWorker`` (while traces are recorded; see ``verl_ext.rollout.trace_hook``) also
gives every output the ``verl_ext_trace`` extra field (None when no request of it went through
``StrategyLLMClient``), so each worker's ``DataProto`` has the same ``non_tensor_batch`` keys
and veRL's ``DataProto.concat`` never sees a mismatch. The V0 manager removes the column again.
"""

from __future__ import annotations

from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from verl_ext.rollout.trajectory import trajectory
from verl_ext.rollout.trace_hook import TRACE_KEY
from verl_ext.rollout.verl_compat import WORKER_HOOKS_V0, require_methods

require_methods(AgentLoopWorker, WORKER_HOOKS_V0)


class TrajectoryAgentLoopWorker(AgentLoopWorker):
    async def _run_agent_loop(self, sampling_params, trajectory_info, *args, **kwargs):
        with trajectory(kwargs.get("uid")):
            return await super()._run_agent_loop(sampling_params, trajectory_info, *args, **kwargs)


class TracingAgentLoopWorker(TrajectoryAgentLoopWorker):
    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        output.extra_fields.setdefault(TRACE_KEY, None)
        return await super()._agent_loop_postprocess(output, validate, **kwargs)
