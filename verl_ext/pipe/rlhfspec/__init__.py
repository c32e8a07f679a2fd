"""RLHFSpec (docs/papers/rlhfspec.md): workload-aware drafting and lightweight sample
reallocation. Everything scheduler-side is here.

* ``strategy.py``: ``RlhfSpecStrategy`` (``rollout=rlhfspec``) and ``RlhfSpecOptions``:
  allocation, the reallocation loop;
* ``realloc.py``: section 6.1's turning point and greedy pairing, as functions.

Engine side, shared by the vLLM drafter and the simulator: the per-step selection of draft
tokens (section 5, ``verl_ext.spec.select``, native search in ``spec/csrc/draft_select.*``).
"""

from verl_ext.pipe.rlhfspec.strategy import RlhfSpecOptions, RlhfSpecStrategy

__all__ = ["RlhfSpecOptions", "RlhfSpecStrategy"]
