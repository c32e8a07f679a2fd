"""``multiscope``: Seer's rollout drafting from every scope, scheduled with history lengths.

* Everything of ``seer`` (``SeerOptions``, the same ablation switches): divided rollout,
  context-aware scheduling, adaptive grouped drafts, the grouped draft server.
* Global drafts (``global_drafts``): the engines also draft from a global tree of recent
  responses to every prompt (``DraftIndex``'s global scope, two generations of about
  ``global_tokens`` tokens). It also holds the prompt's own earlier epochs while they are recent
  (on the small real traces it covers the history trees: docs/BENCHMARKS.md, "Drafting scopes").
* History drafts (``history_drafts``, RhymeRL's HistoSpec): the engines also draft from each
  prompt's reward-weighted history tree, which the history workers (as for ``rhyme``) keep across
  epochs (``HistoryDelivery``: every drafting engine gets the trees of the prompts whose groups
  arrive, in the background). The global tree is bounded, so once an epoch holds more tokens
  than it keeps, a prompt's earlier epochs are in its history tree only.
* History length priors (``history_lengths``): the history workers give each prompt's longest
  earlier response; it is Algorithm 1's ``L_g`` until one of the group finishes
  (``RequestBuffer.set_prior``), so longest-first scheduling is right from the first pick of a
  later epoch instead of waiting for probes.

A prompt without history, or a history lookup that fails, keeps Seer's estimate (``max_tokens``)
and drafts from the other scopes; the rollout never waits on the history workers.

Ablation ladder: ``global_drafts=false``, ``history_drafts=false``, ``history_lengths=false``, then
seer's own switches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.rhyme.delivery import HistoryDelivery
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
    #: draft from each prompt's history tree too (RhymeRL's HistoSpec, the history workers' trees)
    history_drafts: bool = True
    #: Algorithm 1's ``L_g`` from the prompt's history until the group's first finish
    history_lengths: bool = True

    def __post_init__(self):
        super().__post_init__()
        for name in ("global_drafts", "history_drafts", "history_lengths"):
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
        "history_draft_tokens_accepted": "drafter:history_accepted_tokens",  # HistoSpec's trees
        "history_length_priors": "strategy",  # a group's L_g seeded from its prompt's history
    }

    def __init__(self, options=None):
        super().__init__(options)
        self.history = None
        self.step: Optional[int] = None
        self._wanted: list = []  # (buffer, group id, prompt key, pool) awaiting a history lookup
        self._lookup: Optional[asyncio.Task] = None
        self._m = {"history_lookups": 0, "history_failures": 0, "prior_groups": 0}
        self._delivery = HistoryDelivery(self._m, "multiscope")

    def set_history(self, history) -> None:
        self.history = history

    def begin_step(self, step: int) -> None:
        self.step = step

    def engine_spec(self, cost=None):
        spec = super().engine_spec(cost)
        if spec is None:
            return spec
        o = self.options
        spec = dataclasses.replace(spec, scopes=spec.scopes + ("+history" if o.history_drafts else ""))
        if o.global_drafts:
            spec = dataclasses.replace(spec, scopes=spec.scopes + "+global", global_tokens=o.global_tokens)
        return spec

    # -- history: drafts and length priors ------------------------------------------------------
    def new_group(self, buffer: RequestBuffer, r: BufferedRequest, pool: InstancePool) -> None:
        o = self.options
        lengths = o.history_lengths and o.context
        drafts = o.history_drafts and o.speculative
        if self.history is None or not (lengths or drafts):
            return
        self._wanted.append((buffer, r.request.group_id, r.request.history_key, pool))
        if self._lookup is None or self._lookup.done():
            self._lookup = asyncio.ensure_future(self._look_up(lengths, drafts))

    async def _look_up(self, lengths: bool, drafts: bool) -> None:
        """Serve the groups that arrived meanwhile, in one call per batch (veRL's dispatcher
        submits requests one at a time; the first batch waits one loop turn for the rest): their
        prompts' history trees to every drafting engine of their pool, their lengths to the buffer."""
        await asyncio.sleep(0)
        while self._wanted:
            wanted, self._wanted = self._wanted, []
            if drafts:
                by_pool: dict = {}
                for _, _, key, pool in wanted:
                    by_pool.setdefault(id(pool), (pool, set()))[1].add(key)
                for pool, keys in by_pool.values():
                    self._delivery.soon(self.history, self.step, [(list(pool.instances.values()), sorted(keys))])
            if lengths:
                await self._set_priors(wanted)

    async def _set_priors(self, wanted: list) -> None:
        self._m["history_lookups"] += 1
        try:
            lengths = await self.history.lengths(sorted({key for _, _, key, _ in wanted}), self.step or None)
        except Exception as exc:  # a history problem costs the estimate, never the rollout
            self._m["history_failures"] += 1
            log = logger.warning if self._m["history_failures"] == 1 else logger.debug  # once, then counted
            log("multiscope: no history lengths (%s: %s); Seer's estimates instead (history_failures counts "
                "each lookup that fails)", type(exc).__name__, exc)
            return
        for buffer, group_id, key, _ in wanted:
            found = lengths.get(key)
            if found and buffer.set_prior(group_id, int(found[1])):
                self._m["prior_groups"] += 1
                self.acted["history_length_priors"] += 1

    async def close(self) -> None:
        if self._lookup is not None:
            await asyncio.gather(self._lookup, return_exceptions=True)
        await self._delivery.close()
        await super().close()

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out.update({k: float(v) for k, v in self._m.items()})
        return out
