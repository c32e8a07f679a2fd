"""Puts ``pkg://verl_ext.config`` on every Hydra app's search path.

This makes ``rollout@actor_rollout_ref.rollout=<strategy>`` resolve in veRL's ``main_ppo``
without a ``hydra.searchpath`` override. It only appends a search-path entry: an app that never
names a verl_ext option composes exactly as before.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class VerlExtSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="verl_ext", path="pkg://verl_ext.config")
