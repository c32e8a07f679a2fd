"""What each strategy's mechanisms did in a run: the ``mechanisms`` object of ``verl-ext ab``,
``verl-ext sim`` and ``scripts/verl_e2e.sh`` summaries (names in docs/ARCHITECTURE.md,
"Mechanisms").

A strategy declares its mechanisms (``Strategy.mechanisms``: name -> source). A ``"strategy"``
mechanism is counted by the strategy itself in ``Strategy.acted`` when it acts (a chunk
continued, a request placed, a sample moved); a ``"drafter:<counter>"`` one is read from the
engines' drafters (``Instance.drafter_stats``: the vLLM drafter's ``stats`` op, or the simulated
drafter's counters), summed over engines, as the difference between two readings. Every driver
reports the same numbers the same way, so a mechanism that acts in one and not another shows.
"""

from __future__ import annotations

import asyncio
from typing import Iterable, Mapping, Optional

#: the drafter counters a mechanism may name: per scope, tokens drafted and accepted
#: (``<scope>_draft_tokens``, ``<scope>_accepted_tokens``), and RLHFSpec's selection steps
SCOPES = ("request", "group", "history", "global")
DRAFTER_COUNTERS = (*(f"{s}_{k}" for s in SCOPES for k in ("draft_tokens", "accepted_tokens")), "select_steps")


def drafter_counters(stats: Optional[Mapping]) -> dict[str, float]:
    """``DRAFTER_COUNTERS`` of one drafter's ``stats`` answer (zeros where absent)."""
    out = dict.fromkeys(DRAFTER_COUNTERS, 0.0)
    if not stats:
        return out
    for scope, (drafted, accepted) in (stats.get("scope_tokens") or {}).items():
        if scope in SCOPES:
            out[f"{scope}_draft_tokens"] = float(drafted)
            out[f"{scope}_accepted_tokens"] = float(accepted)
    out["select_steps"] = float(stats.get("select_steps", 0))
    return out


async def read_drafters(instances: Iterable) -> dict[str, float]:
    """``DRAFTER_COUNTERS`` summed over the instances' drafters (an instance without one, or one
    that cannot answer, adds nothing)."""
    instances = list(instances)
    answers = await asyncio.gather(*(i.drafter_stats() for i in instances), return_exceptions=True)
    total = dict.fromkeys(DRAFTER_COUNTERS, 0.0)
    for ans in answers:
        if isinstance(ans, BaseException) or not ans:
            continue
        for k, v in drafter_counters(ans).items():
            total[k] += v
    return total


def count(strategy, drafters: Optional[Mapping[str, float]] = None, before: Optional[Mapping[str, float]] = None,
          acted_before: Optional[Mapping[str, int]] = None) -> dict[str, int]:
    """Each of ``strategy``'s mechanisms: how many times it acted. ``drafters`` (and ``before``,
    an earlier reading to subtract) are ``read_drafters`` readings; ``acted_before``, an earlier
    copy of ``strategy.acted`` to subtract."""
    out = {}
    for name, source in type(strategy).mechanisms.items():
        if source == "strategy":
            out[name] = int(strategy.acted.get(name, 0) - (acted_before or {}).get(name, 0))
        elif source.startswith("drafter:"):
            key = source.split(":", 1)[1]
            now = (drafters or {}).get(key, 0.0)
            out[name] = int(now - (before or {}).get(key, 0.0))
        else:
            raise ValueError(f"strategy '{strategy.name}': mechanism '{name}' has an unknown source '{source}'")
    return out


def inert(counts: Mapping[str, int], expected: Optional[Iterable[str]] = None) -> list[str]:
    """The mechanisms among ``expected`` (default: all) that never acted."""
    names = counts if expected is None else expected
    return [n for n in names if not counts.get(n)]
