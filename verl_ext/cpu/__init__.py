"""veRL on CPUs: a ``cpu`` platform for veRL's platform registry (``platform``), the runtime shim
for what veRL 0.9 cannot do on a CPU through its extension points (``shim``), the memory plan
(``memory``) and the switch that turns them on (``mode``: ``trainer.device=cpu``). The runs of real
veRL built on it are :mod:`verl_ext.verl_runs`. docs/CPU_MODE.md has the rationale."""
