"""SpecActor's draft ladder and initial selection (section 4.2, Figure 10).

A ladder maps, for each drafting method, an acceptance rate to the speedup of speculation over
plain decoding, at a few per-worker batch sizes. It is built offline without the trained model's
outputs: the drafter's and the verifier's step times come from profiled cost models
(``verl-ext fit grid``, or a GPU preset), and the verifier is simulated by accepting each draft
token with probability ``p`` (the expected tokens per step, ``verl_ext.spec.tgs``). Methods:

* ``model``: a small draft model (its ``CostModel`` on one GPU: ``D(b)`` is its decode step),
  drafting through the engine's draft-model speculative method where the engine has one;
* ``suffix``: model-free drafting from the suffix-tree index (``verl_ext.spec``), which runs on the
  CPU: ``D(b)`` is the measured time of the native batched proposal (``measure_suffix_draft``;
  ``SUFFIX_DRAFT_S`` is its fit on this project's CI machine).
  ``scopes`` says which trees it drafts from (``request`` alone is n-gram drafting).

At the start of a rollout, ``DraftLadder.select`` picks the method with the best speedup at the
batch's historical average acceptance rate for each method, or plain decoding (``None``) when no
method beats it. The ladder is stored per hardware and model as JSON (``save`` / ``load``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from verl_ext.spec.tgs import COUPLED, DECOUPLED, MAX_WINDOW, AffineTime, SpecTimes

LADDER_VERSION = 1
#: acceptance rates a ladder is tabulated at
RATES = tuple(round(x, 2) for x in np.linspace(0.0, 0.95, 20))
#: per-worker batch sizes a ladder is tabulated at
BATCHES = (1, 16, 64, 128, 256)
#: a method must beat plain decoding by this factor to be chosen
MIN_SPEEDUP = 1.02
#: ``DraftLadder.target`` of a ladder measured on an engine (``verl_ext.measure.engine_ladder``)
#: rather than built against a verifier cost model
ENGINE_LADDER_PREFIX = "engine:"


class LadderError(ValueError):
    pass


@dataclass(frozen=True)
class DraftMethod:
    """One drafting method of a ladder: ``kind`` ``model`` (``drafter``: a cost-model preset or
    profile JSON of the draft model on one GPU) or ``suffix`` (``scopes``: suffix-tree scopes;
    ``draft_s``: its measured CPU time per batch, ``(per request, per call)`` seconds).
    ``acceptance``: the historical average per-token acceptance rate (the initial selection's
    default before a rollout has measured one)."""

    name: str
    kind: str
    acceptance: float
    drafter: str = ""
    scopes: str = "request"
    draft_s: tuple = (0.0, 0.0)

    def __post_init__(self):
        if self.kind not in ("model", "suffix"):
            raise LadderError(f"draft method {self.name!r}: kind must be 'model' or 'suffix', got {self.kind!r}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise LadderError(f"draft method {self.name!r}: acceptance must be in [0, 1], got {self.acceptance}")
        if self.kind == "model" and not self.drafter:
            raise LadderError(f"draft method {self.name!r}: a model method needs drafter (a cost-model preset or JSON)")

    def times(self, verifier, context: float = 1024.0, verify_gpus: int = 1) -> SpecTimes:
        from verl_ext.perf.cost import load_cost_model

        if self.kind == "model":
            return SpecTimes.from_cost(verifier, load_cost_model(self.drafter), context=context, verify_gpus=verify_gpus)
        per_req, per_call = self.draft_s
        return SpecTimes.from_cost(verifier, None, context=context, verify_gpus=verify_gpus,
                                   cpu_draft_s=AffineTime(float(per_req), float(per_call)))


@dataclass
class DraftLadder:
    """``speedup[method][i][j]``: best coupled speedup at ``batches[i]`` and ``rates[j]``;
    ``window[method][i][j]``: the window that achieves it."""

    target: str
    hardware: str
    model: str
    methods: dict  # name -> DraftMethod
    batches: tuple
    rates: tuple
    speedup: dict = field(default_factory=dict)
    window: dict = field(default_factory=dict)
    decoupled: dict = field(default_factory=dict)  # name -> speedups of decoupled execution (one drafter GPU)
    #: per batch: seconds per step of plain decoding (weights the batches in ``drafter_gain``)
    step_s: list = field(default_factory=list)
    #: per batch: how much slower an engine started with a drafter decodes when nothing is drafted
    #: (measured ladders: ``verl_ext.measure.engine_ladder``; empty: not measured, taken as 0)
    idle: list = field(default_factory=list)

    # -- building --------------------------------------------------------------------------------
    @classmethod
    def build(cls, verifier, methods: Sequence[DraftMethod], *, context: float = 1024.0,
              batches: Sequence[int] = BATCHES, rates: Sequence[float] = RATES, verify_gpus: int = 1,
              max_window: int = MAX_WINDOW) -> "DraftLadder":
        if not methods:
            raise LadderError("a ladder needs at least one draft method")
        names = [m.name for m in methods]
        if len(set(names)) != len(names):
            raise LadderError(f"draft method names must be unique, got {names}")
        lad = cls(verifier.name, verifier.hardware, verifier.model, {m.name: m for m in methods},
                  tuple(int(b) for b in batches), tuple(float(p) for p in rates))
        for m in methods:
            t = m.times(verifier, context, verify_gpus)
            if not lad.step_s:
                lad.step_s = [1.0 / t.tgs_plain(b) for b in lad.batches]
            sp, win, dec = [], [], []
            for b in lad.batches:
                base = t.tgs_plain(b)
                row_s, row_w, row_d = [], [], []
                for p in lad.rates:
                    w, tgs = t.best_window(p, b, COUPLED, w_max=max_window)
                    row_s.append(tgs / base)
                    row_w.append(w)
                    row_d.append(t.best_window(p, b, DECOUPLED, w_max=max_window)[1] / base)
                sp.append(row_s)
                win.append(row_w)
                dec.append(row_d)
            lad.speedup[m.name], lad.window[m.name], lad.decoupled[m.name] = sp, win, dec
        return lad

    # -- reading ---------------------------------------------------------------------------------
    def lookup(self, method: str, p: float, batch: int, table: Optional[dict] = None) -> float:
        """Speedup of ``method`` at acceptance ``p`` and per-worker ``batch``: linear in ``p``,
        and in log2(batch) between the tabulated batches around ``batch`` (clamped at the ends)."""
        rows = (table or self.speedup)[method]
        at = [float(np.interp(p, self.rates, row)) for row in rows]
        return float(np.interp(np.log2(max(1.0, batch)), np.log2(self.batches), at))

    def best_window(self, method: str, p: float, batch: int) -> int:
        """The best coupled window at the tabulated batch nearest ``batch`` in log2 (17 reads 16's,
        not 64's) and the tabulated acceptance nearest ``p``."""
        i = int(np.argmin(np.abs(np.log2(self.batches) - np.log2(max(1.0, batch)))))
        j = int(np.argmin(np.abs(np.asarray(self.rates) - p)))
        return int(self.window[method][i][j])

    def select(self, batch: int, acceptance: Optional[Mapping[str, float]] = None,
               methods: Optional[Sequence[str]] = None) -> Optional[str]:
        """Initial selection (Figure 10 b): rank the methods (``methods``: only these) by their
        ladder speedup at their historical average acceptance (``acceptance`` overrides a method's
        default) and take the best; ``None`` (plain decoding) when none beats plain decoding by
        ``MIN_SPEEDUP``."""
        return pick(self.rank(batch, acceptance, methods))

    def rank(self, batch: int, acceptance: Optional[Mapping[str, float]] = None,
             methods: Optional[Sequence[str]] = None) -> list[tuple[str, float]]:
        """``(method, speedup)`` best first at the methods' historical acceptance (``methods``:
        only these)."""
        acc = dict(acceptance or {})
        out = [(n, self.lookup(n, acc.get(n, m.acceptance), batch)) for n, m in self.methods.items()
               if methods is None or n in methods]
        return sorted(out, key=lambda x: (-x[1], x[0]))

    def drafter_gain(self, batch: int, acceptance: Optional[Mapping[str, float]] = None,
                     methods: Optional[Sequence[str]] = None) -> float:
        """The share of a rollout's decode time that starting the engines with a drafter saves
        (negative: it costs), for a step that begins at ``batch`` requests per worker and drains
        to 1 with one decode step at each batch size in between (response lengths spread
        uniformly). At each batch the best method drafts where it beats plain decoding by
        ``MIN_SPEEDUP`` (time ``T(b) / speedup``); elsewhere the engine decodes plainly, but with
        the drafter's idle cost (``T(b) (1 + idle(b))``). ``T(b)``, the plain step time, and
        ``idle(b)`` are interpolated over the tabulated batches."""
        bs = np.arange(1, max(1, int(batch)) + 1)
        step = np.interp(bs, self.batches, self.step_s) if self.step_s else np.ones(len(bs))
        idle = np.interp(bs, self.batches, self.idle) if self.idle else np.zeros(len(bs))
        plain = float(step.sum())
        drafted = 0.0
        for b, t, o in zip(bs, step, idle):
            ranked = self.rank(int(b), acceptance, methods)
            s = ranked[0][1] if ranked else 0.0
            drafted += t / s if s >= MIN_SPEEDUP else t * (1.0 + o)
        return float(1.0 - drafted / plain)

    # -- storage ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": LADDER_VERSION, "target": self.target, "hardware": self.hardware, "model": self.model,
            "batches": list(self.batches), "rates": list(self.rates),
            "step_s": list(self.step_s), "idle": list(self.idle),
            "methods": {n: {"kind": m.kind, "acceptance": m.acceptance, "drafter": m.drafter, "scopes": m.scopes,
                            "draft_s": list(m.draft_s), "speedup": self.speedup[n], "window": self.window[n],
                            "decoupled": self.decoupled.get(n)}
                        for n, m in self.methods.items()},
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "ladder") -> "DraftLadder":
        try:
            if d.get("version") != LADDER_VERSION:
                raise LadderError(f"{where}: unsupported ladder version {d.get('version')!r} (expected {LADDER_VERSION})")
            lad = cls(str(d["target"]), str(d.get("hardware", "")), str(d.get("model", "")), {},
                      tuple(int(b) for b in d["batches"]), tuple(float(p) for p in d["rates"]))
            lad.step_s = [float(x) for x in d.get("step_s") or []]
            lad.idle = [float(x) for x in d.get("idle") or []]
            for name in ("step_s", "idle"):
                if getattr(lad, name) and len(getattr(lad, name)) != len(lad.batches):
                    raise LadderError(f"{where}: {name} must have one value per batch ({len(lad.batches)})")
            for n, m in d["methods"].items():
                lad.methods[n] = DraftMethod(n, m["kind"], float(m["acceptance"]), m.get("drafter", ""),
                                             m.get("scopes", "request"), tuple(m.get("draft_s", (0.0, 0.0))))
                lad.speedup[n] = [list(map(float, r)) for r in m["speedup"]]
                lad.window[n] = [list(map(int, r)) for r in m["window"]]
                if m.get("decoupled") is not None:
                    lad.decoupled[n] = [list(map(float, r)) for r in m["decoupled"]]
                shape = (len(lad.batches), len(lad.rates))
                if np.shape(lad.speedup[n]) != shape or np.shape(lad.window[n]) != shape:
                    raise LadderError(f"{where}: method {n!r} tables must be {shape}")
        except LadderError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise LadderError(f"{where}: malformed ladder ({exc!r})") from exc
        if not lad.methods:
            raise LadderError(f"{where}: the ladder has no draft methods")
        return lad

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> "DraftLadder":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()), str(path))
        except (OSError, json.JSONDecodeError) as exc:
            raise LadderError(f"ladder {path}: {exc}") from exc


def pick(ranked: Sequence[tuple[str, float]]) -> Optional[str]:
    """The best of ``DraftLadder.rank``'s list, or None (plain decoding) below ``MIN_SPEEDUP``."""
    return ranked[0][0] if ranked and ranked[0][1] >= MIN_SPEEDUP else None


#: (seconds per request, seconds per call) of the native batched proposal at k = 16 on 1,024-token
#: contexts, the affine fit ``measure_suffix_draft`` makes: what ``rollout=specactor`` prices its
#: suffix methods at when it builds its ladder from a cost model (a fit, never timed during a run:
#: the run's figures then depend on nothing but its inputs). Measured on this project's CI machine
#: (2-core x86_64, one pinned core, 2026-11-27; k = 8: 1.04e-6, 0):
#: OMP_NUM_THREADS=1 taskset -c 1 python -c "from verl_ext.spec.ladder import measure_suffix_draft as m; print(m(k=16))"
#: ``verl-ext fit ladder`` measures it afresh on the machine it runs on.
SUFFIX_DRAFT_S = (1.08e-6, 0.0)


def measure_suffix_draft(k: int = 8, context: int = 1024, batches: Sequence[int] = (1, 16, 64, 256),
                         repeats: int = 20, seed: int = 0) -> tuple[float, float]:
    """Time the native batched proposal (``DraftIndex.batch_propose``, request scope) on random
    contexts: ``(seconds per request, seconds per call)`` by an affine fit over ``batches``."""
    from verl_ext.spec import DraftIndex

    rng = np.random.default_rng(seed)
    idx = DraftIndex(32, 0, k)
    bmax = max(batches)
    ctx = rng.integers(0, 200, size=(bmax, context + k), dtype=np.int64)  # a small vocabulary: matches exist
    keys = [f"r{i}" for i in range(bmax)]
    for i, key in enumerate(keys):
        idx.start_request(key, ctx[i, : context // 2], scopes=1)
        idx.append(key, ctx[i, context // 2: context])
    lens = np.full(bmax, context, dtype=np.int64)
    ys = []
    for b in batches:
        ks = np.full(b, k, dtype=np.int64)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            idx.batch_propose(keys[:b], ks, ctx[:b], lens[:b], scopes=1)
            best = min(best, time.perf_counter() - t0)
        ys.append(best)
    f = AffineTime.fit(lambda b: ys[list(batches).index(b)], batches)
    return f.slope, f.intercept


def parse_method(text: str) -> tuple[DraftMethod, bool]:
    """``--method`` values: ``NAME=model:PRESET_OR_JSON@RATE`` or ``NAME=suffix:SCOPES@RATE``;
    ``@trace`` instead of a rate: measured on a trace by ``verl-ext fit ladder --trace``."""
    name, sep, rest = text.partition("=")
    kind, sep2, rest = rest.partition(":")
    what, _, rate = rest.partition("@")
    if not (sep and sep2 and name and what and rate):
        raise LadderError(f"--method {text!r}: expected NAME=model:PRESET@RATE or NAME=suffix:SCOPES@RATE")
    measure = rate == "trace"
    acc = 0.0 if measure else float(rate)
    if kind == "model":
        return DraftMethod(name, "model", acc, drafter=what), measure
    return DraftMethod(name, kind, acc, scopes=what), measure
