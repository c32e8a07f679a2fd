"""Real veRL runs on this machine, the harnesses around veRL's own trainer and managers:

* ``e2e``: training with each strategy, step by step (``scripts/verl_e2e.sh``);
* ``identity``: one batch through veRL's agent-loop manager and verl_ext's on the same servers;
* ``conformance`` (with its agent loops, ``conformance_loop``, and tools, ``conformance_tools``):
  what each strategy gives the trainer against veRL's manager, across sampling settings
  (``scripts/conformance.py``).
"""
