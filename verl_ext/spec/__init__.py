"""Model-free speculative drafting.

- ``_suffix`` (native, ``csrc/``): the suffix-tree draft index. ``DraftIndex`` keeps request,
  group (Seer section 4.4) and history (RhymeRL HistoSpec, section 5.3)
  trees and proposes drafts for a whole engine batch in one call.
- ``options``: ``SpecOptions``, the knobs, and the vLLM engine arguments that enable drafting.
- ``history_build``: history trees built off the drafting thread.

The vLLM drafter over the index and the plugin that gives it the engine batch live in
``verl_ext.vllm`` (``proposer``, ``plugin``).

The names below are imported on first use: importing this package (for ``options``, say) must
not load the native extension where nothing drafts (issue 47).
"""

import importlib

_EXPORTS = {"DraftIndex": "_suffix", "SCOPE_REQUEST": "_suffix", "SCOPE_GROUP": "_suffix",
            "SCOPE_HISTORY": "_suffix", "SpecOptions": "options", "scope_mask": "options"}

__all__ = list(_EXPORTS)


def load_native():
    """Import the native extension (``_suffix``) and return it; raises what its import raises
    (``verl-ext doctor`` reports it)."""
    return importlib.import_module(f"{__name__}._suffix")


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
