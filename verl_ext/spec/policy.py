"""The engine-side drafting rules, combined in one place: how many tokens each request of a step
may draft. The vLLM proposer asks one step at a time (``step_caps``); ``SimInstance`` asks once
per plan of steps (``plan_caps``). Each rule is a small class behind one interface
(``limit(batch, ks)``: lower the caps ``ks`` in place); the policy applies them in this order:

1. ``RequestWindows``: a request's own window (``spec_window``; SpecActor, Algorithm 2);
2. ``AimdRule``: RhymeRL's AIMD window (RhymeRL section 5.4; live engines only: the simulator's
   drafter replays the same ``AimdWindows`` by position, ``verl_ext.sim.drafting``);
3. ``CutoffRule``: HistoSpec's batch-size cut-off: nothing drafted above it, with probe steps
   that re-measure the acceptance rate (``verl_ext.spec.cutoff``);
4. ``AdaptiveBudget``: Seer's adaptive budget (Seer section 4.4, ``verl_ext.spec.adaptive``).

The caps are minima, so the order changes no cap; it decides what ``AdaptiveBudget.capped``
counts (room the budget took that the other rules left). RLHFSpec's selection and reference
drafts then act on the drafts proposed within the caps (``SuffixProposer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from verl_ext.spec.adaptive import draft_caps
from verl_ext.spec.aimd import AimdWindows
from verl_ext.spec.cutoff import BatchCutoff


@dataclass
class DraftBatch:
    """One step's requests as the rules see them."""

    #: the step's requests: their ids where a rule keeps state per request (AIMD)
    keys: Sequence
    #: mean context of the step's requests (the cut-off's table is by context)
    context: float
    #: each request's own window, None where it has none (or None for the whole batch)
    windows: Optional[Sequence[Optional[int]]] = None
    #: the finished fraction of each request's group (adaptive budget); called only when needed
    fractions: Optional[Callable[[], Optional[np.ndarray]]] = None

    def __len__(self) -> int:
        return len(self.keys)


class RequestWindows:
    @staticmethod
    def binds(batch: DraftBatch) -> bool:
        return batch.windows is not None and any(w is not None for w in batch.windows)

    def limit(self, batch: DraftBatch, ks: np.ndarray) -> None:
        if self.binds(batch):
            big = np.iinfo(np.int64).max
            np.minimum(ks, np.fromiter((big if w is None else w for w in batch.windows), dtype=np.int64,
                                       count=len(batch)), out=ks)


class AimdRule:
    def __init__(self, windows: AimdWindows):
        self.windows = windows

    def limit(self, batch: DraftBatch, ks: np.ndarray) -> None:
        np.minimum(ks, self.windows.get_many(batch.keys), out=ks)


class CutoffRule:
    def __init__(self, cutoff: BatchCutoff):
        self.cutoff = cutoff

    def limit(self, batch: DraftBatch, ks: np.ndarray) -> None:
        """An engine step: the cut-off's decision for this step (a probe is counted as taken)."""
        if not self.cutoff.allows(len(batch), batch.context):
            ks[:] = 0

    def plan(self, batch: DraftBatch, commit: bool) -> Optional[int]:
        """A plan of steps: None (drafting allowed), 1 (one probe step) or ``-n`` (off for at most
        ``n`` steps, until the next probe). ``commit``: the plan is taken (a probe is counted)."""
        if self.cutoff.pays(len(batch), batch.context):
            return None
        if self.cutoff.probe_due():
            if commit:
                self.cutoff.note_probe()
            return 1
        return -(self.cutoff.steps_to_probe() or 1 << 62)


class AdaptiveBudget:
    def __init__(self, k: int, knee_tokens: int, sibling_boost: float):
        self.k, self.knee_tokens, self.sibling_boost = k, knee_tokens, sibling_boost
        self.capped = 0  # draft room the budget removed (on top of the other rules)

    def caps(self, batch: DraftBatch) -> np.ndarray:
        frac = batch.fractions() if (batch.fractions is not None and self.sibling_boost > 0) else None
        return draft_caps(self.k, len(batch), self.knee_tokens, frac, self.sibling_boost)

    def limit(self, batch: DraftBatch, ks: np.ndarray) -> None:
        caps = self.caps(batch)
        self.capped += int(np.maximum(ks - caps, 0).sum())
        np.minimum(ks, caps, out=ks)


class DraftPolicy:
    """The rules ``options`` (``SpecOptions``) turn on. ``aimd=False``: leave the AIMD window to
    the caller (the simulator replays it by position)."""

    def __init__(self, options, aimd: bool = True):
        self.k = options.k
        self.windows = RequestWindows()
        self.aimd = AimdRule(options.aimd_windows()) if (aimd and options.aimd) else None
        cutoff = options.batch_cutoff()
        self.cutoff = CutoffRule(cutoff) if cutoff is not None else None
        # adaptive caps bind only with a batch threshold (draft_caps gives k otherwise)
        self.adaptive = (AdaptiveBudget(options.k, options.knee_tokens, options.sibling_boost)
                         if options.adaptive and options.knee_tokens > 0 else None)

    @property
    def rules(self) -> list:
        return [r for r in (self.windows, self.aimd, self.cutoff, self.adaptive) if r is not None]

    def step_caps(self, batch: DraftBatch, ks: np.ndarray) -> np.ndarray:
        """An engine step: ``ks`` (each request's room) lowered by every rule, in place."""
        if len(batch):
            for rule in self.rules:
                rule.limit(batch, ks)
        return ks

    def plan_caps(self, batch: DraftBatch, commit: bool = True) -> tuple[Optional[np.ndarray], Optional[int]]:
        """A plan of steps on a simulated engine: (caps, or None for ``k`` each; the cut-off's
        decision, ``CutoffRule.plan``). The AIMD window is the caller's."""
        caps = None
        if self.adaptive is not None or self.windows.binds(batch):
            caps = np.full(len(batch), self.k, dtype=np.int64)
            self.windows.limit(batch, caps)
            if self.adaptive is not None:
                np.minimum(caps, self.adaptive.caps(batch), out=caps)
        cut = None
        if self.cutoff is not None:
            cut = self.cutoff.plan(batch, commit)
            if cut is not None and cut < 0:
                caps = np.zeros(len(batch), dtype=np.int64)
        return caps, cut
