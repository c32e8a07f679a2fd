"""A trainer config's verl_ext settings, checked before veRL starts anything.

``check_rollout(rollout)`` does, in the driver and in about a second, every check the rollout's
own start-up would do minutes later (after Ray, the training workers and the vLLM servers are
up): ``custom.verl_ext`` (unknown keys, malformed values), the strategy's options (unknown
options, unreadable profiles: the strategy is built once and dropped), the engines' drafter
settings (``engine_kwargs.vllm.additional_config.verl_ext_spec``, parsed as the drafter parses
them) and the options that must agree between the two. It raises ``ValueError`` with the same
message the later failure would have, or returns None for a config that does not select verl_ext.

``ConfigCheck`` runs it as a Hydra callback (``on_job_start``, before veRL's task function);
verl_ext's ``verl.plugins`` entry point adds it to ``python -m verl.trainer.main_ppo`` command
lines (:mod:`verl_ext.plugin`). A bad setting then ends the run, status 1, with one line on
stderr, ``verl_ext: <what is wrong>``. (The CPU mode adds a callback of its own that checks the
run's memory: ``verl_ext.cpu.memory.MemoryCheck``.)

This module imports nothing of verl_ext's strategies at import time: the callback is on every
trainer command line, and a run that does not select verl_ext must not load its code (issue 47).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

logger = logging.getLogger(__name__)

#: where the plugin registers ``ConfigCheck`` among Hydra's callbacks
CALLBACK_KEY = "verl_ext_check"
CALLBACK_ARG = f"+hydra.callbacks.{CALLBACK_KEY}._target_=verl_ext.config.check.ConfigCheck"


def vllm_engine_kwargs(rollout) -> dict:
    return (rollout.get("engine_kwargs") or {}).get("vllm") or {}


def runs_verl_ext_drafter(rollout) -> bool:
    """Whether veRL starts its vLLM servers with verl_ext's suffix drafter (``engine_kwargs``)."""
    if rollout.get("name") != "vllm":
        return False
    spec = vllm_engine_kwargs(rollout).get("speculative_config") or {}
    return str(spec.get("model", "")).startswith("verl_ext.")


def drafter_options(rollout) -> Optional[dict]:
    """The drafter's settings as the engines will read them (``verl_ext_spec`` plus ``k``), or None
    without verl_ext's drafter."""
    if not runs_verl_ext_drafter(rollout):
        return None
    engine = vllm_engine_kwargs(rollout)
    spec = dict((engine.get("additional_config") or {}).get("verl_ext_spec") or {})
    spec["k"] = int(engine["speculative_config"].get("num_speculative_tokens") or 0)
    return spec


#: drafter settings the engines may hold apart from the strategy's ``engine_spec``: the knee's and
#: the cut-off's profiles are named where the engines resolve them, and ``seer`` switches the
#: group trees' source at run time where a grouped draft server streams to the engines
ENGINE_LOCAL = ("knee_profile", "cutoff_profile", "group_source")


def engine_spec_differences(want, have) -> list[str]:
    """The drafter settings in which the engines' ``SpecOptions`` (``have``, from
    ``engine_kwargs``) differ from what the strategy's options ask of them (``want``,
    ``Strategy.engine_spec``), as ``"name: engines X, options Y"``."""
    a, b = want.to_dict(), have.to_dict()
    a["scopes"], b["scopes"] = want.mask, have.mask  # "group+request" is "request+group"
    return [f"{key}: engines {b.get(key)!r}, options {a.get(key)!r}" for key in sorted(set(a) | set(b))
            if key not in ENGINE_LOCAL and a.get(key) != b.get(key)]


def check_drafter_config(settings, rollout, strategy=None) -> None:
    """Refuse, or warn about, strategy options and engine drafter settings that disagree (the
    engines read theirs from ``engine_kwargs`` at start-up). ``strategy``: the strategy built
    from ``settings``, whose ``engine_spec`` the engines' settings must match."""
    spec = drafter_options(rollout)
    if spec is None:
        return
    if strategy is not None:
        from verl_ext.pipe.strategy import StrategyConfigError
        from verl_ext.spec.options import SpecOptions

        try:
            want = strategy.engine_spec()
        except StrategyConfigError:  # options the rollout refuses anyway (checked below or at start)
            want = None
        diff = engine_spec_differences(want, SpecOptions.from_dict(spec)) if want is not None else []
        if diff:
            raise ValueError(
                f"verl_ext: the engines' drafter settings (actor_rollout_ref.rollout.engine_kwargs.vllm: "
                f"speculative_config.num_speculative_tokens and additional_config.verl_ext_spec) disagree with what "
                f"strategy '{settings.strategy}' asks of them (its custom.verl_ext.options): {'; '.join(diff)}. "
                f"Set the strategy's options and leave the engines' settings to rollout={settings.strategy}'s config")
    if spec.get("select") and not spec.get("select_profile"):
        raise ValueError("verl_ext: the engines' draft selection (engine_kwargs.vllm.additional_config.verl_ext_spec."
                         "select, rollout=rlhfspec) needs step times: set actor_rollout_ref.rollout.custom.verl_ext."
                         "options.profile to a cost-model preset (h100-7b, ...) or a `verl-ext fit grid` JSON, or "
                         "options.selection=false")
    profile = settings.options.get("profile") or settings.options.get("draft_profile")
    if settings.options.get("batch_cutoff") is True and profile and not spec.get("cutoff_profile"):
        logger.warning("verl_ext: options.batch_cutoff=true, but the engines have no cut-off table: set "
                       "engine_kwargs.vllm.additional_config.verl_ext_spec.cutoff_profile=%s", profile)
    if settings.options.get("batch_cutoff") is False and spec.get("cutoff_profile"):
        logger.warning("verl_ext: options.batch_cutoff=false, but the engines compute a batch cut-off from "
                       "engine_kwargs.vllm.additional_config.verl_ext_spec.cutoff_profile=%s; set that to '' "
                       "to draft at every batch size", spec.get("cutoff_profile"))
    k = spec["k"]
    need = int(rollout.get("prompt_length") or 0) + int(rollout.get("response_length") or 0) + k
    if rollout.get("max_model_len") is not None and int(rollout.max_model_len) < need:
        # vLLM 0.32 (gpu_model_runner._input_fits_in_drafter): once any sequence of the batch is
        # within k tokens of max_model_len, every request of the step gets k zero drafts, all
        # verified and rejected: the step costs k + 1 tokens per request
        logger.warning("verl_ext: max_model_len=%s leaves less than num_speculative_tokens=%d tokens past "
                       "prompt_length + response_length; near the end vLLM verifies %d padding drafts per request "
                       "and step. Set actor_rollout_ref.rollout.max_model_len=%d (or leave it unset)",
                       rollout.max_model_len, k, k, need)
    if settings.options.get("histospec") is False or settings.options.get("speculative") is False:
        logger.warning("verl_ext: drafting is off in the strategy's options, but the engines still start "
                       "verl_ext's drafter (engine_kwargs.vllm.speculative_config); remove it to decode plainly")


#: the value that turns a ``Strategy.parts_options`` option off (false where not listed)
_OFF = {"chunk_size": 0}


def check_rollout(rollout):
    """Every check of verl_ext's settings that needs no server (see the module docstring): the
    ``VerlExtSettings``, or None for a rollout that does not select verl_ext."""
    custom = rollout.get("custom") or {}
    if "verl_ext" not in custom:
        return None
    from verl_ext.config.settings import VerlExtSettings
    from verl_ext.pipe.strategy import get_strategy_class

    settings = VerlExtSettings.from_custom(custom)
    strategy = get_strategy_class(settings.strategy)(settings.options)  # unknown options, unreadable profiles
    parts = strategy.parts_options()
    if rollout.get("enable_rollout_routing_replay") and parts:
        # each engine call reports the experts of its own tokens only; a response made in parts
        # would reach the trainer without its routing (issue 48, item 8)
        raise ValueError(
            f"verl_ext: rollout routing replay (actor_rollout_ref.rollout.enable_rollout_routing_replay) needs each "
            f"response generated in one engine call, and strategy '{settings.strategy}' generates some in parts "
            f"({', '.join(f'options.{p}' for p in parts)}); set "
            f"{' and '.join(f'custom.verl_ext.options.{p}={_OFF.get(p, False)}' for p in parts)}, or turn replay off")
    spec = drafter_options(rollout)
    if spec is not None:
        from verl_ext.spec.options import SpecOptions

        SpecOptions.from_dict(spec)  # as each engine's drafter does at start-up
    check_drafter_config(settings, rollout, strategy)
    return settings


def refuse(exc: Exception) -> None:
    """End the run: the error's one line on stderr (``verl_ext: ...``), status 1. Hydra turns a
    callback's exceptions into warnings and runs the job anyway, so exiting is the only way."""
    message = str(exc)
    sys.stderr.write((message if message.startswith("verl_ext") else f"verl_ext: {message}") + "\n")
    sys.stderr.flush()
    raise SystemExit(1) from None


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - Hydra comes with veRL
    Callback = object


class ConfigCheck(Callback):
    """Hydra callback: :func:`check_rollout` on ``actor_rollout_ref.rollout`` before the job runs.
    A bad setting writes its one line to stderr and exits with status 1 (Hydra turns a callback's
    exceptions into warnings and runs the job anyway, so exiting is the only way to stop it); a
    failure of the check itself is logged and the run goes on (the rollout's start-up checks again)."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        rollout = OmegaConf.select(config, "actor_rollout_ref.rollout", default=None)
        if rollout is None:
            return
        try:
            check_rollout(rollout)
        except (ValueError, TypeError) as exc:
            refuse(exc)
        except Exception as exc:  # the check's own failure must not stop a run
            logger.warning("verl_ext: could not check the rollout settings before start (%s: %s)",
                           type(exc).__name__, exc)
