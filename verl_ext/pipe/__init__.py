"""Scheduling: which request (or chunk) goes to which engine instance, and when.

``strategy.py`` holds the ``Strategy`` interface and registry, ``pool.py`` the instance pool,
and one module per strategy (``baseline.py``, ...).
"""

from verl_ext.pipe.pool import InstancePool, RequestRecord
from verl_ext.pipe.strategy import (
    Strategy,
    StrategyConfigError,
    UnknownStrategyError,
    available_strategies,
    get_strategy_class,
    make_strategy,
    register_strategy,
)

__all__ = [
    "InstancePool",
    "RequestRecord",
    "Strategy",
    "StrategyConfigError",
    "UnknownStrategyError",
    "available_strategies",
    "get_strategy_class",
    "make_strategy",
    "register_strategy",
]
