"""Everything of verl_ext that runs inside vLLM or adapts it.

- ``hooks``: every vLLM attribute verl_ext replaces or adds (``HOOKS``: where, when, for which
  versions, why) and the only functions that install them.
- ``plugin``: the ``vllm.general_plugins`` entry point (``verl_ext_spec``), loaded in every vLLM
  process (it calls ``hooks.install``), and the worker RPCs and the drafter's step hook.
- ``proposer``: ``SuffixProposer``, the ``custom_class`` drafter over the native suffix index.
- ``keyed``: position-keyed sampling's step hooks (the rule itself: ``verl_ext.engine.keyed_sampling``).
- ``versions``: the vLLM versions whose hook points these modules know.
- ``machine``: what a machine and an engine process run (``engine_info``, the worker RPC).
- ``local``: ``VLLMInstance``, the ``Instance`` over an in-process vLLM engine, and its factory.
- ``engine_log``: local engines' logs and output in a file (``verl-ext ab --engine-log``).

This package imports nothing on import: vLLM loads ``plugin`` in every engine process, and that
must stay cheap and load no native code (issue 47). Its modules import vLLM absolutely
(``import vllm`` is always the real vLLM, never this package).
"""
