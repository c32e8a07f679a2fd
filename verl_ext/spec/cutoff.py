"""HistoSpec's batch-size cut-off (RhymeRL, seed 001 section 5.4): above a batch size that depends
on the acceptance rate, verifying drafts costs more compute than the accepted tokens save, so
drafting is switched off for the step.

The table ``((acceptance, max_batch), ...)`` comes from the profiled cost model
(``CostModel.spec_batch_cutoffs``); ``BatchCutoff`` keeps the engine's measured acceptance rate
(accepted / drafted tokens, an exponential moving average weighted by drafted tokens) and answers
whether a batch may draft. It reads the table conservatively: the row of the largest tabulated
rate not above the measured one. Before anything has been measured it allows drafting (so that
the rate gets measured); while drafting is off the rate stays as it was, and drafting resumes once
the batch shrinks below the cut-off, as in the tail of a rollout.
"""

from __future__ import annotations

import bisect
from typing import Sequence


def check_cutoffs(table) -> tuple:
    """``table`` as a sorted tuple of (rate, max_batch) pairs; ``ValueError`` if malformed."""
    try:
        rows = tuple(sorted((float(a), int(b)) for a, b in table))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"batch cut-offs must be (acceptance rate, max batch) pairs, got {table!r}") from exc
    for a, b in rows:
        if not 0.0 <= a <= 1.0 or b < 0:
            raise ValueError(f"batch cut-off ({a}, {b}): the rate must be in [0, 1] and the batch >= 0")
    return rows


class BatchCutoff:
    def __init__(self, table: Sequence, ema: float = 0.05):
        self.table = check_cutoffs(table)
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        self._rates = [a for a, _ in self.table]
        self.ema = ema
        self.rate = None  # measured acceptance; None before the first drafted step
        self.off_steps = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        r = accepted / drafted
        w = min(1.0, self.ema * max(1.0, drafted / 8.0))  # a step with more drafts counts more
        self.rate = r if self.rate is None else (1 - w) * self.rate + w * r

    def max_batch(self, rate=None):
        rate = self.rate if rate is None else rate
        if rate is None or not self.table:
            return None  # no limit
        i = bisect.bisect_right(self._rates, rate) - 1
        return 0 if i < 0 else self.table[i][1]

    def allows(self, batch: int) -> bool:
        m = self.max_batch()
        ok = m is None or batch <= m
        if not ok:
            self.off_steps += 1
        return ok
