"""``SynthConfig``: the shape (prompts x samples x epochs), the length model's parameters and the
content knobs of a synthetic workload, validated on construction (``ValueError`` names the
field). The length defaults are fitted to the papers' figures (``lengths``); the knobs default
to 0, the source's own similarity (``calibration.with_level`` sets a calibrated level)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SynthConfig:
    """A synthetic workload. Every field is validated on construction (``ValueError`` names it).

    Shape: ``prompts`` GRPO groups of ``samples`` responses, rolled out ``epochs`` times.
    Lengths (tokens): exact per response, in ``[min_len, max_len]``, mean ``mean_len``.

    Length-model defaults (sources: docs/SIMULATOR.md, "Synthetic workloads"): ``group_sigma`` /
    ``sample_sigma``: log-sd of prompt difficulty / of lengths within a group (total ~0.78:
    RLHFSpec §3.1, Seer §6.2.2); ``epoch_rho``: correlation of a prompt's difficulty across
    adjacent epochs; with ``sample_sigma`` fitted to RhymeRL §6.1 / Table 2 (8 rank groups:
    ~16% move up, 16 groups: ~22%); ``outlier_frac``: RhymeRL §6.3 (2.2-5.5% anomalous);
    ``overlong_frac``: extra responses forced to ``max_len`` (no seed figure; 0, clipping
    already truncates ~1%).

    Content knobs (probabilities per ``segment_len``-token segment, sum <= 1): copied from a
    sibling of the same epoch (``group_similarity``), from one of the prompt's previous-epoch
    responses (``epoch_similarity``), or from the response's own earlier text
    (``self_similarity``) instead of its own real text. ``epoch_edit_rate`` / ``group_edit_rate``:
    the chance that a token copied from the previous epoch / from a sibling or the response
    itself is the response's own token instead (the copy diverges from its source there for one
    token, as a re-sampled response does: it bounds how long a draft from a copy survives). Two
    rates because the previous epoch was sampled from an older policy, siblings from this one.
    Two knobs tie the scopes together, as a model's responses to one prompt are tied on real
    traces (the pair overlaps of ``scripts/bench_scopes.py``): ``shared_path``, the chance that a
    response follows its group template's previous-epoch response rather than one of its own
    (the group takes one solution path), and ``self_from_history``, the chance that a run of a
    response's own earlier text repeats a stretch it copied from the previous epoch (what a
    response repeats, its prompt's earlier responses said too).
    All 0 keeps the similarity of the source's real groups; ``with_level(cfg, "measured" | "published")`` sets calibrated values.
    ``relabel``: see ``content``. ``prompt_len``: (lo, hi) prompt length in tokens,
    uniform, real prompts with other real prompts in front (like few-shot examples); (0, 0)
    keeps each real prompt as it is. Assumption: no seed gives prompt lengths.
    """

    prompts: int = 512
    samples: int = 16
    epochs: int = 2
    mean_len: int = 8192
    max_len: int = 32768
    min_len: int = 64
    group_sigma: float = 0.77
    sample_sigma: float = 0.09
    epoch_rho: float = 0.99
    outlier_frac: float = 0.04
    overlong_frac: float = 0.0
    group_similarity: float = 0.0
    epoch_similarity: float = 0.0
    self_similarity: float = 0.0
    epoch_edit_rate: float = 0.0
    group_edit_rate: float = 0.0
    shared_path: float = 0.0
    self_from_history: float = 0.0
    segment_len: int = 64
    relabel: bool = True
    prompt_len: tuple[int, int] = (128, 1024)
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(name, why):
            raise ValueError(f"SynthConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("prompts", "samples", "epochs", "min_len", "segment_len"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                bad(name, "must be an integer >= 1")
        for name in ("mean_len", "max_len", "seed"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                bad(name, "must be an integer")
        if self.max_len < self.min_len:
            bad("max_len", f"must be >= min_len ({self.min_len})")
        if self.mean_len > self.max_len:
            bad("mean_len", f"must be <= max_len ({self.max_len})")
        if self.mean_len < self.min_len:
            bad("mean_len", f"must be >= min_len ({self.min_len})")
        for name in ("group_sigma", "sample_sigma"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 5):
                bad(name, "must be a number in [0, 5]")
        if not (isinstance(self.epoch_rho, (int, float)) and -1 <= self.epoch_rho <= 1):
            bad("epoch_rho", "must be in [-1, 1]")
        for name in ("outlier_frac", "overlong_frac", "group_similarity", "epoch_similarity", "self_similarity",
                     "epoch_edit_rate", "group_edit_rate", "shared_path", "self_from_history"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 1):
                bad(name, "must be in [0, 1]")
        if self.group_similarity + self.epoch_similarity + self.self_similarity > 1 + 1e-9:
            bad("epoch_similarity", "group_similarity + epoch_similarity + self_similarity must be <= 1 "
                f"(group_similarity={self.group_similarity}, self_similarity={self.self_similarity})")
        if self.overlong_frac * self.max_len + (1 - self.overlong_frac) * self.min_len > self.mean_len:
            bad("overlong_frac", f"forces a mean above mean_len={self.mean_len}")
        if not isinstance(self.relabel, bool):
            bad("relabel", "must be a bool")
        pl = self.prompt_len
        if not (isinstance(pl, (tuple, list)) and len(pl) == 2 and all(isinstance(x, (int, np.integer)) for x in pl)):
            bad("prompt_len", "must be a (lo, hi) pair of integers")
        if pl[0] < 0 or pl[1] < pl[0] or (pl[1] > 0 and pl[0] < 1):
            bad("prompt_len", "needs 1 <= lo <= hi, or (0, 0) for the real prompts")
        object.__setattr__(self, "prompt_len", (int(pl[0]), int(pl[1])))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["prompt_len"] = list(self.prompt_len)
        return d
