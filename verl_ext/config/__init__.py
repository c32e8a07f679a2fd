"""Hydra options (``rollout/<strategy>.yaml``, on the search path as ``pkg://verl_ext.config``)
and the typed view of verl_ext's settings under ``actor_rollout_ref.rollout.custom.verl_ext``."""

from verl_ext.config.settings import VerlExtSettings, option_names

__all__ = ["VerlExtSettings", "option_names"]
