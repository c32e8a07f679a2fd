"""A pool of engine instances with in-flight accounting and per-request timing.

Every strategy dispatches through ``InstancePool.run`` so that load (in-flight requests per
instance) and request timings are tracked the same way for every strategy and every engine
kind. ``least_loaded`` and the sticky map reproduce veRL 0.9.1's ``GlobalRequestLoadBalancer``
(``verl/workers/rollout/router.py``): a request id keeps its instance while that instance is in
the pool; otherwise the instance with the fewest in-flight requests wins, ties broken at random.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from verl_ext.engine.instance import Completion, GenRequest, Instance

#: sticky-map capacity (veRL 0.9.1's DEFAULT_ROUTING_CACHE_SIZE)
STICKY_CACHE_SIZE = 10_000


@dataclass
class RequestRecord:
    """Timing of one dispatched request (or chunk), relative to the pool's clock."""

    request_id: str
    group_id: str
    instance: str
    submit_s: float
    finish_s: float = float("nan")
    output_tokens: int = 0
    finish_reason: str = ""
    num_steps: Optional[int] = None


class BurstClock:
    """Where each instance's engine steps start to be timed in one burst of requests.

    Strategies that pace or rate by engine steps (``rlhfspec``'s reallocation, ``specactor``'s
    rounds) run one burst per rollout, and inside veRL the engines idle between bursts (the
    trainer's turn), while veRL's servers are read only while requests run, so a burst's first
    reading can date from the last burst. A burst's clock of an instance therefore starts at the
    first reading taken after the instance stepped in the burst. ``clear`` at each burst."""

    def __init__(self):
        self._start: dict[str, tuple] = {}  # instance -> (steps, timestamp or None before it stepped)

    def clear(self) -> None:
        self._start.clear()

    def start(self, name: str, telemetry) -> Optional[tuple]:
        """``(steps, timestamp)`` the burst's timing of ``name`` starts at, or None until a reading
        shows it stepped in the burst (the first reading only notes its steps)."""
        first = self._start.get(name)
        if first is None:
            self._start[name] = (telemetry.steps, None)
            return None
        if first[1] is None:
            if telemetry.steps <= first[0]:
                return None
            first = self._start[name] = (telemetry.steps, telemetry.timestamp)
        return first


class InstancePool:
    def __init__(self, instances: Sequence[Instance], seed: int = 0, clock=time.monotonic):
        if not instances:
            raise ValueError("InstancePool needs at least one instance")
        names = [inst.name for inst in instances]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be unique, got {names}")
        self.instances: dict[str, Instance] = {inst.name: inst for inst in instances}
        self.inflight: dict[str, int] = {name: 0 for name in names}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # LRU, like veRL's routing cache
        self._rng = random.Random(seed)
        self._clock = clock
        self.t0 = clock()
        self.records: list[RequestRecord] = []
        #: called with each finished ``RequestRecord`` (progress bars, tracing)
        self.on_finish: Optional[Callable[[RequestRecord], None]] = None

    @property
    def keyed_sampling(self) -> bool:
        """Whether every instance samples keyed requests by key (``Instance.keyed_sampling``)."""
        return all(getattr(inst, "keyed_sampling", False) for inst in self.instances.values())

    def now(self) -> float:
        return self._clock() - self.t0

    async def refresh_progress(self) -> int:
        """Instances that do not stream (veRL's servers) tell running requests' tokens so far from
        a reading of the engine (``Instance.refresh_progress``): take one on each, at once. For
        strategies about to rank running requests by their progress. Returns how many readings
        failed (raised; an instance with nothing running reads nothing and has not failed)."""
        reads = [fn() for inst in self.instances.values()
                 if not getattr(inst, "streams_tokens", False)
                 and (fn := getattr(inst, "refresh_progress", None)) is not None]
        if not reads:
            return 0
        return sum(isinstance(r, BaseException) for r in await asyncio.gather(*reads, return_exceptions=True))

    def reset_clock(self) -> None:
        self.t0 = self._clock()
        self.records.clear()

    # -- choosing -------------------------------------------------------------------------
    def least_loaded(self, request_id: Optional[str] = None) -> Instance:
        """veRL's rule: sticky by request id, else fewest in-flight (random tie-break)."""
        if request_id is not None:
            name = self._sticky.get(request_id)
            if name in self.instances:
                self._sticky.move_to_end(request_id)
                return self.instances[name]
        low = min(self.inflight.values())
        name = self._rng.choice([n for n, c in self.inflight.items() if c == low])
        if request_id is not None:
            self._sticky[request_id] = name
            if len(self._sticky) > STICKY_CACHE_SIZE:
                self._sticky.popitem(last=False)
        return self.instances[name]

    def forget(self, request_id: str) -> None:
        self._sticky.pop(request_id, None)

    # -- dispatching ----------------------------------------------------------------------
    async def run(self, instance: Instance, request: GenRequest, on_tokens=None) -> Completion:
        """Run ``request`` on ``instance``, counting it in flight and recording its timing;
        ``on_tokens`` is passed to ``Instance.generate``."""
        record = self._begin(instance, request)
        try:
            completion = await self._generate(instance, request, on_tokens)
        finally:
            self._end(instance, record)
        return self._finished(record, completion)

    def start(self, instance: Instance, request: GenRequest, on_tokens=None) -> asyncio.Task:
        """``run`` as a task that counts in flight from this call on, not from when the task
        first runs: requests dispatched in one burst (``least_loaded`` between ``start`` calls)
        see each other's load. A task cancelled before it ran is released too."""
        record = self._begin(instance, request)
        task = asyncio.ensure_future(self._generate(instance, request, on_tokens))

        def done(t: asyncio.Task) -> None:
            self._end(instance, record)
            if not t.cancelled() and t.exception() is None:
                self._finished(record, t.result())

        task.add_done_callback(done)
        return task

    def _begin(self, instance: Instance, request: GenRequest) -> RequestRecord:
        record = RequestRecord(request.request_id, request.group_id, instance.name, self.now())
        self.records.append(record)
        self.inflight[instance.name] += 1
        return record

    @staticmethod
    async def _generate(instance: Instance, request: GenRequest, on_tokens) -> Completion:
        return await (instance.generate(request) if on_tokens is None else instance.generate(request, on_tokens))

    def _end(self, instance: Instance, record: RequestRecord) -> None:
        self.inflight[instance.name] -= 1
        record.finish_s = self.now()

    def _finished(self, record: RequestRecord, completion: Completion) -> Completion:
        record.output_tokens = len(completion.token_ids)
        record.finish_reason = completion.finish_reason
        record.num_steps = completion.num_steps
        if self.on_finish is not None:
            self.on_finish(record)
        return completion
