"""HistoSpec's batch-size cut-off (RhymeRL section 5.4): above a batch size that depends
on the acceptance rate, verifying drafts costs more compute than the accepted tokens save, so
drafting is switched off for the step.

The table ``((context, acceptance, max_batch), ...)`` comes from the profiled cost model
(``CostModel.spec_batch_cutoffs``): the cut-off also depends on how memory-bound a step is, i.e.
on the batch's context length. ``BatchCutoff`` keeps the engine's measured acceptance rate
(accepted / drafted tokens, an exponential moving average weighted by drafted tokens) and answers
whether a batch may draft. It reads the table conservatively: the row of the longest tabulated
context not above the batch's mean context, and of the largest tabulated rate not above the
measured one. Before anything has been measured it allows drafting (so that the rate gets
measured), and so it does until the rate rests on ``MIN_DRAFTED`` drafted tokens: one step of
two requests' first drafts (4 tokens in short AIMD windows, often on spurious matches of the
prompt's tail) is no measurement. While drafting is off the rate stays as it was, and drafting
resumes once the batch shrinks below the cut-off, as in the tail of a rollout.

A rate measured low (a few rejected drafts at the start of a rollout, where a response leaves
its history) could otherwise switch drafting off for good: below the table's lowest rate the
cut-off is 0 and nothing would re-measure it. So every ``probe_every`` steps spent off, one step
drafts anyway (a probe) and updates the rate; at most one step in ``probe_every + 1`` pays for a
probe that does not help. Tables with ``B = 0`` everywhere (drafting never pays, e.g. a CPU
profile) are exact and never probed.

The engines of ``seer``, ``rhyme`` and ``specactor`` apply it by default, ``rlhfspec``'s on
request (``batch_cutoff`` in each strategy's options; ``cutoff_table`` below): RhymeRL's rule is
the general one, "draft only where the measured acceptance and the engine's step costs predict a
gain".
"""

from __future__ import annotations

import bisect
import functools
from typing import Optional, Sequence


def check_cutoffs(table) -> tuple:
    """``table`` as a sorted tuple of (context, rate, max_batch); ``ValueError`` if malformed."""
    try:
        rows = tuple(sorted((int(c), float(a), int(b)) for c, a, b in table))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"batch cut-offs must be (context, acceptance rate, max batch) triples, got {table!r}") from exc
    for c, a, b in rows:
        if c < 0 or not 0.0 <= a <= 1.0 or b < 0:
            raise ValueError(f"batch cut-off ({c}, {a}, {b}): context >= 0, rate in [0, 1], batch >= 0")
    return rows


#: the draft length a strategy without an AIMD window computes its table at: with step costs linear
#: in draft tokens (``CostModel.step_time``) the cut-off does not depend on it, except where the
#: drafts reach the engine's token budget
CUTOFF_DRAFT = 2


@functools.lru_cache(maxsize=64)
def cutoff_table(cost, draft: int = CUTOFF_DRAFT) -> tuple:
    """The cut-off table of ``cost`` (a ``CostModel``, frozen and hashable) at drafts of ``draft``
    tokens; () without a cost model (no cut-off: every batch drafts)."""
    return cost.spec_batch_cutoffs(draft) if cost is not None else ()


#: steps spent with drafting off between two probes
PROBE_EVERY = 64
#: drafted tokens the measured rate must rest on before the cut-off binds: until then the rate is
#: the plain ratio of what was drafted, and every batch may draft
MIN_DRAFTED = 16


class BatchCutoff:
    def __init__(self, table: Sequence, ema: float = 0.05, probe_every: int = PROBE_EVERY):
        self.table = check_cutoffs(table)
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        if probe_every < 0:
            raise ValueError(f"probe_every must be >= 0 (0 = never probe), got {probe_every}")
        # probing (and waiting for a measurement to rest on enough drafts) only helps where some
        # rate lets some batch draft
        self._can_draft = any(b > 0 for _, _, b in self.table)
        self.probe_every = probe_every if self._can_draft else 0
        self._contexts = sorted({c for c, _, _ in self.table})
        self._rows = {c: ([a for cc, a, _ in self.table if cc == c], [b for cc, _, b in self.table if cc == c])
                      for c in self._contexts}
        self.ema = ema
        self.rate: Optional[float] = None  # measured acceptance; None before the first drafted step
        self.drafted = self.accepted = 0  # tokens observed
        self.off_steps = 0  # steps with drafting off
        self.probes = 0  # steps drafted as probes
        self._since_probe = 0  # steps off since the last probe

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        warm = self.drafted < MIN_DRAFTED  # the plain ratio until the rate rests on MIN_DRAFTED tokens
        self.drafted += drafted
        self.accepted += accepted
        if warm:
            self.rate = self.accepted / self.drafted
            return
        r = accepted / drafted
        w = min(1.0, self.ema * max(1.0, drafted / 8.0))  # a step with more drafts counts more
        self.rate = (1 - w) * self.rate + w * r

    def max_batch(self, rate: Optional[float] = None, context: float = 0.0) -> Optional[int]:
        """The cut-off at ``rate`` (default: the measured one) and a mean context of ``context``
        tokens; None (no limit) without a table, before any measurement, or (where some batch may
        draft) for a measured rate that does not rest on ``MIN_DRAFTED`` drafted tokens yet."""
        if rate is None:
            rate = self.rate if self.drafted >= MIN_DRAFTED or not self._can_draft else None
        if rate is None or not self.table:
            return None
        ci = bisect.bisect_right(self._contexts, context) - 1
        rates, batches = self._rows[self._contexts[max(ci, 0)]]
        i = bisect.bisect_right(rates, rate) - 1
        return 0 if i < 0 else batches[i]

    def pays(self, batch: int, context: float = 0.0) -> bool:
        """Whether the table lets ``batch`` requests of mean context ``context`` draft at the
        measured rate (no probing, no counting)."""
        m = self.max_batch(context=context)
        return m is None or batch <= m

    def allows(self, batch: int, context: float = 0.0) -> bool:
        """The engine's per-step decision: ``pays``, or a probe when one is due (counted)."""
        if self.pays(batch, context):
            return True
        if self.probe_due():
            self.note_probe()
            return True
        self.note_off(1)
        return False

    def probe_due(self) -> bool:
        return self.probe_every > 0 and self._since_probe >= self.probe_every

    def steps_to_probe(self) -> Optional[int]:
        """Steps off until the next probe is due (None: never)."""
        return max(1, self.probe_every - self._since_probe) if self.probe_every else None

    def note_probe(self) -> None:
        self.probes += 1
        self._since_probe = 0

    def note_off(self, steps: int) -> None:
        self.off_steps += steps
        self._since_probe += steps

    def stats(self) -> dict:
        """What a drafter's ``stats`` report of it: steps kept plain, probe steps, and the
        measured acceptance (-1 before any)."""
        return {"cutoff_off_steps": self.off_steps, "cutoff_probes": self.probes,
                "cutoff_rate": -1.0 if self.rate is None else self.rate}
