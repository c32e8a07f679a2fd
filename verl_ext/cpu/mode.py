"""veRL's CPU mode: when it is on, and how a process turns it on.

The user asks for it with ``trainer.device=cpu`` on the command line of veRL's trainer
(``python -m verl.trainer.main_ppo ...``), on a machine with no accelerator. verl_ext's
``verl.plugins`` entry point (:mod:`verl_ext.plugin`) then, in the driver, before veRL resolves
its platform:

* sets ``VERL_PLATFORM=cpu`` and ``VLLM_TARGET_DEVICE=cpu``; Ray's local workers inherit the
  driver's environment, so every process of the run resolves the same platform;
* adds the CPU preset ``+verl_ext_cpu=default`` (``verl_ext/config/verl_ext_cpu/default.yaml``),
  whose values any command-line override replaces, and the Hydra callback that checks the run's
  memory before Ray starts (``verl_ext.cpu.memory.MemoryCheck``).

In every process whose environment says ``VERL_PLATFORM=cpu`` (the driver above, Ray's workers,
vLLM's engine processes) it registers veRL's ``cpu`` platform (:mod:`verl_ext.cpu.platform`) and
installs the runtime shim (:mod:`verl_ext.cpu.shim`). With an accelerator present,
``trainer.device=cpu`` changes nothing here (veRL itself then picks the accelerator), and a GPU run
never loads either module.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("verl_ext")

PLATFORM_ENV = "VERL_PLATFORM"
#: what the driver exports for every process of a CPU-mode run
CPU_ENV = {PLATFORM_ENV: "cpu", "VLLM_TARGET_DEVICE": "cpu"}
DEVICE_ARG = "trainer.device=cpu"
PRESET_GROUP = "verl_ext_cpu"
PRESET_ARG = f"+{PRESET_GROUP}=default"
#: the CPU run's memory check (``verl_ext.cpu.memory.MemoryCheck``), a Hydra callback
MEMORY_CHECK_KEY = "verl_ext_cpu_memory"
MEMORY_CHECK_ARG = f"+hydra.callbacks.{MEMORY_CHECK_KEY}._target_=verl_ext.cpu.memory.MemoryCheck"


def enabled() -> bool:
    """Whether this process runs in CPU mode (its environment names veRL's ``cpu`` platform)."""
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == "cpu"


def requested(argv: list[str]) -> bool:
    """Whether a trainer command line asks for the CPU (``trainer.device=cpu``)."""
    return any(arg.lstrip("+") == DEVICE_ARG for arg in argv[1:])


def accelerator_present() -> bool:
    """Whether veRL detects an accelerator here (its own platforms' detection, as at start-up)."""
    from verl.plugin.platform import PlatformRegistry

    from verl_ext.cpu.platform import PLATFORM_NAME

    for name in PlatformRegistry.registered_names():
        cls = PlatformRegistry.get(name)
        if name == PLATFORM_NAME or cls is None:
            continue
        try:
            if cls().is_platform_available(use_smi_check=True):
                return True
        except Exception:  # a platform whose probe fails is not present
            continue
    return False


def insert_override(argv: list[str], override: str) -> list[str]:
    """``argv`` with ``override`` right after its last Hydra override (or at the end without one):
    Hydra's parser takes the overrides as one run of positional arguments, so one appended after
    ``--cfg job`` would be refused."""
    last = max((i for i, arg in enumerate(argv) if i > 0 and "=" in arg and not arg.startswith("-")), default=len(argv) - 1)
    return [*argv[: last + 1], override, *argv[last + 1:]]


def with_preset(argv: list[str]) -> list[str]:
    """``argv`` plus the CPU preset, unless the command line already picks a preset option, and
    the memory check (once)."""
    out = list(argv)
    if not any(arg.lstrip("+~").startswith(f"{PRESET_GROUP}=") for arg in argv[1:]):
        out = insert_override(out, PRESET_ARG)
    if not any(f"hydra.callbacks.{MEMORY_CHECK_KEY}" in arg for arg in argv[1:]):
        out = insert_override(out, MEMORY_CHECK_ARG)
    return out


def install() -> None:
    """Register veRL's ``cpu`` platform and install the shim in this process."""
    import verl

    import verl_ext.cpu.platform  # noqa: F401  (registers the platform)
    from verl_ext.cpu import shim

    shim.install(verl.__version__)


def activate_for_trainer(argv: list[str], add_preset: bool = True) -> list[str]:
    """In a trainer's driver: if ``argv`` asks for the CPU and no accelerator is present (or the
    environment already names the ``cpu`` platform), export the CPU mode's environment and return
    ``argv`` plus the preset (without it when ``add_preset`` is False); else ``argv``."""
    if not requested(argv):
        return argv
    if not enabled():
        if accelerator_present():
            logger.warning("verl_ext: trainer.device=cpu with an accelerator present; the CPU mode stays off")
            return argv
        os.environ.update(CPU_ENV)
    return with_preset(argv) if add_preset else argv
