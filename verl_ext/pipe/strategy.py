"""Strategies and their registry.

A strategy decides which request (or chunk of a request) goes to which instance, and when. It
sees only the engine contract (``verl_ext.engine.instance``) through an ``InstancePool``, so
the same code drives local vLLM engines, veRL's server replicas and the simulator.

Third-party strategies are named in one of three ways (see ``examples/custom_strategy.py``):
by import path, ``"my_pkg.my_mod:MyStrategy"`` (any ``Strategy`` subclass; nothing to register);
by an entry point in the ``verl_ext.strategies`` group of an installed package
(``name = my_pkg.my_mod:MyStrategy``); or by ``@register_strategy("name")`` in a module imported
before the name is used. Only strategies that work are registered: naming any other fails with
``UnknownStrategyError``, which lists the available ones.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import secrets
from collections import Counter
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

from verl_ext.engine.instance import Completion, GenRequest
from verl_ext.pipe.pool import InstancePool


class UnknownStrategyError(ValueError):
    pass


class StrategyConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """A strategy without knobs."""


def parse_options(options_cls: type, raw: Optional[Mapping[str, Any]], where: str) -> Any:
    """Build ``options_cls`` from a plain mapping, rejecting unknown keys and bad types."""
    raw = dict(raw or {})
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise StrategyConfigError(
            f"{where}: unknown option(s) {unknown}; valid options: {sorted(fields) or 'none'}"
        )
    try:
        return options_cls(**raw)
    except (TypeError, ValueError) as exc:
        raise StrategyConfigError(f"{where}: {exc}") from exc


class Strategy(abc.ABC):
    """Base class. Subclasses set ``name`` (via ``register_strategy``) and may set ``Options``."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: whether the strategy reads per-prompt history (``set_history``); inside veRL the
    #: dispatcher then starts the history workers and feeds them every finished trajectory
    uses_history: ClassVar[bool] = False
    #: the strategy's mechanisms and where each is counted (``verl_ext.pipe.mechanisms``):
    #: ``"strategy"`` (``self.acted[name]``, over the strategy's life) or ``"drafter:<counter>"``
    #: (the engines' drafter counters, ``mechanisms.DRAFTER_COUNTERS``)
    mechanisms: ClassVar[Mapping[str, str]] = {}
    #: whether the strategy chunks, migrates or copies requests: it then samples them keyed
    #: (``keyed``), so that every chunk, migrated part and copy emits the tokens of the whole
    keys_samples: ClassVar[bool] = False

    def __init__(self, options: Optional[Mapping[str, Any]] = None):
        self.options = parse_options(self.Options, options, f"strategy '{self.name}'")
        self.acted: Counter = Counter()  # how many times each mechanism acted (``mechanisms``)

    @abc.abstractmethod
    async def submit(self, request: GenRequest, pool: InstancePool) -> Completion:
        """Generate one request. Requests arrive concurrently: from ``rollout`` in A/B runs, or
        one by one from veRL's agent loops through ``verl_ext.rollout.dispatcher``."""

    async def rollout(self, requests: Sequence[GenRequest], pool: InstancePool) -> list[Completion]:
        """Generate every request; return completions in the order of ``requests``."""
        return await gather_or_abort([self.submit(r, pool) for r in requests])

    def keyed(self, request: GenRequest, pool: InstancePool) -> GenRequest:
        """``request`` with position-keyed sampling (``SamplingSpec.keyed``; a seed drawn here,
        once, when it has none) where the strategy ``keys_samples``, the request samples
        (temperature > 0) and every instance of ``pool`` can key; otherwise ``request`` itself."""
        s = request.sampling
        if not self.keys_samples or s.keyed or s.temperature <= 0 or not pool.keyed_sampling:
            return request
        seed = s.seed if s.seed is not None else secrets.randbits(62)
        return dataclasses.replace(request, sampling=dataclasses.replace(s, seed=seed, keyed=True))

    def parts_options(self) -> list[str]:
        """The options, as set, under which this strategy generates a request in parts (chunks,
        copies, moves): settings that a response's engine state cannot cross (MoE routing replay)
        are refused with them (``verl_ext.config.check``). None here."""
        return []

    def metrics(self) -> dict[str, float]:
        """Strategy-specific metrics of the last rollout (merged into veRL's tracking)."""
        return {}

    def set_step_overlap(self, overlap: bool) -> None:
        """Whether the driver overlaps the coming rollouts with the previous step's training
        (one-step-off and streaming pipelines, veRL's async trainers); drivers that do not say
        run synchronous steps."""

    async def prepare(self, pool: InstancePool) -> None:
        """Start long-lived helpers (e.g. ``seer``'s draft server) before a timed rollout; A/B
        runs call it before their clock starts. Inside veRL it is not called: strategies must
        also work (starting lazily) without it."""

    async def close(self) -> None:
        """Release what ``prepare`` or the rollouts started (idempotent)."""

    def begin_step(self, step: int) -> None:
        """The training step (veRL's ``global_steps``) the next requests belong to."""

    def expect_requests(self, requests: int, instances: int) -> None:
        """How many requests the step begun last will submit, over how many instances, where
        the driver submits them one at a time and knows the count (veRL's dispatcher); a driver
        that calls ``rollout`` passes them all at once instead."""

    def observe_train_time(self, seconds: float) -> None:
        """How long the last training step took (the simulator's pipeline passes it; strategies
        that plan against the trainer's pace, like ``rhyme``'s tier 2, may use it)."""

    @property
    def defers_samples(self) -> bool:
        """Whether the strategy may defer samples to the next training step (inter-step
        migration, ``verl_ext.pipe.defer``); drivers that cannot carry them refuse it."""
        return False

    def set_deferral(self, carry) -> None:
        """The driver's carrier for deferred samples of the coming step: ``carry(state)`` resumes
        a ``Chunked`` state in the next step; None: there is no next step. Only drivers that run
        consecutive off-policy steps call it."""

    def set_history(self, history) -> None:
        """The history provider (``verl_ext.history.HistoryClient`` or a stand-in with the same
        coroutines), for strategies with ``uses_history``."""

    def engine_spec(self, cost=None):
        """Speculative drafting this strategy wants its engines started with
        (``verl_ext.spec.SpecOptions``), or None for plain decoding. ``cost``: the instances'
        ``CostModel`` where known (the simulator), for profiled thresholds."""
        return None


async def gather_or_abort(coros: Sequence[Any]) -> list[Any]:
    """``asyncio.gather`` that cancels the other requests when one fails.

    Cancelling a request's coroutine aborts it in the engine, so a failed rollout never leaves
    requests running behind it.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"invalid strategy name {name!r}")

    def deco(cls: type[Strategy]) -> type[Strategy]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"strategy '{name}' is already registered by {_REGISTRY[name].__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


#: entry-point group of installed packages' strategies (``name = module:Class``)
ENTRY_POINT_GROUP = "verl_ext.strategies"


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_strategies() -> list[str]:
    """Registered strategies and those installed packages declare (``ENTRY_POINT_GROUP``)."""
    _load_builtins()
    return sorted(set(_REGISTRY) | set(_entry_points()))


def _imported(path: str, what: str) -> type[Strategy]:
    import importlib

    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownStrategyError(f"rollout strategy '{what}': cannot import {path} ({type(exc).__name__}: {exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)) or getattr(cls, "__abstractmethods__", None):
        raise UnknownStrategyError(f"rollout strategy '{what}': {path} is not a concrete verl_ext Strategy subclass")
    return cls


def get_strategy_class(name: str) -> type[Strategy]:
    """The strategy class for a registered name, an entry point's name, or an import path
    (``module:Class``)."""
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _imported(name, name)
    ep = _entry_points().get(name)
    if ep is not None:
        return _imported(ep.value, name)
    raise UnknownStrategyError(
        f"unknown rollout strategy '{name}'; available: {', '.join(available_strategies())} "
        "(or an import path, module:Class)"
    )


def make_strategy(name: str, options: Optional[Mapping[str, Any]] = None) -> Strategy:
    return get_strategy_class(name)(options)


def _load_builtins() -> None:
    # Importing the modules registers them. Keep this list to strategies that work.
    import verl_ext.pipe.baseline  # noqa: F401
    import verl_ext.pipe.multiscope.strategy  # noqa: F401
    import verl_ext.pipe.oracle  # noqa: F401
    import verl_ext.pipe.rlhfspec.strategy  # noqa: F401
    import verl_ext.pipe.rhyme.strategy  # noqa: F401
    import verl_ext.pipe.seer.strategy  # noqa: F401
    import verl_ext.pipe.specactor.strategy  # noqa: F401
