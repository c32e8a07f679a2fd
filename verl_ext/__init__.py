"""verl_ext: faster veRL rollouts without changing the RL algorithm.

Layers (see docs/ARCHITECTURE.md): ``engine`` (the Instance contract and engine adapters),
``pipe`` (strategies: which request goes where and when), ``spec`` (drafting), ``history``
(history workers), ``rollout`` (veRL-facing manager), ``config`` (Hydra options), ``ab``
(side-by-side runs) and ``workload`` (the default arithmetic workload).
"""

__version__ = "0.1.0"
