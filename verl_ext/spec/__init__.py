"""Model-free speculative drafting.

- ``_suffix`` (native, ``csrc/``): the suffix-tree draft index. ``DraftIndex`` keeps request,
  group (Seer section 4.4), history (RhymeRL HistoSpec, section 5.3) and, when turned on, global
  (every recent response, Arctic's global tree) trees and proposes drafts for a whole engine
  batch in one call.
- ``options``: ``SpecOptions``, the knobs, and the vLLM engine arguments that enable drafting.
- ``history_build``: history trees built off the drafting thread.

The vLLM drafter over the index and the plugin that gives it the engine batch live in
``verl_ext.vllm`` (``proposer``, ``plugin``). The index's API, contents and proposal rule are in
docs/ARCHITECTURE.md ("Draft index and the vLLM drafter"); what it costs and guarantees:

* **Costs.** Append inserts at most one window: ``O(D)``, at most two new 20-byte nodes; tokens are
  stored once (4 bytes). Hub nodes (8+ children) are indexed by one open-addressing table per tree.
* **Deltas.** Every change bumps the tree version; ``export_group(g, since)`` ships, per sequence
  changed after ``since``, the tokens from its length at ``since``. ``import_group`` checks every
  record (gaps, disagreeing overlap, appends to closed sequences) before applying any.
* **Memory.** Every tree's bytes are accounted; above ``max_bytes`` the least recently used trees
  (request, group or history) are evicted down to 90% of the cap. The global tree is bounded by
  its own token cap (two generations), not evicted. A request whose tree was
  evicted keeps drafting from its group and history.
* **Threads.** No internal locking: every ``DraftIndex`` call holds the GIL, so Python threads
  are serialized; only ``build_history_tree`` (a tree apart from any index) releases it. One index
  per process (vLLM has one per worker/TP rank).

The names below are imported on first use: importing this package (for ``options``, say) must
not load the native extension where nothing drafts (issue 47).
"""

import importlib

_EXPORTS = {"DraftIndex": "_suffix", "SCOPE_REQUEST": "_suffix", "SCOPE_GROUP": "_suffix",
            "SCOPE_HISTORY": "_suffix", "SCOPE_GLOBAL": "_suffix", "match_lengths": "_suffix", "SpecOptions": "options",
            "scope_mask": "options"}

__all__ = list(_EXPORTS)


def load_native():
    """Import the native extension (``_suffix``) and return it; raises what its import raises
    (``verl-ext doctor`` reports it)."""
    return importlib.import_module(f"{__name__}._suffix")


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
