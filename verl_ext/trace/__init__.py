"""Rollout traces: the versioned Parquet format (``format``), ``verl-ext trace record``
(``record``) and the veRL manager hook that records training rollouts (``verl_hook``)."""

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
