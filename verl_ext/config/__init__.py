"""Hydra options (``rollout/<strategy>.yaml``, on the search path as ``pkg://verl_ext.config``)
and the typed view of verl_ext's settings under ``actor_rollout_ref.rollout.custom.verl_ext``.

``option_names`` is here and ``VerlExtSettings`` is imported on first use: veRL's plugin hook and
the config check import this package for every trainer run, selected or not, and must not reach
the strategies (or the native extension) there (issue 47).
"""

from importlib import resources


def option_names() -> list[str]:
    """verl_ext's Hydra options in the ``rollout`` group (one per registered strategy)."""
    folder = resources.files("verl_ext.config") / "rollout"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def __getattr__(name: str):
    if name == "VerlExtSettings":
        from verl_ext.config.settings import VerlExtSettings

        return VerlExtSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["VerlExtSettings", "option_names"]
