"""SpecActor (docs/papers/specactor.md): initial selection, per-request reconfiguration and
Best-of-N speculation. Everything scheduler-side is here.

* ``strategy.py``: ``SpecActorStrategy`` (``rollout=specactor``) and ``SpecActorOptions``: the
  per-step method, per-request windows (Algorithm 2), the Best-of-N loop;
* ``bon.py``: Algorithm 3's greedy assignment of copies, as a function.

Shared with the drafter and the measurements: the TGS model and Algorithm 1
(``verl_ext.spec.tgs``), the draft ladder (``verl_ext.spec.ladder``), reference drafts
(``verl_ext.spec.reference``).
"""

from verl_ext.pipe.specactor.strategy import SpecActorOptions, SpecActorStrategy

__all__ = ["SpecActorOptions", "SpecActorStrategy"]
