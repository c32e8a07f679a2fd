"""Helpers shared by tests (tests/ is not a package; conftest puts this folder on sys.path)."""

import importlib.util
from pathlib import Path


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
