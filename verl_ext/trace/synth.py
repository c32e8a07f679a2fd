"""Synthetic long-tail rollout workloads for the cluster-scale simulator.

``synthesize(cfg, source)`` builds a :class:`~verl_ext.trace.format.Trace` of
``cfg.epochs x cfg.prompts x cfg.samples`` responses whose *lengths* follow a parameterised
long-tail model and whose *tokens* are real responses of ``source`` (any ``Trace``, e.g. the
committed SmolLM2 trace), spliced and copied so that exact-match drafting sees real local
n-gram statistics. Three knobs set how much text a response shares with its GRPO group, with
its prompt's previous-epoch responses and with its own earlier text. ``SIMILARITY_LEVELS``
holds two calibrated settings: ``measured`` (what the committed real trace shows) and
``published`` (RhymeRL §5.1 reuse and Seer Table 2 grouped gain). Report drafting results at
both, each with its label: a 135M model sampled at temperature 1 on CPU is far less
self-similar than a trained reasoning model, so the measured level alone understates drafting
on real clusters.

Figures from the four papers verl_ext implements (Seer, RhymeRL, RLHFSpec,
SpecActor) that the defaults are fitted to. They are *assumptions about production
clusters* quoted from the papers, not something this repository measured (``SEED_TARGETS``):

* Seer §2.2 / §6.2.2: output lengths from hundreds to 98K tokens, "high mean and extreme
  variance"; the last 10% of requests take "up to 50%" of rollout time. Proxy here:
  ``tail_share_last10 = (max - p90) / max`` (every request starts at once and finishes at a
  time proportional to its length).
* RLHFSpec §3.1 (LMSYS-Chat-1M, not RL): p95 length ~3.6x the median. A lognormal with log-sd
  0.78 has both p95/median = 3.6 and p90 ~2x the mean (tail share ~50% at
  ``max_len = 4 * mean_len``): the defaults use a total log-sd of ~0.78.
* Seer §3.2 (Fig. 4): responses of one group have strongly correlated lengths.
* RhymeRL §6.1 / Table 2 (math, 14B, GRPO): responses split into 8 length-rank groups, each
  prompt's group predicted from its previous-epoch median: only ~16% land in a higher group
  (Table 2 "Accurate" 85.7/83.2% with 8 groups, 79.7/76.9% with 16). ``length_stats`` computes
  the same statistic (``rank_up_8``/``rank_up_16``). Matching it needs very tight groups
  (``sample_sigma`` 0.09) and a near-fixed difficulty ranking (``epoch_rho`` 0.99); the
  within-group spread then comes mostly from outliers:
* RhymeRL §6.3 / Fig. 18: 2.2-5.5% of responses are anomalously long outliers (migrated).
* SpecActor §2.2: DAPO-32B-20K, 16,384 responses per step, ~50% of GPU time idle waiting for
  the slowest worker (``slot_idle_frac`` is a crude proxy; not fitted, it reads ~0.75).

Length model (per epoch ``e``, prompt ``p``, sample ``j``)::

    z[0,p] ~ N(0,1);  z[e,p] = rho * z[e-1,p] + sqrt(1 - rho^2) * N(0,1)     # prompt difficulty
    log L = mu + group_sigma * z[e,p] + sample_sigma * N(0,1)                # body
    with prob outlier_frac:  L <- L * (max_len / L) ** U(0,1)                # anomalous outlier
    with prob overlong_frac: L <- max_len                                    # forced truncation
    L <- round(clip(L, min_len, max_len));  mu solved so that mean(L) == mean_len

``epoch_rho`` is then close to the Spearman correlation of prompts' median lengths across
adjacent epochs (``spearman_group_median``).

Token content (``_Plan``): a response is a sequence of *chapters*, each one real source
response. The responses of a group share an ordered list of *units* (a source prompt and a
token relabelling); sample ``j`` takes sample ``j mod K`` of each unit (K = the source's group
size; sample blocks beyond K get their own units) and epoch ``e`` takes source epoch
``e mod E_src``. So with all knobs at 0 a synthetic group has the within-group and
cross-epoch similarity of the source's real groups, chapter by chapter. Chapter 0 of sample
block 0 is the real response to the synthetic prompt's real prompt. With ``relabel``
(default) every other unit maps tokens through its own bijection of the source's response
vocabulary (a cyclic shift in one random order), so a ~200k-token source fills 134M tokens
without the spurious matches that repeating the same few hundred responses would create;
exact-match drafting only sees token equality, which a bijection keeps. Then the knobs
overwrite ``segment_len``-token segments (runs of consecutive segments continue the same
source) with copies of the prompt's previous-epoch responses (``epoch_similarity``; aligned
by relative position), of siblings (``group_similarity``) or of the response's own earlier
text (``self_similarity``). Copies are one gather per chunk, so memory stays near the int32
token array (134M tokens: ~3 s, peak ~1.35x the arrays it returns).

Limitations: chapters after the first answer *other* prompts, so numbers they copy from
their prompts are not in the synthetic prompt (``similarity_stats`` therefore drafts from the
response alone by default, Seer's n = 0 baseline); the chance overlap of unrelated real text
(``reuse_other_prompt``: 2% on the real trace) is gone between relabelled units; with more
epochs than the source has, epoch ``e`` and ``e - E_src`` share their texts.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from verl_ext.history.store import history_weight
from verl_ext.trace.format import Trace

__all__ = [
    "SynthConfig",
    "SIMILARITY_LEVELS",
    "SEED_TARGETS",
    "CALIBRATION_CONFIG",
    "CALIBRATION_STATS",
    "with_level",
    "synthesize",
    "sample_lengths",
    "similarity_stats",
    "length_stats",
    "calibrate_levels",
    "load_source",
    "default_source_path",
]

REPO = Path(__file__).resolve().parents[2]
COMMITTED_TRACE = REPO / "data" / "traces" / "smollm2_arith_e2.parquet"
REPLAY_JSON = REPO / "data" / "replay_smollm2_arith.json.gz"

_KINDS_BASE, _KINDS_HISTORY, _KINDS_SIBLING, _KINDS_SELF = 0, 1, 2, 3


# ----------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SynthConfig:
    """A synthetic workload. Every field is validated on construction (``ValueError`` names it).

    Shape: ``prompts`` GRPO groups of ``samples`` responses, rolled out ``epochs`` times.
    Lengths (tokens): exact per response, in ``[min_len, max_len]``, mean ``mean_len``.

    Length-model defaults (see the module docstring for the sources): ``group_sigma`` /
    ``sample_sigma``: log-sd of prompt difficulty / of lengths within a group (total ~0.78:
    RLHFSpec §3.1, Seer §6.2.2); ``epoch_rho``: correlation of a prompt's difficulty across
    adjacent epochs; with ``sample_sigma`` fitted to RhymeRL §6.1 / Table 2 (8 rank groups:
    ~16% move up, 16 groups: ~22%); ``outlier_frac``: RhymeRL §6.3 (2.2-5.5% anomalous);
    ``overlong_frac``: extra responses forced to ``max_len`` (no seed figure; 0, clipping
    already truncates ~1%).

    Content knobs (probabilities per ``segment_len``-token segment, sum <= 1): copied from a
    sibling of the same epoch (``group_similarity``), from one of the prompt's previous-epoch
    responses (``epoch_similarity``), or from the response's own earlier text
    (``self_similarity``) instead of its own real text. All 0 keeps the similarity of the
    source's real groups; ``with_level(cfg, "measured" | "published")`` sets calibrated values.
    ``relabel``: see the module docstring. ``prompt_len``: (lo, hi) prompt length in tokens,
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
        for name in ("outlier_frac", "overlong_frac", "group_similarity", "epoch_similarity", "self_similarity"):
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


# ----------------------------------------------------------------------------------- source
def default_source_path() -> Path:
    """The committed real trace if present, else the replay data it supersedes."""
    return COMMITTED_TRACE if COMMITTED_TRACE.exists() else REPLAY_JSON


def load_source(path=None) -> Trace:
    """A real trace to draw tokens from: a ``verl_ext.trace`` Parquet file, or the replay
    layout of ``scripts/make_replay_data.py`` (``.json.gz``: seeds become epochs)."""
    path = Path(path) if path is not None else default_source_path()
    if path.suffix != ".gz":
        from verl_ext.trace.format import read_trace

        return read_trace(path)
    with gzip.open(path, "rt") as f:
        d = json.load(f)
    rows = []
    for e, (epoch, rewards) in enumerate(zip(d["epochs"], d["rewards"])):
        for p, (group, rew) in enumerate(zip(epoch, rewards)):
            for j, (resp, r) in enumerate(zip(group, rew)):
                rows.append({
                    "epoch": e, "prompt_uid": f"p{p}", "sample_index": j, "prompt_ids": d["prompts"][p],
                    "response_ids": resp, "reward": float(r),
                    "finish_reason": "length" if len(resp) >= d.get("args", {}).get("max_tokens", 1 << 30) else "stop",
                })
    return Trace.from_rows(rows, meta={"source": "real", "model": d.get("model"), "created": d.get("created"), "file": path.name})


class _Source:
    """The source trace arranged as units: rows[e_src][sp, s] -> trace row."""

    def __init__(self, trace: Trace, seed: int):
        if len(trace) == 0:
            raise ValueError("source trace is empty")
        lens = trace.response_lengths()
        keep = lens > 0
        epochs = sorted(set(trace.epoch[keep].tolist()))
        uids_by_epoch = []
        for e in epochs:
            m = keep & (trace.epoch == e)
            uids_by_epoch.append(set(trace.prompt_uid[m].tolist()))
        common = set.intersection(*uids_by_epoch)
        order = []
        seen = set()
        for u in trace.prompt_uid[keep].tolist():  # first-appearance order
            if u in common and u not in seen:
                seen.add(u)
                order.append(u)
        if not order:
            raise ValueError("source trace has no prompt with a non-empty response in every epoch")
        self.uids = order
        self.S = len(order)
        self.E = len(epochs)
        uid_index = {u: i for i, u in enumerate(order)}
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i in np.flatnonzero(keep).tolist():
            u = trace.prompt_uid[i]
            if u in uid_index:
                groups.setdefault((epochs.index(int(trace.epoch[i])), uid_index[u]), []).append((int(trace.sample_index[i]), i))
        self.K = max(len(v) for v in groups.values())
        rows = np.zeros((self.E, self.S, self.K), np.int64)
        for (e, sp), v in groups.items():
            v.sort()
            idx = [i for _, i in v]
            rows[e, sp] = [idx[k % len(idx)] for k in range(self.K)]
        self.rows = rows
        self.trace = trace
        self.lens = lens.astype(np.int64)
        self.starts = trace.response_offsets[:-1].astype(np.int64)
        self.mean_len = float(self.lens[rows].mean())
        first = rows[0, :, 0]
        self.prompts = [trace.prompt(int(i)).astype(np.int32) for i in first]
        self.rewards = trace.reward
        tokens = trace.response_tokens
        vocab = np.unique(tokens)
        self.vocab = vocab
        self.V = int(vocab.size)
        rng = np.random.default_rng([seed, 7])
        order_v = vocab[rng.permutation(self.V)].astype(np.int32)
        pos = np.zeros(int(vocab[-1]) + 1, np.int32)
        pos[order_v] = np.arange(self.V, dtype=np.int32)
        self.src_pos = pos[tokens]  # token -> its place in the random order
        self.order2 = np.concatenate([order_v, order_v])  # order2[pos + shift], shift < V
        self.tokens = tokens

    def describe(self) -> dict:
        m = self.trace.meta or {}
        return {
            "rows": len(self.trace), "prompts": self.S, "epochs": self.E, "samples": self.K,
            "response_tokens": int(self.tokens.size), "vocab": self.V, "mean_response_len": round(self.mean_len, 1),
            "meta": {k: m[k] for k in ("source", "model", "created", "file", "workload") if k in m},
        }


# ----------------------------------------------------------------------------------- lengths
def sample_lengths(cfg: SynthConfig, rng: Optional[np.random.Generator] = None) -> tuple[np.ndarray, dict]:
    """Lengths ``[epochs, prompts, samples]`` (int64) and the solved model parameters."""
    rng = np.random.default_rng([cfg.seed, 1]) if rng is None else rng
    E, P, G = cfg.epochs, cfg.prompts, cfg.samples
    z = np.empty((E, P))
    z[0] = rng.standard_normal(P)
    rho = float(cfg.epoch_rho)
    for e in range(1, E):
        z[e] = rho * z[e - 1] + math.sqrt(max(0.0, 1 - rho * rho)) * rng.standard_normal(P)
    rel = cfg.group_sigma * z[:, :, None] + cfg.sample_sigma * rng.standard_normal((E, P, G))
    outlier = rng.random((E, P, G)) < cfg.outlier_frac
    u = rng.random((E, P, G))
    overlong = rng.random((E, P, G)) < cfg.overlong_frac
    lo, hi = float(cfg.min_len), float(cfg.max_len)
    log_hi = math.log(hi)

    def lengths(mu):
        logl = np.minimum(mu + rel, log_hi)
        logl = np.where(outlier, logl + u * (log_hi - logl), logl)
        out = np.rint(np.clip(np.exp(logl), lo, hi))
        out[overlong] = hi
        return out

    a, b = math.log(lo) - 10 * (1 + cfg.group_sigma + cfg.sample_sigma), log_hi + 10
    target = float(cfg.mean_len)
    for _ in range(100):
        mid = 0.5 * (a + b)
        if lengths(mid).mean() < target:
            a = mid
        else:
            b = mid
        if b - a < 1e-9:
            break
    mu = 0.5 * (a + b)
    L = lengths(mu).astype(np.int64)
    return L, {"mu": mu, "median_len": math.exp(mu), "outliers": int(outlier.sum()), "overlong": int(overlong.sum())}


# ----------------------------------------------------------------------------------- content
def _expand(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ranges ``[starts[i], starts[i] + lens[i])`` (int64)."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    cum = np.cumsum(lens) - lens
    return np.repeat(starts - cum, lens) + np.arange(total, dtype=np.int64)


class _Plan:
    """Per-epoch chapter tables and copy segments; see the module docstring."""

    def __init__(self, cfg: SynthConfig, src: _Source, L: np.ndarray):
        self.cfg, self.src, self.L = cfg, src, L
        E, P, G = L.shape
        self.B = (G + src.K - 1) // src.K  # sample blocks per group
        rng = np.random.default_rng([cfg.seed, 2])
        self.sp0 = np.concatenate([rng.permutation(src.S) for _ in range(-(-P // src.S))])[:P]  # cycled
        self.base = rng.integers(0, 1 << 30, size=P)
        # output offsets: rows ordered (epoch, prompt, sample)
        flatL = L.reshape(-1)
        self.offsets = np.zeros(flatL.size + 1, np.int64)
        np.cumsum(flatL, out=self.offsets[1:])

    def units(self, p: np.ndarray, b: np.ndarray, m: np.ndarray, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(source prompt, relabel shift) of chapter ``m`` of block ``b`` of prompt ``p``."""
        src = self.src
        t = m * self.B + b
        sp = (self.sp0[p] + t) % src.S
        if not self.cfg.relabel or src.V < 2:
            return sp, np.zeros_like(t)
        fresh = e * 7919 if src.E == 1 else 0  # one-epoch source: new units each epoch
        shift = 1 + (self.base[p] + fresh + t) % (src.V - 1)  # one bijection per unit
        shift = np.where((t == 0) & (fresh == 0), 0, shift)
        return sp, shift

    def chapters(self, e: int, p: np.ndarray, j: np.ndarray, L: np.ndarray):
        """Chapter pieces of responses (e, p[i], j[i]) of lengths L[i]: per response, arrays of
        (source trace row, length, shift) in output order, plus the count per response."""
        src = self.src
        e_src = e % src.E
        rot = 0 if src.E == 1 else e // src.E
        s = (j % src.K + rot) % src.K
        b = j // src.K
        M = int(np.ceil(1.5 * L.max() / max(1.0, src.mean_len))) + 4
        while True:
            m = np.arange(M)
            sp, shift = self.units(p[:, None], b[:, None], m[None, :], e)
            rows = src.rows[e_src][sp, s[:, None]]
            clen = src.lens[rows]
            cum = np.cumsum(clen, axis=1)
            if (cum[:, -1] >= L).all():
                break
            M *= 2
        n_chap = (cum < L[:, None]).sum(axis=1) + 1
        valid = m[None, :] < n_chap[:, None]
        last = n_chap - 1
        before = np.where(last > 0, cum[np.arange(len(L)), np.maximum(last - 1, 0)], 0)
        plen = clen.copy()
        plen[np.arange(len(L)), last] = L - before
        return rows[valid], plen[valid], shift[valid], n_chap

    def fill_base(self, out: np.ndarray, e: int, chunk_tokens: int = 1 << 20) -> np.ndarray:
        """Writes the chapter content of epoch ``e``; returns its source rows of chapter 0."""
        cfg, src = self.cfg, self.src
        P, G = cfg.prompts, cfg.samples
        n = P * G
        first = np.zeros(n, np.int64)
        p_all = np.repeat(np.arange(P), G)
        j_all = np.tile(np.arange(G), P)
        L_all = self.L[e].reshape(-1)
        r0 = e * n
        i = 0
        while i < n:  # chunks of responses
            k = i + 1
            acc = int(L_all[i])
            while k < n and acc + L_all[k] <= chunk_tokens:
                acc += int(L_all[k])
                k += 1
            rows, plen, shift, n_chap = self.chapters(e, p_all[i:k], j_all[i:k], L_all[i:k])
            first[i:k] = rows[np.cumsum(n_chap) - n_chap]
            a, z = int(self.offsets[r0 + i]), int(self.offsets[r0 + k])
            idx = _expand(src.starts[rows], plen)
            if cfg.relabel and src.V >= 2:
                out[a:z] = src.order2[src.src_pos[idx] + np.repeat(shift.astype(np.int32), plen)]
            else:
                out[a:z] = src.tokens[idx]
            i = k
        return first

    def copies(self, e: int, rng: np.random.Generator):
        """Copy segments of epoch ``e``: (dst start, src start, length, kind), global offsets."""
        cfg = self.cfg
        P, G = cfg.prompts, cfg.samples
        n = P * G
        eps = cfg.epoch_similarity if e > 0 else 0.0
        gam = cfg.group_similarity if G > 1 else 0.0
        sig = cfg.self_similarity
        empty = (np.zeros(0, np.int64),) * 3 + (np.zeros(0, np.int8),)
        if eps + gam + sig <= 0:
            return empty
        seg = cfg.segment_len
        L = self.L[e].reshape(-1)
        nseg = -(-L // seg)
        resp = np.repeat(np.arange(n), nseg)
        k = np.arange(resp.size) - np.repeat(np.cumsum(nseg) - nseg, nseg)
        q = k * seg
        ln = np.minimum(seg, L[resp] - q)
        u = rng.random(resp.size)
        kind = np.select([u < eps, u < eps + gam, u < eps + gam + sig], [_KINDS_HISTORY, _KINDS_SIBLING, _KINDS_SELF],
                         _KINDS_BASE).astype(np.int8)
        kind[(kind == _KINDS_SELF) & (q < ln)] = _KINDS_BASE  # nothing earlier to repeat yet
        cont = np.zeros(resp.size, bool)
        cont[1:] = (kind[1:] == kind[:-1]) & (resp[1:] == resp[:-1])
        run = np.cumsum(~cont) - 1
        nrun = int(run[-1]) + 1 if run.size else 0
        run_first = np.flatnonzero(~cont)
        # the response each run copies from
        p = resp // G
        j = resp % G
        h = rng.integers(0, G, size=nrun)
        sib = (j[run_first] + 1 + rng.integers(0, max(1, G - 1), size=nrun)) % G
        rk = kind[run_first]
        own = e * n + resp[run_first]
        src_row = np.select([rk == _KINDS_HISTORY, rk == _KINDS_SIBLING, rk == _KINDS_SELF],
                            [(e - 1) * n + p[run_first] * G + h, e * n + p[run_first] * G + sib, own], 0)
        Lsrc = self.L.reshape(-1)[src_row]
        q0 = q[run_first]
        start = np.floor(q0 / L[resp[run_first]] * Lsrc).astype(np.int64)  # aligned position
        # self: a run repeats earlier text of the response, [start, start + run length) < q0
        selfr = rk == _KINDS_SELF
        Lsrc = np.where(selfr, q0, Lsrc)
        start = np.where(selfr, np.floor(rng.random(nrun) * np.maximum(q0 - seg + 1, 1)).astype(np.int64), start)
        sel = kind != _KINDS_BASE
        r = run[sel]
        off = start[r] + (q[sel] - q0[r])
        lsel = ln[sel]
        room = Lsrc[r] - lsel + 1
        ok = room >= 1
        off = np.where(ok, off % np.maximum(room, 1), 0)
        dst = self.offsets[e * n + resp[sel]] + q[sel]
        srcs = self.offsets[src_row[r]] + off
        return dst[ok], srcs[ok], lsel[ok], kind[sel][ok]


def _apply(out: np.ndarray, dst: np.ndarray, srcs: np.ndarray, ln: np.ndarray, chunk_tokens: int = 1 << 20) -> None:
    """``out[dst_i : dst_i + ln_i] = out[src_i : ...]`` for all i, each chunk reading the buffer
    as it was before that chunk (numpy evaluates the gather before the scatter)."""
    if dst.size == 0:
        return
    cum = np.cumsum(ln)
    i = 0
    while i < dst.size:
        k = int(np.searchsorted(cum, (cum[i - 1] if i else 0) + chunk_tokens, side="right"))
        k = max(k, i + 1)
        out[_expand(dst[i:k], ln[i:k])] = out[_expand(srcs[i:k], ln[i:k])]
        i = k


def _prompts(cfg: SynthConfig, src: _Source, sp0: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    lo, hi = cfg.prompt_len
    out = []
    for p in range(cfg.prompts):
        real = src.prompts[int(sp0[p])]
        if hi == 0:
            out.append(real)
            continue
        n = int(rng.integers(lo, hi + 1))
        if len(real) >= n:
            out.append(real[len(real) - n:])
            continue
        parts, need, q = [], n - len(real), int(sp0[p])
        while need > 0:  # other real prompts in front (like few-shot examples)
            q = (q + 1) % src.S
            piece = src.prompts[q][:need]
            parts.append(piece)
            need -= len(piece)
        out.append(np.concatenate(parts + [real]).astype(np.int32))
    return out


def synthesize(cfg: SynthConfig, source: Trace) -> Trace:
    """A synthetic trace for ``cfg`` with tokens drawn from ``source`` (see the module docstring).
    Rows are ordered (epoch, prompt, sample); ``step == epoch``; ``meta`` records the config,
    the source and the solved length model."""
    t0 = time.perf_counter()
    if not isinstance(cfg, SynthConfig):
        raise TypeError("cfg must be a SynthConfig")
    src = _Source(source, cfg.seed)
    L, lm = sample_lengths(cfg)
    plan = _Plan(cfg, src, L)
    E, P, G = L.shape
    n = P * G
    out = np.empty(int(plan.offsets[-1]), np.int32)
    rng = np.random.default_rng([cfg.seed, 3])
    first = np.zeros(E * n, np.int64)
    copied = {"history": 0, "self": 0, "sibling": 0}
    for e in range(E):
        first[e * n:(e + 1) * n] = plan.fill_base(out, e)
        dst, srcs, ln, kind = plan.copies(e, rng)
        # history copies read epoch e-1 (final); self copies then read the response's text
        # before this pass, sibling copies the siblings' text before theirs
        for name, kd in (("history", _KINDS_HISTORY), ("self", _KINDS_SELF), ("sibling", _KINDS_SIBLING)):
            m = kind == kd
            _apply(out, dst[m], srcs[m], ln[m])
            copied[name] += int(ln[m].sum())
    prompts = _prompts(cfg, src, plan.sp0, np.random.default_rng([cfg.seed, 4]))
    plens = np.array([len(x) for x in prompts], np.int64)
    p_rows = np.tile(np.repeat(np.arange(P), G), E)
    prompt_offsets = np.zeros(E * n + 1, np.int64)
    np.cumsum(plens[p_rows], out=prompt_offsets[1:])
    pflat = np.concatenate(prompts) if prompts else np.zeros(0, np.int32)
    poff = np.zeros(P + 1, np.int64)
    np.cumsum(plens, out=poff[1:])
    prompt_tokens = pflat[_expand(poff[p_rows], plens[p_rows])]
    uids = np.array([f"synth{cfg.seed}-p{p:06d}" for p in range(P)], dtype=object)
    Lf = L.reshape(-1)
    finish = np.where(Lf >= cfg.max_len, "length", "stop").astype(object)
    level = next((k for k, v in SIMILARITY_LEVELS.items()
                  if all(v[x] == getattr(cfg, x) for x in _KNOBS)), None)
    meta = {
        "source": "synthetic",
        "generator": "verl_ext.trace.synth",
        "synth": {
            "config": cfg.to_dict(),
            "similarity_level": level,
            "length_model": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in lm.items()},
            "copied_tokens": copied,
            "seconds": round(time.perf_counter() - t0, 3),
        },
        "synth_source": src.describe(),
        "model": (source.meta or {}).get("model"),
    }
    trace = Trace(
        epoch=np.repeat(np.arange(E, dtype=np.int32), n),
        step=np.repeat(np.arange(E, dtype=np.int32), n),
        prompt_uid=uids[p_rows],
        sample_index=np.tile(np.arange(G, dtype=np.int32), E * P),
        prompt_tokens=prompt_tokens,
        prompt_offsets=prompt_offsets,
        response_tokens=out,
        response_offsets=plan.offsets,
        reward=np.nan_to_num(src.rewards[first], nan=0.0).astype(np.float32),
        finish_reason=finish,
        instance=np.full(E * n, None, dtype=object),
        submit_s=np.full(E * n, np.nan),
        finish_s=np.full(E * n, np.nan),
        meta=meta,
    )
    return trace


# ----------------------------------------------------------------------------------- metrics
def _groups(trace: Trace) -> dict[tuple[int, str], np.ndarray]:
    """(epoch, prompt_uid) -> row indices sorted by sample_index."""
    order = np.lexsort((trace.sample_index, trace.prompt_uid.astype(str), trace.epoch))
    out: dict[tuple[int, str], list[int]] = {}
    for i in order.tolist():
        out.setdefault((int(trace.epoch[i]), trace.prompt_uid[i]), []).append(i)
    return {k: np.asarray(v, np.int64) for k, v in out.items()}


_H1 = np.uint64(0x9E3779B97F4A7C15)
_H2 = np.uint64(0xC2B2AE3D27D4EB4F)


def _ngram_keys(trace: Trace, rows: np.ndarray, labels: np.ndarray, n_prefix: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """For each response token of ``rows``: a 64-bit hash of (label, previous ``n_prefix``
    tokens, the token), the context being the prompt's last ``n_prefix`` tokens + the response.
    Returns the keys and the row (position in ``rows``) of each key."""
    seqs = []
    for i in rows.tolist():
        pr = trace.prompt(i)[-n_prefix:]
        if len(pr) < n_prefix:
            pr = np.concatenate([np.full(n_prefix - len(pr), -1, np.int64), pr])
        seqs.append(pr.astype(np.int64))
        seqs.append(trace.response(i).astype(np.int64))
    if not seqs:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    flat = np.concatenate(seqs).astype(np.uint64)
    rl = trace.response_lengths()[rows]
    seq_len = rl + n_prefix
    seq_start = np.cumsum(seq_len) - seq_len
    # windows ending at each response token: positions seq_start + n_prefix + t
    end = _expand(seq_start + n_prefix, rl)
    h = np.zeros(end.size, np.uint64)
    with np.errstate(over="ignore"):
        for d in range(n_prefix, -1, -1):
            h = h * _H1 + flat[end - d] + np.uint64(1)
        lab = np.repeat(labels.astype(np.uint64), rl)
        h ^= (lab + np.uint64(1)) * _H2
    return h, np.repeat(np.arange(rows.size), rl)


def _reuse(trace: Trace, cur_rows, cur_lab, hist_rows, hist_lab) -> tuple[float, float]:
    ck, crow = _ngram_keys(trace, cur_rows, cur_lab)
    hk, _ = _ngram_keys(trace, hist_rows, hist_lab)
    if ck.size == 0:
        return float("nan"), float("nan")
    hs = np.sort(hk)
    at = np.minimum(np.searchsorted(hs, ck), max(0, hs.size - 1))
    hit = hs[at] == ck if hs.size else np.zeros(ck.size, bool)
    per = np.bincount(crow, weights=hit, minlength=cur_rows.size) / np.maximum(1, np.bincount(crow, minlength=cur_rows.size))
    return float(hit.mean()), float(per.mean())


def _replay_accept(items, k: int, min_prob: float, scopes: int, max_tokens: int, ref_tokens: Optional[int]):
    """Exact-match replay of target responses. ``items``: (prompt, response, group refs,
    history refs [(tokens, weight)]). Returns (accepted draft tokens, steps, tokens)."""
    from verl_ext.spec import DraftIndex

    idx = DraftIndex(32, 0, max(1, k))
    keys, rows, starts, ends = [], [], [], []
    for t, (prompt, resp, refs, hist) in enumerate(items):
        g, h = f"g{t}", f"h{t}"
        for r_i, ref in enumerate(refs):
            ref = ref[:ref_tokens] if ref_tokens else ref
            if len(ref):
                idx.group_append(g, f"r{r_i}", np.ascontiguousarray(ref, np.int32))
        for ref, w in hist:
            ref = ref[:ref_tokens] if ref_tokens else ref
            if len(ref):
                idx.add_history(h, np.ascontiguousarray(ref, np.int32), float(w))
        key = f"t{t}"
        idx.start_request(key, np.ascontiguousarray(prompt, np.int32), group=g, history=h)
        row = np.concatenate([prompt, resp[:max_tokens]]).astype(np.int32)
        keys.append(key)
        rows.append(row)
        starts.append(len(prompt))
        ends.append(len(row))
    if hasattr(idx, "replay"):
        res = idx.replay(keys, rows, starts, ends, k, scopes=scopes, min_prob=min_prob)
        emitted = np.concatenate([np.asarray(e, np.int64) for e, _ in res]) if res else np.zeros(0, np.int64)
        steps, toks = emitted.size, int(emitted.sum())
        return toks - steps, steps, toks
    # fallback: lockstep loop over batch_propose_lists (older native module)
    pos = list(starts)
    live = [i for i in range(len(keys)) if pos[i] < ends[i]]
    acc_total = steps = toks = 0
    while live:
        drafts = idx.batch_propose_lists([keys[i] for i in live], [k] * len(live), scopes=scopes, min_prob=min_prob)
        for i, d in zip(live, drafts):
            row, left = rows[i], ends[i] - pos[i]
            acc = 0
            while acc < len(d) and acc + 1 < left and d[acc] == row[pos[i] + acc]:
                acc += 1
            emit = min(acc + 1, left)
            idx.append(keys[i], row[pos[i]:pos[i] + emit])
            pos[i] += emit
            acc_total += emit - 1
            steps += 1
            toks += emit
        live = [i for i in live if pos[i] < ends[i]]
    return acc_total, steps, toks


def similarity_stats(
    trace: Trace,
    *,
    k: int = 8,
    groups: int = 8,
    targets: int = 2,
    max_tokens: int = 2048,
    ref_tokens: Optional[int] = None,
    reuse_prompts: int = 64,
    min_prob: float = 0.0,
    with_prompt: bool = False,
    seed: int = 0,
) -> dict:
    """Calibration metrics of a (real or synthetic) trace.

    ``reuse_fraction`` (RhymeRL §5.1): over the responses of every epoch ``e >= 1`` of up to
    ``reuse_prompts`` prompts, the fraction of response tokens ``t`` such that the 3 tokens
    before ``t`` (the prompt's last tokens before the response starts) followed by ``t`` occur
    in some epoch ``e-1`` response of the same prompt. This is the token set that the paper's
    routine (3-token prefix, accept the longest identical continuation, else generate one)
    accepts when it takes the longest continuation over all matches. ``reuse_fraction_mean``
    averages per response; ``reuse_other_prompt`` is the same against a *different* prompt's
    previous-epoch responses (chance level of the text).

    ``group`` (Seer Table 2): exact-match replay with the native ``DraftIndex`` (linear drafts
    of up to ``k`` = 8 tokens, the paper's max draft length) of ``targets`` responses in each
    of ``groups`` groups (the last epoch, first ``max_tokens`` tokens). ``accepted_request``:
    draft tokens accepted with the request scope only: the response's own tokens so far, which
    is Seer's n = 0 baseline ("each request's own generation history"); ``with_prompt=True``
    adds the prompt to that context (what the deployed drafter sees; see the note below);
    ``accepted_group``: with the other ``samples-1`` complete responses of the group as
    references (Seer's CST with reference count n = G-1). ``gain = group / request - 1``
    (bonus tokens excluded, as in the paper). ``history``: the same with request + history
    scope (the previous epoch's responses of the prompt, weighted by reward, RhymeRL).

    Note: a synthetic response's chapters after the first are relabelled answers to *other*
    prompts, so the numbers they copy from their own prompts are not in the synthetic prompt.
    Measured with the prompt in context, the request-only baseline of synthetic traces is then
    lower than a real trace's, and the gains higher; the default (no prompt) compares like
    with like.
    """
    from verl_ext.spec import SCOPE_GROUP, SCOPE_HISTORY, SCOPE_REQUEST

    rng = np.random.default_rng(seed)
    by = _groups(trace)
    epochs = trace.epochs()
    out: dict = {"params": {"k": k, "groups": groups, "targets": targets, "max_tokens": max_tokens, "ref_tokens": ref_tokens,
                            "reuse_prompts": reuse_prompts, "min_prob": min_prob, "with_prompt": with_prompt, "seed": seed}}
    # (a) RhymeRL reuse
    uids = sorted({u for (e, u) in by if e == epochs[-1]})
    pick = [uids[i] for i in sorted(rng.choice(len(uids), size=min(reuse_prompts, len(uids)), replace=False))] if uids else []
    cur_rows, cur_lab, hist_rows, hist_lab, oth_rows, oth_lab = [], [], [], [], [], []
    lab = 0
    for e_prev, e in zip(epochs[:-1], epochs[1:]):
        for pi, u in enumerate(pick):
            if (e, u) not in by or (e_prev, u) not in by:
                continue
            other = pick[(pi + 1) % len(pick)]
            c = by[(e, u)]
            cur_rows.append(c)
            cur_lab.append(np.full(c.size, lab))
            hr = by[(e_prev, u)]
            hist_rows.append(hr)
            hist_lab.append(np.full(hr.size, lab))
            if len(pick) > 1 and (e_prev, other) in by:
                orr = by[(e_prev, other)]
                oth_rows.append(orr)
                oth_lab.append(np.full(orr.size, lab))
            lab += 1
    if cur_rows:
        cat = np.concatenate
        out["reuse_fraction"], out["reuse_fraction_mean"] = _reuse(trace, cat(cur_rows), cat(cur_lab), cat(hist_rows), cat(hist_lab))
        out["reuse_other_prompt"] = (_reuse(trace, cat(cur_rows), cat(cur_lab), cat(oth_rows), cat(oth_lab))[0]
                                     if oth_rows else float("nan"))
        out["reuse_responses"] = int(sum(r.size for r in cur_rows))
    else:
        out["reuse_fraction"] = out["reuse_fraction_mean"] = out["reuse_other_prompt"] = float("nan")
        out["reuse_responses"] = 0
    # (b) grouped and history drafting
    e_last = epochs[-1]
    e_prev = epochs[-2] if len(epochs) > 1 else None
    cand = [u for (e, u) in by if e == e_last and by[(e, u)].size > 1]
    cand.sort()
    gpick = [cand[i] for i in sorted(rng.choice(len(cand), size=min(groups, len(cand)), replace=False))] if cand else []
    items_g, items_h = [], []
    for u in gpick:
        rows = by[(e_last, u)]
        hist = []
        if e_prev is not None and (e_prev, u) in by:
            hist = [(trace.response(int(i)), history_weight(float(trace.reward[i]))) for i in by[(e_prev, u)]]
        for t in sorted(rng.choice(rows.size, size=min(targets, rows.size), replace=False).tolist()):
            i = int(rows[t])
            refs = [trace.response(int(r)) for r in rows if int(r) != i]
            prompt = trace.prompt(i) if with_prompt else trace.prompt(i)[-1:]
            items_g.append((prompt, trace.response(i), refs, []))
            items_h.append((prompt, trace.response(i), [], hist))

    def run(items, scopes):
        if not items:
            return {"accepted": 0, "steps": 0, "tokens": 0, "tokens_per_step": float("nan")}
        a, s, t = _replay_accept(items, k, min_prob, scopes, max_tokens, ref_tokens)
        return {"accepted": a, "steps": s, "tokens": t, "tokens_per_step": t / max(1, s)}

    req = run(items_g, SCOPE_REQUEST)
    grp = run(items_g, SCOPE_REQUEST | SCOPE_GROUP)
    out["group"] = {
        "accepted_request": req["accepted"], "accepted_group": grp["accepted"],
        "gain": grp["accepted"] / req["accepted"] - 1 if req["accepted"] else float("nan"),
        "tokens_per_step_request": req["tokens_per_step"], "tokens_per_step_group": grp["tokens_per_step"],
        "targets": len(items_g), "tokens": req["tokens"], "refs_per_target": (int(np.mean([len(x[2]) for x in items_g])) if items_g else 0),
    }
    if e_prev is not None and items_h:
        his = run(items_h, SCOPE_REQUEST | SCOPE_HISTORY)
        out["history"] = {
            "accepted_request": req["accepted"], "accepted_history": his["accepted"],
            "gain": his["accepted"] / req["accepted"] - 1 if req["accepted"] else float("nan"),
            "tokens_per_step_history": his["tokens_per_step"],
        }
    return out


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 2:
        return float("nan")
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(float)
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable").astype(float)
    # average ranks for ties
    def avg(x, r):
        _, inv, cnt = np.unique(x, return_inverse=True, return_counts=True)
        s = np.bincount(inv, weights=r)
        return (s / cnt)[inv]
    ra, rb = avg(a, ra), avg(b, rb)
    c = np.corrcoef(ra, rb)[0, 1]
    return float(c)


def length_stats(trace: Trace, *, worker_batch: int = 256) -> dict:
    """Tail-shape metrics of a trace's response lengths.

    ``p50/p90/p99/max_over_mean``, ``p95_over_p50``; ``frac_at_max`` (responses with
    ``finish_reason == "length"``); ``within_group_cv`` (mean over groups of sd/mean) and
    ``within_group_icc`` (share of log-length variance between groups); ``tail_share_last10``
    (Seer §6.2.2 proxy: all requests start together and finish at a time proportional to their
    length, so the last 10% run from p90 to max: (max - p90) / max, per epoch, averaged);
    ``slot_idle_frac`` (SpecActor §2.2 proxy: each worker decodes ``worker_batch`` responses
    to completion; idle = 1 - mean/max length per worker, averaged); ``spearman_group_median``
    (adjacent epochs, prompts' median lengths); ``rank_up_8`` / ``rank_up_16`` (RhymeRL §6.1 /
    Table 2: prompts ranked by previous-epoch median into N equal groups, this epoch's
    responses ranked into N equal groups; fraction of responses in a higher group than their
    prompt's predicted one).
    """
    L = trace.response_lengths().astype(np.float64)
    out: dict = {"responses": int(L.size), "tokens": int(L.sum()), "mean": float(L.mean()) if L.size else float("nan")}
    if not L.size:
        return out
    m = L.mean()
    for q in (50, 90, 99):
        out[f"p{q}_over_mean"] = float(np.percentile(L, q) / m)
    out["max_over_mean"] = float(L.max() / m)
    out["p95_over_p50"] = float(np.percentile(L, 95) / np.percentile(L, 50))
    out["frac_at_max"] = float(np.mean(trace.finish_reason == "length"))
    by = _groups(trace)
    cvs, gmeans, gsizes, logs = [], [], [], []
    for rows in by.values():
        x = L[rows]
        if x.size > 1:
            cvs.append(x.std() / x.mean())
        lx = np.log(np.maximum(x, 1))
        logs.append(lx)
        gmeans.append(lx.mean())
        gsizes.append(x.size)
    out["within_group_cv"] = float(np.mean(cvs)) if cvs else float("nan")
    allg = np.concatenate(logs)
    tot = allg.var()
    within = np.sum([((lx - lx.mean()) ** 2).sum() for lx in logs]) / allg.size
    out["within_group_icc"] = float(1 - within / tot) if tot > 0 else float("nan")
    tails, idles = [], []
    rng = np.random.default_rng(0)
    for e in trace.epochs():
        x = L[trace.epoch == e]
        tails.append((x.max() - np.percentile(x, 90)) / x.max())
        perm = x[rng.permutation(x.size)]
        nw = max(1, x.size // worker_batch)
        w = np.array_split(perm, nw)
        idles.append(np.mean([1 - c.mean() / c.max() for c in w]))
    out["tail_share_last10"] = float(np.mean(tails))
    out["slot_idle_frac"] = float(np.mean(idles))
    epochs = trace.epochs()
    sp, up8, up16 = [], [], []
    for e0, e1 in zip(epochs[:-1], epochs[1:]):
        uids = sorted({u for (e, u) in by if e == e0} & {u for (e, u) in by if e == e1})
        if len(uids) < 2:
            continue
        med0 = np.array([np.median(L[by[(e0, u)]]) for u in uids])
        med1 = np.array([np.median(L[by[(e1, u)]]) for u in uids])
        sp.append(_spearman(med0, med1))
        for ng, acc in ((8, up8), (16, up16)):
            pred = np.empty(len(uids), np.int64)
            pred[np.argsort(med0, kind="stable")] = np.arange(len(uids)) * ng // len(uids)
            rows = np.concatenate([by[(e1, u)] for u in uids])
            owner = np.concatenate([np.full(by[(e1, u)].size, i) for i, u in enumerate(uids)])
            real = np.empty(rows.size, np.int64)
            real[np.argsort(L[rows], kind="stable")] = np.arange(rows.size) * ng // rows.size
            acc.append(float(np.mean(real > pred[owner])))
    out["spearman_group_median"] = float(np.mean(sp)) if sp else float("nan")
    out["rank_up_8"] = float(np.mean(up8)) if up8 else float("nan")
    out["rank_up_16"] = float(np.mean(up16)) if up16 else float("nan")
    return out


# ----------------------------------------------------------------------------------- calibration
def calibrate_levels(source: Trace, cfg: SynthConfig = CALIBRATION_CONFIG, *, published_reuse: float = 0.85,
                     published_gain: float = 1.19, iters: int = 7, stats_kw: Optional[dict] = None, log=None) -> dict:
    """Fits the knobs of both levels on ``cfg`` (minutes: ~100 synthesize + replay rounds).

    Targets: ``measured``: the reuse fraction and grouped gain ``similarity_stats`` reports on
    ``source`` itself. ``published``: ``published_reuse`` (the middle of RhymeRL §5.1's 75-95%)
    and ``published_gain`` (Seer Table 2's +119%).

    Search: for a given (group, self) pair, ``epoch_similarity`` is bisected to the reuse
    target (0 if already above). If the gain at group = self = 0 is below the target,
    ``group_similarity`` is bisected up to it; otherwise ``self_similarity`` is (self-repetition
    raises the request-only baseline and so lowers the relative gain). Heavy cross-epoch reuse
    already makes siblings share text (they copy the same previous-epoch responses), so the
    published level needs self-similarity rather than group copies.
    Returns {level: {knobs..., "target", "achieved"}, "real": the source's metrics}."""
    kw = dict(CALIBRATION_STATS if stats_kw is None else stats_kw)
    real = similarity_stats(source, **kw)
    targets = {
        "measured": (real["reuse_fraction"], real["group"]["gain"]),
        "published": (published_reuse, published_gain),
    }

    def stats(g, e, sg):
        c = dataclasses.replace(cfg, group_similarity=g, epoch_similarity=e, self_similarity=sg)
        s = similarity_stats(synthesize(c, source), **kw)
        if log:
            log(f"  g={g:.4f} e={e:.4f} s={sg:.4f}: reuse={s['reuse_fraction']:.4f} gain={s['group']['gain']:.3f}")
        return s

    def fit_epoch(g, sg, t_reuse):
        s = stats(g, 0.0, sg)
        if s["reuse_fraction"] >= t_reuse:
            return 0.0, s
        lo, hi, best = 0.0, 1.0 - g - sg, (0.0, s)
        for _ in range(iters):
            mid = 0.5 * (lo + hi)
            s = stats(g, mid, sg)
            if abs(s["reuse_fraction"] - t_reuse) < abs(best[1]["reuse_fraction"] - t_reuse):
                best = (mid, s)
            lo, hi = (mid, hi) if s["reuse_fraction"] < t_reuse else (lo, mid)
        return best

    res = {}
    for name, (t_reuse, t_gain) in targets.items():
        if log:
            log(f"{name}: target reuse {t_reuse:.4f}, gain {t_gain:.3f}")
        e, s = fit_epoch(0.0, 0.0, t_reuse)
        g = sg = 0.0
        if abs(s["group"]["gain"] - t_gain) > 0.02:
            up = s["group"]["gain"] < t_gain  # raise group copies, else self-repetition
            lo, hi, best = 0.0, 1.0, (0.0, e, s)
            for _ in range(iters):
                mid = 0.5 * (lo + hi)
                ee, ss = fit_epoch(mid if up else 0.0, 0.0 if up else mid, t_reuse)
                if abs(ss["group"]["gain"] - t_gain) < abs(best[2]["group"]["gain"] - t_gain):
                    best = (mid, ee, ss)
                if (ss["group"]["gain"] < t_gain) == up:
                    lo = mid
                else:
                    hi = mid
                if mid + ee > 1:
                    hi = mid
            x, e, s = best
            g, sg = (x, 0.0) if up else (0.0, x)
        res[name] = {
            "group_similarity": round(g, 4), "epoch_similarity": round(e, 4), "self_similarity": round(sg, 4),
            "target": {"reuse_fraction": t_reuse, "group_gain": t_gain},
            "achieved": {"reuse_fraction": s["reuse_fraction"], "group_gain": s["group"]["gain"],
                         "history_gain": s.get("history", {}).get("gain"),
                         "tokens_per_step_request": s["group"]["tokens_per_step_request"],
                         "tokens_per_step_group": s["group"]["tokens_per_step_group"]},
        }
    res["real"] = {"reuse_fraction": real["reuse_fraction"], "group_gain": real["group"]["gain"],
                   "reuse_other_prompt": real["reuse_other_prompt"], "history_gain": real.get("history", {}).get("gain"),
                   "tokens_per_step_request": real["group"]["tokens_per_step_request"]}
    res["stats_kw"] = kw
    return res
