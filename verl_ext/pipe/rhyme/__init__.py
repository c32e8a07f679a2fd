"""RhymeRL (docs/papers/rhymerl.md): HistoSpec and HistoPipe over the history of earlier epochs.
Everything scheduler-side is here.

* ``strategy.py``: ``RhymeStrategy`` (``rollout=rhyme``) and ``RhymeOptions``: history delivery
  to the engines, ranking groups and their instances, intra- and inter-step migration;
* ``histopipe.py``: HistoPipe's decisions (section 6) as plain functions over lengths and times;
* ``delivery.py``: HistoSpec's delivery of history trees to the engines (also ``multiscope``'s).

Engine side, shared by the vLLM drafter and the simulator: the AIMD window and the batch cut-off
(``verl_ext.spec.aimd``, ``verl_ext.spec.cutoff``) among the drafting rules
(``verl_ext.spec.policy``), history trees built beside the engine (``verl_ext.spec.history_build``).
The history itself lives in the history workers (``verl_ext.history``).
"""

from verl_ext.pipe.rhyme.strategy import RhymeOptions, RhymeStrategy

__all__ = ["RhymeOptions", "RhymeStrategy"]
