"""``multiscope``: Seer's rollout drafting from every scope, scheduled with history lengths.

* Everything of ``seer`` (``SeerOptions``, the same ablation switches): divided rollout,
  context-aware scheduling, adaptive grouped drafts, the grouped draft server.
* Global drafts (``global_drafts``): the engines also draft from a global tree of recent
  responses to every prompt (``DraftIndex``'s global scope, two generations of about
  ``global_tokens`` tokens). It holds the prompt's own earlier epochs while they are recent, so
  it stands in for RhymeRL's history drafts without shipping trees to the engines; measured
  against them in docs/BENCHMARKS.md ("Draft scopes").
* History length priors (``history_lengths``): the history workers (as for ``rhyme``) give each
  prompt's longest earlier response; it is Algorithm 1's ``L_g`` until one of the group
  finishes (``RequestBuffer.set_prior``), so longest-first scheduling is right from the first
  pick of a later epoch instead of waiting for probes. A prompt without history, or a history
  lookup that fails, keeps Seer's estimate (``max_tokens``); the rollout never waits on it.

Ablation ladder: ``global_drafts=false``, ``history_lengths=false``, then seer's own switches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

from verl_ext.pipe.seer.buffer import BufferedRequest, RequestBuffer
from verl_ext.pipe.seer.strategy import SeerOptions, SeerStrategy
from verl_ext.pipe.strategy import register_strategy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MultiscopeOptions(SeerOptions):
    """Knobs of ``rollout=multiscope``: ``SeerOptions`` and the two below."""

    #: draft from the engines' global tree of recent responses to every prompt too
    global_drafts: bool = True
    #: tokens per generation of the global tree (it holds up to about twice this)
    global_tokens: int = 1 << 20
    #: Algorithm 1's ``L_g`` from the prompt's history until the group's first finish
    history_lengths: bool = True

    def __post_init__(self):
        super().__post_init__()
        for name in ("global_drafts", "history_lengths"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.global_tokens, bool) or not isinstance(self.global_tokens, int) or self.global_tokens < 1:
            raise ValueError(f"global_tokens must be an integer >= 1, got {self.global_tokens!r}")


@register_strategy("multiscope")
class MultiscopeStrategy(SeerStrategy):
    Options = MultiscopeOptions
    uses_history = True
    mechanisms = {
        **SeerStrategy.mechanisms,
        "global_draft_tokens_accepted": "drafter:global_accepted_tokens",
        "history_length_priors": "strategy",  # a group's L_g seeded from its prompt's history
    }

    def __init__(self, options=None):
        super().__init__(options)
        self.history = None
        self.step: Optional[int] = None
        self._wanted: list = []  # (buffer, group id, prompt key) awaiting a history lookup
        self._lookup: Optional[asyncio.Task] = None
        self._m = {"history_lookups": 0, "history_failures": 0, "prior_groups": 0}

    def set_history(self, history) -> None:
        self.history = history

    def begin_step(self, step: int) -> None:
        self.step = step

    def engine_spec(self, cost=None):
        spec = super().engine_spec(cost)
        if spec is None or not self.options.global_drafts:
            return spec
        return dataclasses.replace(spec, scopes=spec.scopes + "+global", global_tokens=self.options.global_tokens)

    # -- history length priors ----------------------------------------------------------------
    def new_group(self, buffer: RequestBuffer, r: BufferedRequest) -> None:
        if not self.options.history_lengths or self.history is None or not self.options.context:
            return
        self._wanted.append((buffer, r.request.group_id, r.request.history_key))
        if self._lookup is None or self._lookup.done():
            self._lookup = asyncio.ensure_future(self._look_up())

    async def _look_up(self) -> None:
        """Look up the groups that arrived meanwhile, in one call per batch (veRL's dispatcher
        submits requests one at a time; the first batch waits one loop turn for the rest)."""
        await asyncio.sleep(0)
        while self._wanted:
            wanted, self._wanted = self._wanted, []
            self._m["history_lookups"] += 1
            try:
                lengths = await self.history.lengths(sorted({key for _, _, key in wanted}), self.step or None)
            except Exception as exc:  # a history problem costs the estimate, never the rollout
                self._m["history_failures"] += 1
                log = logger.warning if self._m["history_failures"] == 1 else logger.debug  # once, then counted
                log("multiscope: no history lengths (%s: %s); Seer's estimates instead (history_failures counts "
                    "each lookup that fails)", type(exc).__name__, exc)
                continue
            for buffer, group_id, key in wanted:
                found = lengths.get(key)
                if found and buffer.set_prior(group_id, int(found[1])):
                    self._m["prior_groups"] += 1
                    self.acted["history_length_priors"] += 1

    async def close(self) -> None:
        if self._lookup is not None:
            await asyncio.gather(self._lookup, return_exceptions=True)
        await super().close()

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out.update({k: float(v) for k, v in self._m.items()})
        return out
