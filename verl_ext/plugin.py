"""veRL plugin (entry point ``verl.plugins: verl_ext``), imported by ``import verl`` in every process.

It must stay cheap and must never raise: veRL logs plugin import errors only at DEBUG level, so
we catch everything and log a WARNING ourselves.

What it does:

1. The CPU mode (:mod:`verl_ext.cpu.mode`): ``trainer.device=cpu`` on the trainer's command line,
   on a machine without an accelerator, exports ``VERL_PLATFORM=cpu`` (and ``VLLM_TARGET_DEVICE``)
   and adds the CPU preset ``+verl_ext_cpu=default``; in every process whose environment names
   the ``cpu`` platform, it registers that platform and installs the CPU shim.
2. The literal short form ``python -m verl.trainer.main_ppo rollout=<strategy>``.
veRL's defaults list names the rollout group ``rollout@actor_rollout_ref.rollout``, so plain
Hydra rejects ``rollout=<strategy>`` ("Could not override 'rollout'"). When, and only when, the
running program is ``verl.trainer.main_ppo`` and its command line has a bare ``rollout=<name>``
argument, this rewrites that one argument to ``rollout@actor_rollout_ref.rollout=<name>``, which
Hydra then resolves against ``pkg://verl_ext.config`` (added to every Hydra app's search path by
``hydra_plugins/verl_ext_searchpath``). Any other program, or a command line without a bare
``rollout=`` argument, is left untouched. Set ``VERL_EXT_REWRITE_ARGV=0`` to leave the command
line alone (the long form keeps working; the CPU mode then needs ``+verl_ext_cpu=default`` on it),
or ``VERL_USE_EXTERNAL_PLUGINS=none`` to skip all plugins.
3. An early check of verl_ext's settings. On the same trainer command lines it adds the Hydra
callback :class:`verl_ext.config.check.ConfigCheck` (``+hydra.callbacks.verl_ext_check``), which
checks ``custom.verl_ext``, the strategy's options and profiles and the engines' drafter settings
once the config is composed, before veRL starts Ray or any server: a bad setting ends the run in
seconds with one line, ``verl_ext: ...``. It does nothing for a config without ``custom.verl_ext``
(but, in the CPU mode, check that the run fits in memory: :mod:`verl_ext.cpu.memory`).
4. The OmegaConf resolver ``verl_ext_cpu_kv_bytes`` that the CPU preset sizes the servers' KV
cache with (:mod:`verl_ext.cpu.memory`); it reads nothing until a config uses it.

None of this imports verl_ext's strategies or its native extension: a run that does not select
verl_ext trains as plain veRL even where that extension is missing or broken.
"""

from __future__ import annotations

import logging
import os
import sys

from verl_ext.cpu import mode as cpu_mode

logger = logging.getLogger("verl_ext")

#: programs whose root config is veRL's ``ppo_trainer`` (the rollout group lives at
#: ``actor_rollout_ref.rollout``)
TRAINER_MODULES = ("verl.trainer.main_ppo",)
SHORT_PREFIX = "rollout="
LONG_PREFIX = "rollout@actor_rollout_ref.rollout="


def running_module(orig_argv: list[str]) -> str | None:
    """The ``-m`` module or script path of the interpreter command line, if any."""
    args = orig_argv[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
        if arg in ("-c",):
            return None
        if arg in ("-W", "-X", "-Q"):  # options that take a value
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg  # a script path
    return None


def _is_trainer(program: str | None) -> bool:
    if not program:
        return False
    if program in TRAINER_MODULES:
        return True
    normalized = program.replace(os.sep, "/")
    return any(normalized.endswith(m.replace(".", "/") + ".py") for m in TRAINER_MODULES)


def rewrite_rollout_args(argv: list[str], program: str | None) -> list[str]:
    """Return ``argv`` with a bare ``rollout=X`` rewritten to the long form (for veRL's trainer)."""
    if not _is_trainer(program):
        return argv
    out = list(argv)
    for i, arg in enumerate(out):
        if i == 0:  # the program itself ('-m' while `python -m` is still importing)
            continue
        if arg.startswith(SHORT_PREFIX):
            name = arg[len(SHORT_PREFIX):]
            out[i] = LONG_PREFIX + name
            _check_known(name)
    return out


def with_config_check(argv: list[str], program: str | None) -> list[str]:
    """``argv`` plus verl_ext's config-check callback (for veRL's trainer, once)."""
    if not _is_trainer(program):
        return argv
    from verl_ext.config.check import CALLBACK_ARG, CALLBACK_KEY

    if any(f"hydra.callbacks.{CALLBACK_KEY}" in arg for arg in argv[1:]):
        return argv
    return cpu_mode.insert_override(argv, CALLBACK_ARG)


def _check_known(name: str) -> None:
    try:
        from verl_ext.config import option_names

        known = option_names()
    except Exception:  # pragma: no cover - never break the trainer from here
        return
    if name not in known:
        # Hydra fails right after with "Could not find 'rollout/<name>'"; say what exists.
        logger.warning("verl_ext: unknown rollout strategy '%s'; available: %s", name, ", ".join(known))


def _apply() -> None:
    orig = getattr(sys, "orig_argv", None)
    if not orig:
        return
    program = running_module(orig)
    rewrite = os.environ.get("VERL_EXT_REWRITE_ARGV", "1") != "0"
    new = sys.argv
    if _is_trainer(program):
        new = cpu_mode.activate_for_trainer(new, add_preset=rewrite)
    if rewrite:
        new = with_config_check(rewrite_rollout_args(new, program), program)
    if new != sys.argv:
        # In place: runpy keeps this list object and only replaces argv[0] afterwards.
        sys.argv[:] = new


try:
    _apply()
except Exception as exc:  # never raise from a veRL plugin
    logger.warning("verl_ext plugin: skipped argv handling (%s: %s)", type(exc).__name__, exc)


def _register_resolvers() -> None:
    """The CPU preset's KV-size resolver (light: ``verl_ext.cpu.memory`` imports no torch)."""
    from omegaconf import OmegaConf

    from verl_ext.cpu.memory import RESOLVER, resolve_kv_bytes

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, resolve_kv_bytes)


try:
    _register_resolvers()
except Exception as exc:
    logger.warning("verl_ext plugin: resolver not registered (%s: %s)", type(exc).__name__, exc)

try:
    if cpu_mode.enabled():
        cpu_mode.install()
except Exception as exc:
    logger.warning("verl_ext plugin: CPU mode not set up (%s: %s)", type(exc).__name__, exc)

