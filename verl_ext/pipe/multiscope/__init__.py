"""``multiscope``: the four papers' mechanisms in one strategy (issue 51). Scheduler-side code here.

* ``strategy.py``: ``MultiscopeStrategy`` (``rollout=multiscope``) and ``MultiscopeOptions``:
  Seer's divided rollout, context-aware scheduling and adaptive grouped drafts, with drafts
  from every scope the engines keep (the request, its group, and a bounded global tree of
  recent responses to every prompt, which holds the prompt's earlier epochs as well) and
  Algorithm 1's length estimates seeded by the prompt's history (RhymeRL's history workers).

Engine side: the same drafting rules as every strategy (``verl_ext.spec.policy``), the global
scope in ``DraftIndex`` (``SpecOptions.global_tokens``).
"""

from verl_ext.pipe.multiscope.strategy import MultiscopeOptions, MultiscopeStrategy

__all__ = ["MultiscopeOptions", "MultiscopeStrategy"]
