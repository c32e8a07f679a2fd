"""Model-free speculative drafting.

- ``_suffix`` (native, ``csrc/``): the suffix-tree draft index. ``DraftIndex`` keeps request,
  group (Seer, seed 000 section 4.4) and history (RhymeRL HistoSpec, seed 001 section 5.3)
  trees and proposes drafts for a whole engine batch in one call.
- ``options``: ``SpecOptions``, the knobs, and the vLLM engine arguments that enable drafting.
- ``vllm_proposer``: the vLLM ``custom_class`` proposer over the index.
- ``vllm_plugin``: the ``vllm.general_plugins`` hook that gives the proposer the engine batch
  (request ids, prompts, ``SamplingParams.extra_args``) and an RPC for loading history.
"""

from verl_ext.spec._suffix import SCOPE_GROUP, SCOPE_HISTORY, SCOPE_REQUEST, DraftIndex
from verl_ext.spec.options import SpecOptions, scope_mask

__all__ = ["DraftIndex", "SpecOptions", "scope_mask", "SCOPE_REQUEST", "SCOPE_GROUP", "SCOPE_HISTORY"]
