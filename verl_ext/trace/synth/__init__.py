"""Synthetic long-tail rollout workloads for the simulator, from real tokens.

``synthesize(cfg, source)`` (``content``) returns a ``Trace`` whose response lengths follow a
long-tail model (``lengths``) and whose tokens are real responses of ``source`` with tunable
within-group, cross-epoch and self similarity. ``SynthConfig`` (``config``) sets both;
``with_level`` applies one of the two calibrated similarity levels (``calibration``: their knobs
and per-scope targets, measured by ``verl_ext.sim.calibration``). The papers' figures, the model and its limits: docs/SIMULATOR.md,
"Synthetic workloads"."""

from verl_ext.trace.synth.calibration import (
    CALIBRATION_CONFIG,
    CALIBRATION_STATS,
    KNOBS,
    SCOPE_REFERENCES,
    SCOPE_TARGETS,
    SEED_TARGETS,
    SIMILARITY_LEVELS,
    knobs_from_json,
    with_level,
)
from verl_ext.trace.synth.config import SynthConfig
from verl_ext.trace.synth.content import default_source_path, load_source, synthesize
from verl_ext.trace.synth.lengths import length_stats, sample_lengths
from verl_ext.trace.synth.similarity import similarity_stats

__all__ = [
    "SynthConfig",
    "SIMILARITY_LEVELS",
    "SEED_TARGETS",
    "SCOPE_REFERENCES",
    "SCOPE_TARGETS",
    "KNOBS",
    "CALIBRATION_CONFIG",
    "CALIBRATION_STATS",
    "with_level",
    "knobs_from_json",
    "synthesize",
    "sample_lengths",
    "similarity_stats",
    "length_stats",
    "load_source",
    "default_source_path",
]
