"""Seer (docs/papers/seer.md): divided rollout, context-aware scheduling and adaptive grouped
speculative decoding. Everything scheduler-side is here; a fifth strategy starts as a copy of a
folder like this one.

* ``strategy.py``: ``SeerStrategy`` (``rollout=seer``) and ``SeerOptions``: chunks, placement,
  the ablation switches;
* ``buffer.py``: the request buffer of divided rollout (section 4.2) and Algorithm 1's
  context-aware pick (section 4.3).

Engine side, shared by the vLLM drafter and the simulator: the grouped draft server
(``verl_ext.spec.dgds``), the adaptive budget (``verl_ext.spec.adaptive``) among the drafting
rules (``verl_ext.spec.policy``).
"""

from verl_ext.pipe.seer.strategy import SeerOptions, SeerStrategy

__all__ = ["SeerOptions", "SeerStrategy"]
