"""Measurements on real engines and recordings that feed the fits of :mod:`verl_ext.perf`
(the ``verl-ext fit`` commands).

* ``grid``: a grid of batches on local engines -> a cost model;
* ``trace``: a recorded rollout's engine steps -> a cost model (``perf.trace_fit``);
* ``steplog``: drafting engines' step logs -> draft costs (``perf.steplog_fit``);
* ``acceptance``: a drafter replayed over a trace -> RLHFSpec's acceptance map;
* ``ladder`` / ``engine_ladder``: SpecActor's draft ladder, from cost models or local engines.
"""

from __future__ import annotations

import os
from pathlib import Path


def json_out(path: str) -> Path:
    """``--out`` of every ``verl-ext fit`` command: a writable ``.json`` path (its directory made)."""
    out = Path(path)
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got '{out}'")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"output directory '{out.parent}' is not writable")
    return out
