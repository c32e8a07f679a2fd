"""Strategies side by side: one arm's measured rollout (``run``), the ``summary.json`` metrics
(``metrics``), the output files and tables (``outputs``) and plots (``plots``), shared by the
real-engine A/B runs (:mod:`verl_ext.ab`) and the simulator (:mod:`verl_ext.sim`)."""
