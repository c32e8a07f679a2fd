"""Scheduling: which request (or chunk) goes to which engine instance, and when.

``strategy.py`` holds the ``Strategy`` interface and registry, ``pool.py`` the instance pool,
``lifecycle.py`` what every driver does around a strategy's rollouts, ``arms.py`` the arm grammar
of A/B runs, ``chunks.py`` / ``defer.py`` continuations and deferred samples. ``baseline.py`` and
``oracle.py`` are one module each; each paper's scheduler side is one folder (``seer/``,
``rhyme/``, ``rlhfspec/``, ``specactor/``: its strategy, options and helpers), its engine side in
:mod:`verl_ext.spec`, named in the folder's docstring.
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
