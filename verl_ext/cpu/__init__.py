"""veRL on CPUs: a ``cpu`` platform for veRL's platform registry, the runtime shim for what veRL
0.9 cannot do on a CPU through its extension points, the switch that turns both on
(``trainer.device=cpu``), and the harnesses that run real veRL training here
(``scripts/verl_e2e.sh``). docs/CPU_MODE.md has the rationale."""
