"""Helpers shared by tests (tests/ is not a package; conftest puts this folder on sys.path)."""

import asyncio
import importlib.util
from pathlib import Path

from verl_ext.engine.instance import Completion, GenRequest, Instance, SamplingSpec, Telemetry


def verl_config_dir() -> str:
    """veRL's installed `verl/trainer/config`, found without importing verl."""
    spec = importlib.util.find_spec("verl")
    return str(Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config")


def compose_verl(overrides):
    """Compose veRL's real `ppo_trainer` config with `overrides` (verl_ext's search-path plugin active)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


class ScriptedInstance(Instance):
    """Returns `max_tokens` tokens after `delay` seconds; records the peak concurrency it saw."""

    def __init__(self, name, delay=0.01):
        self.name, self.delay = name, delay
        self.running = self.peak = 0
        self.seen = []

    async def generate(self, request, on_tokens=None):
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.seen.append(request.request_id)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.running -= 1
        return Completion(request.request_id, [7] * request.sampling.max_tokens, "length", num_steps=request.sampling.max_tokens)

    async def abort(self, request_id):
        pass

    def telemetry(self):
        return Telemetry(running=self.running)


def requests(n, max_tokens=4):
    return [GenRequest(f"r{i}", f"g{i // 2}", [1, 2], SamplingSpec(max_tokens=max_tokens)) for i in range(n)]
