"""V0 agent-loop worker used while traces are recorded; see ``verl_ext.trace.verl_hook``.

Every output gets the ``verl_ext_trace`` extra field (None when no request of it went through
``StrategyLLMClient``), so each worker's ``DataProto`` has the same ``non_tensor_batch`` keys
and veRL's ``DataProto.concat`` never sees a mismatch. The V0 manager removes the column again.
"""

from __future__ import annotations

from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from verl_ext.trace.verl_hook import TRACE_KEY


class TracingAgentLoopWorker(AgentLoopWorker):
    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        output.extra_fields.setdefault(TRACE_KEY, None)
        return await super()._agent_loop_postprocess(output, validate, **kwargs)
