"""HistoSpec's batch-size cut-off (RhymeRL, seed 001 section 5.4): above a batch size that depends
on the acceptance rate, verifying drafts costs more compute than the accepted tokens save, so
drafting is switched off for the step.

The table ``((context, acceptance, max_batch), ...)`` comes from the profiled cost model
(``CostModel.spec_batch_cutoffs``): the cut-off also depends on how memory-bound a step is, i.e.
on the batch's context length. ``BatchCutoff`` keeps the engine's measured acceptance rate
(accepted / drafted tokens, an exponential moving average weighted by drafted tokens) and answers
whether a batch may draft. It reads the table conservatively: the row of the longest tabulated
context not above the batch's mean context, and of the largest tabulated rate not above the
measured one. Before anything has been measured it allows drafting (so that the rate gets
measured); while drafting is off the rate stays as it was, and drafting resumes once the batch
shrinks below the cut-off, as in the tail of a rollout.
"""

from __future__ import annotations

import bisect
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


class BatchCutoff:
    def __init__(self, table: Sequence, ema: float = 0.05):
        self.table = check_cutoffs(table)
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        self._contexts = sorted({c for c, _, _ in self.table})
        self._rows = {c: ([a for cc, a, _ in self.table if cc == c], [b for cc, _, b in self.table if cc == c])
                      for c in self._contexts}
        self.ema = ema
        self.rate: Optional[float] = None  # measured acceptance; None before the first drafted step
        self.off_steps = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        r = accepted / drafted
        w = min(1.0, self.ema * max(1.0, drafted / 8.0))  # a step with more drafts counts more
        self.rate = r if self.rate is None else (1 - w) * self.rate + w * r

    def max_batch(self, rate: Optional[float] = None, context: float = 0.0) -> Optional[int]:
        """The cut-off at ``rate`` (default: the measured one) and a mean context of ``context``
        tokens; None (no limit) before any measurement or without a table."""
        rate = self.rate if rate is None else rate
        if rate is None or not self.table:
            return None
        ci = bisect.bisect_right(self._contexts, context) - 1
        rates, batches = self._rows[self._contexts[max(ci, 0)]]
        i = bisect.bisect_right(rates, rate) - 1
        return 0 if i < 0 else batches[i]

    def allows(self, batch: int, context: float = 0.0) -> bool:
        m = self.max_batch(context=context)
        ok = m is None or batch <= m
        if not ok:
            self.off_steps += 1
        return ok
