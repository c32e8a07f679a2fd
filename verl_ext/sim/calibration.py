"""Where a similarity level lands against its calibration targets.

``check_level(level)`` synthesizes ``CALIBRATION_CONFIG`` with the level's knobs (one workload
per seed) and measures each target of ``trace.synth.calibration.SCOPE_TARGETS[level]``: token
statistics by replay (``similarity_stats``) and drafting statistics of the strategies the papers
measured, simulated (``rollout=rhyme``'s HistoSpec with its AIMD window for the history scope,
``rollout=seer``'s late phase for the group scope). Each target has its band and ``ok``; the
papers' figures that need what this project's drafting lacks (``SCOPE_REFERENCES``: Seer's
tree-draft late phase) are reported beside them with the value the level gives, unchecked; what
the papers report but no target holds (speculation rate, HistoSpec's per-rollout speed-up) is
recorded beside them. ``fit_level`` searches the knobs for a level whose targets all land
(minutes; its result is what ``SIMILARITY_LEVELS`` holds). ``scripts/bench_calibration.py``
prints ``check_level`` for every level.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from typing import Callable, Optional, Sequence

import numpy as np

from verl_ext.trace.synth.calibration import (CALIBRATION_CONFIG, CALIBRATION_STATS, KNOBS, SCOPE_REFERENCES,
                                              SCOPE_TARGETS, SIMILARITY_LEVELS)
from verl_ext.trace.synth.config import SynthConfig
from verl_ext.trace.synth.content import load_source, synthesize
from verl_ext.trace.synth.similarity import similarity_stats

#: the simulated arms: rhyme's HistoSpec alone (HistoPipe off: the drafting statistics only)
HISTOSPEC_ARM = "rhyme[histopipe=false]"
ARMS = ("baseline", HISTOSPEC_ARM, "seer")
#: simulated instances of the calibration workload (192 requests: a late phase on each)
INSTANCES = 4
SEEDS = (0, 1)


def _measure_one(cfg: SynthConfig, source, instances: int) -> dict:
    from verl_ext.sim.runner import SimConfig, run_sim_ab

    trace = synthesize(cfg, source)
    st = similarity_stats(trace, **{**CALIBRATION_STATS, "seed": cfg.seed})
    out = tempfile.mkdtemp(prefix="verl_ext_calibration_")
    try:
        arms = run_sim_ab(SimConfig(strategies=list(ARMS), instances=instances, out=out + "/run", seed=cfg.seed),
                          progress=False, trace=trace)["strategies"]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    spec, seer = arms[HISTOSPEC_ARM], arms["seer"]
    group, history = st["group"]["gain"], st.get("history", {}).get("gain", float("nan"))
    return {
        "reuse_fraction": st["reuse_fraction"],
        "group_gain": group,
        "history_gain": history,
        "history_over_group_gain": history / group if group else float("nan"),
        "tokens_per_step_request": st["group"]["tokens_per_step_request"],
        "tokens_per_step_group": st["group"]["tokens_per_step_group"],
        "history_acceptance": spec["draft_acceptance"] or 0.0,
        "history_speculation_rate": spec["speculation_rate"] or 0.0,
        "history_tokens_per_step": spec["tokens_per_step"],
        "histospec_speedup": arms["baseline"]["wall_s"] / spec["wall_s"],
        "late_tokens_per_step": seer["late_tokens_per_step"] or 0.0,
        "seer_tokens_per_step": seer["tokens_per_step"],
    }


def measure_knobs(knobs: dict, seeds: Sequence[int] = SEEDS, source=None, instances: int = INSTANCES,
                  config: SynthConfig = CALIBRATION_CONFIG) -> dict:
    """Every statistic ``check_level`` reads, for ``config`` with ``knobs``: the mean over one
    workload per seed."""
    source = source if source is not None else load_source()
    runs = [_measure_one(dataclasses.replace(config, seed=int(s), **knobs), source, instances) for s in seeds]
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def _miss(value: float, band: Sequence[float]) -> float:
    """How far ``value`` lies outside ``band``, in band widths (0 inside)."""
    lo, hi = band
    return (max(0.0, lo - value) + max(0.0, value - hi)) / (hi - lo)


def score(level: str, measured: dict) -> list[dict]:
    """``SCOPE_TARGETS[level]`` with what was measured and ``ok``."""
    rows = []
    for t in SCOPE_TARGETS[level]:
        value = measured[t["name"]]
        rows.append({**t, "achieved": round(value, 4), "ok": bool(_miss(value, t["band"]) == 0)})
    return rows


def references(level: str, measured: dict) -> list[dict]:
    """``SCOPE_REFERENCES[level]`` with what the level gives: reported, never checked."""
    return [{**r, "achieved": round(measured[r["name"]], 4)} for r in SCOPE_REFERENCES.get(level, [])]


def check_level(level: str, seeds: Sequence[int] = SEEDS, source=None, instances: int = INSTANCES) -> dict:
    """The level's knobs, each target with its band, the value achieved and ``ok``, and the
    statistics recorded beside them."""
    if level not in SCOPE_TARGETS:
        raise ValueError(f"unknown similarity level {level!r}; available: {sorted(SCOPE_TARGETS)}")
    knobs = {k: SIMILARITY_LEVELS[level][k] for k in KNOBS}
    measured = measure_knobs(knobs, seeds, source, instances)
    targets = score(level, measured)
    refs = references(level, measured)
    named = {t["name"] for t in targets} | {r["name"] for r in refs}
    return {
        "label": SIMILARITY_LEVELS[level]["label"],
        "knobs": knobs,
        "targets": targets,
        "references": refs,
        "recorded": {k: round(v, 4) for k, v in measured.items() if k not in named},
        "ok": all(t["ok"] for t in targets),
    }


def fit_level(level: str, start: Optional[dict] = None, rounds: int = 6, seeds: Sequence[int] = SEEDS, source=None,
              log: Optional[Callable[[str], None]] = None) -> dict:
    """Coordinate search over the knobs (from ``start``, default the level's): a step is kept
    when it lowers the total miss of the level's targets; steps halve after a round without
    one. Returns the knobs, what they achieved and the total miss (0: every target lands)."""
    source = source if source is not None else load_source()
    x = dict(start or {k: SIMILARITY_LEVELS[level][k] for k in KNOBS})
    steps = {"epoch_similarity": 0.05, "group_similarity": 0.05, "self_similarity": 0.05,
             "epoch_edit_rate": 0.01, "group_edit_rate": 0.005}

    def loss(knobs):
        m = measure_knobs(knobs, seeds, source)
        return sum(_miss(m[t["name"]], t["band"]) for t in SCOPE_TARGETS[level]), m

    best, measured = loss(x)
    for _ in range(rounds):
        if best == 0:
            break
        moved = False
        for name, step in steps.items():
            for d in (step, -step):
                y = {**x, name: round(min(1.0, max(0.0, x[name] + d)), 4)}
                if y == x or y["epoch_similarity"] + y["group_similarity"] + y["self_similarity"] > 1:
                    continue
                miss, m = loss(y)
                if log:
                    log(f"{name}={y[name]}: miss {miss:.3f} " + " ".join(f"{k}={m[k]:.3f}" for k in sorted(m)))
                if miss < best - 1e-3:
                    x, best, measured, moved = y, miss, m, True
                    break
        if not moved:
            steps = {k: v / 2 for k, v in steps.items()}
    return {"knobs": x, "miss": best, "achieved": measured}
