"""veRL's strategy dispatcher in the simulator: one asyncio actor, so one core, that every
server call goes through (``verl_ext.rollout.dispatcher.StrategyDispatcher``).

Contract: ``SimInstance.generate`` waits in this FIFO before its request reaches the engine
(``DISPATCHER_S_PER_CALL`` and ``DISPATCHER_S_PER_PROMPT_TOKEN`` per prompt token: a
continuation's prompt holds its response so far) and before its completion returns
(``DISPATCHER_S_PER_TOKEN`` per response token); calls queue behind each other, so a step's burst of submissions reaches the
engines spread over time, as it does through the real actor. Costs: ``verl_ext.sim.host_costs``.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from verl_ext.sim import host_costs


class SimDispatcher:
    def __init__(self, s_per_call: Optional[float] = None, s_per_token: Optional[float] = None,
                 s_per_prompt_token: Optional[float] = None):
        """Costs default to ``host_costs``' measured ones."""
        s_per_call = host_costs.DISPATCHER_S_PER_CALL if s_per_call is None else s_per_call
        s_per_token = host_costs.DISPATCHER_S_PER_TOKEN if s_per_token is None else s_per_token
        if s_per_prompt_token is None:
            s_per_prompt_token = host_costs.DISPATCHER_S_PER_PROMPT_TOKEN
        if min(s_per_call, s_per_token, s_per_prompt_token) < 0:
            raise ValueError("dispatcher costs must be >= 0")
        self.s_per_call = s_per_call
        self.s_per_token = s_per_token
        self.s_per_prompt_token = s_per_prompt_token
        self._free_at = 0.0
        self.calls = 0
        self.busy_s = 0.0
        self.wait_s = 0.0  # time calls spent queued behind others

    async def carry(self, calls: int = 0, tokens: int = 0, prompt_tokens: int = 0) -> None:
        """Wait for the dispatcher to handle ``calls`` server calls sending ``prompt_tokens``
        and ``tokens`` response tokens."""
        cost = calls * self.s_per_call + tokens * self.s_per_token + prompt_tokens * self.s_per_prompt_token
        if cost <= 0:
            return
        now = asyncio.get_running_loop().time()
        start = max(now, self._free_at)
        self._free_at = start + cost
        self.calls += calls
        self.busy_s += cost
        self.wait_s += start - now
        await asyncio.sleep(self._free_at - now)

    def stats(self) -> dict:
        return {"dispatcher_calls": self.calls, "dispatcher_busy_s": self.busy_s, "dispatcher_wait_s": self.wait_s}
