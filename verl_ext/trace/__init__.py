"""Rollout traces: the versioned Parquet format (``format``) and the synthetic workload
(``synth``). Recording one on real engines is ``verl-ext trace record`` (:mod:`verl_ext.ab.record`);
inside veRL training, :mod:`verl_ext.rollout.trace_hook`."""
from verl_ext.trace.format import (
    FINISH_REASONS,
    TRACE_FORMAT,
    TRACE_VERSION,
    Trace,
    TraceFormatError,
    read_trace,
    write_trace,
)

__all__ = [
    "FINISH_REASONS",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "Trace",
    "TraceFormatError",
    "read_trace",
    "write_trace",
]
