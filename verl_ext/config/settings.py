"""verl_ext's settings inside veRL's config.

They live in ``actor_rollout_ref.rollout.custom.verl_ext``: ``RolloutConfig.custom`` is veRL's
free-form extension dict, so veRL's dataclass validation leaves it alone, and we validate it
here instead, failing with a clear message on anything malformed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union

from verl_ext.config import option_names  # noqa: F401  (re-exported)
from verl_ext.pipe.defer import require_carrier
from verl_ext.pipe.strategy import StrategyConfigError, get_strategy_class

_KEYS = ("strategy", "options", "seed", "sample_seed", "trace", "history")
_TRACE_KEYS = ("dir", "every")


@dataclass(frozen=True)
class TraceSettings:
    """``custom.verl_ext.trace``: record rollout traces (``verl_ext.trace``) from training.

    ``dir``: directory for ``step_<N>.parquet`` files (one per recorded training step); None
    (the default) turns recording off. ``every``: record the steps with ``N % every == 0``.
    """

    dir: Optional[str] = None
    every: int = 1

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def records(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    @classmethod
    def parse(cls, raw: Any) -> "TraceSettings":
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise StrategyConfigError(f"custom.verl_ext.trace must be a mapping like {{dir: ..., every: 1}}, got {raw!r}")
        unknown = sorted(set(raw) - set(_TRACE_KEYS))
        if unknown:
            raise StrategyConfigError(f"custom.verl_ext.trace: unknown key(s) {unknown}; valid keys: {list(_TRACE_KEYS)}")
        directory = raw.get("dir")
        if directory is not None and (not isinstance(directory, str) or not directory.strip()):
            raise StrategyConfigError(f"custom.verl_ext.trace.dir must be a directory path or null, got {directory!r}")
        every = raw.get("every", 1)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise StrategyConfigError(f"custom.verl_ext.trace.every must be an integer >= 1, got {every!r}")
        return cls(dir=directory, every=every)


@dataclass(frozen=True)
class HistorySettings:
    """``custom.verl_ext.history``: the history workers (``verl_ext.history``), started only for
    strategies that read history (``rhyme``).

    ``shards``: worker actors (prompts sharded by a hash of their key), or ``auto``: as many as an
    epoch's history needs at ``max_bytes`` each (``verl_ext.history.capacity``; from the trainer's
    dataset, ``rollout.n`` and ``data.max_response_length``), at most 16; ``keep``: rollouts kept per
    prompt; ``max_bytes``: memory cap per shard (least recently ingested prompts evicted);
    ``checkpoint_dir``: where shards checkpoint and restore from (``auto`` =
    ``<trainer.default_local_dir>/verl_ext_history``; null = no checkpoints);
    ``checkpoint_every``: checkpoint every this many training steps; ``num_cpus``: Ray CPUs per
    worker (no GPU); ``nice``: OS niceness the workers give themselves; ``timeout_s``: the most any
    history call may take before the rollout goes on without history.
    """

    shards: Union[int, str] = "auto"
    keep: int = 1
    max_bytes: int = 1 << 30
    checkpoint_dir: Optional[str] = "auto"
    checkpoint_every: int = 1
    num_cpus: float = 1.0
    nice: int = 10
    timeout_s: float = 30.0

    @classmethod
    def parse(cls, raw: Any) -> "HistorySettings":
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise StrategyConfigError(f"custom.verl_ext.history must be a mapping like {{shards: 1}}, got {raw!r}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise StrategyConfigError(f"custom.verl_ext.history: unknown key(s) {unknown}; valid keys: {names}")
        out = cls(**raw)
        if out.shards != "auto" and (not isinstance(out.shards, int) or isinstance(out.shards, bool) or out.shards < 1):
            raise StrategyConfigError(f"custom.verl_ext.history.shards must be an integer >= 1 or auto, got {out.shards!r}")
        for name, low in (("keep", 1), ("max_bytes", 0), ("checkpoint_every", 1), ("nice", 0)):
            v = getattr(out, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise StrategyConfigError(f"custom.verl_ext.history.{name} must be an integer >= {low}, got {v!r}")
        for name in ("num_cpus", "timeout_s"):
            v = getattr(out, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise StrategyConfigError(f"custom.verl_ext.history.{name} must be a number > 0, got {v!r}")
        d = out.checkpoint_dir
        if d is not None and (not isinstance(d, str) or not d.strip()):
            raise StrategyConfigError(f"custom.verl_ext.history.checkpoint_dir must be a path, 'auto' or null, got {d!r}")
        return out

    def resolve_dir(self, default_local_dir: Optional[str]) -> Optional[str]:
        """The absolute checkpoint directory (``auto`` under veRL's checkpoint dir), or None."""
        import os

        d = self.checkpoint_dir
        if d == "auto":
            if not default_local_dir:
                return None
            d = os.path.join(str(default_local_dir), "verl_ext_history")
        return None if d is None else os.path.abspath(os.path.expanduser(d))


@dataclass(frozen=True)
class VerlExtSettings:
    """``custom.verl_ext``. ``seed``: the strategy's random tie-breaks. ``sample_seed``: None (the
    default) samples as veRL does; an integer keys every sampled request (position-keyed sampling,
    ``verl_ext.vllm.keyed``) with a seed derived from it, the training step, the prompt and the
    sample's ordinal among that prompt's samples in the step (``StrategyDispatcher``), so that two
    runs from the same checkpoint draw the same samples whatever the strategy: an A/B run inside
    veRL then compares the same work. Every sample is still an exact draw from the policy."""

    strategy: str = "baseline"
    options: dict = field(default_factory=dict)
    seed: int = 0
    sample_seed: Optional[int] = None
    trace: TraceSettings = field(default_factory=TraceSettings)
    history: HistorySettings = field(default_factory=HistorySettings)

    @classmethod
    def from_custom(cls, custom: Optional[Mapping[str, Any]], async_trainer: bool = False) -> "VerlExtSettings":
        """Parse ``RolloutConfig.custom`` (a dict, an OmegaConf node, or None). ``async_trainer``:
        the manager serves one of veRL's async trainers, which streams finished samples into
        training (a strategy may then defer samples to the next step; refused otherwise)."""
        raw = _to_dict((custom or {}).get("verl_ext") if custom is not None else None)
        if raw is None:
            raise StrategyConfigError(
                "actor_rollout_ref.rollout.custom.verl_ext is missing; select a strategy with "
                "rollout=<strategy> (see verl_ext/config/rollout/)"
            )
        if not isinstance(raw, dict):
            raise StrategyConfigError(f"custom.verl_ext must be a mapping, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise StrategyConfigError(f"custom.verl_ext: unknown key(s) {unknown}; valid keys: {list(_KEYS)}")
        strategy = raw.get("strategy", cls.strategy)
        if not isinstance(strategy, str):
            raise StrategyConfigError(f"custom.verl_ext.strategy must be a string, got {strategy!r}")
        options = raw.get("options") or {}
        if not isinstance(options, dict):
            raise StrategyConfigError(f"custom.verl_ext.options must be a mapping, got {options!r}")
        seed = raw.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise StrategyConfigError(f"custom.verl_ext.seed must be an integer, got {seed!r}")
        # Validate eagerly (unknown strategy, unknown or ill-typed options) so that a bad config
        # fails when the manager is built, not in the middle of the first rollout.
        # (constructing the strategy parses its options; strategies start nothing until ``prepare``)
        require_carrier(get_strategy_class(strategy)(options), async_trainer,
                        "verl_ext's manager under veRL 0.9's synchronous and one-step-off-policy trainers (they "
                        "train on every sample of the batch they sent, at a fixed batch size; veRL's async trainers, "
                        "trainer.v1.trainer_mode=colocate_async|separate_async, take finished samples as they come "
                        "and carry deferred ones)")
        sample_seed = raw.get("sample_seed")
        if sample_seed is not None and (not isinstance(sample_seed, int) or isinstance(sample_seed, bool)):
            raise StrategyConfigError(f"custom.verl_ext.sample_seed must be an integer or null, got {sample_seed!r}")
        trace = TraceSettings.parse(raw.get("trace"))
        history = HistorySettings.parse(raw.get("history"))
        return cls(strategy=strategy, options=options, seed=seed, sample_seed=sample_seed, trace=trace,
                   history=history)


def _to_dict(node: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(node, (DictConfig, ListConfig)):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra/verl
        pass
    return node
