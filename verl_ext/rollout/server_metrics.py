"""What a veRL vLLM server's own Prometheus endpoint says about its drafts.

veRL's ``vLLMHttpServer`` serves vLLM's OpenAI app, and with it vLLM's ``/metrics`` (counters
are recorded unless the rollout sets ``disable_log_stats=true``, veRL's default; verl_ext's
drafting strategies turn it off in their rollout configs). :func:`scrape` reads one server's
speculative-decoding counters with ``prometheus_client``'s parser; :class:`SpecCounters` turns
cumulative counters of several servers into per-step deltas for veRL's tracking.
"""

from __future__ import annotations

import logging
import urllib.request
from typing import Iterable, Optional

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

#: vLLM counter family -> our name (vLLM 0.24-0.33, ``vllm/v1/spec_decode/metrics.py``)
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def parse(text: str) -> dict[str, float]:
    """The speculative-decoding counters in a Prometheus text page, summed over their labels
    (engines of one server); counters the page lacks are absent."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = SPEC_COUNTERS.get(family.name)
        if name is None:
            continue
        out[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def scrape(address: str, timeout_s: float = 2.0) -> dict[str, float]:
    """``parse`` of ``http://<address>/metrics``; raises on any HTTP or network error."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
        return parse(resp.read().decode())


class SpecCounters:
    """Per-step drafting figures of a set of servers from their cumulative counters.

    ``step(readings)`` takes one reading per server (None where a scrape failed) and returns what
    the servers drafted and accepted since the previous call, as veRL metrics:
    ``verl_ext/spec/{drafts,draft_tokens,accepted_tokens}`` and ``verl_ext/spec/acceptance``
    (accepted / drafted tokens). A server first seen in this call counts from zero, so the first
    step includes everything since the server started (its warm-up drafts nothing)."""

    def __init__(self):
        self._last: dict[str, dict[str, float]] = {}

    def step(self, readings: dict[str, Optional[dict[str, float]]]) -> dict[str, float]:
        totals = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
        seen = False
        for server, reading in readings.items():
            if not reading:
                continue
            seen = True
            last = self._last.get(server, {})
            for key in totals:
                now = float(reading.get(key, 0.0))
                before = last.get(key, 0.0)
                totals[key] += now - before if now >= before else now  # a restarted server counts anew
            self._last[server] = dict(reading)
        if not seen:
            return {}
        out = {f"verl_ext/spec/{k}": v for k, v in totals.items()}
        out["verl_ext/spec/acceptance"] = totals["accepted_tokens"] / totals["draft_tokens"] if totals["draft_tokens"] else 0.0
        return out


def read_all(addresses: Iterable[str], timeout_s: float = 2.0) -> dict[str, Optional[dict[str, float]]]:
    """``scrape`` of each address; None (and one warning per call) where a server does not answer."""
    out: dict[str, Optional[dict[str, float]]] = {}
    for address in addresses:
        try:
            out[address] = scrape(address, timeout_s)
        except Exception as exc:
            logger.warning("verl_ext: no draft counters from server %s (%s: %s)", address, type(exc).__name__, exc)
            out[address] = None
    return out
