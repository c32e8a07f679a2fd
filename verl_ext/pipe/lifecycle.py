"""One rollout lifecycle for every driver: what a strategy needs around its rollouts.

``verl-ext ab`` (real engines and ``--sim``: ``verl_ext.ab.runner``, ``verl_ext.sim.runner``), the
simulator's training pipeline (``verl_ext.sim.pipeline``) and veRL's dispatcher
(``verl_ext.rollout.dispatcher``) drive a strategy through a ``Lifecycle``, so that what veRL runs
is what the A/B runs and the simulator measure:

* ``Lifecycle(strategy, history=..., carrier=...)``: a history-driven strategy
  (``Strategy.uses_history``) gets the driver's history provider (``LocalHistory`` over a store, the
  history workers' client); a strategy that may defer samples to the next training step gets the
  driver's carrier (``set_deferral``; None: no next step). Either left out: untouched.
* ``begin_step(step, train_s=None, requests=None, instances=None, overlap=None)``: the training
  step the next requests belong to, after the trainer's time since the last rollout where the
  driver knows it (``observe_train_time``), whether the driver overlaps this rollout with the
  previous step's training (``set_step_overlap``: one-step-off and streaming pipelines, veRL's
  async trainers), and, for a driver that submits the step's requests one at a time (veRL's
  dispatcher), how many it will submit over how many instances (``expect_requests``).
* ``mark(instances)`` / ``mechanisms(instances)``: how many times each of the strategy's
  mechanisms acted since the mark (``verl_ext.pipe.mechanisms``; without a mark: over the
  strategy's life and the engines' drafters' counters so far).

Cost models and profiles reach a strategy through its options (``profile``, ``draft_profile``),
the same in every driver; the engines' drafting options come from ``Strategy.engine_spec`` (A/B
runs, the simulator) or the rollout config that mirrors it (veRL; ``tests/test_hydra_on_cpu.py``
checks that the two agree for every option that takes a profile).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from verl_ext.pipe import mechanisms as _mechanisms

#: a ``Lifecycle`` argument the driver does not give: the strategy keeps what it has
UNSET: Any = object()


class Lifecycle:
    def __init__(self, strategy, history: Any = UNSET, carrier: Any = UNSET):
        self.strategy = strategy
        if history is not UNSET and getattr(strategy, "uses_history", False):
            strategy.set_history(history)
        if carrier is not UNSET and strategy.defers_samples:
            strategy.set_deferral(carrier)
        self._acted: dict = {}
        self._drafters: Optional[dict] = None

    def begin_step(self, step: int, train_s: Optional[float] = None, requests: Optional[int] = None,
                   instances: Optional[int] = None, overlap: Optional[bool] = None) -> None:
        if overlap is not None:
            self.strategy.set_step_overlap(bool(overlap))
        if train_s is not None:
            self.strategy.observe_train_time(train_s)
        self.strategy.begin_step(step)
        if requests and instances:
            self.strategy.expect_requests(requests, instances)

    async def mark(self, instances: Iterable) -> None:
        """Start a measured span (``mechanisms`` counts from here)."""
        self._acted = dict(self.strategy.acted)
        self._drafters = await _mechanisms.read_drafters(instances)

    async def mechanisms(self, instances: Iterable) -> dict[str, int]:
        """How many times each of the strategy's mechanisms acted since ``mark``."""
        if not getattr(self.strategy, "mechanisms", None):
            return {}
        return _mechanisms.count(self.strategy, await _mechanisms.read_drafters(instances), self._drafters, self._acted)
