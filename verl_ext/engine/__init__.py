"""Engine adapters behind one contract (``instance.py``): local vLLM, veRL replicas, simulator."""

from verl_ext.engine.instance import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    GenRequest,
    Instance,
    SamplingSpec,
    Telemetry,
)

__all__ = [
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Completion",
    "GenRequest",
    "Instance",
    "SamplingSpec",
    "Telemetry",
]
