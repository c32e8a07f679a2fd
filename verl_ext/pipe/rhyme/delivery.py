"""HistoSpec's delivery of history trees to the engines (RhymeRL section 5), for every strategy
that drafts from the ``history`` scope (``rhyme``, ``multiscope``).

``HistoryDelivery.soon(history, step, assignments)`` gives the engines that take drafter RPCs the
histories of the prompts they will serve, in the background: ``assignments`` is ``[(instances,
prompt keys)]``. No rollout waits for a history worker, a payload or a tree build; an engine's
requests draft from a prompt's history once its tree is in (the drafter builds it on a thread of
its own). A prompt's history grows every step, so an engine gets it again each step it serves the
prompt (its tree replaced, ``SetHistories``), which also restores a tree the engine evicted; the
trees an engine holds from an earlier step for prompts it does not serve now are dropped with the
next delivery. A failure costs drafts, never the rollout: it is counted (``history_failures``),
and what did not arrive is sent again next time.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from verl_ext.engine.drafter_ops import SetHistories

logger = logging.getLogger(__name__)


def _int32_bytes(tokens) -> bytes:
    """``tokens`` as int32 bytes; without a copy where the array views such bytes (history workers
    return responses as read-only views of their payload's bytes)."""
    base = getattr(tokens, "base", None)
    if (isinstance(base, bytes) and isinstance(tokens, np.ndarray) and tokens.dtype == np.int32
            and tokens.nbytes == len(base)):
        return base
    return np.asarray(tokens, dtype=np.int32).tobytes()


def set_histories_items(hist: dict, skip=()) -> list:
    """The drafter's ``set_histories`` payload for ``{uid: ([token arrays], [weights])}`` (what a
    history provider's ``serve`` returns), leaving out the uids in ``skip``: each response as its
    int32 bytes (4 bytes a token through any RPC layer, where a list costs a Python int each),
    without a copy where the array views such bytes."""
    return [(u, [_int32_bytes(t) for t in toks], list(ws))
            for u, (toks, ws) in hist.items() if u not in skip]


class HistoryDelivery:
    """History trees to the drafting engines. ``counters``: the strategy's metrics dict, where
    ``served_histories``, ``history_failures`` and ``history_serve_s`` are counted; ``label``
    names the strategy in warnings."""

    def __init__(self, counters: dict, label: str):
        self.m = counters
        for key, zero in (("served_histories", 0), ("history_failures", 0), ("history_serve_s", 0.0)):
            self.m.setdefault(key, zero)
        self.label = label
        self.served: dict = {}  # instance name -> {uid: the step whose history of uid it holds}
        self.tasks: set = set()  # deliveries in flight (never awaited by a rollout)

    def soon(self, history, step: int, assignments) -> None:
        """``serve`` in the background."""
        task = asyncio.ensure_future(self.serve(history, step, assignments))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Wait for the deliveries in flight (they end by themselves: each catches its errors)."""
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def serve(self, history, step: int, assignments) -> None:
        t0 = time.perf_counter()
        for block, uids in assignments:
            targets = [i for i in block if hasattr(i, "drafter_call") and getattr(i, "drafting", False)]
            if not targets:
                continue
            try:
                hist = await history.serve(uids, step or None)
            except Exception as exc:
                self.m["history_failures"] += 1
                logger.warning("%s: history drafts unavailable (%s: %s)", self.label, type(exc).__name__, exc)
                return
            wanted = set(uids)
            sends = []
            payloads: dict = {}  # one payload per set of prompts an engine already holds
            for inst in targets:
                have = self.served.setdefault(inst.name, {})
                skip = frozenset(u for u, s in have.items() if s == step and u in hist)
                if skip not in payloads:
                    payloads[skip] = set_histories_items(hist, skip=skip)
                new = payloads[skip]
                stale = [u for u, s in have.items() if s != step and u not in wanted]
                if not new and not stale:
                    continue
                for u in stale:  # booked before the RPC: a delivery running beside this one sees them
                    del have[u]
                have.update((u, step) for u, _, _ in new)
                sends.append(self._send(inst, new, stale))
            await asyncio.gather(*sends)  # the engines in parallel, one RPC each
        self.m["history_serve_s"] += time.perf_counter() - t0

    async def _send(self, inst, new, stale) -> None:
        try:
            await inst.drafter_call(SetHistories(new, stale))
        except Exception as exc:  # drafting is an optimisation
            self.m["history_failures"] += 1
            logger.warning("%s: could not load history into %s (%s: %s)", self.label, inst.name,
                           type(exc).__name__, exc)
            have = self.served.get(inst.name, {})
            for u, _, _ in new:  # not delivered: the next step sends them again
                have.pop(u, None)
            for u in stale:  # maybe still held there: dropped with the next delivery
                have.setdefault(u, -1)
            return
        self.m["served_histories"] += len(new)
