"""The dispatcher's metrics in veRL's tracking under the V1 trainer (``trainer.use_v1=true``, the
default of veRL 0.9.1).

The V0 trainer logs what a manager puts in ``meta_info["timing"]``. The V1 trainer's
``generate_sequences`` returns nothing, and results reach the trainer through TransferQueue.
Each training step, though, merges ``PPOTrainer._consume_sync_metrics()`` into the metrics it
logs (``verl/trainer/ppo/v1/trainer_base.py``: weight-sync statistics stashed by
``on_step_end``). The V1 manager registers its ``verl_ext_metrics`` here, and this wraps that
method once per process, so that every training step also logs the ``verl_ext/*`` counters of
the rollouts since the previous step.

Wrapping the method is this module's only effect on veRL, and it is confined to the process
that built a verl_ext manager. The wrapper passes through whatever the original returns and
adds only ``verl_ext/`` keys. A source that fails (a dead dispatcher) is skipped with a
warning. A veRL without the method gets one warning, and the metrics are then not logged.
"""

from __future__ import annotations

import logging
import weakref

from verl_ext.rollout.verl_compat import TRAINER_METRICS_HOOK, VERL_RANGE
from verl_ext.vllm.hooks import Hook

logger = logging.getLogger(__name__)

#: the wrapped method of veRL's V1 trainer
HOOK = TRAINER_METRICS_HOOK
#: it, in the form of ``verl_ext.vllm.hooks.HOOKS`` (``verl-ext doctor``)
HOOKS = (
    Hook(f"verl.trainer.ppo.v1.trainer_base:PPOTrainer.{HOOK}", f"{__name__}.add_source",
         "the trainer process of a run that selects verl_ext", VERL_RANGE,
         "adds verl_ext/* metrics to each step's tracking under the V1 trainer"),
)

_sources: list = []  # weakref.WeakMethod of each live manager's metrics method


def add_source(metrics_method) -> bool:
    """Log ``metrics_method()`` (a bound method returning ``{"verl_ext/...": float}``) with every
    V1 training step while its object lives; False where this veRL has no hook for it."""
    if not _install():
        return False
    _sources.append(weakref.WeakMethod(metrics_method))
    return True


def collect() -> dict[str, float]:
    """The live sources' metrics, merged (dead sources are dropped)."""
    out: dict[str, float] = {}
    for ref in list(_sources):
        fn = ref()
        if fn is None:
            _sources.remove(ref)
            continue
        try:
            got = fn()
        except Exception as exc:  # metrics must never break a step
            logger.warning("verl_ext: no rollout metrics this step (%s: %s)", type(exc).__name__, exc)
            continue
        out.update({k: v for k, v in (got or {}).items() if str(k).startswith("verl_ext/")})
    return out


def _install() -> bool:
    try:
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    except ImportError as exc:
        logger.warning("verl_ext: veRL's V1 trainer is not importable (%s); rollout metrics are not logged", exc)
        return False
    original = getattr(PPOTrainer, HOOK, None)
    if original is None:
        logger.warning("verl_ext: this veRL's V1 trainer has no %s; verl_ext/* rollout metrics are not logged "
                       "(the V0 trainer, trainer.use_v1=false, logs them)", HOOK)
        return False
    if getattr(original, "__verl_ext__", False):
        return True

    def _consume_sync_metrics(self):
        metrics = dict(original(self) or {})
        metrics.update(collect())
        return metrics

    _consume_sync_metrics.__verl_ext__ = True
    _consume_sync_metrics.__wrapped__ = original
    _consume_sync_metrics.__doc__ = original.__doc__
    setattr(PPOTrainer, HOOK, _consume_sync_metrics)
    return True
