"""Virtual time for the simulator: an asyncio event loop whose clock jumps to the next timer.

Strategies are ordinary asyncio code (they ``await instance.generate(...)``, sleep, gather).
The simulator runs them unchanged on this loop: simulated instances schedule their next
engine event with ``loop.call_at``, and whenever every task is waiting, the loop advances its
clock straight to the earliest timer instead of sleeping. A rollout of hours of simulated time
takes as long as its events take to process.

If nothing is ready and no timer is pending, no simulated event can ever wake the waiting
tasks: the loop raises ``SimulationStalled`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Awaitable, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Every task waits and no simulated event is pending (a strategy awaits something that
    no simulated engine will ever deliver)."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: "VirtualTimeLoop | None" = None

    def select(self, timeout=None):
        if timeout is None:
            raise SimulationStalled(
                "simulation stalled at t=%.3fs: every task is waiting and no simulated event is pending"
                % (self.loop.time() if self.loop else float("nan"))
            )
        if timeout > 0 and self.loop is not None:
            self.loop.advance(timeout)
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``loop.time()`` is simulated seconds since the loop was made."""

    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._vnow = 0.0

    def time(self) -> float:
        return self._vnow

    def advance(self, seconds: float) -> None:
        self._vnow += seconds


def run_virtual(main: Awaitable[T]) -> T:
    """``asyncio.run`` on a fresh ``VirtualTimeLoop``."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
