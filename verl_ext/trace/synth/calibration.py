"""What the synthetic workload is calibrated to. ``SEED_TARGETS``: figures quoted from the papers
(assumptions about production clusters, not measured here). ``SIMILARITY_LEVELS``: two knob
settings, ``measured`` (the committed real trace, SmolLM2-135M at T = 1 on CPU: reuse 0.041,
grouped gain +0.29) and ``published`` (RhymeRL §5.1: 75-95% of tokens reusable, 85% targeted;
Seer §3.3 / Table 2: +119% accepted draft tokens with grouped references), each with its target
and what ``similarity.calibrate_levels`` achieved on ``CALIBRATION_CONFIG``. Report drafting at
both levels, each with its label: the measured level alone understates drafting on clusters."""

from __future__ import annotations

import dataclasses
from typing import Optional

from verl_ext.trace.synth.config import SynthConfig


#: Figures from the seeds that ``length_stats``/``similarity_stats`` are compared against.
#: Each is an assumption about production clusters, quoted from the paper's text.
SEED_TARGETS = {
    "tail_share_last10": {"target": 0.50, "source": "Seer §6.2.2: the last 10% of requests take up to 50% of "
                          "rollout time (§2.2: the tail phase is nearly 50%)"},
    "p95_over_p50": {"target": 3.6, "source": "RLHFSpec §3.1: LMSYS-Chat-1M median 378, p95 1373 tokens (not RL; shape only)"},
    "rank_up_8": {"target": 0.155, "source": "RhymeRL §6.1 (16% move up, math) and Table 2 'Accurate' 85.7/83.2% "
                  "(Math-1/2, 8 rank groups)"},
    "rank_up_16": {"target": 0.217, "source": "RhymeRL Table 2 'Accurate' 79.7/76.9% (Math-1/2, 16 rank groups)"},
    "outlier_frac": {"target": 0.04, "source": "RhymeRL §7.2.3 / Fig. 18: 2.2-5.5% of samples migrated as outliers (math)"},
    "within_group": {"target": "most groups have similar lengths", "source": "Seer §3.2, Fig. 4 (qualitative)"},
    "slot_idle_frac": {"target": 0.50, "source": "SpecActor §2.2: ~50% of GPU time wasted waiting for the slowest "
                       "worker (DAPO-32B-20K); crude proxy, not fitted"},
    "reuse_fraction": {"target": [0.75, 0.95], "source": "RhymeRL §5.1: 75-95% of tokens reusable from the previous "
                       "epoch with a 3-token prefix (math 93%, code 75%)"},
    "group_gain": {"target": 1.19, "source": "Seer §3.3 / Table 2: grouped references raise accepted draft tokens by "
                   "up to 119% (20 groups, Qwen2-VL-72B, max draft 8)"},
}

#: The calibration setting: the knob values below were fitted on it (group size = the real
#: trace's, so the measured level compares like with like).
CALIBRATION_CONFIG = SynthConfig(prompts=24, samples=8, epochs=2, mean_len=2048, max_len=8192, min_len=64,
                                 prompt_len=(0, 0), seed=0)
#: ``similarity_stats`` arguments used for calibration (96 replayed targets of <= 1024 tokens).
CALIBRATION_STATS = {"groups": 24, "targets": 4, "max_tokens": 1024}

#: Knob settings. ``measured``: the synthetic metrics equal those of the real source trace
#: (small model on CPU, temperature 1: little self-similarity). ``published``: RhymeRL §5.1
#: reuse in 75-95% (target 85%) and Seer Table 2's +119% grouped gain. Values from
#: ``calibrate_levels`` on CALIBRATION_CONFIG; ``achieved`` is what ``similarity_stats``
#: reported there (mean of 3 seeds). ``published`` needs no sibling copies: at 85% reuse the
#: siblings already share text (they copy the same previous-epoch responses), and +119% rather
#: than ~+300% needs a request-only baseline of ~1.34 tokens/step, i.e. self-repetition
#: (``self_similarity`` 0.19, a consequence of the two targets, not a published figure).
#: On the default 16-sample, 8k-token config: measured reuse 0.041, gain +0.32 (history
#: +0.38); published reuse 0.85, gain +1.36 (history +2.15), more references per group.
SIMILARITY_LEVELS: dict[str, dict] = {
    "measured": {
        "label": "measured: committed real trace (SmolLM2-135M, T=1, CPU)",
        "source": "similarity_stats on data/traces/smollm2_arith_e2.parquet (64 prompts x 8 samples x 2 epochs)",
        "group_similarity": 0.0,
        "epoch_similarity": 0.008,
        "self_similarity": 0.0,
        # calibrate_levels(load_source()) on CALIBRATION_CONFIG / CALIBRATION_STATS
        # mean of 3 seeds: the real trace shows reuse 0.041, gain +0.29, history gain +0.30
        "target": {"reuse_fraction": 0.041, "group_gain": 0.29},
        "achieved": {"reuse_fraction": 0.041, "group_gain": 0.30, "history_gain": 0.36},
    },
    "published": {
        "label": "published (assumption): RhymeRL §5.1 reuse, Seer Table 2 grouped gain",
        "source": "RhymeRL §5.1: 75-95% of tokens reusable from the previous epoch with a 3-token prefix "
                  "(target 85%); Seer §3.3 Table 2: grouped references raise accepted draft tokens by up to 119%",
        "group_similarity": 0.0,
        "epoch_similarity": 0.725,
        "self_similarity": 0.19,
        "target": {"reuse_fraction": 0.85, "group_gain": 1.19},
        "achieved": {"reuse_fraction": 0.85, "group_gain": 1.19, "history_gain": 1.95},
    },
}


_KNOBS = ("group_similarity", "epoch_similarity", "self_similarity")


def with_level(cfg: SynthConfig, level: str) -> SynthConfig:
    """``cfg`` with the knobs of ``SIMILARITY_LEVELS[level]``."""
    if level not in SIMILARITY_LEVELS:
        raise ValueError(f"unknown similarity level {level!r}; available: {sorted(SIMILARITY_LEVELS)}")
    lv = SIMILARITY_LEVELS[level]
    return dataclasses.replace(cfg, **{x: lv[x] for x in _KNOBS})


def level_of(cfg: SynthConfig) -> Optional[str]:
    """The level whose knobs ``cfg`` has, or None."""
    return next((k for k, v in SIMILARITY_LEVELS.items() if all(v[x] == getattr(cfg, x) for x in _KNOBS)), None)
