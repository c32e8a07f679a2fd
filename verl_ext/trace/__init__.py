"""Rollout traces: the versioned Parquet format (``format``), ``verl-ext trace record``
(``record``) and the synthetic workload (``synth``). Recording inside veRL training is
:mod:`verl_ext.rollout.trace_hook`."""

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
